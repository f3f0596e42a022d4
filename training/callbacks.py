"""The Keras callbacks kt-train adds to `model.fit`: resumable backups, a time budget, the ETA, and the
validation BLEU."""

from __future__ import annotations

import datetime
import inspect
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf
from sacrebleu.metrics import BLEU

import keras_transformer as kt
from common.tokenizer import decode_output, encode_source
from keras_transformer.text import END_ID, START_ID
from common.run_dir import UPDATE_CHECKPOINT_PATTERN
from training.errors import BackupError
from training.keras_internals import BackupAndRestoreState, EpochCut
from keras_transformer.distributed import UpdateStep


class ResumePoint:
    """Where in its training batches a run starts: `steps`, the fit steps (batches of every replica) that the
    updates it restored from its backup trained on; 0 for a fresh start. `ResumableBackup` sets it once it has
    restored a backup, and kt-train's prepared stream reads it each time it starts (after that), to skip them."""

    def __init__(self):
        self.steps = 0


class ResumableBackup(BackupAndRestoreState):
    """`keras.callbacks.BackupAndRestore` that also records the optimizer step, reports where it
    resumed, resumes in the middle of an epoch, and writes each backup atomically.

    A kill at any moment leaves a complete (weights, metadata) pair: the new one
    or the previous one. `resumed` holds the metadata a run resumed from (None
    for a fresh start). `save_freq` is "epoch" or a number of updates (optimizer
    steps; Keras' own counts batches). Every backup is taken at an update's
    boundary, so that no batch accumulated towards the next update (which a
    backup does not hold) is lost on a resume: every `save_freq` updates after
    the batch that completes an update, and an epoch's end with batches
    accumulated is backed up after the next update instead.

    With `steps_per_epoch` (fit's, batches of every replica) and
    `batches_per_update` (the gradient accumulation), a resumed run goes on
    from the fit step its optimizer step stands for: fit starts at that step's
    epoch and runs only what is left of it (`epoch_cut`, which must be the last
    of fit's callbacks), so epochs end at the same updates as in a run never
    interrupted, and `resume_point` (a `ResumePoint`) says how many steps the
    training batches skip. A backup is then never taken after an epoch's last
    batch, before the epoch's end (its validation, checkpoint and history row):
    the next update's boundary takes it. Without `steps_per_epoch` (an epoch is
    a pass over a dataset of unknown length), fit starts the backup's epoch
    again from its first batch.
    """

    def __init__(self, backup_dir, save_freq="epoch", num_workers=1, *, steps_per_epoch: int | None = None,
                 batches_per_update: int = 1, resume_point: ResumePoint | None = None):
        super().__init__(backup_dir=str(backup_dir), save_freq=save_freq, double_checkpoint=True)
        self.resumed = None
        self.num_workers = num_workers
        self.saved_at_update = 0
        self.steps_per_epoch, self.batches_per_update = steps_per_epoch, batches_per_update
        self.resume_point = resume_point or ResumePoint()
        self.epoch_cut = EpochCut()
        self.first_batch = 0  # the epoch's batch fit's batch 0 is: where a resumed run starts in its epoch
        self.backup_due = False  # an epoch's end left a backup to take at the next update's boundary

    def on_train_batch_end(self, batch, logs=None):
        self.last_batch_seen = batch + self.first_batch
        if not self.backup_due and (self.save_freq == "epoch"
                                    or optimizer_updates(self.model) - self.saved_at_update < self.save_freq):
            return
        if self.steps_per_epoch and self.last_batch_seen + 1 >= self.steps_per_epoch:
            return  # the epoch's end, after its validation and callbacks, or the next update takes the backup
        if not accumulated_batches(self.model):
            self.save_backup()

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_cut.go_on()
        self.first_batch = 0
        self.current_epoch, self.last_batch_seen = epoch + 1, 0
        if self.save_freq == "epoch":
            if accumulated_batches(self.model):
                self.backup_due = True
            else:
                self.save_backup()

    def on_train_begin(self, logs=None):
        # Not Keras' own restore: it falls back to the previous backup only on an OSError from the
        # weights, and a cut or corrupt metadata file gives a traceback.
        pairs = [(self.weights_path, self.metadata_path)]
        if self.previous_paths:
            pairs.append(tuple(previous for _, previous in self.previous_paths))
        pairs = [(w, m) for w, m in pairs if w.exists() or m.exists()]
        if self.num_workers > 1:
            pairs = self._pairs_every_worker_has(pairs)
        failures = []
        for weights, metadata in pairs:
            try:
                meta = self.load_backup(weights, metadata)
            except Exception as e:  # noqa: BLE001  (h5py, JSON and Keras raise many kinds)
                failures.append(f"{weights} / {metadata.name}: {type(e).__name__}: {str(e)[:200]}")
                print(f"[kt-train] cannot read the backup {weights} ({type(e).__name__}); "
                      "trying the previous one", flush=True)
                continue
            if failures:  # the previous pair becomes the current one again, so the next backup keeps it
                for source, target in ((weights, self.weights_path), (metadata, self.metadata_path)):
                    shutil.copyfile(source, f"{target}.tmp")
                    os.replace(f"{target}.tmp", target)
            self.resumed = meta
            self.current_epoch = meta["epoch"]
            self.saved_at_update = optimizer_updates(self.model)
            going_on = self._resume_mid_epoch()
            print(f"[kt-train] resumed from backup{' (the previous one)' if failures else ''}: "
                  f"epoch {meta['epoch'] + 1} (backup taken after batch {meta.get('batch', 0)} of it), "
                  f"optimizer step {int(self.model.optimizer.iterations.numpy())}{going_on}", flush=True)
            return
        if failures:
            raise BackupError(
                f"No backup in {self.weights_path.parent} can be read:\n  " + "\n  ".join(failures)
                + f"\nTo start this run from the beginning, delete {self.weights_path.parent} "
                "(or train into another --model-dir)."
            )
        print("[kt-train] no backup found: starting at epoch 1, optimizer step 0", flush=True)

    def _resume_mid_epoch(self) -> str:
        """With `steps_per_epoch`: starts fit where the restored optimizer step stands, in the middle of an epoch
        if need be, and sets `resume_point`; returns what the log line adds."""
        if not self.steps_per_epoch:
            return ""
        steps = optimizer_updates(self.model) * self.batches_per_update
        epoch, batch = divmod(steps, self.steps_per_epoch)
        self.resume_point.steps = steps
        self.current_epoch = epoch
        self.start_fit_at(epoch)
        if not batch:
            return f"; epoch {epoch + 1} starts at its first batch"
        if self.epoch_cut.model is not self.model:
            raise RuntimeError("ResumableBackup.epoch_cut is not among fit's callbacks: a run resumed in the "
                               "middle of an epoch would run that epoch whole. Put it last in the list.")
        self.first_batch = batch
        self.epoch_cut.cut_after(self.steps_per_epoch - batch)
        return (f"; epoch {epoch + 1} goes on with the {self.steps_per_epoch - batch} of its {self.steps_per_epoch} "
                f"batches left")

    def _pairs_every_worker_has(self, pairs):
        """The backups (current, previous) that every worker also has, by optimizer step.

        Each worker writes its own backup at the same steps, but a worker killed
        between the others' write and its own is one backup behind, and workers
        resuming from different steps would deadlock in their collectives. The
        workers average their newest steps (all-reduce): a worker whose newest is
        above the mean is ahead, and drops what the others do not have.
        """
        def step(metadata):
            try:
                return int(json.loads(metadata.read_text())["step"])
            except (OSError, ValueError, KeyError, TypeError):
                return -1

        steps = [step(m) for _, m in pairs]
        newest = max(steps, default=-1)
        strategy = self.model.distribute_strategy
        mean = float(strategy.reduce(tf.distribute.ReduceOp.MEAN,
                                     strategy.run(lambda: tf.constant(float(newest))), axis=None))
        if newest <= mean:
            return pairs
        kept = [pair for pair, s in zip(pairs, steps) if s <= mean]
        print(f"[kt-train] another worker's newest backup is older than this worker's (step {newest}): "
              f"resuming from {'the previous backup' if kept else 'the start'}, as it does", flush=True)
        return kept

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    @classmethod
    def start_from(cls, backup_dir, weights_file, epoch: int, step: int) -> None:
        """Writes a backup of `weights_file` (written by `model.save_weights` at the end of epoch `epoch`,
        counted from 1, at optimizer step `step`) into `backup_dir`, for a run to resume from at the next
        epoch. Staged beside it and renamed into place, so that a kill leaves either no backup or a whole one."""
        staging = f"{backup_dir}.continue"
        shutil.rmtree(staging, ignore_errors=True)
        paths = cls(staging)
        os.makedirs(staging)
        shutil.copyfile(weights_file, paths.weights_path)
        paths.metadata_path.write_text(json.dumps({"epoch": epoch, "batch": 0, "step": step}))
        os.replace(staging, backup_dir)

    def save_backup(self):
        # Like Keras' own, but both files are written under temporary names and renamed into place.
        self.weights_path.parent.mkdir(parents=True, exist_ok=True)
        for current, previous in self.previous_paths:
            if current.exists():
                shutil.copyfile(current, f"{previous}.tmp")
                os.replace(f"{previous}.tmp", previous)
        tmp_weights = self.weights_path.with_name("tmp-" + self.weights_path.name)
        self.model.save_weights(str(tmp_weights), overwrite=True)
        meta = {"epoch": self.current_epoch, "batch": self.last_batch_seen,
                "step": int(self.model.optimizer.iterations.numpy())}
        tmp_meta = self.metadata_path.with_name("tmp-" + self.metadata_path.name)
        tmp_meta.write_text(json.dumps(meta))
        os.replace(tmp_weights, self.weights_path)
        os.replace(tmp_meta, self.metadata_path)
        self.saved_at_update, self.backup_due = meta["step"], False


