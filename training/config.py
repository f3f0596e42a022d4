"""Training settings: one dataclass, `TrainSettings`, holding each setting's type, default, flag and help; the
kt-train flags, the `config.json` record and the settings table of training/README.md come from it.

A setting comes from, in increasing priority: its default, a JSON file given with `--config` (any
`TrainSettings` field by name, "model" being {Transformer arguments}), and the command-line flags.

    settings = resolve_settings(["--config", "configs/multi30k.json", "--epochs", "5"])
    settings.epochs              # 5
    settings.to_dict()           # what config.json records under "training"
    print(settings_table())      # the Markdown table of every setting
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from pathlib import Path

from common.run_dir import (DEFAULT_AVERAGE_LAST, DEFAULT_BEAM_SIZE, DEFAULT_LENGTH_PENALTY, RENAMED_SETTINGS,
                            add_renamed_flags, take_renamed_flags, write_run_config)
from keras_transformer.renamed import renamed_note
from keras_transformer.text import VOCAB_TYPES
from keras_transformer.decoding import EXTRA_OUTPUT_LENGTH
from training.trees import METRICS
from training.errors import ConfigError

# kt-train's argument groups, in --help's and the table's order.
GROUPS = ("model", "data", "tokenizer and batches", "training",
          "after training (recorded in config.json for the commands that follow kt-train)", "output")


@dataclasses.dataclass(frozen=True)
class Flag:
    """A command-line flag of a setting: `name`, and argparse's `add_argument` keywords but dest and help."""
    name: str
    kwargs: dict = dataclasses.field(default_factory=dict)
    help: str | None = None  # the setting's help by default


