"""The fit: parallel text -> tokenizer -> batches -> `model.fit` under tf.distribute -> a model directory.

`train(cfg)` runs a whole kt-train run from a resolved configuration
(`training.config.resolve_config`); `build_and_compile` is the model and
compile step alone (benchmarks use it to compile exactly as training does).
"""

from __future__ import annotations

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
from common.run_dir import (CHECKPOINT_DIR, CHECKPOINT_PATTERN, MODEL_FILENAME, TOKENIZER_FILENAME, epoch_checkpoints,
                            read_config, update_checkpoints)
from common.tokenizer import make_tokenizer
from keras_transformer.keras_internals import UpdateBoundProgbar, build_fit_state_now, ignoring_ran_out_of_data
from keras_transformer.text import (check_special_ids, lowercases, read_tokenizer_proto, train_sentencepiece,
                                   vocab_size_of)
from training.callbacks import EpochETA, ResumableBackup, TimeBudget, UpdateBudget, UpdateCheckpoint, ValidationBLEU
from training.config import batch_plan, check_settings, write_config
from training.data import DataSpec, iterate_text, load_text_pairs
from training.distribute import make_strategy, worker_info
from training.errors import ConfigError
from training.fine_tune import init_weights, resolve_init_from, set_init_weights
from training.pipeline import make_batches, mean_target_tokens
from training.prepared import PreparedCorpus, open_prepared, prepared_dataset, steps_per_epoch, worker_shards
from training.precision import choose_policy
from training.update import UpdateStep


# fit()'s epoch count when a run is bounded by --max-updates alone ("epochs": null).
NO_EPOCH_LIMIT = 1_000_000


def data_spec(cfg, corpus: PreparedCorpus | None = None) -> DataSpec:
    """The DataSpec of a configuration; `--dataset files` needs --train-files. With a prepared `corpus`, the
    spec of its validation set: --valid-files, else the one kt-prepare recorded."""
    if corpus is not None:
        validation = ({"files": cfg["valid_files"]} if cfg.get("valid_files")
                      else corpus.manifest.get("validation") or {})
        if "files" in validation:
            return DataSpec(dataset="files", source_lang=cfg["source_lang"], target_lang=cfg["target_lang"],
                            files={"validation": tuple(validation["files"])}, check_alignment=cfg["check_alignment"])
        return DataSpec(dataset=validation.get("tfds", "files"), source_lang=cfg["source_lang"],
                        target_lang=cfg["target_lang"], data_dir=validation.get("data_dir") or cfg["data_dir"],
                        tfds_data_dir=validation.get("tfds_data_dir") or cfg["tfds_data_dir"], files={})
    files = None
    if cfg["dataset"] == "files":
        if not cfg.get("train_files"):
            raise ConfigError("--dataset files needs --train-files SOURCE TARGET")
        files = {"train": tuple(cfg["train_files"])}
        if cfg.get("valid_files"):
            files["validation"] = tuple(cfg["valid_files"])
    return DataSpec(dataset=cfg["dataset"], source_lang=cfg["source_lang"], target_lang=cfg["target_lang"],
                    data_dir=cfg["data_dir"], tfds_data_dir=cfg["tfds_data_dir"], files=files,
                    check_alignment=cfg["check_alignment"])


# Where kt-train prepares a corpus it is given as text files or by TFDS name (kt-prepare's format).
RUN_PREPARED_DIR = "prepared"
# How long another worker waits for the chief to prepare the corpus: kt-prepare's time is linear in the corpus.
PREPARE_WAIT_SECONDS = 12 * 3600.0


def text_reason(cfg) -> str | None:
    """Why kt-train reads its corpus as text rather than preparing it into the run directory first (the
    setting that makes it), or None when it prepares. `--train-files` and TFDS datasets are prepared (kt-prepare's way: memory flat in the
    corpus, tokenized once); Multi30k, small and built in, is read as text, and so is any corpus with
    --subword-sampling (it segments each sentence anew every epoch, from its text) or --max-train-examples."""
    if cfg.get("prepared"):
        return "--prepared"
    if cfg["dataset"] == "multi30k":
        return "Multi30k"
    if cfg.get("subword_sampling"):
        return "--subword-sampling"
    if cfg.get("max_train_examples"):
        return "--max-train-examples"
    return None