class TimeBudget(keras.callbacks.Callback):
    """Ends `fit` after the last whole epoch that fits in `max_minutes` of this process's training time.

    Epochs are never cut short (checkpoints stay whole epochs, so averaging
    still works): after each epoch, training stops if one more epoch of the
    mean length so far would pass the budget. `stopped_after` is the last epoch
    run (1-based) when the budget stopped training, else None.
    """

    def __init__(self, max_minutes: float):
        super().__init__()
        self.max_minutes = max_minutes
        self.stopped_after = None

    def on_train_begin(self, logs=None):
        self.t0, self.epochs_done, self.stopped_after = time.time(), 0, None

    def on_epoch_end(self, epoch, logs=None):
        self.epochs_done += 1
        elapsed = time.time() - self.t0
        if elapsed + elapsed / self.epochs_done > self.max_minutes * 60:
            self.model.stop_training = True
            self.stopped_after = epoch + 1
            print(f"[kt-train] time budget: stopping after epoch {epoch + 1} "
                  f"({elapsed / 60:.1f} of {self.max_minutes:g} minutes used; another epoch would not fit)",
                  flush=True)


def optimizer_updates(model) -> int:
    """The updates `model`'s optimizer has made (`optimizer.iterations`: a backup restores it, and
    accumulated batches count once)."""
    return int(keras.ops.convert_to_numpy(model.optimizer.iterations))


