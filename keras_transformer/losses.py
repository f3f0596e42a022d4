"""The training loss and metric: label smoothing (paper section 5.4), padding ignored."""

import keras
import tensorflow as tf

from keras_transformer.masking import PAD_ID


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


def _token_weights(sample_weight, mask):
    """`sample_weight` (a scalar, one per sentence `[batch]` or one per token
    `[batch, length]`) as float32 `[batch, length]`, shaped like `mask`."""
    weight = tf.cast(sample_weight, tf.float32)
    if weight.shape.rank == 1:
        weight = weight[:, None]
    return tf.broadcast_to(weight, tf.shape(mask))


@keras.saving.register_keras_serializable(package="keras_transformer")
class MaskedSparseCategoricalCrossentropy(keras.losses.Loss):
    """Label-smoothed cross-entropy over real tokens, from logits.

    The target distribution puts 1 - label_smoothing + label_smoothing / V on
    the reference token and label_smoothing / V on every other (Keras'
    convention; eps_ls = 0.1 in the paper). Positions whose reference id is 0
    (padding) contribute nothing. With l the per-token loss, m the real-token
    mask and w the sample weight (1 by default; per sentence `[batch]` or per
    token `[batch, length]`), the reductions are:

    - `"sum_over_batch_size"` (default), `"mean"`, `"mean_with_sample_weight"`:
      sum(w l m) / sum(w m), the (weighted) mean over real tokens. Per
      replica under tf.distribute, divided by the replicas as Keras does
      with its own means, so that the summed gradients average them.
    - `"sum"`: sum(w l m).
    - `None` / `"none"`: w l m, `[batch, length]`.

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

    def __call__(self, y_true, y_pred, sample_weight=None):
        # Keras' own reduction counts every position, padding too, in a mean
        # and in its sample-weight divisor; the mean over real tokens needs
        # both its sum and its count here.
        with tf.name_scope(self.name):
            y_true = tf.cast(y_true, tf.int32)
            weights = tf.cast(tf.not_equal(y_true, PAD_ID), tf.float32)
            losses = self.call(y_true, y_pred)
            if sample_weight is not None:
                sample_weight = _token_weights(sample_weight, weights)
                weights, losses = weights * sample_weight, losses * sample_weight
            if self.reduction in (None, "none"):
                return losses
            total = tf.reduce_sum(losses)
            if self.reduction == "sum":
                return total
            replicas = tf.distribute.get_strategy().num_replicas_in_sync
            return tf.math.divide_no_nan(total, tf.reduce_sum(weights)) * (1.0 / replicas)

    def call(self, y_true, y_pred):
        """The loss of each token `[batch, length]`, 0 at padding."""
        y_true = tf.cast(y_true, tf.int32)
        per_token = smoothed_cross_entropy(tf.cast(y_pred, tf.float32), y_true, self.label_smoothing)
        return tf.where(tf.not_equal(y_true, PAD_ID), per_token, 0.0)

    def get_config(self):
        return {**super().get_config(), "label_smoothing": self.label_smoothing}


@keras.saving.register_keras_serializable(package="keras_transformer")
class MaskedAccuracy(keras.metrics.Metric):
    """Token accuracy over real (non-pad) positions, accumulated over batches.

    A token is right when its reference has the strictly largest logit: a tie
    is a miss, so constant logits score 0, not 1. With `sample_weight` (per
    sentence `[batch]` or per token `[batch, length]`) the result is the
    weighted hits over the weighted real tokens.

    Shapes: y_true `[batch, length]` ids, y_pred `[batch, length, vocab]` logits.
    """

    def __init__(self, name="masked_accuracy", **kwargs):
        super().__init__(name=name, **kwargs)
        self.correct = self.add_variable(shape=(), initializer="zeros", name="correct")
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_true = tf.cast(y_true, tf.int32)
        weights = tf.cast(tf.not_equal(y_true, PAD_ID), self.dtype)
        if sample_weight is not None:
            weights *= tf.cast(_token_weights(sample_weight, weights), self.dtype)
        # The reference is the only logit at least as large as itself: a gather and
        # a count, cheaper than an argmax over [batch, length, vocab], and no tie wins.
        y_pred = tf.convert_to_tensor(y_pred)
        reference = tf.gather(y_pred, y_true, axis=-1, batch_dims=2)
        hits = tf.math.count_nonzero(y_pred >= reference[..., None], axis=-1) == 1
        self.correct.assign_add(tf.reduce_sum(tf.where(hits, weights, 0.0)))
        self.total.assign_add(tf.reduce_sum(weights))

    def result(self):
        return tf.math.divide_no_nan(self.correct, self.total)
