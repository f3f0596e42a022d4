"""The training loss.

`kt.MaskedSparseCategoricalCrossentropy` now lets Keras' own reduction divide
the loss by the replicas in sync under tf.distribute (it used to return a
scalar, which skipped that step; the core library fixed it). This name stays
as a plain alias so that models saved with it still load; new code should use
`kt.MaskedSparseCategoricalCrossentropy` directly.
"""

import keras

import keras_transformer as kt


@keras.saving.register_keras_serializable(package="kt_training")
class ReplicaScaledMaskedLoss(kt.MaskedSparseCategoricalCrossentropy):
    """Alias of `kt.MaskedSparseCategoricalCrossentropy` (no extra scaling)."""