def setting(default, help: str, group: str, *, flags=None, shown: str | None = None, **flag_kwargs):
    """A `TrainSettings` field: its `default` (a dict default is copied for each instance), its `help` (one or
    two sentences, without the default), its argparse `group`, and its flags: by default one, `--NAME-WITH-DASHES`
    with `flag_kwargs`; `flags=()` for a setting only a --config file sets. `shown`: the default as --help and the
    table say it where the value alone would not ("off", "one pass")."""
    assert group in GROUPS, group
    metadata = {"help": help, "group": group, "flags": flags, "flag_kwargs": flag_kwargs, "shown": shown}
    if isinstance(default, dict):
        return dataclasses.field(default_factory=lambda: dict(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _verbosity(value):
    return value if value == "auto" else int(value)


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """Every kt-train setting, with its default. Frozen: `dataclasses.replace` makes a changed copy. The runtime
    objects a run builds from these (the model it starts from, the strategy, the datasets) are not settings."""

    preset: str = setting("small", "model size: tiny | small | base | big (`keras_transformer.PRESETS`)", "model")
    model: dict = setting(
        {}, "Transformer arguments over the preset's, e.g. {\"dropout\": 0.3, \"norm_first\": true}; "
        "attention_dropout and activation_dropout (0 by default, not in the paper) drop the attention weights "
        "and the feed-forward's inner activations", "model", shown="the preset's",
        flags=(Flag("--model-arg", dict(action="append", metavar="KEY=VALUE", dest="model_args"),
                    "override a Transformer argument, e.g. --model-arg dropout=0.3 (repeatable)"),
               Flag("--dropout", dict(type=float, metavar="X", dest="dropout"),
                    "shortcut for --model-arg dropout=X")))

    dataset: str = setting(
        "multi30k", "multi30k (read as text) | files | a TFDS name, e.g. ted_hrlr_translate/pt_to_en (prepared "
        "into MODEL_DIR/prepared first, as --train-files)", "data")
    data_dir: str | None = setting(
        None, "raw Multi30k directory", "data", shown="$KT_MULTI30K_DIR, else ../shared/data/multi30k, else download")
    tfds_data_dir: str | None = setting(None, "where TFDS stores prepared datasets", "data",
                                        shown="$KT_TFDS_DIR or ~/tensorflow_datasets")
    train_files: list | None = setting(
        None, "parallel text files, plain or gzip (sets dataset to files); prepared into MODEL_DIR/prepared first, "
        "as kt-prepare does, unless --subword-sampling or --max-train-examples keeps them text", "data",
        nargs=2, metavar=("SOURCE", "TARGET"))
    valid_files: list | None = setting(None, "validation text files for --dataset files", "data",
                                       nargs=2, metavar=("SOURCE", "TARGET"))
    prepared: str | None = setting(
        None, "train on a corpus kt-prepare prepared (its shards, its vocabulary, its validation set unless "
        "--valid-files), streamed, each worker its own shards", "data", metavar="DIR")
    check_alignment: bool = setting(
        True, "check that --train-files/--valid-files' lines are pairs: the flag trains on them even where "
        "their pairs look shifted by a line", "data", shown="check",
        flags=(Flag("--no-alignment-check", dict(action="store_false")),))
    source_lang: str = setting("en", "the source language: its files' suffix, its side of a TFDS dataset", "data")
    target_lang: str = setting("de", "the target language", "data")
    max_train_examples: int | None = setting(None, "use only the first N training pairs (quick runs)", "data",
                                             type=int, metavar="N", shown="all")
    max_eval_examples: int | None = setting(None, "use only the first N validation pairs", "data", type=int,
                                            metavar="N", shown="all")
    validation: bool = setting(True, "compute the validation loss every epoch (the flag skips it)", "data",
                               flags=(Flag("--no-validation", dict(action="store_false")),))
    val_bleu: bool = setting(
        False, "after every epoch, also greedy-decode the validation set and record its sacreBLEU (val_bleu in "
        "history.csv and TensorBoard), e.g. for kt-average-checkpoints --best N --by val_bleu", "data",
        action="store_true")

    tokenizer: str | None = setting(None, "an existing sentencepiece .model to use instead of training one",
                                    "tokenizer and batches", shown="trained by the run")
    vocab_size: int = setting(8000, "joint subword vocabulary size", "tokenizer and batches", type=int)
    vocab_type: str = setting(VOCAB_TYPES[0], "the vocabulary's sentencepiece model: unigram or bpe (byte-pair "
                              "encoding, the paper's)", "tokenizer and batches", choices=VOCAB_TYPES)
    vocab_sample: int = setting(
        2_000_000, "train the vocabulary on a uniform random sample of this many lines of all the training "
        "text, both sides, drawn by --seed (a smaller corpus is used whole); its memory and time grow with it",
        "tokenizer and batches", type=int, metavar="LINES")
    lowercase: bool = setting(
        False, "train a case-folding vocabulary (sentencepiece's nmt_nfkc_cf normaliser): the model reads and "
        "writes lowercase text, and kt-evaluate scores it case-insensitively", "tokenizer and batches",
        shown="cased", action="store_true")
    tokens_per_batch: int = setting(
        4096, "token budget of a batch and side, over all replicas together (split evenly between them)",
        "tokenizer and batches", type=int)
    tokens_per_replica: int | None = setting(
        None, "token budget of a batch and side on each replica (fairseq's --max-tokens): the batch on N "
        "replicas is N times this; when set, it wins over --tokens-per-batch", "tokenizer and batches",
        shown="off", type=int, metavar="T")
    max_sentence_length: int = setting(
        128, "drop training pairs whose source or decoder input is longer than this many tokens (end or start "
        "id included); config.json records it as max_source_length, the longest source kt-evaluate and the "
        "export translate (longer ones are cut, and say so)", "tokenizer and batches", type=int, metavar="N")
    shuffle_buffer: int = setting(20_000, "the training batches' shuffle buffer, in pairs, for text corpora",
                                  "tokenizer and batches", type=int, metavar="PAIRS")
    subword_sampling: float | None = setting(
        None, "subword regularization (Kudo, 2018): sample each training sentence's segmentation anew every "
        "epoch, with probabilities proportional to p ** ALPHA (lower = more varied, e.g. 0.2-0.5); validation "
        "and evaluation keep the best segmentation", "tokenizer and batches", shown="off", type=float,
        metavar="ALPHA")

    model_dir: str = setting("runs/model", "output directory", "training")
    init_from: str | None = setting(
        None, "fine-tune: start from this kt-train model directory (or a .keras file in one), with its "
        "vocabulary, architecture and weights, and a fresh optimizer and learning-rate schedule", "training",
        metavar="MODEL_DIR")
    epochs: int | None = setting(
        10, "passes over the training data; with --max-updates, at most this many (a config's \"epochs\": null: "
        "no epoch limit)", "training", type=int)
    max_updates: int | None = setting(
        None, "stop after N optimizer updates, in the middle of an epoch if need be (fairseq's --max-update; that "
        "epoch still ends: validation, checkpoint, history row): a recipe defined by work; a resumed run stops at "
        "the same update", "training", shown="no limit",
        type=int, metavar="N")
    checkpoint_every: int | None = setting(
        None, "a recipe by updates (fairseq's --save-interval-updates): every N updates a checkpoint "
        "(checkpoints/update-NNNNNNN.weights.h5, which kt-average-checkpoints --last averages), the validation "
        "loss, a history.csv row and, by default, a backup, instead of once per pass over the corpus; needs "
        "--max-updates, the run's length (Keras' progress calls each N updates an epoch; --epochs is not used)",
        "training", shown="off", type=int, metavar="N")
    steps_per_epoch: int | None = setting(None, "fixed steps per epoch over a repeated dataset", "training",
                                          shown="one pass", type=int, metavar="N")
    max_minutes: float | None = setting(
        None, "stop after the last whole epoch that fits in this many minutes of training (one more epoch of the "
        "mean length so far would not; 0: no limit; one worker only)", "training", shown="no limit", type=float,
        metavar="M")
    warmup_steps: int = setting(
        4000, "the learning rate's warm-up, in updates (kt.TransformerSchedule; kt.paper_adam: beta_1 0.9, beta_2 "
        "0.98)", "training", type=int)
    learning_rate_scale: float = setting(
        1.0, "multiply the paper's learning-rate curve by this (OpenNMT-tf's NoamDecay scale): the peak, at "
        "the end of warm-up, is S * (d_model * warmup) ** -0.5", "training", type=float, metavar="S")
    label_smoothing: float = setting(0.1, "label smoothing of the loss (the paper's epsilon_ls)", "training",
                                     type=float)
    r_drop: float | None = setting(
        None, "R-Drop (Liang et al., 2021): every training and validation pair twice in its batch, and WEIGHT "
        "times the mean of KL(P||Q) and KL(Q||P) between the two dropout passes P and Q added to the loss (the "
        "paper's alpha: 5 for translation); an update costs over twice as much", "training", shown="off",
        type=float, metavar="WEIGHT")
    adam_epsilon: float | None = setting(None, "Adam's epsilon (fairseq's default is 1e-8)", "training",
                                         shown="1e-9, the paper's", type=float)
    global_clipnorm: float | None = setting(
        None, "rescale the update's gradient when its global norm, over all variables together, exceeds NORM "
        "(fairseq's --clip-norm; not Keras' per-variable clipnorm): the gradient summed over every replica and "
        "accumulated batch", "training", shown="no clipping", type=float, metavar="NORM")
    grad_accum: int = setting(
        1, "batches per update on every replica (fairseq's --update-freq): the gradient is summed over them and "
        "over the replicas, then clipped and applied once", "training", type=int, metavar="N")
    mixed_precision: bool | str = setting(
        "auto", "auto: mixed_bfloat16 on a CPU only with native bfloat16 (avx512_bf16 or amx_bf16), on GPUs "
        "mixed_bfloat16 from compute capability 8.0 and mixed_float16 from 7.0, else float32. The flags force "
        "mixed precision (mixed_bfloat16 on CPU, mixed_float16 on GPU) or float32", "training",
        flags=(Flag("--mixed-precision", dict(action="store_true"), "force mixed precision (default: auto, "
                    "where the hardware computes half precision natively)"),
               Flag("--no-mixed-precision", dict(action="store_false"), "force float32")))
    jit_compile: bool = setting(False, "compile the train step with XLA", "training", action="store_true")
    cpu_replicas: int = setting(1, "split the CPU into N logical devices for MirroredStrategy", "training",
                                type=int, metavar="N")
    backup_every: int | None = setting(None, "a backup every N updates, for a killed run to resume from",
                                       "training", shown="every epoch", type=int, metavar="N")
    seed: int = setting(1234, "seeds the weights, the vocabulary's sample and the data order", "training",
                        type=int)

    average_last: int | None = setting(
        None, "kt-average-checkpoints averages the last N checkpoints", GROUPS[4],
        shown=f"its own: {DEFAULT_AVERAGE_LAST}", type=int, metavar="N")
    beam_size: int | None = setting(None, "kt-evaluate's and kt-export's beam size", GROUPS[4],
                                    shown=f"theirs: {DEFAULT_BEAM_SIZE}", type=int)
    length_penalty: float | None = setting(
        None, "kt-evaluate's and kt-export's length penalty: a hypothesis scores log P / ((5 + length) / 6)^A",
        GROUPS[4], shown=f"theirs: {DEFAULT_LENGTH_PENALTY}", type=float, metavar="A")
    metric: str = setting(
        "bleu", "kt-evaluate's score: bleu (sacreBLEU, chrF) | evalb (EVALB's bracket F1 of parses against the "
        "gold trees given as references, COLLINS.prm's conventions: the parsing recipe)", GROUPS[4])
    extra_output_length: int | None = setting(
        None, "kt-evaluate's and kt-export's room for the output: at most the source's length + N pieces "
        "(the paper's parsing: 300)", GROUPS[4], shown=f"theirs: {EXTRA_OUTPUT_LENGTH}", type=int, metavar="N")

    verbose: int | str = setting(
        "auto", "show TensorFlow's and absl's log lines (hidden by default); N sets Keras' fit verbosity: 0 "
        "silent, 1 progress bar, 2 one line per epoch", "output", shown="auto: 1 on a terminal, 2 otherwise",
        nargs="?", const="auto", type=_verbosity, metavar="N")

    def to_dict(self) -> dict:
        """The settings by name, as config.json's "training" records them."""
        return dataclasses.asdict(self)


SETTINGS = {f.name: f for f in dataclasses.fields(TrainSettings)}
_TYPES = typing.get_type_hints(TrainSettings)


def default(name: str):
    """A setting's default value."""
    f = SETTINGS[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def flags_of(name: str) -> list[Flag]:
    f = SETTINGS[name]
    if f.metadata["flags"] is not None:
        return list(f.metadata["flags"])
    return [Flag("--" + name.replace("_", "-"), f.metadata["flag_kwargs"])]


def shown_default(name: str) -> str:
    """A setting's default as --help and the table say it: its `shown` text, else its value ("" for None, on/off
    for a flag, thousands separated from 10,000)."""
    f = SETTINGS[name]
    if f.metadata["shown"] is not None:
        return f.metadata["shown"]
    value = default(name)
    if value is None:
        return ""
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:,}" if isinstance(value, int) and value >= 10_000 else str(value)


def add_setting_flags(parser_or_group, names, *, with_defaults: bool = False) -> None:
    """Adds the flags of the settings `names` to an argparse parser or group, each with its help and default.
    `with_defaults`: the parser sets the default itself (for a command whose parser does not suppress them)."""
    for name in names:
        for flag in flags_of(name):
            kwargs = dict(flag.kwargs)
            kwargs.setdefault("dest", name)
            if with_defaults and kwargs["dest"] == name:
                kwargs["default"] = default(name)
            # A flag's own help is one of several ways to set the setting: the default is said with the setting's.
            help_text, shown = (flag.help, "") if flag.help else (SETTINGS[name].metadata["help"], shown_default(name))
            parser_or_group.add_argument(flag.name, help=f"{help_text} (default: {shown})" if shown else help_text,
                                         **kwargs)


DESCRIPTION = """Train a Transformer with `model.fit` under tf.distribute.

    kt-train --config configs/multi30k.json --source-lang en --target-lang de --model-dir runs/en-de

Writes to --model-dir: tokenizer.model (sentencepiece proto), config.json
(langs, ids, vocabulary, model and training settings), model.keras (final
model), checkpoints/epoch-NNN.weights.h5 (one per epoch, for averaging; with
--checkpoint-every N, checkpoints/update-NNNNNNN.weights.h5 every N updates),
backup/ (BackupAndRestore, removed when training finishes), logs/
(TensorBoard) and history.csv.
"""


def build_parser() -> argparse.ArgumentParser:
    """kt-train's parser: --config, then each setting's flags (`TrainSettings`), by group. A flag not given is
    absent from the parsed arguments (argparse.SUPPRESS), so that the --config file's value stands."""
    p = argparse.ArgumentParser(
        prog="kt-train", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS)
    p.add_argument("--config", help="JSON file with any of the settings below (keys with underscores) "
                   "and \"model\": {Transformer arguments}. Command-line flags override it.")
    for group in GROUPS:
        g = p if group == "model" else p.add_argument_group(group)
        add_setting_flags(g, [name for name, f in SETTINGS.items() if f.metadata["group"] == group])
        if group == "tokenizer and batches":
            add_renamed_flags(g, "max_length")  # --max-length, still read (with a note): see resolve_settings
        if group == GROUPS[4]:
            add_renamed_flags(g, "alpha")  # --alpha, still read (with a note)
    return p


def _renamed_keys(file_cfg: dict, config_file) -> dict:
    """A --config file's settings with each old name (`RENAMED_SETTINGS`) moved onto its new one, with a note."""
    for old, renamed in RENAMED_SETTINGS.items():
        if old in file_cfg:
            if renamed.new in file_cfg:
                raise SystemExit(f"{config_file}: config key \"{old}\" is the old name of \"{renamed.new}\": "
                                 f"give \"{renamed.new}\" only")
            file_cfg[renamed.new] = file_cfg.pop(old)
            note = renamed_note(f'config key "{old}"', f'"{renamed.new}"')
            print(f"[kt-train] note: {note}", file=sys.stderr, flush=True)
    return file_cfg


def resolve_settings(argv=None) -> TrainSettings:
    """The settings of a run: the defaults, overridden by the --config file, overridden by the flags in `argv`.
    A key the file should not have, or a value of the wrong type, exits with a message naming it."""
    parser = build_parser()
    parsed = parser.parse_args(argv)
    take_renamed_flags(parser, parsed, "[kt-train] note:")
    args = vars(parsed)
    values = {}
    if "config" in args:
        config_file = args.pop("config")
        with open(config_file, encoding="utf-8") as f:
            values = _renamed_keys(json.load(f), config_file)
        unknown = set(values) - set(SETTINGS)
        if unknown:
            raise SystemExit(f"{config_file}: unknown keys {sorted(unknown)}; known: {sorted(SETTINGS)}")
        for name, value in values.items():
            problem = type_problem(name, value)
            if problem:
                raise SystemExit(f"{config_file}: \"{name}\": {problem}")
    model = {**default("model"), **values.pop("model", {})}
    for kv in args.pop("model_args", []):
        key, _, value = kv.partition("=")
        try:
            model[key] = json.loads(value)
        except json.JSONDecodeError:
            model[key] = value
    if "dropout" in args:
        model["dropout"] = args.pop("dropout")
    values.update(args)
    if values.get("train_files"):
        values["dataset"] = "files"
    return TrainSettings(**values, model=model)


def type_problem(name: str, value) -> str | None:
    """Why `value` cannot be setting `name` (by `TrainSettings`' annotation), or None when it can."""
    allowed = typing.get_args(_TYPES[name]) or (_TYPES[name],)
    for kind in allowed:
        if kind is type(None) and value is None:
            return None
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return None
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return None
        if kind in (str, bool, dict) and isinstance(value, kind):
            return None
        if kind is list and isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value):
            return None
    wanted = " or ".join({type(None): "null", list: "a [SOURCE, TARGET] pair of file names"}.get(k, k.__name__)
                         for k in allowed)
    return f"expected {wanted}, got {value!r}"


def settings_table() -> str:
    """The Markdown table of every setting: its config key, its flags, its default and its help (training/README.md
    holds a copy, which a test checks)."""
    def cell(text):
        return text.replace("|", "\\|")

    rows = ["| config key | flag | default | meaning |", "|---|---|---|---|"]
    for name, f in SETTINGS.items():
        flags = ", ".join(f"`{flag.name}`" for flag in flags_of(name))
        rows.append(f"| `{name}` | {flags} | {cell(shown_default(name))} | {cell(f.metadata['help'])} |")
    return "\n".join(rows)


def check_settings(settings: TrainSettings) -> None:
    """Raises `ConfigError` naming the first setting out of its range, or of a type it cannot have."""
    s = settings
    for name in SETTINGS:
        problem = type_problem(name, getattr(s, name))
        if problem:
            raise ConfigError(f"{name}: {problem}")
    for name in ("adam_epsilon", "global_clipnorm"):
        if getattr(s, name) is not None and not getattr(s, name) > 0:
            raise ConfigError(f"{_flag(name)} ({name}) must be positive, got {getattr(s, name)!r}")
    for name in ("epochs", "max_updates", "average_last", "beam_size", "grad_accum", "tokens_per_replica",
                 "tokens_per_batch", "backup_every", "checkpoint_every", "vocab_sample", "max_sentence_length",
                 "cpu_replicas"):
        if getattr(s, name) is not None and not getattr(s, name) >= 1:
            raise ConfigError(f"{_flag(name)} ({name}) must be a whole number of at least 1, got {getattr(s, name)!r}")
    if s.extra_output_length is not None and not s.extra_output_length >= 0:
        raise ConfigError(f"--extra-output-length (extra_output_length) must be a whole number of at least 0, "
                          f"got {s.extra_output_length!r}")
    if s.epochs is None and s.max_updates is None:
        raise ConfigError("\"epochs\": null (no epoch limit) needs max_updates (--max-updates N)")
    if s.metric not in METRICS:
        raise ConfigError(f"metric (--metric) must be one of {', '.join(METRICS)}, got {s.metric!r}")
    if s.vocab_type not in VOCAB_TYPES:
        raise ConfigError(f"vocab_type (--vocab-type) must be one of {', '.join(VOCAB_TYPES)}, got {s.vocab_type!r}")
    if s.checkpoint_every:
        if s.max_updates is None:
            raise ConfigError("--checkpoint-every (checkpoint_every) counts updates: the run's length is then "
                              "--max-updates N (max_updates), which is not set")
        if s.steps_per_epoch:
            raise ConfigError("--checkpoint-every sets the span between checkpoints: drop --steps-per-epoch")
    if s.prepared:
        clashes = {"subword_sampling": "--subword-sampling: it draws each sentence's segmentation anew every "
                   "epoch, from its text, and a prepared corpus holds token ids; train from text "
                   "(--train-files) to sample segmentations",
                   "tokenizer": "--tokenizer: a prepared corpus's ids are in its own vocabulary",
                   "max_train_examples": "--max-train-examples: prepare a smaller corpus instead",
                   "train_files": "--train-files: the corpus is the prepared one"}
        for name, why in clashes.items():
            if getattr(s, name):
                raise ConfigError(f"--prepared cannot be combined with {why}")
    for name in ("subword_sampling", "r_drop"):
        if getattr(s, name) is not None and not getattr(s, name) >= 0:
            raise ConfigError(f"{_flag(name)} ({name}) must be positive (or 0 for off), got {getattr(s, name)!r}")


def check_jit_compile(device_kind: str, replicas: int) -> None:
    """--jit-compile's start-up check, for a run on `replicas` replicas in sync on devices of `device_kind`
    ("CPU" or "GPU", `training.distribute.device_kind`): a `ConfigError` saying what to do on more than one.

    Keras compiles the whole distributed step with XLA, the replicas' all-reduces in it. On CPUs TensorFlow 2.21
    cannot: MirroredStrategy's replicas on one CPU's logical devices fail at the first update (XLA reaches one
    device's variables), workers with "Collectives are not yet implemented for CPU devices when compiling with
    XLA". On GPUs TensorFlow takes XLA's own all-reduce instead, which nothing here tests (the replica tests run on
    CPUs)."""
    if replicas <= 1:
        return
    if device_kind == "GPU":
        raise ConfigError(
            f"--jit-compile on {replicas} GPU replicas: under XLA, TensorFlow all-reduces the update's gradients "
            "with XLA's GPU all-reduce, a path no test of kt-train runs (its replica tests run on CPUs). Drop "
            "--jit-compile (the update is the same without it), or train on one GPU (CUDA_VISIBLE_DEVICES=0, one "
            "worker).")
    raise ConfigError(
        f"--jit-compile on {replicas} replicas on CPUs: TensorFlow cannot compile the update's all-reduce across "
        "replicas with XLA on CPUs (the first update fails). Drop --jit-compile, or train on one replica "
        "(no --cpu-replicas, one worker).")


def _flag(name: str) -> str:
    """The first flag of setting `name`, for messages (every setting a range check names has one)."""
    return flags_of(name)[0].name


def write_config(settings: TrainSettings, model_dir: Path, vocab_size: int, model, policy: str, extra=None, *,
                 target_tokenizer: bool = False) -> Path:
    """Writes MODEL_DIR/config.json (`common.run_dir.write_run_config`) of a run with `settings`: its languages,
    the longest source its model translates (`max_source_length`, the training pairs' `max_sentence_length`),
    its preset, and every setting ("training"). `target_tokenizer`: the run has a vocabulary per side."""
    return write_run_config(model_dir, source_lang=settings.source_lang, target_lang=settings.target_lang,
                            vocab_size=vocab_size, max_source_length=settings.max_sentence_length, model=model,
                            policy=policy, preset=settings.preset, training=settings.to_dict(),
                            target_tokenizer=target_tokenizer, extra=extra)


def batch_plan(settings: TrainSettings, replicas: int, previous: dict | None = None) -> dict:
    """How many tokens an update takes: {"tokens_per_replica", "replicas", "grad_accum", "tokens_per_update"}
    (budgets of padded tokens per side; `make_batches` takes `tokens_per_replica * replicas` as its batch's).

    `settings.tokens_per_replica`, when set, wins over `settings.tokens_per_batch`: it is what a device's memory
    bounds, and the same per-replica batch then fits on any number of devices. A global `tokens_per_batch`
    is split between the replicas, so the update keeps its size on any number of them.

    `previous` is the plan a resumed run recorded (config.json's "batch_plan"). On another number of replicas
    with a per-replica budget, the accumulation is changed to keep the run's tokens per update, and where no
    whole number of batches keeps it, a `ConfigError` says how to go on.
    """
    accumulate = settings.grad_accum
    if settings.tokens_per_replica:
        per_replica = int(settings.tokens_per_replica)
    else:
        per_replica = int(settings.tokens_per_batch) // replicas
    plan = {"tokens_per_replica": per_replica, "replicas": replicas, "grad_accum": accumulate,
            "tokens_per_update": per_replica * replicas * accumulate}
    if previous is None or previous["replicas"] == replicas or not settings.tokens_per_replica:
        return plan
    wanted = previous["tokens_per_update"]
    batches, left = divmod(wanted, per_replica * replicas)
    if left or batches < 1:
        raise ConfigError(
            f"This run was trained with {previous['replicas']} replica(s) x {previous['grad_accum']} batch(es) per "
            f"update x {previous['tokens_per_replica']:,} tokens = {wanted:,} tokens per update; on {replicas} "
            f"replicas, no whole number of batches of {per_replica:,} tokens (--tokens-per-replica) makes "
            f"{wanted:,}. Resume with --tokens-per-replica T --grad-accum N such that {replicas} x N x T = "
            f"{wanted:,}, or on {previous['replicas']} replica(s); or start a run of its own from this one's "
            f"weights with --init-from.")
    return {**plan, "grad_accum": batches, "tokens_per_update": wanted}


if __name__ == "__main__":  # python -m training.config: the settings table of training/README.md
    print(settings_table())
