"""The encoder: a stack of N identical layers (paper section 3.1)."""

import keras
import tensorflow as tf

from keras_transformer.attention import MultiHeadAttention, head_size
from keras_transformer.feed_forward import FeedForward
from keras_transformer.residual import residual

LAYER_NORM_EPSILON = 1e-6


def keras_mask(x):
    """The Keras padding mask attached to `x` by an upstream layer, if any."""
    return getattr(x, "_keras_mask", None)


@keras.saving.register_keras_serializable(package="keras_transformer")
class EncoderLayer(keras.layers.Layer):
    """Self-attention then feed-forward, each in a residual block.

    Args:
        d_model: model width.
        num_heads: attention heads h; d_model must be divisible by it.
        d_ff: feed-forward inner width.
        dropout: residual dropout rate (P_drop).
        norm_first: pre-norm instead of the paper's post-norm.

    Shapes:
        call(x `[batch, source_len, d_model]`, padding_mask `[batch, source_len]`
        bool, True at real tokens) -> `[batch, source_len, d_model]`.
        Without `padding_mask` the Keras mask of `x` is used (for example the
        one `PositionalEmbedding` attaches); without either, nothing is masked.

    Example:

    ```python
    ids = keras.Input(shape=(None,), dtype="int32")
    x = PositionalEmbedding(8000, 512)(ids)
    x = EncoderLayer(d_model=512, num_heads=8, d_ff=2048)(x)
    ```
    """

    def __init__(self, d_model, num_heads, d_ff, dropout=0.1, norm_first=False, **kwargs):
        super().__init__(**kwargs)
        self.d_model = d_model
        self.num_heads = num_heads
        self.d_ff = d_ff
        self.dropout = dropout
        self.norm_first = norm_first
        self.self_attention = MultiHeadAttention(
            num_heads, head_size(d_model, num_heads), dtype=self.dtype_policy, name="self_attention"
        )
        self.self_attention_norm = keras.layers.LayerNormalization(
            epsilon=LAYER_NORM_EPSILON, dtype=self.dtype_policy, name="self_attention_norm"
        )
        self.feed_forward = FeedForward(d_model, d_ff, dtype=self.dtype_policy, name="feed_forward")
        self.feed_forward_norm = keras.layers.LayerNormalization(
            epsilon=LAYER_NORM_EPSILON, dtype=self.dtype_policy, name="feed_forward_norm"
        )
        self.dropout_layer = keras.layers.Dropout(dropout, dtype=self.dtype_policy)
        self.supports_masking = True

    def build(self, input_shape):
        self.self_attention.build(input_shape, input_shape)
        self.self_attention_norm.build(input_shape)
        self.feed_forward.build(input_shape)
        self.feed_forward_norm.build(input_shape)
        self.built = True

    def call(self, x, padding_mask=None, training=None):
        if padding_mask is None:
            padding_mask = keras_mask(x)
        attention_mask = None if padding_mask is None else padding_mask[:, None, :]

        def self_attention(h):
            return self.self_attention(h, h, attention_mask=attention_mask, training=training)

        x = residual(x, self_attention, self.self_attention_norm, self.dropout_layer, self.norm_first, training)
        return residual(x, self.feed_forward, self.feed_forward_norm, self.dropout_layer, self.norm_first, training)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {
            **super().get_config(),
            "d_model": self.d_model,
            "num_heads": self.num_heads,
            "d_ff": self.d_ff,
            "dropout": self.dropout,
            "norm_first": self.norm_first,
        }


@keras.saving.register_keras_serializable(package="keras_transformer")
class Encoder(keras.layers.Layer):
    """N `EncoderLayer`s (plus a final LayerNorm when `norm_first`).

    Takes embedded tokens, not ids: `PositionalEmbedding` comes before it.

    Args:
        num_layers: N (6 in the paper).
        d_model, num_heads, d_ff, dropout, norm_first: as in `EncoderLayer`.

    Shapes:
        call(x `[batch, source_len, d_model]`, padding_mask `[batch, source_len]`)
        -> `[batch, source_len, d_model]`.

    Example:

    ```python
    x = PositionalEmbedding(8000, 512)(source_ids)
    memory = Encoder(6, 512, 8, 2048)(x, padding_mask=source_ids != 0)
    ```
    """

    def __init__(self, num_layers, d_model, num_heads, d_ff, dropout=0.1, norm_first=False, **kwargs):
        super().__init__(**kwargs)
        self.num_layers = num_layers
        self.d_model = d_model
        self.num_heads = num_heads
        self.d_ff = d_ff
        self.dropout = dropout
        self.norm_first = norm_first
        self.encoder_layers = [
            EncoderLayer(d_model, num_heads, d_ff, dropout, norm_first, dtype=self.dtype_policy, name=f"layer_{i}")
            for i in range(num_layers)
        ]
        self.final_norm = (
            keras.layers.LayerNormalization(epsilon=LAYER_NORM_EPSILON, dtype=self.dtype_policy, name="final_norm")
            if norm_first
            else None
        )
        self.supports_masking = True

    def build(self, input_shape):
        for layer in self.encoder_layers:
            layer.build(input_shape)
        if self.final_norm is not None:
            self.final_norm.build(input_shape)
        self.built = True

    def call(self, x, padding_mask=None, training=None):
        if padding_mask is None:
            padding_mask = keras_mask(x)
        for layer in self.encoder_layers:
            x = layer(x, padding_mask=padding_mask, training=training)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {
            **super().get_config(),
            "num_layers": self.num_layers,
            "d_model": self.d_model,
            "num_heads": self.num_heads,
            "d_ff": self.d_ff,
            "dropout": self.dropout,
            "norm_first": self.norm_first,
        }
