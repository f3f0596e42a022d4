"""The fit: parallel text -> tokenizer -> batches -> `model.fit` under tf.distribute -> a model directory.

`train(settings)` runs a whole kt-train run from the settings as asked
(`training.config.resolve_settings`), in named steps: where the run writes
(`open_run_dir`), --init-from's model, the corpus, the vocabulary, the batch
plan, then the run's settings, made once from what those found out
(`resolve_run_settings`, the one place a setting changes), the batches
(`make_fit_data`), the model, the callbacks, the fit and the saved run.
`build_and_compile` is the model and compile step alone (benchmarks use it to
compile exactly as training does).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import sys
import time
from pathlib import Path

import keras
import numpy as np
import sentencepiece as spm
import tensorflow as tf
import tensorflow_datasets as tfds

import keras_transformer as kt
from common.run_dir import (CHECKPOINT_DIR, CHECKPOINT_PATTERN, MODEL_FILENAME, TARGET_TOKENIZER_FILENAME,
                            TOKENIZER_FILENAME, epoch_checkpoints, read_config, update_checkpoints)
from common.tokenizer import SourceTargetTokenizer, make_tokenizer
from keras_transformer.keras_internals import build_fit_state_now
from keras_transformer.text import (check_special_ids, lowercases, read_tokenizer_proto, train_sentencepiece,
                                   vocab_size_of)
from training.callbacks import (EpochETA, ResumableBackup, ResumePoint, TimeBudget, UpdateBudget, UpdateCheckpoint,
                                ValidationBLEU)
from training.config import TrainSettings, batch_plan, check_jit_compile, check_settings, write_config
from training.data import DataSpec, iterate_text, load_text_pairs
from training.distribute import device_kind, input_pipeline, make_strategy, worker_info
from training.errors import ConfigError
from training.fine_tune import InitFrom, init_weights, resolve_init_from, set_init_weights
from training.keras_internals import UpdateBoundProgbar, ignoring_ran_out_of_data
from training.pipeline import make_batches, mean_target_tokens
from training.prepared_corpus import (PreparedCorpus, open_for_worker, prepared_dataset, steps_per_epoch,
                                      worker_dataset_fn)
from training.precision import choose_policy
from keras_transformer.distributed import UpdateStep


# fit()'s epoch count when a run is bounded by --max-updates alone ("epochs": null).
NO_EPOCH_LIMIT = 1_000_000


def data_spec(settings: TrainSettings, corpus: PreparedCorpus | None = None) -> DataSpec:
    """The DataSpec of a configuration; `--dataset files` needs --train-files. With a prepared `corpus`, the
    spec of its validation set: --valid-files, else the one kt-prepare recorded."""
    if corpus is not None:
        validation = ({"files": settings.valid_files} if settings.valid_files
                      else corpus.manifest.get("validation") or {})
        if "files" in validation:
            return DataSpec(dataset="files", source_lang=settings.source_lang, target_lang=settings.target_lang,
                            files={"validation": tuple(validation["files"])}, check_alignment=settings.check_alignment)
        return DataSpec(dataset=validation.get("tfds", "files"), source_lang=settings.source_lang,
                        target_lang=settings.target_lang, data_dir=validation.get("data_dir") or settings.data_dir,
                        tfds_data_dir=validation.get("tfds_data_dir") or settings.tfds_data_dir, files={})
    files = None
    if settings.dataset == "files":
        if not settings.train_files:
            raise ConfigError("--dataset files needs --train-files SOURCE TARGET")
        files = {"train": tuple(settings.train_files)}
        if settings.valid_files:
            files["validation"] = tuple(settings.valid_files)
    return DataSpec(dataset=settings.dataset, source_lang=settings.source_lang, target_lang=settings.target_lang,
                    data_dir=settings.data_dir, tfds_data_dir=settings.tfds_data_dir, files=files,
                    check_alignment=settings.check_alignment)


# Where kt-train prepares a corpus it is given as text files or by TFDS name (kt-prepare's format).
RUN_PREPARED_DIR = "prepared"
# How long another worker waits for the chief to prepare the corpus: kt-prepare's time is linear in the corpus.
PREPARE_WAIT_SECONDS = 12 * 3600.0


def text_reason(settings: TrainSettings) -> str | None:
    """Why kt-train reads its corpus as text rather than preparing it into the run directory first (the
    setting that makes it), or None when it prepares. `--train-files` and TFDS datasets are prepared (kt-prepare's way: memory flat in the
    corpus, tokenized once); Multi30k, small and built in, is read as text, and so is any corpus with
    --subword-sampling (it segments each sentence anew every epoch, from its text) or --max-train-examples."""
    if settings.prepared:
        return "--prepared"
    if settings.dataset == "multi30k":
        return "Multi30k"
    if settings.subword_sampling:
        return "--subword-sampling"
    if settings.max_train_examples:
        return "--max-train-examples"
    return None


def prepare_into_run(settings: TrainSettings, model_dir: Path, is_chief: bool, vocabulary: str | None,
                     target_vocabulary: str | None = None) -> str:
    """Prepares the run's training corpus into MODEL_DIR/prepared with kt-prepare (the chief; the other
    workers wait for its manifest) and returns that directory. The vocabulary is the run's own if it has one (a
    resumed run), else `vocabulary`, the one the run is given (--tokenizer's, or --init-from's:
    `given_vocabulary`), else trained as kt-train trains one; with a vocabulary per side, the targets' is the
    run's own or `target_vocabulary` (--init-from's); a finished preparation is reused, a killed one starts
    again."""
    from training.prepare import parse_args, prepare
    from training.prepared_corpus import MANIFEST_FILENAME

    out = model_dir / RUN_PREPARED_DIR
    if is_chief:
        argv = ["--out", str(out), "--source-lang", settings.source_lang, "--target-lang", settings.target_lang,
                "--seed", str(settings.seed)]
        if settings.dataset == "files":
            argv += ["--train-files", *settings.train_files]
        else:
            argv += ["--tfds", settings.dataset]
        if settings.valid_files:
            argv += ["--valid-files", *settings.valid_files]
        for flag, value in (("--data-dir", settings.data_dir), ("--tfds-data-dir", settings.tfds_data_dir)):
            if value:
                argv += [flag, value]
        own, given, target = model_dir / TOKENIZER_FILENAME, None, None
        if own.is_file() and not (out / MANIFEST_FILENAME).is_file():
            # A run begun on its text keeps the vocabulary its checkpoints are in.
            given, what, whose = own, f"this run's vocabulary {own}", "the run's"
            own_target = model_dir / TARGET_TOKENIZER_FILENAME
            target = own_target if own_target.is_file() else None
        elif vocabulary:
            given, what = vocabulary, f"the vocabulary {vocabulary}"
            whose = "--init-from's" if settings.init_from else "--tokenizer's"
            target = target_vocabulary
        if given is not None:
            # The vocabulary's checks first, naming the file given, before anything is prepared with it.
            proto = read_tokenizer_proto(given)
            check_special_ids(proto)
            _check_lowercase(settings, lowercases(proto), what, whose)
            argv += ["--tokenizer", str(given)] + (["--target-tokenizer", str(target)] if target else [])
        else:
            argv += ["--vocab-size", str(settings.vocab_size), "--vocab-type", settings.vocab_type,
                     "--vocab-sample", str(settings.vocab_sample)]
            argv += ["--lowercase"] if settings.lowercase else []
        if not settings.check_alignment:
            argv += ["--no-alignment-check"]
        print(f"[kt-train] preparing the corpus into {out} (kt-prepare {' '.join(argv)})", flush=True)
        prepare(parse_args(argv))
    else:
        print(f"[kt-train] waiting for the chief worker to prepare the corpus into {out}", flush=True)
        _wait_for(out / MANIFEST_FILENAME, PREPARE_WAIT_SECONDS, what="the prepared corpus",
                  instead="prepare it once with kt-prepare and give every worker --prepared DIR")
    return str(out)


def _wait_for(path: Path, timeout: float = 1800.0, what: str = "the vocabulary",
              instead: str = "train the vocabulary once and give every worker --tokenizer PATH") -> None:
    """Waits for the chief worker to write `path`; a `ConfigError` saying what to check after `timeout` s."""
    t0 = time.time()
    while not path.exists():
        if time.time() - t0 > timeout:
            raise ConfigError(
                f"this worker waited {timeout:.0f} s for the chief worker to write {what} {path}. Is "
                f"--model-dir on storage every worker shares, and is the chief running? To skip the wait, "
                f"{instead}.")
        time.sleep(0.5)


def get_tokenizer_proto(settings: TrainSettings, train_pairs, model_dir: Path, is_chief: bool, *,
                        tokenizer: str | None = None, flag: str | None = None) -> tuple[bytes, bool]:
    """Reuses the vocabulary the run is given, `tokenizer` (by default --tokenizer's) by `flag` (the log line's
    name for it; by default --init-from, --prepared or --tokenizer, as `settings` say), else model_dir/tokenizer.model
    (resume), else trains one on the training text (case-folding with `settings.lowercase`). Returns the proto and
    whether it case-folds. A cased vocabulary where `settings.lowercase` asks for a case-folding one is a
    `ConfigError`."""
    path = model_dir / TOKENIZER_FILENAME
    given = tokenizer or settings.tokenizer
    if given:
        proto = read_tokenizer_proto(given)
        check_special_ids(proto)
        folding = lowercases(proto)
        _check_lowercase(settings, folding, f"the vocabulary {given}",
                         "--init-from's" if settings.init_from else "--tokenizer's")
        if is_chief:
            path.write_bytes(proto)
            flag = flag or ("--init-from" if settings.init_from else "--prepared" if settings.prepared
                            else "--tokenizer")
            print(f"[kt-train] tokenizer: {given} ({flag}{_folding(folding)}), copied to {path}", flush=True)
        return proto, folding
    if path.exists():
        proto = read_tokenizer_proto(path)
        folding = lowercases(proto)
        _check_lowercase(settings, folding, f"this run's vocabulary {path}", "the run's")
        if is_chief:
            print(f"[kt-train] tokenizer: {path} (the run's own{_folding(folding)})", flush=True)
        return proto, folding
    if not is_chief:  # every worker must use the chief's vocabulary
        _wait_for(path)
        proto = read_tokenizer_proto(path)
        return proto, lowercases(proto)
    spm.set_random_generator_seed(settings.seed)  # seeds sentencepiece's sample of the lines too
    t0 = time.time()
    lines = [0]

    def counted():
        for line in iterate_text(train_pairs):
            lines[0] += 1
            yield line

    try:
        proto = train_sentencepiece(counted(), settings.vocab_size, model_type=settings.vocab_type,
                                    input_sentence_size=settings.vocab_sample,
                                    lowercase=settings.lowercase)
    except ValueError as e:
        raise ConfigError(f"{e} (--vocab-size)") from e
    tmp = model_dir / (TOKENIZER_FILENAME + ".tmp")
    tmp.write_bytes(proto)
    os.replace(tmp, path)  # atomic: other workers wait for this file
    folding = lowercases(proto)
    sample = (f"a uniform random sample of {settings.vocab_sample:,} of its {lines[0]:,} lines"
              if lines[0] > settings.vocab_sample else f"all its {lines[0]:,} lines")
    print(f"[kt-train] tokenizer: {path} (a joint sentencepiece vocabulary of {vocab_size_of(proto):,} pieces "
          f"({settings.vocab_type})"
          f"{_folding(folding)}, trained on {sample} of training text, both sides, in {time.time() - t0:.1f} s)",
          flush=True)
    return proto, folding


def _folding(folding: bool) -> str:
    """What the tokenizer line adds for a case-folding vocabulary."""
    return ", case-folding: the model reads and writes lowercase text" if folding else ""


def _check_lowercase(settings: TrainSettings, folding: bool, what: str, whose: str) -> None:
    """`ConfigError` when `settings` asks for a case-folding vocabulary and the one found is cased (`folding` false)."""
    if settings.lowercase and not folding:
        raise ConfigError(f"--lowercase (\"lowercase\": true) asks for a case-folding vocabulary, but {what} "
                          f"is cased: drop --lowercase to train with {whose} vocabulary, or train a new one "
                          "(without --tokenizer, in a new --model-dir)")


def build_model(settings: TrainSettings, vocab_size: int, init: InitFrom | None = None):
    """A new Transformer: `settings.preset` with `settings.model` overrides, or with `init` (`--init-from`'s
    model, `resolve_init_from`) that model's architecture (`settings.model` may still change what has no
    weights, such as dropout)."""
    if init is not None:
        return kt.Transformer.from_config({**init.model_config, **settings.model, "vocab_size": vocab_size})
    return kt.Transformer.from_preset(settings.preset, vocab_size=vocab_size, **settings.model)


def compile_model(model, settings: TrainSettings, optimizer=None):
    """Compiles `model` with the paper's Adam (or `optimizer`) and the configured loss. Gradient accumulation
    and clipping are not the optimizer's: `build_and_compile`'s `UpdateStep` does them on the summed gradient."""
    kwargs = {}
    if settings.adam_epsilon is not None:
        kwargs["epsilon"] = settings.adam_epsilon
    if optimizer is None:
        optimizer = kt.paper_adam(model.d_model, warmup_steps=settings.warmup_steps,
                                  scale=settings.learning_rate_scale, **kwargs)
    if settings.r_drop:
        # The training and validation batches hold every pair twice in a row (make_batches(copies=2): `_copies`).
        loss = kt.MaskedRDropCrossentropy(kl_weight=settings.r_drop, label_smoothing=settings.label_smoothing)
    else:
        loss = kt.MaskedSparseCategoricalCrossentropy(label_smoothing=settings.label_smoothing)
    model.compile(
        optimizer=optimizer,
        loss=loss,
        metrics=[kt.MaskedAccuracy()],
        jit_compile=settings.jit_compile,
    )
    return model


def build_and_compile(settings: TrainSettings, vocab_size: int, optimizer=None, init: InitFrom | None = None):
    """Model + optimizer + loss, built (variables created) in the current strategy scope, training with an
    `UpdateStep` (`settings.grad_accum` batches per update, clipped to `settings.global_clipnorm`); `init`:
    `build_model`'s."""
    model = build_model(settings, vocab_size, init)
    dummy = np.ones((2, 2), "int32")  # two rows: one pair for R-Drop's loss
    model((dummy, dummy))
    compile_model(model, settings, optimizer)  # under a strategy, kt.Transformer.compile builds what fit needs
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    build_fit_state_now(model, ((dummy, dummy), dummy))
    UpdateStep.install(model, accumulate=settings.grad_accum, global_clipnorm=settings.global_clipnorm)
    return model


