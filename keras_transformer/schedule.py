"""The learning-rate schedule of paper section 5.3, equation 3."""

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="keras_transformer")
class TransformerSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5).

    Linear warm-up for `warmup_steps`, then decay with the inverse square root
    of the step. `step` is the optimizer's iteration count, as Keras passes
    it; at step 0 the rate is 0. The paper's schedule has `scale` 1; another
    scale multiplies the whole curve, as OpenNMT-tf's `NoamDecay` does (its
    peak, at `warmup_steps`, is `scale * (d_model * warmup_steps)^-0.5`).

    Example:

    ```python
    optimizer = keras.optimizers.Adam(TransformerSchedule(512), beta_1=0.9, beta_2=0.98, epsilon=1e-9)
    ```
    """

    def __init__(self, d_model, warmup_steps=4000, scale=1.0):
        if scale <= 0:
            raise ValueError(f"TransformerSchedule: scale must be positive, got {scale!r}.")
        self.d_model = d_model
        self.warmup_steps = warmup_steps
        self.scale = scale

    def __call__(self, step):
        step = ops.cast(step, "float32")
        decay = ops.rsqrt(ops.maximum(step, 1.0))
        warmup = step * float(self.warmup_steps) ** -1.5
        return float(self.scale) * float(self.d_model) ** -0.5 * ops.minimum(decay, warmup)

    def get_config(self):
        return {"d_model": self.d_model, "warmup_steps": self.warmup_steps, "scale": self.scale}


@keras.saving.register_keras_serializable(package="keras_transformer")
class PaperAdam(keras.optimizers.Adam):
    """`keras.optimizers.Adam`, under a name of its own, which `paper_adam` returns.

    Why a class: on the PyTorch backend Keras builds its fused `Adam` instead,
    and a compiled `.keras` file saved there names that class, which no other
    backend can load. This one saves and loads the same on every backend (on
    PyTorch it runs Keras' own Adam step, not the fused one).
    """


def paper_adam(d_model, warmup_steps=4000, scale=1.0, *, epsilon=1e-9, **kwargs):
    """Adam with the paper's settings (section 5.3): beta_1 0.9, beta_2 0.98,
    epsilon 1e-9, and `TransformerSchedule(d_model, warmup_steps, scale)`.

    `epsilon` may be changed (fairseq's Adam uses 1e-8). Other keyword
    arguments go to `keras.optimizers.Adam`, e.g.
    `gradient_accumulation_steps=4` or `global_clipnorm=25.0`. Returns a `PaperAdam`.
    """
    return PaperAdam(
        learning_rate=TransformerSchedule(d_model, warmup_steps, scale),
        beta_1=0.9,
        beta_2=0.98,
        epsilon=epsilon,
        **kwargs,
    )
