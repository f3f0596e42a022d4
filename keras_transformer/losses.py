"""The training losses and metric, padding ignored: label smoothing (paper section 5.4), and R-Drop on top of it."""

import keras
import numpy as np
from keras import ops

from keras_transformer.masking import PAD_ID
from keras_transformer.renamed import renamed_arguments


def smoothed_cross_entropy(logits, labels, label_smoothing, kl_weight=0.0):
    """Label-smoothed cross-entropy per position, from float32 logits; with `kl_weight`, R-Drop's KL term too.

    With z the logits, V the vocabulary and eps the smoothing:
    (1 - eps) * (-log p_y) + eps * mean_v(-log p_v) = lse(z) - (1 - eps) z_y - eps mean(z),
    with gradient softmax(z) - (1 - eps) onehot(y) - eps / V. Written out (a
    custom gradient), it never materializes log_softmax over the vocabulary, and
    the backward pass is one multiply plus a scatter of one value per position.

    With `kl_weight` > 0, rows 2i and 2i + 1 are two predictions of the same
    sentence, and each row's value adds `kl_weight` times the pair's symmetric
    KL(P || Q) + KL(Q || P). For the logits z of one row and w of its partner,
    p and q their softmaxes and d = z - w, that is sum_v (p_v - q_v) d_v (log p
    - log q is d minus a constant per position, which sum_v (p_v - q_v) = 0
    cancels), with gradient (p - q) + p (d - <p, d>) for z, and the same with
    the roles swapped for w. The softmax of each row is taken once for both
    terms; d and p - q are kept once per pair (the partner's are their
    negatives), and the backward pass needs nothing that automatic
    differentiation would save.

    Shapes: logits `[batch, length, vocab]`, labels `[batch, length]` -> `[batch, length]`
    (with `kl_weight`, an even batch).
    """
    vocab_size = ops.cast(ops.shape(logits)[-1], logits.dtype)

    @ops.custom_gradient
    def loss(z):
        probs = ops.softmax(z, axis=-1)
        # lse(z) = z_j - log p_j for any j; at the argmax p_j >= 1/V, so the log cannot underflow.
        lse = ops.max(z, axis=-1) - ops.log(ops.max(probs, axis=-1))
        z_y = ops.take_along_axis(z, labels[..., None], axis=-1)[..., 0]
        value = lse - (1.0 - label_smoothing) * z_y - label_smoothing * ops.mean(z, axis=-1)
        if kl_weight:
            # Per pair, [pairs, 1, length, vocab]: the first row's d = z - w and p - q; the second row's are
            # their negatives, so half-size arrays that broadcast over both rows of a pair carry both.
            z_pairs, prob_pairs = _pairs(z), _pairs(probs)
            gap = z_pairs[:, :1] - z_pairs[:, 1:]
            prob_gap = prob_pairs[:, :1] - prob_pairs[:, 1:]
            kl = ops.sum(prob_gap * gap, axis=-1)  # [pairs, 1, length], the same for both rows
            value = ops.reshape(_pairs(value) + kl_weight * kl, ops.shape(value))

        def grad(*args, upstream=None):  # PyTorch passes `upstream` by name, TensorFlow and JAX positionally
            upstream = args[-1] if upstream is None else upstream
            g = probs * upstream[..., None] - (upstream * (label_smoothing / vocab_size))[..., None]
            if kl_weight:
                # Both rows of a pair carry the KL, so each row's share of it gets both rows' upstream; the
                # second row's gradient is the first's formula with d and p - q negated, hence the sign.
                kl_upstream = kl_weight * ops.sum(_pairs(upstream), axis=1, keepdims=True)[..., None]
                centred = gap - ops.sum(prob_pairs * gap, axis=-1, keepdims=True)
                kl_grad = (prob_gap + prob_pairs * centred) * ops.multiply(kl_upstream, _PAIR_SIGN)
                g = g + ops.reshape(kl_grad, ops.shape(g))
            # -(1 - eps) upstream at each label: one value per position, not a pass over a one-hot.
            at_label = ops.take_along_axis(g, labels[..., None], axis=-1)[..., 0] - (1.0 - label_smoothing) * upstream
            return ops.scatter_update(g, _label_indices(labels), ops.reshape(at_label, (-1,)))

        return value, grad

    return loss(logits)


# +1 for the first row of an R-Drop pair, -1 for the second: `[1, 2, 1, 1]` against `[pairs, 2, length, vocab]`.
_PAIR_SIGN = np.array([1.0, -1.0], "float32").reshape(1, 2, 1, 1)


