"""The training loss and metric: label smoothing (paper section 5.4), padding ignored."""

import keras
import tensorflow as tf

from keras_transformer.embedding import PAD_ID


def smoothed_cross_entropy(logits, labels, label_smoothing):
    """Label-smoothed cross-entropy per position, from float32 logits.

    With z the logits, V the vocabulary and eps the smoothing:
    (1 - eps) * (-log p_y) + eps * mean_v(-log p_v) = lse(z) - (1 - eps) z_y - eps mean(z),
    with gradient softmax(z) - (1 - eps) onehot(y) - eps / V. Written out (a
    custom gradient), it never materializes log_softmax over the vocabulary, and
    the backward pass is one multiply plus a scatter of one value per position.

    Shapes: logits `[batch, length, vocab]`, labels `[batch, length]` -> `[batch, length]`.
    """
    vocab_size = tf.cast(tf.shape(logits)[-1], logits.dtype)

    @tf.custom_gradient
    def loss(z):
        probs = tf.nn.softmax(z)
        # lse(z) = z_j - log p_j for any j; at the argmax p_j >= 1/V, so the log cannot underflow.
        lse = tf.reduce_max(z, axis=-1) - tf.math.log(tf.reduce_max(probs, axis=-1))
        z_y = tf.gather(z, labels, axis=-1, batch_dims=2)
        value = lse - (1.0 - label_smoothing) * z_y - label_smoothing * tf.reduce_mean(z, axis=-1)

        def grad(upstream):
            g = probs * upstream[..., None] - (upstream * (label_smoothing / vocab_size))[..., None]
            positions = tf.cast(tf.where(tf.ones_like(labels, tf.bool)), tf.int32)  # [batch * length, 2]
            indices = tf.concat([positions, tf.reshape(labels, [-1, 1])], axis=1)
            return tf.tensor_scatter_nd_sub(g, indices, tf.reshape((1.0 - label_smoothing) * upstream, [-1]))

        return value, grad

    return loss(logits)


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
        per_token = smoothed_cross_entropy(tf.cast(y_pred, tf.float32), y_true, self.label_smoothing)
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
        # The reference token has the top logit (a tie counts as a hit): a max and a
        # gather, cheaper than an argmax over [batch, length, vocab].
        y_pred = tf.convert_to_tensor(y_pred)
        top = tf.gather(y_pred, y_true, axis=-1, batch_dims=2) >= tf.reduce_max(y_pred, axis=-1)
        hits = tf.logical_and(mask, top)
        self.correct.assign_add(tf.reduce_sum(tf.cast(hits, self.dtype)))
        self.total.assign_add(tf.reduce_sum(tf.cast(mask, self.dtype)))

    def result(self):
        return tf.math.divide_no_nan(self.correct, self.total)
