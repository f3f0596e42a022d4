"""Training settings: their defaults, the kt-train flags that set them, and the config.json a run writes.

A setting comes from, in increasing priority: `DEFAULTS`, a JSON file given
with `--config` (any key of `DEFAULTS`, plus "model": {Transformer
arguments}), and the command-line flags.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from common.run_dir import (CHECKPOINT_DIR, CONFIG_FILENAME, MODEL_FILENAME, RENAMED_SETTINGS, TOKENIZER_FILENAME,
                            add_renamed_flags, take_renamed_flags)
from keras_transformer.text import END_ID, PAD_ID, START_ID, UNK_ID, VOCAB_TYPES
from training.errors import ConfigError


# Training settings and their defaults (a JSON config file may set any of these,
# plus "model": {Transformer constructor overrides}).
DEFAULTS = {
    "preset": "small",
    "model": {},
    "dataset": "multi30k",
    "data_dir": None,
    "tfds_data_dir": None,
    "train_files": None,
    "valid_files": None,
    "prepared": None,
    "check_alignment": True,
    "source_lang": "en",
    "target_lang": "de",
    "model_dir": "runs/model",
    "tokenizer": None,
    "init_from": None,
    "vocab_size": 8000,
    "vocab_type": VOCAB_TYPES[0],
    "vocab_sample": 2_000_000,
    "lowercase": False,
    "tokens_per_batch": 4096,
    "tokens_per_replica": None,
    "max_length": 128,
    "subword_sampling": None,
    "warmup_steps": 4000,
    "learning_rate_scale": 1.0,
    "label_smoothing": 0.1,
    "r_drop": None,
    "adam_epsilon": None,
    "global_clipnorm": None,
    "epochs": 10,
    "max_updates": None,
    "checkpoint_every": None,
    "max_minutes": None,
    "steps_per_epoch": None,
    "validation": True,
    "val_bleu": False,
    "max_train_examples": None,
    "max_eval_examples": None,
    "mixed_precision": "auto",
    "jit_compile": False,
    "grad_accum": 1,
    "cpu_replicas": 1,
    "seed": 1234,
    "backup_every": None,
    "shuffle_buffer": 20000,
    "verbose": "auto",
    # Not read by kt-train: recorded in config.json for the commands that follow it (`make train`).
    "average_last": None,
    "beam_size": None,
    "length_penalty": None,
}

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
    p = argparse.ArgumentParser(
        prog="kt-train", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS)
    p.add_argument("--config", help="JSON file with any of the settings below (keys with underscores) "
                   "and \"model\": {Transformer arguments}. Command-line flags override it.")
    p.add_argument("--preset", help="model size: tiny | small | base | big (default small)")
    p.add_argument("--model-arg", action="append", metavar="KEY=VALUE", dest="model_args",
                   help="override a Transformer argument, e.g. --model-arg dropout=0.3 (repeatable)")
    p.add_argument("--dropout", type=float, help="shortcut for --model-arg dropout=X")
    g = p.add_argument_group("data")
    g.add_argument("--dataset", help="multi30k (default; read as text) | files | a TFDS name, e.g. "
                   "ted_hrlr_translate/pt_to_en (prepared into MODEL_DIR/prepared first, as --train-files)")
    g.add_argument("--data-dir", help="raw Multi30k directory (default: $KT_MULTI30K_DIR, else "
                   "../shared/data/multi30k, else download)")
    g.add_argument("--tfds-data-dir", help="where TFDS stores prepared datasets (default $KT_TFDS_DIR or ~/tensorflow_datasets)")
    g.add_argument("--train-files", nargs=2, metavar=("SOURCE", "TARGET"), help="parallel text files, plain or gzip (implies --dataset files); prepared into "
                   "MODEL_DIR/prepared first, as kt-prepare does, unless --subword-sampling or --max-train-examples "
                   "keeps them text")
    g.add_argument("--valid-files", nargs=2, metavar=("SOURCE", "TARGET"), help="validation text files for --dataset files")
    g.add_argument("--prepared", metavar="DIR",
                   help="train on a corpus kt-prepare prepared (its shards, its vocabulary, its validation set "
                   "unless --valid-files), streamed, each worker its own shards")
    g.add_argument("--source-lang")
    g.add_argument("--target-lang")
    g.add_argument("--no-alignment-check", dest="check_alignment", action="store_false",
                   help="train on --train-files/--valid-files even where their pairs look shifted by a line")
    g.add_argument("--max-train-examples", type=int, help="use only the first N training pairs (quick runs)")
    g.add_argument("--max-eval-examples", type=int, help="use only the first N validation pairs")
    g.add_argument("--no-validation", dest="validation", action="store_false", help="skip the validation loss")
    g.add_argument("--val-bleu", action="store_true",
                   help="after every epoch, also greedy-decode the validation set and record its BLEU (val_bleu in "
                   "history.csv), e.g. for kt-average-checkpoints --best N --by val_bleu")
    g = p.add_argument_group("tokenizer and batches")
    g.add_argument("--tokenizer", help="existing sentencepiece .model to use instead of training one")
    g.add_argument("--vocab-size", type=int, help="joint subword vocabulary size (default 8000)")
    g.add_argument("--vocab-type", choices=VOCAB_TYPES,
                   help="the vocabulary's sentencepiece model: unigram (default) or bpe (byte-pair encoding, the "
                   "paper's)")
    g.add_argument("--vocab-sample", type=int, metavar="LINES",
                   help="train the vocabulary on a uniform random sample of this many lines of all the training "
                   "text, both sides, drawn by --seed (default 2,000,000; a smaller corpus is used whole)")
    g.add_argument("--lowercase", action="store_true",
                   help="train a case-folding vocabulary (sentencepiece's nmt_nfkc_cf normaliser): the model reads "
                   "and writes lowercase text, and kt-evaluate scores it case-insensitively (default: cased)")
    g.add_argument("--tokens-per-batch", type=int,
                   help="token budget of a batch and side, over all replicas together (default 4096; split evenly "
                   "between them)")
    g.add_argument("--tokens-per-replica", type=int,
                   help="token budget of a batch and side on each replica (fairseq's --max-tokens): the batch on "
                   "N replicas is N times this; when set, it wins over --tokens-per-batch")
    g.add_argument("--max-length", type=int, help="drop training pairs longer than this many tokens (default 128)")
    g.add_argument("--shuffle-buffer", type=int)
    g.add_argument("--subword-sampling", type=float, metavar="ALPHA",
                   help="subword regularization (Kudo, 2018): sample each training sentence's segmentation anew "
                   "every epoch, with probabilities proportional to p ** ALPHA (lower = more varied, e.g. 0.2-0.5); "
                   "validation and evaluation keep the best segmentation (default: off)")
    g = p.add_argument_group("training")
    g.add_argument("--model-dir", help="output directory (default runs/model)")
    g.add_argument("--init-from", metavar="MODEL_DIR",
                   help="fine-tune: start from this kt-train model directory (or a .keras file in one), with its "
                   "vocabulary, architecture and weights, and a fresh optimizer and learning-rate schedule")
    g.add_argument("--epochs", type=int, help="passes over the training data (default 10); with --max-updates, "
                   "at most this many (a config's \"epochs\": null: no epoch limit)")
    g.add_argument("--max-updates", type=int, metavar="N",
                   help="stop after N optimizer updates, in the middle of an epoch if need be (fairseq's "
                   "--max-update): a recipe defined by work; a resumed run stops at the same update")
    g.add_argument("--checkpoint-every", type=int, metavar="N",
                   help="a recipe by updates (fairseq's --save-interval-updates): every N updates a checkpoint "
                   "(checkpoints/update-NNNNNNN.weights.h5, which kt-average-checkpoints --last averages), the "
                   "validation loss, a history.csv row and, by default, a backup, instead of once per pass over "
                   "the corpus; needs --max-updates, the run's length (Keras' progress calls each N updates an "
                   "epoch; --epochs is not used)")
    g.add_argument("--steps-per-epoch", type=int, help="fixed steps per epoch over a repeated dataset")
    g.add_argument("--max-minutes", type=float,
                   help="stop after the last whole epoch that fits in this many minutes of training (default and 0: no limit)")
    g.add_argument("--warmup-steps", type=int, help="learning-rate warm-up (default 4000)")
    g.add_argument("--learning-rate-scale", type=float,
                   help="multiply the paper's learning-rate curve by this (default 1; OpenNMT-tf's NoamDecay scale)")
    g.add_argument("--label-smoothing", type=float)
    g.add_argument("--r-drop", type=float, metavar="WEIGHT",
                   help="R-Drop (Liang et al., 2021): every training and validation pair twice in its batch, and "
                   "WEIGHT times the mean of KL(P||Q) and KL(Q||P) between the two dropout passes P and Q added to "
                   "the loss (the paper's alpha: 5 for translation); an update costs over twice as much "
                   "(default: off)")
    g.add_argument("--adam-epsilon", type=float,
                   help="Adam's epsilon (default 1e-9, the paper's; fairseq's default is 1e-8)")
    g.add_argument("--global-clipnorm", type=float, metavar="NORM",
                   help="rescale the gradients when their global norm (over all variables together) exceeds "
                   "NORM (Keras' global_clipnorm; fairseq's --clip-norm; default: no clipping)")
    g.add_argument("--grad-accum", type=int, metavar="N",
                   help="batches per update on every replica (fairseq's --update-freq): the gradient is summed over "
                   "them and over the replicas, then clipped and applied once (default 1)")
    g.add_argument("--mixed-precision", action="store_true", help="force mixed precision: mixed_bfloat16 on CPU, "
                   "mixed_float16 on GPU (default auto: only where the hardware computes half precision natively)")
    g.add_argument("--no-mixed-precision", dest="mixed_precision", action="store_false", help="force float32")
    g.add_argument("--jit-compile", action="store_true", help="compile the train step with XLA")
    g.add_argument("--cpu-replicas", type=int, help="split the CPU into N logical devices for MirroredStrategy")
    g.add_argument("--backup-every", type=int, metavar="N",
                   help="a backup every N updates, for a killed run to resume from (default: every epoch)")
    g.add_argument("--seed", type=int)
    g = p.add_argument_group("after training (recorded in config.json for the commands that follow kt-train)")
    g.add_argument("--average-last", type=int, metavar="N",
                   help="kt-average-checkpoints averages the last N epoch checkpoints (its own default: 5)")
    g.add_argument("--beam-size", type=int, help="kt-evaluate's and kt-export's beam size (their default: 4)")
    g.add_argument("--length-penalty", type=float, metavar="A",
                   help="kt-evaluate's and kt-export's length penalty: a hypothesis scores log P / ((5 + length) "
                   "/ 6)^A (their default: 0.6)")
    add_renamed_flags(g)  # --alpha, still read (with a note): see resolve_config
    g = p.add_argument_group("output")
    g.add_argument("--verbose", nargs="?", const="auto", type=_verbosity, metavar="N",
                   help="show TensorFlow's and absl's log lines (hidden by default); N sets Keras' fit verbosity: "
                   "0 silent, 1 progress bar, 2 one line per epoch (default: 1 on a terminal, 2 otherwise)")
    return p


def _verbosity(value):
    return value if value == "auto" else int(value)


def resolve_config(argv=None) -> dict:
    """The settings of a run: DEFAULTS, overridden by the --config file, overridden by the flags in `argv`."""
    parser = build_parser()
    parsed = parser.parse_args(argv)
    take_renamed_flags(parser, parsed, "[kt-train] note:")
    args = vars(parsed)
    cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in DEFAULTS.items()}
    if "config" in args:
        config_file = args.pop("config")
        with open(config_file, encoding="utf-8") as f:
            file_cfg = json.load(f)
        for old, new in RENAMED_SETTINGS.items():
            if old in file_cfg:
                if new in file_cfg:
                    raise SystemExit(f"{config_file}: config key \"{old}\" is the old name of \"{new}\": "
                                     f"give \"{new}\" only")
                file_cfg[new] = file_cfg.pop(old)
                print(f"[kt-train] note: config key \"{old}\" is now \"{new}\" (read as such)", file=sys.stderr,
                      flush=True)
        unknown = set(file_cfg) - set(DEFAULTS)
        if unknown:
            raise SystemExit(f"Unknown keys in config file: {sorted(unknown)}; known: {sorted(DEFAULTS)}")
        model = {**cfg["model"], **file_cfg.pop("model", {})}
        cfg.update(file_cfg)
        cfg["model"] = model
    for kv in args.pop("model_args", []):
        key, _, value = kv.partition("=")
        try:
            cfg["model"][key] = json.loads(value)
        except json.JSONDecodeError:
            cfg["model"][key] = value
    if "dropout" in args:
        cfg["model"]["dropout"] = args.pop("dropout")
    cfg.update(args)
    if cfg.get("train_files"):
        cfg["dataset"] = "files"
    return cfg


def check_settings(cfg) -> None:
    """Raises `ConfigError` naming the first setting out of its range."""
    positive = {"adam_epsilon": "--adam-epsilon", "global_clipnorm": "--global-clipnorm"}
    for key, flag in positive.items():
        if cfg.get(key) is not None and not cfg[key] > 0:
            raise ConfigError(f"{flag} ({key}) must be positive, got {cfg[key]!r}")
    at_least_one = {"epochs": "--epochs", "max_updates": "--max-updates", "average_last": "--average-last",
                    "beam_size": "--beam-size", "grad_accum": "--grad-accum", "tokens_per_replica": "--tokens-per-replica",
                    "tokens_per_batch": "--tokens-per-batch", "backup_every": "--backup-every",
                    "checkpoint_every": "--checkpoint-every",
                    "vocab_sample": "--vocab-sample"}
    for key, flag in at_least_one.items():
        if cfg.get(key) is not None and not (isinstance(cfg[key], int) and cfg[key] >= 1):
            raise ConfigError(f"{flag} ({key}) must be a whole number of at least 1, got {cfg[key]!r}")
    if cfg.get("epochs") is None and cfg.get("max_updates") is None:
        raise ConfigError("\"epochs\": null (no epoch limit) needs max_updates (--max-updates N)")
    if cfg.get("vocab_type", VOCAB_TYPES[0]) not in VOCAB_TYPES:
        raise ConfigError(f"vocab_type (--vocab-type) must be one of {', '.join(VOCAB_TYPES)}, got {cfg['vocab_type']!r}")
    if cfg.get("checkpoint_every"):
        if cfg.get("max_updates") is None:
            raise ConfigError("--checkpoint-every (checkpoint_every) counts updates: the run's length is then "
                              "--max-updates N (max_updates), which is not set")
        if cfg.get("steps_per_epoch"):
            raise ConfigError("--checkpoint-every sets the span between checkpoints: drop --steps-per-epoch")
    if cfg.get("prepared"):
        clashes = {"subword_sampling": "--subword-sampling: it draws each sentence's segmentation anew every "
                   "epoch, from its text, and a prepared corpus holds token ids; train from text "
                   "(--train-files) to sample segmentations",
                   "tokenizer": "--tokenizer: a prepared corpus's ids are in its own vocabulary",
                   "max_train_examples": "--max-train-examples: prepare a smaller corpus instead",
                   "train_files": "--train-files: the corpus is the prepared one"}
        for key, why in clashes.items():
            if cfg.get(key):
                raise ConfigError(f"--prepared cannot be combined with {why}")
    off_at_zero = {"subword_sampling": "--subword-sampling", "r_drop": "--r-drop"}
    for key, flag in off_at_zero.items():
        if cfg.get(key) is not None and not cfg[key] >= 0:
            raise ConfigError(f"{flag} ({key}) must be positive (or 0 for off), got {cfg[key]!r}")


def write_config(cfg, model_dir: Path, vocab_size: int, model, policy: str, extra=None) -> Path:
    """Writes MODEL_DIR/config.json atomically (common.run_dir.read_config reads it)."""
    out = {
        "source_lang": cfg["source_lang"],
        "target_lang": cfg["target_lang"],
        "vocab_size": vocab_size,
        "pad_id": PAD_ID, "unk_id": UNK_ID, "bos_id": START_ID, "eos_id": END_ID,
        "start_id": START_ID, "end_id": END_ID,
        "source_format": "sentencepiece pieces + [eos_id]",
        "target_format": "decoder input [bos_id] + pieces; output pieces + [eos_id]",
        "max_length": cfg["max_length"],
        "tokenizer_file": TOKENIZER_FILENAME,
        "model_file": MODEL_FILENAME,
        "checkpoint_dir": CHECKPOINT_DIR,
        "preset": cfg["preset"],
        "model_config": {k: v for k, v in model.get_config().items()
                         if k not in ("name", "trainable", "dtype")},
        "dtype_policy": policy,
        "training": {k: v for k, v in cfg.items() if k not in ("model", "init_from_model")},
    }
    if extra:
        out.update(extra)
    path = Path(model_dir) / CONFIG_FILENAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(out, indent=2, default=str))
    os.replace(tmp, path)
    return path


def batch_plan(cfg, replicas: int, previous: dict | None = None) -> dict:
    """How many tokens an update takes: {"tokens_per_replica", "replicas", "grad_accum", "tokens_per_update"}
    (budgets of padded tokens per side; `make_batches` takes `tokens_per_replica * replicas` as its batch's).

    `cfg["tokens_per_replica"]`, when set, wins over `cfg["tokens_per_batch"]`: it is what a device's memory
    bounds, and the same per-replica batch then fits on any number of devices. A global `tokens_per_batch`
    is split between the replicas, so the update keeps its size on any number of them.

    `previous` is the plan a resumed run recorded (config.json's "batch_plan"). On another number of replicas
    with a per-replica budget, the accumulation is changed to keep the run's tokens per update, and where no
    whole number of batches keeps it, a `ConfigError` says how to go on.
    """
    accumulate = cfg.get("grad_accum") or 1
    if cfg.get("tokens_per_replica"):
        per_replica = int(cfg["tokens_per_replica"])
    else:
        per_replica = int(cfg["tokens_per_batch"]) // replicas
    plan = {"tokens_per_replica": per_replica, "replicas": replicas, "grad_accum": accumulate,
            "tokens_per_update": per_replica * replicas * accumulate}
    if previous is None or previous["replicas"] == replicas or not cfg.get("tokens_per_replica"):
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
