"""TensorBoard logging that works without the `tensorboard` package.

Keras' `TensorBoard` callback calls `tf.summary.scalar`, which lives in the
`tensorboard` package (not a dependency of TensorFlow 2.21, and not installed
here). When it is missing, `ScalarLogger` writes the same kind of event files
with TensorFlow's own `tf.summary.write` and the "scalars" plugin metadata, so
`tensorboard --logdir MODEL_DIR/logs` shows loss, accuracy and learning rate.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from tensorflow.core.framework import summary_pb2


def tensorboard_available() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def _scalar_metadata():
    return summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"),
        data_class=summary_pb2.DATA_CLASS_SCALAR,
    ).SerializeToString()


class ScalarLogger(keras.callbacks.Callback):
    """Per-epoch scalars (and every `update_freq` steps the batch loss) as TensorBoard events."""

    def __init__(self, log_dir, update_freq: int | None = 100):
        super().__init__()
        self.log_dir = str(log_dir)
        self.update_freq = update_freq
        self._writers = {}
        self._metadata = _scalar_metadata()

    def _writer(self, name):
        if name not in self._writers:
            self._writers[name] = tf.summary.create_file_writer(f"{self.log_dir}/{name}")
        return self._writers[name]

    def _write(self, name, tag, value, step):
        with self._writer(name).as_default():
            tf.summary.write(tag, tf.constant(float(value), tf.float32), step=int(step), metadata=self._metadata)

    def on_train_batch_end(self, batch, logs=None):
        if not self.update_freq or not logs:
            return
        step = int(self.model.optimizer.iterations.numpy())
        if step % self.update_freq == 0 and "loss" in logs:
            self._write("train", "batch_loss", logs["loss"], step)

    def on_epoch_end(self, epoch, logs=None):
        for key, value in (logs or {}).items():
            try:
                value = float(value)
            except (TypeError, ValueError):
                continue
            if key.startswith("val_"):
                self._write("validation", "epoch_" + key[4:], value, epoch)
            else:
                self._write("train", "epoch_" + key, value, epoch)
        for w in self._writers.values():
            w.flush()

    def on_train_end(self, logs=None):
        for w in self._writers.values():
            w.close()
        self._writers = {}


def tensorboard_callback(log_dir):
    if tensorboard_available():
        return keras.callbacks.TensorBoard(log_dir=str(log_dir))
    return ScalarLogger(log_dir)