def prepare_into_run(cfg, model_dir: Path, is_chief: bool) -> dict:
    """Prepares the run's training corpus into MODEL_DIR/prepared with kt-prepare (the chief; the other
    workers wait for its manifest) and returns `cfg` with `prepared` set to it. The vocabulary is the run's
    own if it has one (a resumed run), else --tokenizer's (or --init-from's), else trained as kt-train trains
    one; a finished preparation is reused, a killed one starts again."""
    from training.prepare import parse_args, prepare
    from training.prepared import MANIFEST_FILENAME

    out = model_dir / RUN_PREPARED_DIR
    if is_chief:
        argv = ["--out", str(out), "--source-lang", cfg["source_lang"], "--target-lang", cfg["target_lang"],
                "--seed", str(cfg["seed"])]
        if cfg["dataset"] == "files":
            argv += ["--train-files", *cfg["train_files"]]
        else:
            argv += ["--tfds", cfg["dataset"]]
        if cfg.get("valid_files"):
            argv += ["--valid-files", *cfg["valid_files"]]
        for flag, key in (("--data-dir", "data_dir"), ("--tfds-data-dir", "tfds_data_dir")):
            if cfg.get(key):
                argv += [flag, cfg[key]]
        own, given = model_dir / TOKENIZER_FILENAME, None
        if own.is_file() and not (out / MANIFEST_FILENAME).is_file():
            # A run begun on its text keeps the vocabulary its checkpoints are in.
            given, what, whose = own, f"this run's vocabulary {own}", "the run's"
        elif cfg.get("tokenizer"):
            given, what = cfg["tokenizer"], f"the vocabulary {cfg['tokenizer']}"
            whose = "--init-from's" if cfg.get("init_from") else "--tokenizer's"
        if given is not None:
            # The vocabulary's checks first, naming the file given, before anything is prepared with it.
            proto = read_tokenizer_proto(given)
            check_special_ids(proto)
            _check_lowercase(cfg, lowercases(proto), what, whose)
            argv += ["--tokenizer", str(given)]
        else:
            argv += ["--vocab-size", str(cfg["vocab_size"]), "--vocab-type", cfg["vocab_type"],
                     "--vocab-sample", str(cfg["vocab_sample"])]
            argv += ["--lowercase"] if cfg.get("lowercase") else []
        if not cfg["check_alignment"]:
            argv += ["--no-alignment-check"]
        print(f"[kt-train] preparing the corpus into {out} (kt-prepare {' '.join(argv)})", flush=True)
        prepare(parse_args(argv))
    else:
        print(f"[kt-train] waiting for the chief worker to prepare the corpus into {out}", flush=True)
        _wait_for(out / MANIFEST_FILENAME, PREPARE_WAIT_SECONDS, what="the prepared corpus",
                  instead="prepare it once with kt-prepare and give every worker --prepared DIR")
    return {**cfg, "prepared": str(out)}


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