def accumulated_batches(model) -> int:
    """Batches accumulated towards `model`'s next update (its `UpdateStep`'s; 0 without one)."""
    step = inspect.unwrap(model.train_step)
    return step.pending() if isinstance(step, UpdateStep) else 0


class UpdateCheckpoint(keras.callbacks.Callback):
    """Saves the weights after every `every`-th optimizer update, as `directory/update-NNNNNNN.weights.h5`
    (fairseq's `--save-interval-updates`), for `kt-average-checkpoints --last N`.

    Named by the update, not the epoch: a run resumed from a backup taken in the middle of an epoch
    still writes its checkpoints at the same updates (the optimizer's own count, which a backup restores,
    and which counts accumulated batches once). Each file is written under a temporary name and renamed into
    place, so a kill never leaves a cut checkpoint for averaging to read.
    """

    def __init__(self, directory, every: int):
        super().__init__()
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.directory, self.every = Path(directory), every
        self.saved_at = None

    def on_train_begin(self, logs=None):
        self.directory.mkdir(parents=True, exist_ok=True)
        self.saved_at = optimizer_updates(self.model)  # a resumed run's start was saved by the run before

    def on_train_batch_end(self, batch, logs=None):
        updates = optimizer_updates(self.model)
        if updates % self.every or updates == self.saved_at or accumulated_batches(self.model):
            return
        self.save(updates)

    def on_train_end(self, logs=None):
        # The run's last state, as fairseq saves its last checkpoint: what a finished run is continued from
        # when --max-updates is raised.
        updates = optimizer_updates(self.model)
        finite = all(bool(np.isfinite(keras.ops.convert_to_numpy(w)).all()) for w in self.model.weights)
        if updates != self.saved_at and finite:  # not the weights a NaN loss stopped the run with
            self.save(updates)

    def save(self, updates: int) -> None:
        self.saved_at = updates
        path = self.directory / UPDATE_CHECKPOINT_PATTERN.format(update=updates)
        staged = path.with_name(f"{path.name[:-len('.weights.h5')]}.tmp.weights.h5")  # Keras wants the suffix
        self.model.save_weights(str(staged))
        os.replace(staged, path)