def _pairs(x):
    """`x` `[2 * pairs, ...]` as `[pairs, 2, ...]`: rows 2i and 2i + 1 side by side."""
    return ops.reshape(x, (-1, 2, *ops.shape(x)[1:]))


def _label_indices(labels):
    """`[batch * length, 3]` int32: (sentence, position, label) of every position of `labels` `[batch, length]`."""
    batch, length = ops.shape(labels)[0], ops.shape(labels)[1]
    sentence = ops.broadcast_to(ops.arange(batch, dtype="int32")[:, None], (batch, length))
    position = ops.broadcast_to(ops.arange(length, dtype="int32")[None, :], (batch, length))
    return ops.reshape(ops.stack([sentence, position, ops.cast(labels, "int32")], axis=-1), (-1, 3))


def _token_weights(sample_weight, mask):
    """`sample_weight` (a scalar, one per sentence `[batch]` or one per token
    `[batch, length]`) as float32 `[batch, length]`, shaped like `mask`."""
    weight = ops.cast(sample_weight, "float32")
    if len(weight.shape) == 1:
        weight = weight[:, None]
    return ops.broadcast_to(weight, ops.shape(mask))


def _mean_over_replicas(total, count):
    """`total / count` as each replica's share of the mean over every replica's tokens.

    Keras sums the replicas' gradients under tf.distribute (TensorFlow), so each replica returns its own sum
    divided by the count of all replicas (all-reduced): the shares add up to the mean over every real token
    of the global batch, whatever each replica holds. Outside a replica's step (a symbolic build) with N
    replicas, the replica's own mean divided by N. On JAX and PyTorch (TensorFlow not imported): `total / count`.
    """
    if keras.backend.backend() != "tensorflow":
        return ops.divide_no_nan(total, count)
    import tensorflow as tf

    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    if replicas == 1:
        return ops.divide_no_nan(total, count)
    if tf.distribute.in_cross_replica_context():
        return ops.divide_no_nan(total, count) * (1.0 / replicas)
    count = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, tf.stop_gradient(count))
    return ops.divide_no_nan(total, count)


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
      sum(w l m) / sum(w m), the (weighted) mean over real tokens. Under
      tf.distribute, each replica's sum over the count of every replica's
      tokens (all-reduced), so that Keras' summed gradients are those of
      the mean over all the global batch's real tokens.
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
        with keras.name_scope(self.name):
            losses, weights = self._weighted(y_true, y_pred, sample_weight)
            if self.reduction in (None, "none"):
                return losses
            total = ops.sum(losses)
            if self.reduction == "sum":
                return total
            return _mean_over_replicas(total, ops.sum(weights))

    def token_sum_and_count(self, y_true, y_pred, sample_weight=None):
        """(sum(w l m), sum(w m)): the summed loss of the real tokens and their (weighted) count, float32
        scalars, whatever the reduction. A training step that normalises over more than one batch or
        replica divides the sums of the first by the sum of the second (`keras_transformer.distributed.UpdateStep`)."""
        with keras.name_scope(self.name):
            losses, weights = self._weighted(y_true, y_pred, sample_weight)
            return ops.sum(losses), ops.sum(weights)

    def _weighted(self, y_true, y_pred, sample_weight):
        """The per-token losses w l m and weights w m, `[batch, length]` float32."""
        y_true = ops.cast(y_true, "int32")
        weights = ops.cast(ops.not_equal(y_true, PAD_ID), "float32")
        losses = self.call(y_true, y_pred)
        if sample_weight is not None:
            sample_weight = _token_weights(sample_weight, weights)
            weights, losses = weights * sample_weight, losses * sample_weight
        return losses, weights

    def call(self, y_true, y_pred):
        """The loss of each token `[batch, length]`, 0 at padding."""
        y_true = ops.cast(y_true, "int32")
        per_token = smoothed_cross_entropy(ops.cast(y_pred, "float32"), y_true, self.label_smoothing)
        return ops.where(ops.not_equal(y_true, PAD_ID), per_token, 0.0)

    def get_config(self):
        return {**super().get_config(), "label_smoothing": self.label_smoothing}