def get_tokenizer_proto(cfg, train_pairs, model_dir: Path, is_chief: bool) -> tuple[bytes, bool]:
    """Reuses model_dir/tokenizer.model (resume) or --tokenizer, else trains one on the training text
    (case-folding with `cfg["lowercase"]`). Returns the proto and whether it case-folds. A cased vocabulary
    where `cfg["lowercase"]` asks for a case-folding one is a `ConfigError`."""
    path = model_dir / TOKENIZER_FILENAME
    if cfg.get("tokenizer"):
        proto = read_tokenizer_proto(cfg["tokenizer"])
        check_special_ids(proto)
        folding = lowercases(proto)
        _check_lowercase(cfg, folding, f"the vocabulary {cfg['tokenizer']}",
                         "--init-from's" if cfg.get("init_from") else "--tokenizer's")
        if is_chief:
            path.write_bytes(proto)
            flag = "--init-from" if cfg.get("init_from") else "--prepared" if cfg.get("prepared") else "--tokenizer"
            print(f"[kt-train] tokenizer: {cfg['tokenizer']} ({flag}{_folding(folding)}), copied to {path}",
                  flush=True)
        return proto, folding
    if path.exists():
        proto = read_tokenizer_proto(path)
        folding = lowercases(proto)
        _check_lowercase(cfg, folding, f"this run's vocabulary {path}", "the run's")
        if is_chief:
            print(f"[kt-train] tokenizer: {path} (the run's own{_folding(folding)})", flush=True)
        return proto, folding
    if not is_chief:  # every worker must use the chief's vocabulary
        _wait_for(path)
        proto = read_tokenizer_proto(path)
        return proto, lowercases(proto)
    spm.set_random_generator_seed(cfg["seed"])  # seeds sentencepiece's sample of the lines too
    t0 = time.time()
    lines = [0]

    def counted():
        for line in iterate_text(train_pairs):
            lines[0] += 1
            yield line

    try:
        proto = train_sentencepiece(counted(), cfg["vocab_size"], model_type=cfg["vocab_type"],
                                    input_sentence_size=cfg["vocab_sample"],
                                    lowercase=bool(cfg.get("lowercase")))
    except ValueError as e:
        raise ConfigError(f"{e} (--vocab-size)") from e
    tmp = model_dir / (TOKENIZER_FILENAME + ".tmp")
    tmp.write_bytes(proto)
    os.replace(tmp, path)  # atomic: other workers wait for this file
    folding = lowercases(proto)
    sample = (f"a uniform random sample of {cfg['vocab_sample']:,} of its {lines[0]:,} lines"
              if lines[0] > cfg["vocab_sample"] else f"all its {lines[0]:,} lines")
    print(f"[kt-train] tokenizer: {path} (a joint sentencepiece vocabulary of {vocab_size_of(proto):,} pieces "
          f"({cfg['vocab_type']})"
          f"{_folding(folding)}, trained on {sample} of training text, both sides, in {time.time() - t0:.1f} s)",
          flush=True)
    return proto, folding


def _folding(folding: bool) -> str:
    """What the tokenizer line adds for a case-folding vocabulary."""
    return ", case-folding: the model reads and writes lowercase text" if folding else ""


def _check_lowercase(cfg, folding: bool, what: str, whose: str) -> None:
    """`ConfigError` when `cfg` asks for a case-folding vocabulary and the one found is cased (`folding` false)."""
    if cfg.get("lowercase") and not folding:
        raise ConfigError(f"--lowercase (\"lowercase\": true) asks for a case-folding vocabulary, but {what} "
                          f"is cased: drop --lowercase to train with {whose} vocabulary, or train a new one "
                          "(without --tokenizer, in a new --model-dir)")


def build_model(cfg, vocab_size: int):
    """A new Transformer: `cfg["preset"]` with `cfg["model"]` overrides, or with `--init-from` that model's
    architecture (`cfg["model"]` may still change what has no weights, such as dropout)."""
    init = cfg.get("init_from_model")
    if init is not None:
        return kt.Transformer.from_config({**init.model_config, **cfg["model"], "vocab_size": vocab_size})
    return kt.Transformer.from_preset(cfg["preset"], vocab_size=vocab_size, **cfg["model"])


