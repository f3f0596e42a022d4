"""kt-train's uses of private Keras API, written for Keras 3.15 (setup.py pins keras>=3.15,<3.16).

Workarounds for Keras' trainer, progress bar and backup callback that only kt-train's `fit()` needs
(training/fit.py, training/callbacks.py). The library's own (the attention layer's, and the training step
`kt.UpdateStep`'s) are in keras_transformer/keras_internals.py: one such module per package, and no other module
reads a private Keras attribute (tests/test_layout.py). On a Keras upgrade, run tests/test_keras_internals.py
first: one test per use, each checking the Keras behaviour the use relies on.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from pathlib import Path

import keras


# What Keras 3.15's EpochIterator warns when a dataset of unknown length (bucketed batches) runs out.
RAN_OUT_OF_DATA = "Your input ran out of data"


@contextlib.contextmanager
def ignoring_ran_out_of_data():
    """Silences `RAN_OUT_OF_DATA` inside the block (Keras 3.15: the private
    `EpochIterator.catch_stop_iteration`, which warns through `_interrupted_warning`).

    Bucketed batches have no length known in advance, so fit() and evaluate()
    learn an epoch's length by running out of data once, and Keras warns as if
    that were a mistake. Other warnings pass.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=RAN_OUT_OF_DATA)
        yield


class BackupAndRestoreState(keras.callbacks.BackupAndRestore):
    """`keras.callbacks.BackupAndRestore` with its private state (Keras 3.15) under public names.

    Keras 3.15 keeps the backup's paths in `_weights_path`, `_training_metadata_path`, `_prev_weights_path`
    and `_prev_training_metadata_path`, the metadata its `_save_model` writes in `_current_epoch` and
    `_last_batch_seen`, and writes every backup through `_save_model` (from `on_epoch_end`, and from
    `on_train_batch_end` when `save_freq` is a number). `save_backup()` replaces that private `_save_model()`;
    subclasses override `save_backup` and read the paths and counters below. `load_backup` restores as the
    private `_load_model` does, which sets the private `model._initial_epoch` that fit() starts at.
    """

    @property
    def weights_path(self) -> Path:
        return Path(self._weights_path)

    @property
    def metadata_path(self) -> Path:
        return Path(self._training_metadata_path)

    @property
    def previous_paths(self) -> list[tuple[Path, Path]]:
        """(current, previous) pairs for the weights and the metadata, when `double_checkpoint` is on."""
        if not self.double_checkpoint:
            return []
        return [(self.weights_path, Path(self._prev_weights_path)),
                (self.metadata_path, Path(self._prev_training_metadata_path))]

    @property
    def current_epoch(self) -> int:
        return self._current_epoch

    @current_epoch.setter
    def current_epoch(self, epoch: int) -> None:
        # Keras 3.15 leaves this at 0 after a resume until the first epoch ends, so a second
        # crash during the resumed epoch would record (and restart at) epoch 0.
        self._current_epoch = epoch

    @property
    def last_batch_seen(self) -> int:
        return self._last_batch_seen

    @last_batch_seen.setter
    def last_batch_seen(self, batch: int) -> None:
        # Keras 3.15 sets it in `_should_save_on_batch`, which a subclass that decides itself when to save
        # (overriding `on_train_batch_end`) no longer calls; `on_epoch_end` resets it to 0.
        self._last_batch_seen = batch

    def _save_model(self):
        self.save_backup()

    def load_backup(self, weights_path, metadata_path) -> dict:
        """Restores the model (and optimizer) from one backup pair as Keras' `_load_model` does,
        and sets the epoch `fit` starts at; returns the metadata. Raises if either file is unreadable, or if
        the two are of different optimizer steps."""
        meta = json.loads(Path(metadata_path).read_text())
        epoch = int(meta["epoch"])
        if self.model.optimizer is not None and not self.model.optimizer.built:
            self.model.optimizer.build(self.model.trainable_variables)
        weights_path = Path(weights_path)
        if weights_path.name.endswith(".weights.h5"):
            self.model.load_weights(str(weights_path))
        else:  # the previous backup (".bkp"): Keras reads weights only from a file named *.weights.h5
            readable = weights_path.with_name("restore.weights.h5")
            shutil.copyfile(weights_path, readable)
            try:
                self.model.load_weights(str(readable))
            finally:
                readable.unlink()
        if "step" in meta:
            # A pair is written and rotated one file after the other, so a kill between the two leaves new weights
            # beside old metadata (or the reverse): refused, as an unreadable pair is, so the other pair is used.
            loaded = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
            if loaded != int(meta["step"]):
                raise ValueError(f"its weights are of optimizer step {loaded}, its metadata "
                                 f"({Path(metadata_path).name}) of step {meta['step']}: a pair cut in two")
        self.model._initial_epoch = epoch
        return meta

    def start_fit_at(self, epoch: int) -> None:
        """The epoch (0-based) fit starts at, as `load_backup` sets it (Keras 3.15's private
        `model._initial_epoch`, which fit reads after the callbacks' `on_train_begin`)."""
        self.model._initial_epoch = epoch

    def save_backup(self):
        super()._save_model()