class UpdateBudget(keras.callbacks.Callback):
    """Ends `fit` once the optimizer has made `max_updates` updates (fairseq's `--max-update`).

    The check follows every batch, so the run stops in the middle of an epoch
    if need be; Keras still ends that epoch as usual (validation, the epoch
    checkpoint, history.csv). The count is the optimizer's own
    (`optimizer.iterations`, which a backup restores, and which counts
    accumulated batches once), so a resumed run stops at the same update.
    `stopped_at` is the update count when this callback stopped training, else None.
    """

    def __init__(self, max_updates: int):
        super().__init__()
        self.max_updates = max_updates
        self.stopped_at = None

    def on_train_batch_end(self, batch, logs=None):
        done = optimizer_updates(self.model)
        if done >= self.max_updates and self.stopped_at is None:
            self.model.stop_training = True
            self.stopped_at = done
            print(f"\n[kt-train] reached {done:,} of {self.max_updates:,} updates (--max-updates): "
                  "stopping after this batch", flush=True)


class EpochETA(keras.callbacks.Callback):
    """After every epoch, one line: the epochs (and updates) done, the time so far and an estimate of the time left.

    The estimate is the median time of this process's recent epochs (the last `window`) times the epochs left
    (of `epochs`, counting from the epoch a resumed run starts at); with `max_updates`, their median time per
    update times the updates left, where that ends sooner; at most what is left of a `max_minutes` time budget.
    Recent epochs, because a run's pace changes: the process's first epoch also traces the graphs (it is left out
    once a later one is timed), and a run that shares its machine, or was paused, runs slower for a while; a
    median, so that one stalled epoch does not move the estimate. `epochs` None: no epoch limit (`max_updates`
    is then required).
    """

    def __init__(self, epochs: int | None, max_minutes: float | None = None, clock=time.time,
                 max_updates: int | None = None, window: int = 5):
        super().__init__()
        if epochs is None and max_updates is None:
            raise ValueError("EpochETA needs epochs or max_updates")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.epochs, self.max_minutes, self.clock, self.max_updates = epochs, max_minutes, clock, max_updates
        self.window = window

    def on_train_begin(self, logs=None):
        self.t0 = self.clock()
        self.timed = []  # (seconds, updates) of each epoch of this process

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch_start = self.clock()
        self.updates_at_start = optimizer_updates(self.model) if self.max_updates else 0

    def on_epoch_end(self, epoch, logs=None):
        now = self.clock()
        elapsed = now - self.t0
        updates = optimizer_updates(self.model) if self.max_updates else 0
        self.timed.append((now - self.epoch_start, updates - self.updates_at_start))
        recent = (self.timed[1:] or self.timed)[-self.window:]  # the first epoch traces: left out once another is timed
        lefts, done = [], f"epoch {epoch + 1}" + (f"/{self.epochs}" if self.epochs else "")
        if self.epochs:
            lefts.append((self.epochs - epoch - 1) * statistics.median(seconds for seconds, _ in recent))
        if self.max_updates:
            done += f" (update {updates:,}/{self.max_updates:,})"
            per_update = statistics.median(seconds / max(1, n) for seconds, n in recent)
            lefts.append(max(0, self.max_updates - updates) * per_update)
        left = min(lefts)
        if self.max_minutes:
            left = max(0.0, min(left, self.max_minutes * 60 - elapsed))
        finish = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=left)
        print(f"[kt-train] {done} done: {_minutes(elapsed)} so far, "
              f"about {_minutes(left)} left (ends around {finish:%H:%M} UTC)", flush=True)