def compile_model(model, cfg, optimizer=None):
    """Compiles `model` with the paper's Adam (or `optimizer`) and the configured loss. Gradient accumulation
    and clipping are not the optimizer's: `build_and_compile`'s `UpdateStep` does them on the summed gradient."""
    kwargs = {}
    if cfg.get("adam_epsilon") is not None:
        kwargs["epsilon"] = cfg["adam_epsilon"]
    if optimizer is None:
        optimizer = kt.paper_adam(model.d_model, warmup_steps=cfg["warmup_steps"],
                                  scale=cfg["learning_rate_scale"], **kwargs)
    if cfg.get("r_drop"):
        # The training and validation batches hold every pair twice in a row (make_batches(copies=2), in train()).
        loss = kt.MaskedRDropCrossentropy(kl_weight=cfg["r_drop"], label_smoothing=cfg["label_smoothing"])
    else:
        loss = kt.MaskedSparseCategoricalCrossentropy(label_smoothing=cfg["label_smoothing"])
    model.compile(
        optimizer=optimizer,
        loss=loss,
        metrics=[kt.MaskedAccuracy()],
        jit_compile=bool(cfg["jit_compile"]),
    )
    return model


def build_and_compile(cfg, vocab_size: int, optimizer=None):
    """Model + optimizer + loss, built (variables created) in the current strategy scope, training with an
    `UpdateStep` (`cfg["grad_accum"]` batches per update, clipped to `cfg["global_clipnorm"]`)."""
    model = build_model(cfg, vocab_size)
    dummy = np.ones((2, 2), "int32")  # two rows: one pair for R-Drop's loss
    model((dummy, dummy))
    compile_model(model, cfg, optimizer)
    model.optimizer.build(model.trainable_variables)
    build_fit_state_now(model, ((dummy, dummy), dummy))
    UpdateStep.install(model, accumulate=cfg["grad_accum"] or 1, global_clipnorm=cfg.get("global_clipnorm"))
    return model


def set_precision(cfg) -> str:
    """Sets Keras' global dtype policy as `cfg["mixed_precision"]` says ("auto", True, False) and says why."""
    policy, reason = choose_policy(cfg["mixed_precision"])
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


