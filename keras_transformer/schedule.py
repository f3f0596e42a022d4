"""The learning-rate schedule of paper section 5.3, equation 3."""

import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="keras_transformer")
class TransformerSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5).

    Linear warm-up for `warmup_steps`, then decay with the inverse square root
    of the step. `step` is the optimizer's iteration count, as Keras passes
    it; at step 0 the rate is 0.

    Example:

    ```python
    optimizer = keras.optimizers.Adam(TransformerSchedule(512), beta_1=0.9, beta_2=0.98, epsilon=1e-9)
    ```
    """

    def __init__(self, d_model, warmup_steps=4000):
        self.d_model = d_model
        self.warmup_steps = warmup_steps

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        decay = tf.math.rsqrt(tf.maximum(step, 1.0))
        warmup = step * float(self.warmup_steps) ** -1.5
        return float(self.d_model) ** -0.5 * tf.minimum(decay, warmup)

    def get_config(self):
        return {"d_model": self.d_model, "warmup_steps": self.warmup_steps}


def paper_adam(d_model, warmup_steps=4000, **kwargs):
    """Adam with the paper's settings (section 5.3): beta_1 0.9, beta_2 0.98,
    epsilon 1e-9, and `TransformerSchedule(d_model, warmup_steps)`.

    Other keyword arguments go to `keras.optimizers.Adam`, e.g.
    `gradient_accumulation_steps=4` or `clipnorm=1.0`.
    """
    return keras.optimizers.Adam(
        learning_rate=TransformerSchedule(d_model, warmup_steps),
        beta_1=0.9,
        beta_2=0.98,
        epsilon=1e-9,
        **kwargs,
    )
