"""The training loss and metric: label smoothing (paper section 5.4), padding ignored."""

import keras
import tensorflow as tf

from keras_transformer.embedding import PAD_ID


@keras.saving.register_keras_serializable(package="keras_transformer")
class MaskedSparseCategoricalCrossentropy(keras.losses.Loss):
    """Label-smoothed cross-entropy over real tokens, from logits.

    The target distribution puts 1 - label_smoothing + label_smoothing / V on
    the reference token and label_smoothing / V on every other (Keras'
    convention; eps_ls = 0.1 in the paper). Positions whose reference id is 0
    (padding) contribute nothing; the result is the mean over real tokens
    (per replica under tf.distribute, where Keras divides it by the replicas
    so that the summed gradients average them).

    Shapes:
        y_true `[batch, length]` int ids, y_pred `[batch, length, vocab]` logits
        -> scalar.

    Example:

    ```python
    model.compile(optimizer=paper_adam(512), loss=MaskedSparseCategoricalCrossentropy())
    ```
    """

    def __init__(self, label_smoothing=0.1, name="masked_sparse_categorical_crossentropy", **kwargs):
        super().__init__(name=name, **kwargs)
        self.label_smoothing = label_smoothing

    def call(self, y_true, y_pred):
        y_true = tf.cast(y_true, tf.int32)
        log_probs = tf.nn.log_softmax(tf.cast(y_pred, tf.float32), axis=-1)
        nll = -tf.gather(log_probs, y_true, axis=-1, batch_dims=2)
        uniform = -tf.reduce_mean(log_probs, axis=-1)
        per_token = (1.0 - self.label_smoothing) * nll + self.label_smoothing * uniform
        mask = tf.cast(tf.not_equal(y_true, PAD_ID), tf.float32)
        # Keras reduces with the mean over all positions, then divides by the
        # replicas in sync under tf.distribute (a scalar returned here would
        # skip that). Weighting real tokens by positions / real tokens turns
        # that mean into the mean over real tokens.
        positions = tf.cast(tf.size(mask), tf.float32)
        return per_token * mask * (positions / tf.maximum(tf.reduce_sum(mask), 1.0))

    def get_config(self):
        return {**super().get_config(), "label_smoothing": self.label_smoothing}


@keras.saving.register_keras_serializable(package="keras_transformer")
class MaskedAccuracy(keras.metrics.Metric):
    """Token accuracy over real (non-pad) positions, accumulated over batches.

    Shapes: y_true `[batch, length]` ids, y_pred `[batch, length, vocab]` logits.
    """

    def __init__(self, name="masked_accuracy", **kwargs):
        super().__init__(name=name, **kwargs)
        self.correct = self.add_variable(shape=(), initializer="zeros", name="correct")
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_true = tf.cast(y_true, tf.int32)
        mask = tf.not_equal(y_true, PAD_ID)
        hits = tf.logical_and(mask, tf.equal(tf.argmax(y_pred, axis=-1, output_type=tf.int32), y_true))
        self.correct.assign_add(tf.reduce_sum(tf.cast(hits, self.dtype)))
        self.total.assign_add(tf.reduce_sum(tf.cast(mask, self.dtype)))

    def result(self):
        return tf.math.divide_no_nan(self.correct, self.total)
