"""Train a Transformer with `model.fit` under tf.distribute.

    python -m training.train --preset small --data-dir ../shared/data/multi30k \
        --source-lang en --target-lang de --model-dir runs/en-de

Writes to --model-dir: tokenizer.model (sentencepiece proto), config.json
(langs, ids, vocabulary, model and training settings), model.keras (final
model), checkpoints/epoch-NNN.weights.h5 (one per epoch, for averaging),
backup/ (BackupAndRestore, removed when training finishes), logs/
(TensorBoard) and history.csv.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

log = logging.getLogger("training.train")

CONFIG_FILENAME = "config.json"
MODEL_FILENAME = "model.keras"
CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_PATTERN = "epoch-{epoch:03d}.weights.h5"

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
    "source_lang": "en",
    "target_lang": "de",
    "model_dir": "runs/model",
    "tokenizer": None,
    "vocab_size": 8000,
    "tokens_per_batch": 4096,
    "max_length": 128,
    "warmup_steps": 4000,
    "label_smoothing": 0.1,
    "epochs": 10,
    "max_minutes": None,
    "steps_per_epoch": None,
    "validation": True,
    "max_train_examples": None,
    "max_eval_examples": None,
    "mixed_precision": False,
    "jit_compile": False,
    "grad_accum": 1,
    "cpu_replicas": 1,
    "seed": 1234,
    "backup_every": None,
    "shuffle_buffer": 20000,
    "verbose": "auto",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kt-train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS)
    p.add_argument("--config", help="JSON file with any of the settings below (keys with underscores) "
                   "and \"model\": {Transformer arguments}. Command-line flags override it.")
    p.add_argument("--preset", help="model size: tiny | small | base | big (default small)")
    p.add_argument("--model-arg", action="append", metavar="KEY=VALUE", dest="model_args",
                   help="override a Transformer argument, e.g. --model-arg dropout=0.3 (repeatable)")
    p.add_argument("--dropout", type=float, help="shortcut for --model-arg dropout=X")
    g = p.add_argument_group("data")
    g.add_argument("--dataset", help="multi30k (default) | files | a TFDS name, e.g. ted_hrlr_translate/pt_to_en")
    g.add_argument("--data-dir", help="raw Multi30k directory (default: $KT_MULTI30K_DIR, else "
                   "../shared/data/multi30k, else download)")
    g.add_argument("--tfds-data-dir", help="where TFDS stores prepared datasets (default $KT_TFDS_DIR or ~/tensorflow_datasets)")
    g.add_argument("--train-files", nargs=2, metavar=("SOURCE", "TARGET"), help="parallel text files (implies --dataset files)")
    g.add_argument("--valid-files", nargs=2, metavar=("SOURCE", "TARGET"), help="validation text files for --dataset files")
    g.add_argument("--source-lang")
    g.add_argument("--target-lang")
    g.add_argument("--max-train-examples", type=int, help="use only the first N training pairs (quick runs)")
    g.add_argument("--max-eval-examples", type=int, help="use only the first N validation pairs")
    g.add_argument("--no-validation", dest="validation", action="store_false", help="skip the validation loss")
    g = p.add_argument_group("tokenizer and batches")
    g.add_argument("--tokenizer", help="existing sentencepiece .model to use instead of training one")
    g.add_argument("--vocab-size", type=int, help="joint subword vocabulary size (default 8000)")
    g.add_argument("--tokens-per-batch", type=int, help="token budget per batch and side (default 4096; paper ~25000)")
    g.add_argument("--max-length", type=int, help="drop training pairs longer than this many tokens (default 128)")
    g.add_argument("--shuffle-buffer", type=int)
    g = p.add_argument_group("training")
    g.add_argument("--model-dir", help="output directory (default runs/model)")
    g.add_argument("--epochs", type=int)
    g.add_argument("--steps-per-epoch", type=int, help="fixed steps per epoch over a repeated dataset")
    g.add_argument("--max-minutes", type=float,
                   help="stop after the last whole epoch that fits in this many minutes of training (default and 0: no limit)")
    g.add_argument("--warmup-steps", type=int, help="learning-rate warm-up (default 4000)")
    g.add_argument("--label-smoothing", type=float)
    g.add_argument("--grad-accum", type=int, help="gradient accumulation steps (optimizer's gradient_accumulation_steps)")
    g.add_argument("--mixed-precision", action="store_true", help="mixed_bfloat16 on CPU, mixed_float16 on GPU")
    g.add_argument("--jit-compile", action="store_true", help="compile the train step with XLA")
    g.add_argument("--cpu-replicas", type=int, help="split the CPU into N logical devices for MirroredStrategy")
    g.add_argument("--backup-every", type=int, help="BackupAndRestore every N steps (default: every epoch)")
    g.add_argument("--seed", type=int)
    g.add_argument("--verbose", type=int, help="Keras fit verbosity (0, 1 progress bar, 2 one line per epoch)")
    return p


def resolve_config(argv=None) -> dict:
    args = vars(build_parser().parse_args(argv))
    cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in DEFAULTS.items()}
    if "config" in args:
        with open(args.pop("config"), encoding="utf-8") as f:
            file_cfg = json.load(f)
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


# --------------------------------------------------------------------------


def _data_spec(cfg):
    from training.data import DataSpec

    files = None
    if cfg["dataset"] == "files":
        if not cfg.get("train_files"):
            raise SystemExit("--dataset files needs --train-files SOURCE TARGET")
        files = {"train": tuple(cfg["train_files"])}
        if cfg.get("valid_files"):
            files["validation"] = tuple(cfg["valid_files"])
    return DataSpec(dataset=cfg["dataset"], source_lang=cfg["source_lang"], target_lang=cfg["target_lang"],
                    data_dir=cfg["data_dir"], tfds_data_dir=cfg["tfds_data_dir"], files=files)


def _wait_for(path: Path, timeout: float = 600.0) -> None:
    t0 = time.time()
    while not path.exists():
        if time.time() - t0 > timeout:
            raise TimeoutError(f"Waited {timeout:.0f}s for the chief to write {path}")
        time.sleep(0.5)


def get_tokenizer_proto(cfg, train_pairs, model_dir: Path, is_chief: bool) -> bytes:
    """Reuses model_dir/tokenizer.model (resume) or --tokenizer, else trains one on the training text."""
    import sentencepiece as spm

    from training.data import iterate_text
    from training.tokenizer import (TOKENIZER_FILENAME, check_special_ids, load_model_proto,
                                    save_model_proto, train_sentencepiece)

    path = model_dir / TOKENIZER_FILENAME
    if cfg.get("tokenizer"):
        proto = load_model_proto(cfg["tokenizer"])
        check_special_ids(proto)
        if is_chief:
            save_model_proto(proto, model_dir)
        return proto
    if path.exists():
        log.info("Using the existing tokenizer %s", path)
        return load_model_proto(path)
    if not is_chief:  # every worker must use the chief's vocabulary
        _wait_for(path)
        return load_model_proto(path)
    spm.set_random_generator_seed(cfg["seed"])
    t0 = time.time()
    proto = train_sentencepiece(iterate_text(train_pairs, limit=2_000_000), cfg["vocab_size"])
    tmp = model_dir / (TOKENIZER_FILENAME + ".tmp")
    tmp.write_bytes(proto)
    os.replace(tmp, path)  # atomic: other workers wait for this file
    log.info("Trained a joint sentencepiece vocabulary in %.1fs -> %s", time.time() - t0, path)
    return proto


class ResumableBackup:
    """Factory for a `keras.callbacks.BackupAndRestore` subclass that also records
    the optimizer step, reports where it resumed, and keeps the epoch counter
    right after a resume (Keras 3.15's callback leaves it at 0 until the first
    epoch ends, so a second crash during the resumed epoch would restart at 0)."""

    @staticmethod
    def make(backup_dir, save_freq):
        import keras

        class _Backup(keras.callbacks.BackupAndRestore):
            resumed = None

            def on_train_begin(self, logs=None):
                super().on_train_begin(logs)
                meta_path = Path(self._training_metadata_path)
                if meta_path.exists():
                    meta = json.loads(meta_path.read_text())
                    self.resumed = meta
                    self._current_epoch = meta["epoch"]
                    print(f"[kt-train] resumed from backup: epoch {meta['epoch'] + 1} "
                          f"(backup taken after batch {meta.get('batch', 0)} of it), "
                          f"optimizer step {int(self.model.optimizer.iterations.numpy())}",
                          flush=True)
                else:
                    print("[kt-train] no backup found: starting at epoch 1, optimizer step 0", flush=True)

            def on_epoch_begin(self, epoch, logs=None):
                self._current_epoch = epoch

            def _save_model(self):
                # Like Keras' version, but both files are written to temporary names
                # first and renamed, so a kill at any moment leaves a complete
                # (weights, metadata) pair: the new one or the previous one.
                weights, meta_path = Path(self._weights_path), Path(self._training_metadata_path)
                weights.parent.mkdir(parents=True, exist_ok=True)
                if self.double_checkpoint:
                    for src, dst in ((weights, self._prev_weights_path), (meta_path, self._prev_training_metadata_path)):
                        if src.exists():
                            shutil.copyfile(src, dst + ".tmp")
                            os.replace(dst + ".tmp", dst)
                tmp_weights = weights.with_name("tmp-" + weights.name)
                self.model.save_weights(str(tmp_weights), overwrite=True)
                meta = {"epoch": self._current_epoch, "batch": self._last_batch_seen,
                        "step": int(self.model.optimizer.iterations.numpy())}
                tmp_meta = meta_path.with_name("tmp-" + meta_path.name)
                tmp_meta.write_text(json.dumps(meta))
                os.replace(tmp_weights, weights)
                os.replace(tmp_meta, meta_path)

        return _Backup(backup_dir=str(backup_dir), save_freq=save_freq, double_checkpoint=True)


class TimeBudget:
    """Factory for a Keras callback that ends `fit` after the last epoch that fits in `max_minutes`.

    Epochs are never cut short (checkpoints stay whole epochs, so averaging still
    works): after each epoch, training stops if one more epoch of the mean length
    so far would pass the budget. The budget counts this process's training time.
    """

    @staticmethod
    def make(max_minutes: float):
        import keras

        class _TimeBudget(keras.callbacks.Callback):
            def on_train_begin(self, logs=None):
                self.t0, self.epochs_done, self.stopped_after = time.time(), 0, None

            def on_epoch_end(self, epoch, logs=None):
                self.epochs_done += 1
                elapsed = time.time() - self.t0
                if elapsed + elapsed / self.epochs_done > max_minutes * 60:
                    self.model.stop_training = True
                    self.stopped_after = epoch + 1
                    print(f"[kt-train] time budget: stopping after epoch {epoch + 1} "
                          f"({elapsed / 60:.1f} of {max_minutes:g} minutes used; another epoch would not fit)",
                          flush=True)

        return _TimeBudget()


def build_model(cfg, vocab_size: int):
    import keras_transformer as kt

    return kt.Transformer.from_preset(cfg["preset"], vocab_size=vocab_size, **cfg["model"])


def compile_model(model, cfg, optimizer=None):
    import keras_transformer as kt

    kwargs = {}
    if cfg["grad_accum"] and cfg["grad_accum"] > 1:
        kwargs["gradient_accumulation_steps"] = cfg["grad_accum"]
    if optimizer is None:
        optimizer = kt.paper_adam(model.d_model, warmup_steps=cfg["warmup_steps"], **kwargs)
    model.compile(
        optimizer=optimizer,
        loss=kt.MaskedSparseCategoricalCrossentropy(label_smoothing=cfg["label_smoothing"]),
        metrics=[kt.MaskedAccuracy()],
        jit_compile=bool(cfg["jit_compile"]),
    )
    return model


def build_and_compile(cfg, vocab_size: int, optimizer=None):
    """Model + optimizer + loss, built (variables created) in the current strategy scope."""
    import numpy as np

    model = build_model(cfg, vocab_size)
    dummy = np.ones((1, 2), "int32")
    model((dummy, dummy))
    compile_model(model, cfg, optimizer)
    model.optimizer.build(model.trainable_variables)
    # Build the compiled loss and metrics now, from an int batch. Otherwise
    # Keras 3.15's fit() under tf.distribute builds them from the first batch
    # reduced with strategy.reduce("MEAN"), which turns the int token ids into
    # floats (the Transformer casts them back, as keras.layers.Embedding does).
    # With everything built, also skip fit()'s own pre-build: it pulls one batch
    # from the distributed iterator and all-reduces it (MEAN) across replicas,
    # which fails under MultiWorkerMirroredStrategy when workers' batches differ
    # in shape (PerReplica conversion error), and wastes a batch otherwise.
    symbolic_build = getattr(model, "_symbolic_build", None)
    if symbolic_build is not None and hasattr(model, "_maybe_symbolic_build"):
        symbolic_build(data_batch=((dummy, dummy), dummy))
        model._maybe_symbolic_build = lambda *args, **kwargs: None
    return model


def _rank1_step_logs(model) -> None:
    """Under MultiWorkerMirroredStrategy, Keras 3.15's fit() averages each step's
    logs across workers with `strategy.reduce("MEAN", v, axis=0)`, which fails on
    the scalar loss/metric values ("Invalid reduction dimension 0 for input with
    0 dimensions"). Returning them with shape [1] from the step makes that
    reduction the mean over workers, a scalar again."""
    import tensorflow as tf

    def rank1(step):
        def wrapped(data):
            return {k: tf.reshape(v, [1]) for k, v in step(data).items()}

        return wrapped

    model.train_step = rank1(model.train_step)
    model.test_step = rank1(model.test_step)


def set_precision(cfg) -> str:
    import keras

    from training.distribute import has_gpu

    policy = "float32"
    if cfg["mixed_precision"]:
        policy = "mixed_float16" if has_gpu() else "mixed_bfloat16"
    keras.mixed_precision.set_global_policy(policy)
    return policy


def write_config(cfg, model_dir: Path, vocab_size: int, model, policy: str, extra=None) -> Path:
    from training.tokenizer import BOS_ID, EOS_ID, PAD_ID, TOKENIZER_FILENAME, UNK_ID

    out = {
        "source_lang": cfg["source_lang"],
        "target_lang": cfg["target_lang"],
        "vocab_size": vocab_size,
        "pad_id": PAD_ID, "unk_id": UNK_ID, "bos_id": BOS_ID, "eos_id": EOS_ID,
        "start_id": BOS_ID, "end_id": EOS_ID,
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
        "training": {k: v for k, v in cfg.items() if k != "model"},
    }
    if extra:
        out.update(extra)
    path = model_dir / CONFIG_FILENAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(out, indent=2, default=str))
    os.replace(tmp, path)
    return path


def load_config(model_dir) -> dict:
    path = Path(model_dir) / CONFIG_FILENAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {model_dir} a directory written by training.train?")
    return json.loads(path.read_text())


def train(cfg: dict, strategy=None) -> dict:
    """Runs training as configured; returns a summary dict (also printed as JSON)."""
    from training.distribute import make_strategy, worker_info

    if strategy is None:
        strategy = make_strategy(cfg["cpu_replicas"], cfg["grad_accum"] or 1)
    import keras
    import tensorflow_datasets as tfds

    from training.data import load_text_pairs
    from training.pipeline import make_batches
    from training.tokenizer import make_tokenizer, vocab_size_of

    tfds.disable_progress_bar()
    is_chief, task_index, num_workers = worker_info()
    model_dir = Path(cfg["model_dir"])
    model_dir.mkdir(parents=True, exist_ok=True)
    # Non-chief workers write their (identical) checkpoints/backups/logs aside.
    out_dir = model_dir if is_chief else model_dir / f".worker-{task_index}"
    out_dir.mkdir(parents=True, exist_ok=True)
    keras.utils.set_random_seed(cfg["seed"])

    spec = _data_spec(cfg)
    train_pairs = load_text_pairs(spec, "train", max_examples=cfg["max_train_examples"])
    proto = get_tokenizer_proto(cfg, train_pairs, model_dir, is_chief)
    tokenizer = make_tokenizer(proto)
    vocab_size = vocab_size_of(proto)
    replicas = strategy.num_replicas_in_sync
    batch_args = dict(max_length=cfg["max_length"], tokens_per_batch=cfg["tokens_per_batch"],
                      num_replicas=replicas, pad_to_bucket_boundary=bool(cfg["jit_compile"]))
    steps = cfg["steps_per_epoch"]
    train_ds = make_batches(train_pairs, tokenizer, shuffle=True, shuffle_buffer=cfg["shuffle_buffer"],
                            seed=cfg["seed"], repeat=bool(steps), **batch_args)
    val_ds = None
    if cfg["validation"] and (spec.dataset != "files" or (spec.files and "validation" in spec.files)):
        val_pairs = load_text_pairs(spec, "validation", max_examples=cfg["max_eval_examples"])
        val_ds = make_batches(val_pairs, tokenizer, shuffle=False, **batch_args)

    previous_policy = keras.mixed_precision.global_policy()
    policy = set_precision(cfg)
    try:
        return _fit(cfg, strategy, model_dir, out_dir, is_chief, task_index, num_workers, vocab_size, policy,
                    train_ds, val_ds, steps, replicas)
    finally:
        keras.mixed_precision.set_global_policy(previous_policy)


def _fit(cfg, strategy, model_dir, out_dir, is_chief, task_index, num_workers, vocab_size, policy,
         train_ds, val_ds, steps, replicas) -> dict:
    import keras
    import tensorflow as tf

    from training.errors import ConfigError
    from training.tb import tensorboard_callback

    with strategy.scope():
        model = build_and_compile(cfg, vocab_size)
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        _rank1_step_logs(model)
    if is_chief:
        write_config(cfg, model_dir, vocab_size, model, policy)
    strategy_name = ("MultiWorkerMirroredStrategy" if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
                     else type(strategy).__name__.lstrip("_"))
    print(f"[kt-train] {replicas} replica(s) ({strategy_name}, worker {task_index + 1}/{num_workers}), "
          f"preset {cfg['preset']}, vocab {vocab_size}, {model.count_params():,} parameters, policy {policy}",
          flush=True)

    backup = ResumableBackup.make(out_dir / "backup", cfg["backup_every"] or "epoch")
    callbacks = [
        backup,
        keras.callbacks.ModelCheckpoint(str(out_dir / CHECKPOINT_DIR / CHECKPOINT_PATTERN),
                                        save_weights_only=True, save_freq="epoch"),
        tensorboard_callback(out_dir / "logs"),
        keras.callbacks.TerminateOnNaN(),
        keras.callbacks.CSVLogger(str(out_dir / "history.csv"), append=True),
    ]
    budget = None
    if cfg.get("max_minutes"):
        if num_workers > 1:
            # Each worker would decide on its own clock; one stopping alone would hang the others.
            raise ConfigError("--max-minutes is not supported with more than one worker; set --epochs instead")
        budget = TimeBudget.make(cfg["max_minutes"])
        callbacks.append(budget)
    t0 = time.time()
    with warnings.catch_warnings():
        # Bucketed batches have no length known in advance, so Keras learns the epoch's
        # length by running out of data once, and warns as if that were a mistake.
        warnings.filterwarnings("ignore", message="Your input ran out of data")
        # shuffle=False: the dataset shuffles itself (Keras would only warn that it ignores shuffle=True).
        history = model.fit(train_ds, validation_data=val_ds, epochs=cfg["epochs"], steps_per_epoch=steps,
                            callbacks=callbacks, verbose=cfg["verbose"], shuffle=False)
    elapsed = time.time() - t0
    summary = {
        "epochs_run": [e + 1 for e in history.epoch],
        "resumed_from": backup.resumed,
        "optimizer_steps": int(model.optimizer.iterations.numpy()),
        "final_loss": history.history["loss"][-1] if history.history.get("loss") else None,
        "seconds": round(elapsed, 1),
        "replicas": replicas,
        "stopped_by_time_budget": bool(budget and budget.stopped_after),
    }
    losses = history.history.get("loss") or [0.0]
    if not all(l == l and abs(l) != float("inf") for l in losses):  # TerminateOnNaN stopped the run
        summary["nan_loss"] = True
        print("[kt-train] stopped: the loss became NaN/inf; model.keras not written "
              "(epoch checkpoints before it are in checkpoints/)", flush=True)
        return summary
    if is_chief:
        model.save(model_dir / MODEL_FILENAME)
        write_config(cfg, model_dir, vocab_size, model, policy, extra={"last_run": summary})
    print("[kt-train] done " + json.dumps(summary), flush=True)
    return summary


def main(argv=None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from training.errors import ConfigError, DataError

    cfg = resolve_config(argv)
    try:
        summary = train(cfg)
    except (DataError, ConfigError) as e:
        print(f"kt-train: error: {e}", file=sys.stderr)
        return 2
    return 1 if summary.get("nan_loss") else 0


if __name__ == "__main__":
    sys.exit(main())