class ValidationBLEU(keras.callbacks.Callback):
    """After every epoch, greedy-decodes the validation sources and adds their sacreBLEU corpus BLEU
    to the epoch's logs as `val_bleu`, so history.csv and TensorBoard record it beside `val_loss`
    (`kt-average-checkpoints --best N --by val_bleu` reads it there).

    Args:
        sources, references: the validation pairs, as strings.
        tokenizer: `common.tokenizer.make_tokenizer`'s tokenizer.
        max_source_length: most source tokens (end id included), as in training.
        batch_size: sentences decoded at once (sorted by length, so batches pad little).
        lowercase: score case-insensitively (sacreBLEU's `lowercase`), for a case-folding vocabulary,
            whose model writes lowercase text.
    """

    def __init__(self, sources, references, tokenizer, max_source_length: int, batch_size: int = 64,
                 lowercase: bool = False):
        super().__init__()
        self.sources, self.references = list(sources), list(references)
        self.tokenizer, self.max_source_length, self.batch_size = tokenizer, max_source_length, batch_size
        self.lowercase = lowercase
        self._decode = None

    def translate(self) -> list[str]:
        """The model's greedy translations of the sources, in their order (a blank source gives "")."""
        if self._decode is None:
            model = self.model
            self._decode = tf.function(lambda ids: kt.greedy_decode(model, ids, START_ID, END_ID),
                                       reduce_retracing=True)
        # kt-translate's batching by length, imported here: kt-train loads nothing of export/ without --val-bleu.
        from export.translate import translate_lines

        return translate_lines(self._translate_batch, self.sources, self.batch_size).texts

    def _translate_batch(self, sources):
        source = encode_source(self.tokenizer, tf.constant(sources), self.max_source_length)
        tokens, scores = self._decode(source.to_tensor())
        texts = decode_output(self.tokenizer, tokens).numpy().tolist()
        return [text.decode("utf-8", errors="replace") for text in texts], scores.numpy().tolist()

    def on_epoch_end(self, epoch, logs=None):
        t0 = time.time()
        bleu = BLEU(lowercase=self.lowercase).corpus_score(self.translate(), [self.references]).score
        if logs is not None:
            logs["val_bleu"] = bleu
        print(f"[kt-train] epoch {epoch + 1}: validation BLEU {bleu:.2f} (greedy, {len(self.sources)} sentences, "
              f"{time.time() - t0:.0f} s)", flush=True)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"