class EpochCut(keras.callbacks.Callback):
    """Ends the epoch fit is in once it has run a given number of batches, and lets fit go on to the next:
    how a resumed run runs what was left of the epoch its backup was taken in.

    Keras 3.15's fit starts every epoch at its first step, with no way to start one part-way through. But
    `model.stop_training`, set in `on_train_batch_end`, ends the epoch's loop over batches (fit then validates
    and calls `on_epoch_end`), and fit ends after `on_epoch_end` only if it is still set then; with
    `steps_per_epoch`, fit's next epoch goes on reading the same dataset iterator. `cut_after(batches)` asks for
    the current (or next) epoch to end after that many batches: this sets `stop_training` after them, unless a
    callback before it in the list has set it (that stop stands: this goes last among fit's callbacks), and
    `go_on()`, called from the `on_epoch_end` of a callback before any that stops fit at an epoch's end, sets it
    back.
    """

    def __init__(self):
        super().__init__()
        self.batches = None  # the batches the epoch being cut runs, or None
        self.stopped = False  # whether this set `stop_training`

    def cut_after(self, batches: int) -> None:
        if batches < 1:
            raise ValueError(f"an epoch runs at least one batch, not {batches}")
        self.batches = batches

    def on_train_batch_end(self, batch, logs=None):
        if self.batches is not None and batch + 1 >= self.batches:
            self.batches = None
            if not self.model.stop_training:
                self.model.stop_training = self.stopped = True

    def go_on(self) -> None:
        """Lets fit go on to its next epoch if this ended the epoch (and nothing else asked fit to stop)."""
        if self.stopped:
            self.model.stop_training = self.stopped = False


class UpdateBoundProgbar(keras.callbacks.ProgbarLogger):
    """Keras' progress bar for a run bounded by updates alone: "Epoch 2 (to update 8,060)", not "Epoch 2/1000000".

    fit() needs an epoch count, and such a run gives it a stand-in that is never
    reached (`training.fit.NO_EPOCH_LIMIT`). Keras 3.15's `ProgbarLogger`
    prints its "Epoch N/M" line only when its `epochs` attribute (set from fit's
    epochs in `set_params`; public-named, but internal state) is above 1, and
    reads that attribute for nothing else; this sets it to 1 and prints its own
    line. Passed to fit() among the callbacks, it takes the place of the progress
    bar Keras would add (`CallbackList` adds one only when none is given).
    """

    def __init__(self, max_updates: int):
        super().__init__()
        self.max_updates = max_updates

    def set_params(self, params):
        super().set_params(params)
        self.epochs = 1

    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        if self.verbose:
            print(f"Epoch {epoch + 1} (to update {self.max_updates:,})", flush=True)
