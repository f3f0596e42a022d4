"""Position-wise feed-forward network (paper section 3.3, equation 2)."""

import keras
from keras import ops

from keras_transformer.linear import batch_and_length, is_plain, matmul_2d


@keras.saving.register_keras_serializable(package="keras_transformer")
class FeedForward(keras.layers.Layer):
    """FFN(x) = max(0, x W_1 + b_1) W_2 + b_2, applied to each position alike (paper equation 2); another
    `activation` in place of max(0, .) gives f(x W_1 + b_1) W_2 + b_2.

    Args:
        d_model: input and output width.
        d_ff: inner width (2048 in the base model).
        dropout: dropout on the inner activations f(x W_1 + b_1) in
            training (fairseq's "activation dropout"; not in the paper, 0 by
            default).
        activation: f, the name of a Keras activation: "relu" (default, the
            paper's max(0, .)), "silu" or its other name "swish" (Marian's
            and OPUS-MT's: x * sigmoid(x)), "gelu", ... Saved by name.

    Shapes:
        `[batch, length, d_model]` -> `[batch, length, d_model]`.

    Example:

    ```python
    ffn = FeedForward(d_model=512, d_ff=2048)
    y = ffn(x)
    ```
    """

    def __init__(self, d_model, d_ff, dropout=0.0, activation="relu", **kwargs):
        super().__init__(**kwargs)
        self.d_model = d_model
        self.d_ff = d_ff
        self.dropout = dropout
        self.activation = activation
        self.activation_fn = activation_function(activation, type(self).__name__)
        self.dropout_layer = keras.layers.Dropout(dropout, dtype=self.dtype_policy) if dropout > 0.0 else None
        self.inner = keras.layers.Dense(d_ff, activation=activation, dtype=self.dtype_policy, name="inner")
        self.outer = keras.layers.Dense(d_model, dtype=self.dtype_policy, name="outer")
        self.supports_masking = True

    def build(self, input_shape):
        self.inner.build(input_shape)
        self.outer.build((*input_shape[:-1], self.d_ff))
        self.built = True

    def call(self, x, training=None):
        if not (is_plain(self.inner) and is_plain(self.outer)):
            return self.outer(self._dropped(self.inner(x), training))
        # Two 2-D matmuls on [batch * length, d_model]: one weight gradient each, where Keras' Dense on a
        # 3-D input (a tensordot) computes it per sentence and sums it.
        y = self._dropped(self.activation_fn(matmul_2d(ops.reshape(x, (-1, self.d_model)), self.inner)), training)
        return ops.reshape(matmul_2d(y, self.outer), batch_and_length(x) + (self.d_model,))

    def _dropped(self, y, training):
        return y if self.dropout_layer is None else self.dropout_layer(y, training=training)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "d_model": self.d_model, "d_ff": self.d_ff, "dropout": self.dropout,
                "activation": self.activation}


def activation_function(name, owner):
    """The Keras activation called `name` (a string, so that a saved configuration holds it), or a ValueError
    naming `owner` and the value."""
    if isinstance(name, str):
        try:
            return keras.activations.get(name)
        except ValueError:
            pass
    raise ValueError(f"{owner}: activation must be the name of a Keras activation (\"relu\", \"silu\" or "
                     f"\"swish\", \"gelu\", ...), got {name!r}.")