def continue_finished_run(cfg, model_dir: Path, out_dir: Path) -> None:
    """Training into a finished run (its model.keras written, its backup deleted) with a larger
    `--max-updates` or `--epochs` continues it, as fairseq does when `--max-update` is raised.

    The run's last epoch checkpoint holds its weights and its optimizer's state (Adam's moments and
    step) as they were when it stopped; it becomes the backup this run resumes from, as if the run had
    been stopped there. The paper's learning-rate schedule depends on the update count alone, so the
    run goes on as one started with the larger bound would have, but for the data order after the
    resume (as after any resume). Writes `out_dir/backup`; a `ConfigError` when the bounds are not
    larger than what the run did (training would otherwise start over at epoch 1 on top of it).
    """
    done = read_config(model_dir).get("last_run") or {}
    steps = done.get("optimizer_steps")
    if cfg.get("checkpoint_every"):
        # A run by updates: its last checkpoint is the one its end wrote (`UpdateCheckpoint.on_train_end`), and
        # its spans of N updates are Keras' epochs.
        checkpoints = [(-(-update // cfg["checkpoint_every"]), path) for update, path in update_checkpoints(out_dir)
                       if update == steps]
    else:
        checkpoints = epoch_checkpoints(out_dir)
    epochs, last = checkpoints[-1] if checkpoints else (None, None)
    bounds = [(cfg.get("max_updates"), steps), (cfg.get("epochs"), epochs)]
    larger = [bool(done_so_far is not None and wanted > done_so_far) for wanted, done_so_far in bounds if wanted]
    if cfg.get("init_from") or steps is None or not checkpoints or not larger or not all(larger):
        did = f"; it made {steps:,} updates in {epochs} epochs" if steps is not None and epochs else ""
        past = (f"--max-updates above {steps:,} (and --epochs, if set, above {epochs}; a config's \"epochs\": null "
                "sets no epoch limit)") if did else "a larger --max-updates or --epochs"
        asked = " and ".join(f"--{flag} {cfg[key]:,}" for key, flag in (("max_updates", "max-updates"),
                                                                       ("epochs", "epochs")) if cfg.get(key))
        raise ConfigError(
            f"{model_dir} holds a finished run ({model_dir / MODEL_FILENAME}{did}). This run ({asked}) would "
            f"not go past it, and training into it would start over at epoch 1, overwriting its checkpoints. To "
            f"continue it with its optimizer state and schedule, run again with {past}. To fine-tune that model "
            f"with a fresh optimizer, pass --init-from {model_dir} with another --model-dir; to start over, "
            f"delete {model_dir} or pick another --model-dir.")
    ResumableBackup.start_from(out_dir / "backup", last, epochs, steps)
    print(f"[kt-train] {model_dir} finished at update {steps:,} (epoch {epochs}): continuing it from "
          f"{last.name}, with its optimizer state", flush=True)


def train(cfg: dict, strategy=None) -> dict:
    """Runs training as configured; returns a summary dict (also printed as JSON)."""
    check_settings(cfg)
    if strategy is None:
        strategy = make_strategy(cfg["cpu_replicas"])
    tfds.disable_progress_bar()
    is_chief, task_index, num_workers = worker_info()
    model_dir = Path(cfg["model_dir"])
    model_dir.mkdir(parents=True, exist_ok=True)
    # Non-chief workers write their (identical) checkpoints/backups/logs aside.
    out_dir = model_dir if is_chief else model_dir / f".worker-{task_index}"
    out_dir.mkdir(parents=True, exist_ok=True)
    if (model_dir / MODEL_FILENAME).exists() and not (out_dir / "backup").exists():
        continue_finished_run(cfg, model_dir, out_dir)
    keras.utils.set_random_seed(cfg["seed"])
    if cfg.get("init_from"):
        # Fine-tuning reuses the vocabulary and architecture of the model it starts from.
        if cfg.get("tokenizer"):
            raise ConfigError("--init-from reuses that model's vocabulary: drop --tokenizer")
        init = resolve_init_from(cfg["init_from"])
        cfg = {**cfg, "tokenizer": str(init.tokenizer_file), "init_from_model": init,
               "preset": init.preset or cfg["preset"]}

    if text_reason(cfg) is None:
        cfg = prepare_into_run(cfg, model_dir, is_chief)
    corpus = None
    if cfg.get("prepared"):
        corpus = open_prepared(cfg["prepared"], shards=[])  # the manifest alone: this worker's shards below
        worker = worker_shards(len(corpus.shards), task_index, num_workers)
        corpus = open_prepared(cfg["prepared"], shards=worker if num_workers > 1 else None)
    if corpus is not None:
        # The corpus's ids are in its vocabulary; no worker trains one or waits for one.
        for key in ("source_lang", "target_lang"):
            if cfg[key] != corpus.manifest[key]:
                raise ConfigError(f"--{key.replace('_', '-')} {cfg[key]} but {corpus.directory} was prepared with "
                                  f"{corpus.manifest[key]}")
        if cfg.get("init_from") and Path(cfg["tokenizer"]).read_bytes() != corpus.tokenizer_file.read_bytes():
            raise ConfigError(f"{corpus.directory} was prepared with another vocabulary than --init-from's: prepare "
                              f"it with kt-prepare --tokenizer {cfg['tokenizer']}")
        # config.json's dataset is where kt-evaluate finds the test set: a TFDS corpus's, or files it is given.
        validation = corpus.manifest.get("validation") or {}
        cfg = {**cfg, "dataset": validation.get("tfds", "files"),
               "data_dir": cfg["data_dir"] or validation.get("data_dir"),
               "tfds_data_dir": cfg["tfds_data_dir"] or validation.get("tfds_data_dir")}
        train_pairs = None
        proto, folding = get_tokenizer_proto({**cfg, "tokenizer": str(corpus.tokenizer_file)}, None, model_dir,
                                             is_chief)
    else:
        train_pairs = load_text_pairs(data_spec(cfg), "train", max_examples=cfg["max_train_examples"])
        proto, folding = get_tokenizer_proto(cfg, train_pairs, model_dir, is_chief)
    spec = data_spec(cfg, corpus)
    # config.json records what the vocabulary does (a --tokenizer may case-fold without --lowercase):
    # kt-evaluate scores a case-folding model's output case-insensitively.
    cfg = {**cfg, "lowercase": folding}
    tokenizer = make_tokenizer(proto)
    vocab_size = vocab_size_of(proto)
    replicas = strategy.num_replicas_in_sync
    plan = batch_plan(cfg, replicas, previous_batch_plan(model_dir, out_dir))
    if plan["grad_accum"] != (cfg["grad_accum"] or 1):
        print(f"[kt-train] resumed on {replicas} replica(s): {plan['grad_accum']} batches per update (not "
              f"{cfg['grad_accum'] or 1}) keep the run's {plan['tokens_per_update']:,} tokens per update", flush=True)
    cfg = {**cfg, "grad_accum": plan["grad_accum"]}
    if is_chief:
        print(f"[kt-train] batch plan: {replicas} replica(s) x {plan['tokens_per_replica']:,} tokens per replica "
              f"x {plan['grad_accum']} batch(es) per update = {plan['tokens_per_update']:,} tokens per update "
              f"(budgets of padded tokens per side; "
              f"{'--tokens-per-replica' if cfg.get('tokens_per_replica') else '--tokens-per-batch split between the replicas'})",
              flush=True)
    batch_args = dict(max_length=cfg["max_length"], tokens_per_batch=plan["tokens_per_replica"] * replicas,
                      num_replicas=replicas, pad_to_bucket_boundary=bool(cfg["jit_compile"]))
    steps = cfg["steps_per_epoch"]
    if cfg.get("checkpoint_every"):
        # A recipe by updates: Keras' epochs are spans of N updates over the repeated stream, each ending in the
        # validation and a history row; the checkpoints follow the update count itself (`UpdateCheckpoint`).
        steps = cfg["checkpoint_every"] * cfg["grad_accum"]
        cfg = {**cfg, "epochs": None}
    sampling_alpha = cfg["subword_sampling"]
    train_tokenizer = make_tokenizer(proto, sampling_alpha=sampling_alpha) if sampling_alpha else tokenizer
    # R-Drop's loss pairs rows 2i and 2i + 1, in validation too, where without dropout the two agree and
    # the loss is the plain one. The batch counts below see each pair once: what an update trains on.
    copies = 2 if cfg.get("r_drop") else 1
    if corpus is not None:
        stream = dict(max_length=cfg["max_length"], tokens_per_replica=plan["tokens_per_replica"], seed=cfg["seed"],
                      start=ResumableBackup.saved_step(out_dir / "backup"),
                      pad_to_bucket_boundary=bool(cfg["jit_compile"]), copies=copies)

        def worker_batches(context=tf.distribute.InputContext()):
            # One batch per replica: each of this worker's replicas takes the next one in turn.
            shards = worker_shards(len(corpus.shards), context.input_pipeline_id, context.num_input_pipelines)
            return prepared_dataset(corpus, shards, **stream)

        train_ds = (strategy.distribute_datasets_from_function(worker_batches) if replicas > 1 or num_workers > 1
                    else worker_batches())
        one_pass = steps_per_epoch(corpus, max_length=cfg["max_length"],
                                   tokens_per_replica=plan["tokens_per_replica"], replicas=replicas)
        steps = steps or one_pass
        span = (f"a pass over it is {one_pass // cfg['grad_accum']:,} updates; a checkpoint and the validation "
                f"every {cfg['checkpoint_every']:,} updates (--checkpoint-every)" if cfg.get("checkpoint_every")
                else f"an epoch is {steps // cfg['grad_accum']:,} updates")
        print(f"[kt-train] data: {corpus.directory} ({corpus.pairs:,} pairs in {len(corpus.shards)} shards; "
              f"worker {task_index + 1}/{num_workers} reads {len(worker)}); {span}", flush=True)
    else:
        reason = text_reason(cfg)
        print(f"[kt-train] data: {spec.dataset}'s text, read into memory and tokenized every epoch ({reason}: "
              f"{'small' if reason == 'Multi30k' else 'not prepared'}; --train-files and TFDS corpora are "
              "prepared into the run first)", flush=True)
        train_ds = make_batches(train_pairs, train_tokenizer, shuffle=True, shuffle_buffer=cfg["shuffle_buffer"],
                                seed=cfg["seed"], repeat=bool(steps), copies=copies, **batch_args)
    batch_contents = None
    if is_chief:
        if corpus is not None:
            counted = prepared_dataset(corpus, worker, **{**stream, "copies": 1})
        else:
            # A pipeline of its own, so that counting does not move the training pipeline's shuffling.
            counted = make_batches(train_pairs, tokenizer, shuffle=True, shuffle_buffer=cfg["shuffle_buffer"],
                                   seed=cfg["seed"], **batch_args)
        batch_contents = mean_target_tokens(counted)
        accum = cfg["grad_accum"] or 1
        # Per batch of all replicas: the prepared stream's batches are one replica's.
        per_batch = 1 if corpus is None else replicas
        batch_contents["target_tokens_per_update"] = round(batch_contents["target_tokens"] * accum * per_batch)
        print(f"[kt-train] batches: {batch_contents['target_tokens_per_update']:,} target tokens per update "
              f"on average ({batch_contents['target_tokens']:,.0f} per batch, "
              f"{batch_contents['padded_target_tokens']:,.0f} with padding, {batch_contents['sentences']:.0f} "
              f"sentences; the first {batch_contents['batches']} batches"
              f"{f' of one replica, {replicas} replicas' if per_batch > 1 else ''}"
              f"{f', {accum} batches per update' if accum > 1 else ''})"
              f"{'; R-Drop: each sentence twice in its batch' if copies > 1 else ''}", flush=True)
    val_ds = val_bleu = None
    if cfg["validation"] and (spec.dataset != "files" or (spec.files and "validation" in spec.files)):
        val_pairs = load_text_pairs(spec, "validation", max_examples=cfg["max_eval_examples"])
        val_ds = make_batches(val_pairs, tokenizer, shuffle=False, copies=copies, **batch_args)
        if cfg["val_bleu"]:
            texts = [(s.decode("utf-8"), t.decode("utf-8")) for s, t in val_pairs.as_numpy_iterator()]
            val_bleu = ValidationBLEU([s for s, _ in texts], [t for _, t in texts], tokenizer, cfg["max_length"],
                                      lowercase=cfg["lowercase"])
    elif cfg["val_bleu"]:
        raise ConfigError("--val-bleu needs validation data (--valid-files with --dataset files; "
                          "not --no-validation)")

    previous_policy = keras.mixed_precision.global_policy()
    policy = set_precision(cfg)
    try:
        return _fit(cfg, strategy, model_dir, out_dir, is_chief, task_index, num_workers, vocab_size, policy,
                    train_ds, val_ds, steps, replicas, val_bleu, batch_contents, plan)
    finally:
        keras.mixed_precision.set_global_policy(previous_policy)


def _fit(cfg, strategy, model_dir, out_dir, is_chief, task_index, num_workers, vocab_size, policy,
         train_ds, val_ds, steps, replicas, val_bleu=None, batch_contents=None, plan=None) -> dict:
    init = cfg.get("init_from_model")
    weights = init_weights(init) if init is not None else None  # read outside the strategy's scope
    with strategy.scope():
        model = build_and_compile(cfg, vocab_size)
        if weights is not None:
            set_init_weights(model, weights, init)
    multi_worker = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
    batches_extra = {"batch_plan": plan} if plan else {}
    if batch_contents:
        batches_extra["batches"] = batch_contents
    if is_chief:
        write_config(cfg, model_dir, vocab_size, model, policy, extra=batches_extra)
    shape = f"preset {cfg['preset']}" + (f" with {json.dumps(cfg['model'])}" if cfg["model"] else "")
    strategy_name = "MultiWorkerMirroredStrategy" if multi_worker else type(strategy).__name__.lstrip("_")
    print(f"[kt-train] {replicas} replica(s) ({strategy_name}, worker {task_index + 1}/{num_workers}), "
          f"{shape}, vocab {vocab_size}, {model.count_params():,} parameters, policy {policy}",
          flush=True)

    backup_dir = out_dir / "backup"
    backup = ResumableBackup(backup_dir, cfg["backup_every"] or "epoch", num_workers=num_workers)
    initial_val_loss = None
    if init is not None and val_ds is not None and not backup_dir.exists():
        # Where fine-tuning starts on the new data: the first epoch's val_loss is measured against it.
        with ignoring_ran_out_of_data():
            initial_val_loss = float(model.evaluate(val_ds, verbose=0, return_dict=True)["loss"])
        print(f"[kt-train] --init-from {init.model_file}: validation loss {initial_val_loss:.4f} before "
              "fine-tuning (fresh optimizer and learning-rate schedule)", flush=True)
    # ValidationBLEU first: the callbacks after it (history.csv, TensorBoard) see its val_bleu.
    callbacks = [val_bleu] if val_bleu is not None else []
    callbacks += [
        backup,
        (UpdateCheckpoint(out_dir / CHECKPOINT_DIR, cfg["checkpoint_every"]) if cfg.get("checkpoint_every") else
         keras.callbacks.ModelCheckpoint(str(out_dir / CHECKPOINT_DIR / CHECKPOINT_PATTERN),
                                         save_weights_only=True, save_freq="epoch")),
        keras.callbacks.TensorBoard(log_dir=str(out_dir / "logs")),
        keras.callbacks.TerminateOnNaN(),
        keras.callbacks.CSVLogger(str(out_dir / "history.csv"), append=True),
        EpochETA(cfg["epochs"], cfg.get("max_minutes"), max_updates=cfg.get("max_updates")),
    ]
    updates = None
    if cfg.get("max_updates"):
        updates = UpdateBudget(cfg["max_updates"])
        callbacks.append(updates)
        if not cfg["epochs"]:
            callbacks.append(UpdateBoundProgbar(cfg["max_updates"]))
    budget = None
    if cfg.get("max_minutes"):
        if num_workers > 1:
            # Each worker would decide on its own clock; one stopping alone would hang the others.
            raise ConfigError("--max-minutes is not supported with more than one worker; set --epochs instead")
        budget = TimeBudget(cfg["max_minutes"])
        callbacks.append(budget)
    t0 = time.time()
    with ignoring_ran_out_of_data():
        # shuffle=False: the dataset shuffles itself (Keras would only warn that it ignores shuffle=True).
        history = model.fit(train_ds, validation_data=val_ds, epochs=cfg["epochs"] or NO_EPOCH_LIMIT,
                            steps_per_epoch=steps,
                            callbacks=callbacks, verbose=fit_verbosity(cfg["verbose"]), shuffle=False)
    elapsed = time.time() - t0
    summary = {
        "epochs_run": [e + 1 for e in history.epoch],
        "resumed_from": backup.resumed,
        "optimizer_steps": int(model.optimizer.iterations.numpy()),
        "final_loss": history.history["loss"][-1] if history.history.get("loss") else None,
        "seconds": round(elapsed, 1),
        "replicas": replicas,
        "stopped_by_time_budget": bool(budget and budget.stopped_after),
        "stopped_by_max_updates": bool(updates and updates.stopped_at),
    }
    if initial_val_loss is not None:
        summary["initial_val_loss"] = initial_val_loss
    losses = history.history.get("loss") or [0.0]
    if not all(l == l and abs(l) != float("inf") for l in losses):  # TerminateOnNaN stopped the run
        summary["nan_loss"] = True
        print("[kt-train] stopped: the loss became NaN/inf; model.keras not written "
              "(epoch checkpoints before it are in checkpoints/)", flush=True)
        return summary
    if is_chief:
        model.save(model_dir / MODEL_FILENAME)
        write_config(cfg, model_dir, vocab_size, model, policy, extra={**batches_extra, "last_run": summary})
    print("[kt-train] done " + json.dumps(summary), flush=True)
    return summary