def set_precision(settings: TrainSettings) -> str:
    """Sets Keras' global dtype policy as `settings.mixed_precision` says ("auto", True, False) and says why."""
    policy, reason = choose_policy(settings.mixed_precision)
    print(f"[kt-train] precision: {policy} ({reason})", flush=True)
    keras.mixed_precision.set_global_policy(policy)
    return policy


def fit_verbosity(setting, stream=sys.stdout) -> int:
    """Keras' per-batch progress bar (1) on a terminal, one line per epoch (2) in a log file; or as set."""
    if setting == "auto":
        return 1 if stream.isatty() else 2
    return int(setting)


def previous_batch_plan(model_dir: Path, out_dir: Path) -> dict | None:
    """The batch plan (`training.config.batch_plan`) a run resumed from its backup recorded in config.json; None
    for a fresh run, or one from before plans were recorded."""
    if not (out_dir / "backup").exists():
        return None
    try:
        return read_config(model_dir).get("batch_plan")
    except (OSError, ValueError):
        return None


def continue_finished_run(settings: TrainSettings, model_dir: Path, out_dir: Path) -> None:
    """Training into a finished run (its model.keras written, its backup deleted) with a larger
    `--max-updates` or `--epochs` continues it, as fairseq does when `--max-update` is raised.

    The run's last epoch checkpoint holds its weights and its optimizer's state (Adam's moments and
    step) as they were when it stopped; it becomes the backup this run resumes from, as if the run had
    been stopped there. The paper's learning-rate schedule depends on the update count alone, and a
    resume goes on in the middle of the epoch it stopped in (on a prepared corpus, with the batches that
    follow), so the run goes on as one started with the larger bound would have. Writes
    `out_dir/backup`; a `ConfigError` when the bounds are not larger than what the run did (training
    would otherwise start over at epoch 1 on top of it).
    """
    done = read_config(model_dir).get("last_run") or {}
    steps = done.get("optimizer_steps")
    if settings.checkpoint_every:
        # A run by updates: its last checkpoint is the one its end wrote (`UpdateCheckpoint.on_train_end`), and
        # its spans of N updates are Keras' epochs.
        checkpoints = [(-(-update // settings.checkpoint_every), path) for update, path in update_checkpoints(out_dir)
                       if update == steps]
    else:
        checkpoints = epoch_checkpoints(out_dir)
    epochs, last = checkpoints[-1] if checkpoints else (None, None)
    bounds = [(settings.max_updates, steps), (settings.epochs, epochs)]
    larger = [bool(done_so_far is not None and wanted > done_so_far) for wanted, done_so_far in bounds if wanted]
    if settings.init_from or steps is None or not checkpoints or not larger or not all(larger):
        did = f"; it made {steps:,} updates in {epochs} epochs" if steps is not None and epochs else ""
        past = (f"--max-updates above {steps:,} (and --epochs, if set, above {epochs}; a config's \"epochs\": null "
                "sets no epoch limit)") if did else "a larger --max-updates or --epochs"
        asked = " and ".join(f"--{flag} {value:,}" for value, flag in ((settings.max_updates, "max-updates"),
                                                                       (settings.epochs, "epochs")) if value)
        raise ConfigError(
            f"{model_dir} holds a finished run ({model_dir / MODEL_FILENAME}{did}). This run ({asked}) would "
            f"not go past it, and training into it would start over at epoch 1, overwriting its checkpoints. To "
            f"continue it with its optimizer state and schedule, run again with {past}. To fine-tune that model "
            f"with a fresh optimizer, pass --init-from {model_dir} with another --model-dir; to start over, "
            f"delete {model_dir} or pick another --model-dir.")
    ResumableBackup.start_from(out_dir / "backup", last, epochs, steps)
    print(f"[kt-train] {model_dir} finished at update {steps:,} (epoch {epochs}): continuing it from "
          f"{last.name}, with its optimizer state", flush=True)


@dataclasses.dataclass(frozen=True)
class RunPlace:
    """Where this process of a run writes, and which worker it is (`open_run_dir`)."""
    model_dir: Path  # --model-dir: config.json, model.keras, the tokenizer
    out_dir: Path  # this worker's checkpoints, backup, logs and history: model_dir on the chief
    is_chief: bool
    task_index: int
    num_workers: int


@dataclasses.dataclass(frozen=True)
class Corpus:
    """What a run trains on (`open_corpus`): a prepared corpus, of which this worker reads `worker`, or the
    training text's pairs, read into memory."""
    prepared: PreparedCorpus | None  # None: the corpus is read as text (`text_reason`)
    directory: str | None  # the prepared corpus's: --prepared's, or the one kt-train prepared into the run
    worker: list | None  # `open_for_worker`'s: the shards (or shares of shards) this worker reads
    pipeline: tuple[int, int] | None  # this worker's input pipeline (id, count: `input_pipeline`)
    pairs: tf.data.Dataset | None  # the training text's (source, target) pairs, when it is read as text


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    """The run's sentencepiece vocabulary (`get_vocabulary`): one joint model, or one per side (`target_proto`,
    both in the model's ids: a run fine-tuned from an imported Marian model, or on a corpus kt-prepare
    --target-tokenizer prepared)."""
    proto: bytes  # the joint one, or the source side's
    lowercase: bool  # whether it case-folds
    size: int
    target_proto: bytes | None = None  # the target side's, in a run with one per side

    @functools.cached_property
    def tokenizer(self):
        """The run's tokenizer (`common.tokenizer`), its most likely segmentation: one model's, or a
        `SourceTargetTokenizer` of a run with one per side."""
        return self.sampling_tokenizer(None)

    def sampling_tokenizer(self, sampling_alpha: float | None):
        """As `tokenizer`, with sentencepiece's sampled segmentation at `sampling_alpha` (--subword-sampling;
        None: the most likely)."""
        source = make_tokenizer(self.proto, sampling_alpha=sampling_alpha)
        if self.target_proto is None:
            return source
        return SourceTargetTokenizer(source, make_tokenizer(self.target_proto, sampling_alpha=sampling_alpha))


@dataclasses.dataclass(frozen=True)
class Run:
    """Where and on what a run trains, found out by `train` before the fit."""
    strategy: tf.distribute.Strategy
    place: RunPlace  # the directories and the worker
    replicas: int  # in sync, over all workers
    vocab_size: int
    policy: str  # Keras' dtype policy, set for the fit
    plan: dict  # `training.config.batch_plan`
    init: InitFrom | None  # --init-from's model, or None
    per_side: bool  # a vocabulary per side (`Vocabulary.target_proto`), which config.json records


@dataclasses.dataclass(frozen=True)
class FitData:
    """What `model.fit` reads: the training stream, the validation set, and what is counted of them."""
    train: tf.data.Dataset
    validation: tf.data.Dataset | None
    steps_per_epoch: int | None  # None: an epoch is a pass over `train`
    val_bleu: ValidationBLEU | None  # --val-bleu's callback
    batch_contents: dict | None  # `mean_target_tokens` of the first batches (the chief's)
    resume: ResumePoint  # the fit steps a resumed run's backup holds, which a prepared `train` skips


@dataclasses.dataclass(frozen=True)
class RunCallbacks:
    """`model.fit`'s callbacks (`make_callbacks`), and those the summary reads."""
    all: list
    backup: ResumableBackup
    updates: UpdateBudget | None  # --max-updates'
    budget: TimeBudget | None  # --max-minutes'


def train(settings: TrainSettings, strategy=None) -> dict:
    """Runs training as `settings` say; returns a summary dict (also printed as JSON).

    `settings` are the settings as asked (`training.config.resolve_settings`). The steps that find out what the
    run is made of (where it writes, --init-from's model, the corpus, the vocabulary, the batch plan) read them;
    `resolve_run_settings` then makes the run's settings from them, once, and the steps after (the batches, the
    model, the fit, config.json) read those."""
    check_settings(settings)
    if strategy is None:
        strategy = make_strategy(settings.cpu_replicas)
    if settings.jit_compile:
        check_jit_compile(device_kind(strategy), strategy.num_replicas_in_sync)
    tfds.disable_progress_bar()
    place = open_run_dir(settings)
    keras.utils.set_random_seed(settings.seed)
    init = fine_tuning_start(settings)
    corpus = open_corpus(settings, place, init)
    vocabulary = get_vocabulary(settings, place, init, corpus)
    plan = plan_batches(settings, strategy.num_replicas_in_sync, place)
    run_settings = resolve_run_settings(settings, init=init, corpus=corpus, lowercase=vocabulary.lowercase, plan=plan)
    data = make_fit_data(run_settings, strategy, place, corpus, vocabulary, plan)
    with dtype_policy(run_settings) as policy:
        run = Run(strategy, place, strategy.num_replicas_in_sync, vocabulary.size, policy, plan, init,
                  vocabulary.target_proto is not None)
        model = build_run_model(run_settings, run, data)
        initial_val_loss = loss_before_fine_tuning(model, run, data)
        callbacks = make_callbacks(run_settings, run, data)
        summary = fit_model(model, run_settings, run, data, callbacks, initial_val_loss)
        save_run(model, run_settings, run, data, summary)
        return summary


def open_run_dir(settings: TrainSettings) -> RunPlace:
    """Takes the settings as asked; makes --model-dir (and, on a worker that is not the chief, its own directory
    in it) and returns where this process writes. A finished run trained into again is made to resume from its
    last checkpoint (`continue_finished_run`, which writes the backup)."""
    is_chief, task_index, num_workers = worker_info()
    model_dir = Path(settings.model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    # Non-chief workers write their (identical) checkpoints/backups/logs aside.
    out_dir = model_dir if is_chief else model_dir / f".worker-{task_index}"
    out_dir.mkdir(parents=True, exist_ok=True)
    if (model_dir / MODEL_FILENAME).exists() and not (out_dir / "backup").exists():
        continue_finished_run(settings, model_dir, out_dir)
    return RunPlace(model_dir, out_dir, is_chief, task_index, num_workers)


def fine_tuning_start(settings: TrainSettings) -> InitFrom | None:
    """Takes the settings as asked; returns --init-from's model (`resolve_init_from`), whose vocabulary and
    architecture fine-tuning reuses, or None without --init-from. A `ConfigError` with --tokenizer too."""
    if not settings.init_from:
        return None
    if settings.tokenizer:
        raise ConfigError("--init-from reuses that model's vocabulary: drop --tokenizer")
    return resolve_init_from(settings.init_from)


def given_vocabulary(settings: TrainSettings, init: InitFrom | None) -> str | None:
    """The vocabulary file the run is given: --init-from's (`init`), else --tokenizer's, else None."""
    return str(init.tokenizer_file) if init is not None else settings.tokenizer


def open_corpus(settings: TrainSettings, place: RunPlace, init: InitFrom | None) -> Corpus:
    """Takes the settings as asked, `open_run_dir`'s place and `fine_tuning_start`'s model; returns the training
    corpus. A corpus read as text (`text_reason`) is loaded into memory; any other is prepared into the run first
    (`prepare_into_run`), unless --prepared gives it, and this worker's shards of it are checked
    (`open_for_worker`), and its languages and vocabulary against the run's (`ConfigError`)."""
    directory = settings.prepared
    init_target = init.target_tokenizer_file if init is not None else None
    if text_reason(settings) is None:
        directory = prepare_into_run(settings, place.model_dir, place.is_chief, given_vocabulary(settings, init),
                                     init_target)
    if not directory:
        pairs = load_text_pairs(data_spec(settings), "train", max_examples=settings.max_train_examples)
        return Corpus(None, directory, None, None, pairs)
    # This worker's shards, numbered as its input pipeline is (with a chief, not by `task_index`), all checked
    # before the first update: what it reads at start-up is what it streams.
    pipeline = input_pipeline()
    corpus, worker = open_for_worker(directory, *pipeline, max_sentence_length=settings.max_sentence_length,
                                     say=lambda line: print(f"[kt-train] {line}", flush=True))
    for key in ("source_lang", "target_lang"):
        if getattr(settings, key) != corpus.manifest[key]:
            raise ConfigError(f"--{key.replace('_', '-')} {getattr(settings, key)} but {corpus.directory} was "
                              f"prepared with {corpus.manifest[key]}")
    if init is not None and (init.tokenizer_file.read_bytes() != corpus.tokenizer_file.read_bytes()
                             or _bytes(init_target) != _bytes(corpus.target_tokenizer_file)):
        how = f"--tokenizer {init.tokenizer_file}" + (f" --target-tokenizer {init_target}" if init_target else "")
        raise ConfigError(f"{corpus.directory} was prepared with another vocabulary than --init-from's: prepare "
                          f"it with kt-prepare {how}")
    return Corpus(corpus, directory, worker, pipeline, None)


def _bytes(path: Path | None) -> bytes | None:
    return None if path is None else path.read_bytes()


def get_vocabulary(settings: TrainSettings, place: RunPlace, init: InitFrom | None, corpus: Corpus) -> Vocabulary:
    """Takes the settings as asked, the place, --init-from's model and `open_corpus`'s corpus; returns the run's
    vocabulary (`get_tokenizer_proto`): a prepared corpus's (its ids are in it: no worker trains one or waits for
    one), else --init-from's or --tokenizer's, else the run's own, else one trained on the training text."""
    if corpus.prepared is not None:
        given, flag = str(corpus.prepared.tokenizer_file), "--init-from" if init is not None else "--prepared"
    else:
        given, flag = given_vocabulary(settings, init), "--init-from" if init is not None else "--tokenizer"
    proto, folding = get_tokenizer_proto(settings, corpus.pairs, place.model_dir, place.is_chief,
                                         tokenizer=given, flag=flag)
    target = target_tokenizer_proto(place, init, corpus)
    if target is not None and vocab_size_of(target) != vocab_size_of(proto):
        raise ConfigError(f"the source's vocabulary has {vocab_size_of(proto):,} ids and the target's "
                          f"{vocab_size_of(target):,}: one model's must number the same ids")
    return Vocabulary(proto, folding, vocab_size_of(proto), target)


def target_tokenizer_proto(place: RunPlace, init: InitFrom | None, corpus: Corpus) -> bytes | None:
    """The target side's sentencepiece model of a run with a vocabulary per side, or None: a prepared corpus's
    (its target ids are in it) or --init-from's (an imported Marian model's), copied into the run by the chief,
    else the run's own (a resumed run's on text)."""
    path = place.model_dir / TARGET_TOKENIZER_FILENAME
    if corpus.prepared is not None:
        given, flag = corpus.prepared.target_tokenizer_file, "--prepared"
    else:
        given, flag = (init.target_tokenizer_file if init is not None else None), "--init-from"
    if given is None:
        return read_tokenizer_proto(path) if path.is_file() and corpus.prepared is None else None
    proto = read_tokenizer_proto(given)
    check_special_ids(proto)
    if place.is_chief:
        path.write_bytes(proto)
        print(f"[kt-train] target tokenizer: {given} ({flag}'s: a vocabulary per side), copied to {path}",
              flush=True)
    return proto


def plan_batches(settings: TrainSettings, replicas: int, place: RunPlace) -> dict:
    """Takes the settings as asked, the replicas in sync and the place; returns the batch plan
    (`training.config.batch_plan`), which keeps the tokens per update a resumed run recorded, and says it (the
    chief; any worker says when a resume on another number of replicas changes the batches per update)."""
    plan = batch_plan(settings, replicas, previous_batch_plan(place.model_dir, place.out_dir))
    if plan["grad_accum"] != settings.grad_accum:
        print(f"[kt-train] resumed on {replicas} replica(s): {plan['grad_accum']} batches per update (not "
              f"{settings.grad_accum}) keep the run's {plan['tokens_per_update']:,} tokens per update", flush=True)
    if place.is_chief:
        budget = "--tokens-per-replica" if settings.tokens_per_replica else "--tokens-per-batch split between the replicas"
        print(f"[kt-train] batch plan: {replicas} replica(s) x {plan['tokens_per_replica']:,} tokens per replica "
              f"x {plan['grad_accum']} batch(es) per update = {plan['tokens_per_update']:,} tokens per update "
              f"(budgets of padded tokens per side; {budget})", flush=True)
    return plan


def resolve_run_settings(settings: TrainSettings, *, init: InitFrom | None, corpus: Corpus, lowercase: bool,
                         plan: dict) -> TrainSettings:
    """The run's settings: `settings` as asked, with what the run found out. The one place kt-train changes a
    setting; the batches, the model, the fit and config.json's "training" read the settings returned.

    - `tokenizer` and `preset`: --init-from's model's (`init`), whose vocabulary and architecture it reuses;
    - `prepared`: the prepared corpus's directory (`corpus`), the run's own when kt-train prepared it;
    - `dataset`, `data_dir`, `tfds_data_dir`: a prepared corpus's validation set's, where kt-evaluate finds the
      test set (a TFDS corpus's, or files it is given);
    - `lowercase`: whether the vocabulary case-folds (a --tokenizer may without --lowercase): kt-evaluate scores a
      case-folding model's output case-insensitively;
    - `grad_accum`: the batch plan's (`plan`), which a resume on another number of replicas may change;
    - `epochs`: none with --checkpoint-every, whose spans of N updates are Keras' epochs (`make_fit_data`).
    """
    changes = dict(prepared=corpus.directory, lowercase=lowercase, grad_accum=plan["grad_accum"])
    if init is not None:
        changes.update(tokenizer=str(init.tokenizer_file), preset=init.preset or settings.preset)
    if corpus.prepared is not None:
        validation = corpus.prepared.manifest.get("validation") or {}
        changes.update(dataset=validation.get("tfds", "files"),
                       data_dir=settings.data_dir or validation.get("data_dir"),
                       tfds_data_dir=settings.tfds_data_dir or validation.get("tfds_data_dir"))
    if settings.checkpoint_every:
        changes["epochs"] = None
    return dataclasses.replace(settings, **changes)


def make_fit_data(settings: TrainSettings, strategy, place: RunPlace, corpus: Corpus, vocabulary: Vocabulary,
                  plan: dict) -> FitData:
    """Takes the run's settings (`resolve_run_settings`), the strategy, the place, the corpus, the vocabulary and the
    batch plan; returns what `model.fit` reads (`FitData`): the training batches (`training_batches`), the chief's
    count of them (`count_batches`) and the validation set (`validation_batches`)."""
    replicas = strategy.num_replicas_in_sync
    resume = ResumePoint()
    train_ds, steps = training_batches(settings, strategy, place, corpus, vocabulary, plan, resume)
    batch_contents = count_batches(settings, place, corpus, vocabulary, plan, replicas) if place.is_chief else None
    val_ds, val_bleu = validation_batches(settings, corpus, vocabulary, plan, replicas)
    return FitData(train_ds, val_ds, steps, val_bleu, batch_contents, resume)


def _batch_args(settings: TrainSettings, plan: dict, replicas: int) -> dict:
    """`make_batches`' batch arguments: batches of all replicas."""
    return dict(max_sentence_length=settings.max_sentence_length,
                tokens_per_batch=plan["tokens_per_replica"] * replicas,
                num_replicas=replicas, pad_to_bucket_boundary=settings.jit_compile)


def _copies(settings: TrainSettings) -> int:
    """How many times each pair is in its batch. R-Drop's loss pairs rows 2i and 2i + 1, in validation too, where
    without dropout the two agree and the loss is the plain one. The batch counts see each pair once: what an
    update trains on."""
    return 2 if settings.r_drop else 1


def _stream_args(settings: TrainSettings, plan: dict) -> dict:
    """`prepared_dataset`'s arguments: one replica's batches, from the stream's start."""
    return dict(max_sentence_length=settings.max_sentence_length, tokens_per_replica=plan["tokens_per_replica"],
                seed=settings.seed, pad_to_bucket_boundary=settings.jit_compile, copies=_copies(settings))


def training_batches(settings: TrainSettings, strategy, place: RunPlace, corpus: Corpus, vocabulary: Vocabulary,
                     plan: dict, resume: ResumePoint) -> tuple:
    """Takes the run's settings, the strategy, the place, the corpus, the vocabulary, the batch plan and where the
    run resumes (set once its backup is restored); returns (the training batches, Keras' steps per epoch or None
    for a pass over them) and says what they are read from. A prepared corpus's batches start after the fit steps
    `resume` holds: the batches every update restored trained on (the order of every epoch is the seed's alone)."""
    replicas = strategy.num_replicas_in_sync
    steps = settings.steps_per_epoch
    if settings.checkpoint_every:
        # A recipe by updates: Keras' epochs are spans of N updates over the repeated stream, each ending in the
        # validation and a history row; the checkpoints follow the update count itself (`UpdateCheckpoint`).
        steps = settings.checkpoint_every * settings.grad_accum
    sampling_alpha = settings.subword_sampling
    train_tokenizer = vocabulary.sampling_tokenizer(sampling_alpha) if sampling_alpha else vocabulary.tokenizer
    if corpus.prepared is not None:
        prepared, worker, pipeline = corpus.prepared, corpus.worker, corpus.pipeline
        # One batch per replica: each of this worker's replicas takes the next one in turn.
        local_replicas = replicas // place.num_workers
        worker_batches = worker_dataset_fn(prepared, worker, pipeline, skip=lambda: resume.steps * local_replicas,
                                           **_stream_args(settings, plan))
        train_ds = (strategy.distribute_datasets_from_function(worker_batches) if replicas > 1 or place.num_workers > 1
                    else worker_batches())
        one_pass = steps_per_epoch(prepared, max_sentence_length=settings.max_sentence_length,
                                   tokens_per_replica=plan["tokens_per_replica"], replicas=replicas)
        steps = steps or one_pass
        span = (f"a pass over it is {one_pass // settings.grad_accum:,} updates; a checkpoint and the validation "
                f"every {settings.checkpoint_every:,} updates (--checkpoint-every)" if settings.checkpoint_every
                else f"an epoch is {steps // settings.grad_accum:,} updates")
        own, shared = sum(p.step == 1 for p in worker), sum(p.step > 1 for p in worker)
        print(f"[kt-train] data: {prepared.directory} ({prepared.pairs:,} pairs in {len(prepared.shards)} shards; "
              f"worker {pipeline[0] + 1}/{pipeline[1]} reads {own}"
              f"{f' and one pair in {pipeline[1]} of {shared} more' if shared else ''}); {span}", flush=True)
        return train_ds, steps
    reason = text_reason(settings)
    print(f"[kt-train] data: {settings.dataset}'s text, read into memory and tokenized every epoch "
          f"({reason}: {'small' if reason == 'Multi30k' else 'not prepared'}; --train-files and TFDS corpora are "
          "prepared into the run first)", flush=True)
    train_ds = make_batches(corpus.pairs, train_tokenizer, shuffle=True, shuffle_buffer=settings.shuffle_buffer,
                            seed=settings.seed, repeat=bool(steps), copies=_copies(settings),
                            **_batch_args(settings, plan, replicas))
    return train_ds, steps


def count_batches(settings: TrainSettings, place: RunPlace, corpus: Corpus, vocabulary: Vocabulary, plan: dict,
                  replicas: int) -> dict:
    """Takes the run's settings, the place, the corpus, the vocabulary, the batch plan and the replicas; returns
    `mean_target_tokens` of the first training batches, with the target tokens per update, and says them (the
    chief's)."""
    if corpus.prepared is not None:
        counted = prepared_dataset(corpus.prepared, corpus.worker,
                                   **{**_stream_args(settings, plan), "copies": 1})
    else:
        # A pipeline of its own, so that counting does not move the training pipeline's shuffling.
        counted = make_batches(corpus.pairs, vocabulary.tokenizer, shuffle=True, shuffle_buffer=settings.shuffle_buffer,
                               seed=settings.seed, **_batch_args(settings, plan, replicas))
    batch_contents = mean_target_tokens(counted)
    accum = settings.grad_accum
    # Per batch of all replicas: the prepared stream's batches are one replica's.
    per_batch = 1 if corpus.prepared is None else replicas
    batch_contents["target_tokens_per_update"] = round(batch_contents["target_tokens"] * accum * per_batch)
    print(f"[kt-train] batches: {batch_contents['target_tokens_per_update']:,} target tokens per update "
          f"on average ({batch_contents['target_tokens']:,.0f} per batch, "
          f"{batch_contents['padded_target_tokens']:,.0f} with padding, {batch_contents['sentences']:.0f} "
          f"sentences; the first {batch_contents['batches']} batches"
          f"{f' of one replica, {replicas} replicas' if per_batch > 1 else ''}"
          f"{f', {accum} batches per update' if accum > 1 else ''})"
          f"{'; R-Drop: each sentence twice in its batch' if _copies(settings) > 1 else ''}", flush=True)
    return batch_contents


def validation_batches(settings: TrainSettings, corpus: Corpus, vocabulary: Vocabulary, plan: dict,
                       replicas: int) -> tuple:
    """Takes the run's settings, the corpus, the vocabulary, the batch plan and the replicas; returns (the
    validation batches, --val-bleu's `ValidationBLEU`), each None when not asked for or without validation data
    (a `ConfigError` for --val-bleu then)."""
    spec = data_spec(settings, corpus.prepared)
    if settings.validation and (spec.dataset != "files" or (spec.files and "validation" in spec.files)):
        val_pairs = load_text_pairs(spec, "validation", max_examples=settings.max_eval_examples)
        val_ds = make_batches(val_pairs, vocabulary.tokenizer, shuffle=False, copies=_copies(settings),
                              **_batch_args(settings, plan, replicas))
        val_bleu = None
        if settings.val_bleu:
            texts = [(s.decode("utf-8"), t.decode("utf-8")) for s, t in val_pairs.as_numpy_iterator()]
            val_bleu = ValidationBLEU([s for s, _ in texts], [t for _, t in texts], vocabulary.tokenizer,
                                      settings.max_sentence_length, lowercase=settings.lowercase)
        return val_ds, val_bleu
    if settings.val_bleu:
        raise ConfigError("--val-bleu needs validation data (--valid-files with --dataset files; "
                          "not --no-validation)")
    return None, None


@contextlib.contextmanager
def dtype_policy(settings: TrainSettings):
    """Sets Keras' global dtype policy for the fit as the run's settings say (`set_precision`, which says it) and
    yields it; the policy before is set again after."""
    previous_policy = keras.mixed_precision.global_policy()
    policy = set_precision(settings)
    try:
        yield policy
    finally:
        keras.mixed_precision.set_global_policy(previous_policy)


def _config_extra(run: Run, data: FitData) -> dict:
    """What config.json records besides the settings and the model: the batch plan and the batches' count."""
    extra = {"batch_plan": run.plan} if run.plan else {}
    if data.batch_contents:
        extra["batches"] = data.batch_contents
    return extra


def build_run_model(settings: TrainSettings, run: Run, data: FitData):
    """Takes the run's settings, the `Run` and the `FitData`; returns the compiled model, built under
    `run.strategy` (with --init-from's weights), after writing config.json (the chief) and saying what it is."""
    strategy, init = run.strategy, run.init
    weights = init_weights(init) if init is not None else None  # read outside the strategy's scope
    with strategy.scope():
        model = build_and_compile(settings, run.vocab_size, init=init)
        if weights is not None:
            set_init_weights(model, weights, init)
    if run.place.is_chief:
        write_config(settings, run.place.model_dir, run.vocab_size, model, run.policy, extra=_config_extra(run, data),
                     target_tokenizer=run.per_side)
    multi_worker = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
    shape = f"preset {settings.preset}" + (f" with {json.dumps(settings.model)}" if settings.model else "")
    strategy_name = "MultiWorkerMirroredStrategy" if multi_worker else type(strategy).__name__.lstrip("_")
    print(f"[kt-train] {run.replicas} replica(s) ({strategy_name}, worker {run.place.task_index + 1}/"
          f"{run.place.num_workers}), {shape}, vocab {run.vocab_size}, {model.count_params():,} parameters, "
          f"policy {run.policy}", flush=True)
    return model


def loss_before_fine_tuning(model, run: Run, data: FitData) -> float | None:
    """Takes the model, the `Run` and the `FitData`; returns the validation loss fine-tuning starts from, and says
    it: where the first epoch's val_loss is measured against. None without --init-from or validation data, or on a
    resume."""
    if run.init is None or data.validation is None or (run.place.out_dir / "backup").exists():
        return None
    with ignoring_ran_out_of_data():
        initial_val_loss = float(model.evaluate(data.validation, verbose=0, return_dict=True)["loss"])
    print(f"[kt-train] --init-from {run.init.model_file}: validation loss {initial_val_loss:.4f} before "
          "fine-tuning (fresh optimizer and learning-rate schedule)", flush=True)
    return initial_val_loss


def make_callbacks(settings: TrainSettings, run: Run, data: FitData) -> RunCallbacks:
    """Takes the run's settings, the `Run` and the `FitData`; returns kt-train's callbacks: the validation BLEU,
    the resumable backup, the checkpoints, TensorBoard's logs, the NaN stop, history.csv, the ETA and the update
    and time budgets. A `ConfigError` for --max-minutes with more than one worker."""
    out_dir = run.place.out_dir
    backup = ResumableBackup(out_dir / "backup", settings.backup_every or "epoch", num_workers=run.place.num_workers,
                             steps_per_epoch=data.steps_per_epoch, batches_per_update=settings.grad_accum,
                             resume_point=data.resume)
    # ValidationBLEU first: the callbacks after it (history.csv, TensorBoard) see its val_bleu.
    callbacks = [data.val_bleu] if data.val_bleu is not None else []
    callbacks += [
        backup,
        (UpdateCheckpoint(out_dir / CHECKPOINT_DIR, settings.checkpoint_every) if settings.checkpoint_every else
         keras.callbacks.ModelCheckpoint(str(out_dir / CHECKPOINT_DIR / CHECKPOINT_PATTERN),
                                         save_weights_only=True, save_freq="epoch")),
        keras.callbacks.TensorBoard(log_dir=str(out_dir / "logs")),
        keras.callbacks.TerminateOnNaN(),
        keras.callbacks.CSVLogger(str(out_dir / "history.csv"), append=True),
        EpochETA(settings.epochs, settings.max_minutes, max_updates=settings.max_updates),
    ]
    updates = None
    if settings.max_updates:
        updates = UpdateBudget(settings.max_updates)
        callbacks.append(updates)
        if not settings.epochs:
            callbacks.append(UpdateBoundProgbar(settings.max_updates))
    budget = None
    if settings.max_minutes:
        if run.place.num_workers > 1:
            # Each worker would decide on its own clock; one stopping alone would hang the others.
            raise ConfigError("--max-minutes is not supported with more than one worker; set --epochs instead")
        budget = TimeBudget(settings.max_minutes)
        callbacks.append(budget)
    # Last: a resumed run's first epoch ends after what was left of it, unless a callback above stops the run.
    callbacks.append(backup.epoch_cut)
    return RunCallbacks(callbacks, backup, updates, budget)


def fit_model(model, settings: TrainSettings, run: Run, data: FitData, callbacks: RunCallbacks,
              initial_val_loss: float | None) -> dict:
    """Takes the model, the run's settings, the `Run`, the `FitData`, the callbacks and the loss before
    fine-tuning; fits the model and returns the run's summary ("nan_loss" when the loss became NaN or inf)."""
    t0 = time.time()
    with ignoring_ran_out_of_data():
        # shuffle=False: the dataset shuffles itself (Keras would only warn that it ignores shuffle=True).
        history = model.fit(data.train, validation_data=data.validation, epochs=settings.epochs or NO_EPOCH_LIMIT,
                            steps_per_epoch=data.steps_per_epoch,
                            callbacks=callbacks.all, verbose=fit_verbosity(settings.verbose), shuffle=False)
    elapsed = time.time() - t0
    budget, updates = callbacks.budget, callbacks.updates
    summary = {
        "epochs_run": [e + 1 for e in history.epoch],
        "resumed_from": callbacks.backup.resumed,
        "optimizer_steps": int(model.optimizer.iterations.numpy()),
        "final_loss": history.history["loss"][-1] if history.history.get("loss") else None,
        "seconds": round(elapsed, 1),
        "replicas": run.replicas,
        "stopped_by_time_budget": bool(budget and budget.stopped_after),
        "stopped_by_max_updates": bool(updates and updates.stopped_at),
    }
    if initial_val_loss is not None:
        summary["initial_val_loss"] = initial_val_loss
    losses = history.history.get("loss") or [0.0]
    if not all(l == l and abs(l) != float("inf") for l in losses):  # TerminateOnNaN stopped the run
        summary["nan_loss"] = True
    return summary


def save_run(model, settings: TrainSettings, run: Run, data: FitData, summary: dict) -> None:
    """Takes the fitted model, the run's settings, the `Run`, the `FitData` and `fit_model`'s summary; writes
    model.keras and config.json with the summary as "last_run" (the chief) and says the run is done. After a NaN
    loss it writes nothing and says so."""
    if summary.get("nan_loss"):
        print("[kt-train] stopped: the loss became NaN/inf; model.keras not written "
              "(epoch checkpoints before it are in checkpoints/)", flush=True)
        return
    if run.place.is_chief:
        model.save(run.place.model_dir / MODEL_FILENAME)
        write_config(settings, run.place.model_dir, run.vocab_size, model, run.policy,
                     extra={**_config_extra(run, data), "last_run": summary}, target_tokenizer=run.per_side)
    print("[kt-train] done " + json.dumps(summary), flush=True)
