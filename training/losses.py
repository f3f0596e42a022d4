"""The training loss, made correct under tf.distribute.

Keras 3 divides a loss by the number of replicas (gradients are then summed
across replicas) inside `Loss.__call__`'s reduction, but skips that step when
`call()` already returns a scalar. `kt.MaskedSparseCategoricalCrossentropy`
returns its masked mean as a scalar, so under a MirroredStrategy with N
replicas the gradient came out N times too large and fit() reported N times
the loss. `ReplicaScaledMaskedLoss` applies the 1/N itself.
"""

import keras
import tensorflow as tf

import keras_transformer as kt


@keras.saving.register_keras_serializable(package="kt_training")
class ReplicaScaledMaskedLoss(kt.MaskedSparseCategoricalCrossentropy):
    """`kt.MaskedSparseCategoricalCrossentropy` divided by the replicas in sync
    (1 outside tf.distribute): per-replica means that sum to the global mean
    when replicas hold equal numbers of real tokens."""

    def call(self, y_true, y_pred):
        loss = super().call(y_true, y_pred)
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        if replicas > 1:
            loss = loss / tf.cast(replicas, loss.dtype)
        return loss