@keras.saving.register_keras_serializable(package="keras_transformer")
class MaskedRDropCrossentropy(MaskedSparseCategoricalCrossentropy):
    """R-Drop (Liang et al., 2021, "R-Drop: Regularized Dropout for Neural Networks"): the label-smoothed
    cross-entropy of two dropout passes over the same sentences, plus `kl_weight` times the mean of their
    two KL divergences.

    The batch holds every sentence twice in a row: rows 2i and 2i + 1 are the same pair (inputs and
    labels), so that in training mode dropout gives two different predictions P and Q of it. For each real
    token of such a pair the paper's loss is CE(P) + CE(Q) + alpha / 2 (KL(P || Q) + KL(Q || P)), alpha
    being the paper's name of `kl_weight`; each row here carries its own CE plus kl_weight / 4 of the
    pair's symmetric KL, and the reductions are those of
    `MaskedSparseCategoricalCrossentropy` over all rows, so the default is the paper's loss averaged over
    the 2N real tokens of the batch (fairseq's `label_smoothed_cross_entropy_with_rdrop` divides the same
    sum by N). Without dropout (inference, `model.evaluate`) the two rows agree, the KL is 0 and the loss
    is `MaskedSparseCategoricalCrossentropy`'s.

    `training.pipeline.make_batches(..., copies=2)` makes such batches (`kt-train --r-drop WEIGHT`); with
    arrays of your own, `np.repeat(x, 2, axis=0)` for inputs and labels alike.

    Args:
        kl_weight: the KL's weight, the paper's alpha (5 for its translation tasks); 0 gives the plain
            loss. `alpha=` is its old name, still accepted (with a `DeprecationWarning`; a saved
            configuration with "alpha" loads without one).
        label_smoothing: as in `MaskedSparseCategoricalCrossentropy`.

    Shapes:
        y_true `[2 * pairs, length]` int ids, y_pred `[2 * pairs, length, vocab]` logits -> scalar.

    Example:

    ```python
    model.compile(optimizer=paper_adam(512), loss=MaskedRDropCrossentropy(kl_weight=5.0))
    model.fit((np.repeat(source, 2, 0), np.repeat(target_in, 2, 0)), np.repeat(target_out, 2, 0))
    ```
    """

    @renamed_arguments(alpha="kl_weight")
    def __init__(self, kl_weight=5.0, label_smoothing=0.1, name="masked_r_drop_crossentropy", **kwargs):
        if not kl_weight >= 0:
            raise ValueError(f"kl_weight must be 0 or more, got {kl_weight!r}")
        super().__init__(label_smoothing=label_smoothing, name=name, **kwargs)
        self.kl_weight = kl_weight

    def call(self, y_true, y_pred):
        """The loss of each token `[2 * pairs, length]`, 0 at padding."""
        y_true = ops.cast(y_true, "int32")
        logits = ops.cast(y_pred, "float32")
        rows = logits.shape[0]
        if rows is not None and rows % 2:
            raise ValueError(
                f"MaskedRDropCrossentropy needs each sentence twice in a row (rows 2i and 2i + 1), so an even "
                f"number of rows; got {rows}. Repeat the batch: np.repeat(x, 2, axis=0), or "
                f"make_batches(..., copies=2)."
            )
        per_token = smoothed_cross_entropy(logits, y_true, self.label_smoothing, kl_weight=self.kl_weight / 4.0)
        return ops.where(ops.not_equal(y_true, PAD_ID), per_token, 0.0)

    def get_config(self):
        return {**super().get_config(), "kl_weight": self.kl_weight}

    @classmethod
    def from_config(cls, config):
        # A loss saved before the rename (a .keras file compiled with it) records its weight as "alpha".
        config = dict(config)
        if "alpha" in config and "kl_weight" not in config:
            config["kl_weight"] = config.pop("alpha")
        return cls(**config)


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
        y_true = ops.cast(y_true, "int32")
        weights = ops.cast(ops.not_equal(y_true, PAD_ID), self.dtype)
        if sample_weight is not None:
            weights *= ops.cast(_token_weights(sample_weight, weights), self.dtype)
        # The reference is the only logit at least as large as itself: a gather and
        # a count, cheaper than an argmax over [batch, length, vocab], and no tie wins.
        # (A sum, not count_nonzero, whose result comes back transposed on PyTorch.)
        y_pred = ops.convert_to_tensor(y_pred)
        reference = ops.take_along_axis(y_pred, y_true[..., None], axis=-1)
        hits = ops.sum(ops.cast(y_pred >= reference, "int32"), axis=-1) == 1
        self.correct.assign_add(ops.sum(ops.where(hits, weights, 0.0)))
        self.total.assign_add(ops.sum(weights))

    def result(self):
        return ops.divide_no_nan(self.correct, self.total)
