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


def attention_spec(layer, query, key):
    """Symbolic attention weights `[batch, num_heads, query_len, key_len]` (functional API, `keras.Input`)."""
    return keras.KerasTensor((query.shape[0], layer.num_heads, query.shape[1], key.shape[1]), dtype=layer.compute_dtype)


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

        With `return_attention_scores=True` the call returns `(output, scores)`,
        as `keras.layers.MultiHeadAttention` does: `scores` are the
        self-attention weights `[batch, num_heads, source_len, source_len]`
        (query by key; a real token's row sums to 1, 0 on padding keys). It
        works in the functional API too (a second symbolic output).

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

    def call(self, x, padding_mask=None, training=None, return_attention_scores=False):
        if padding_mask is None:
            padding_mask = keras_mask(x)
        attention_mask = None if padding_mask is None else padding_mask[:, None, :]
        # The residual block takes a tensor -> tensor sub-layer, so the weights leave by this list.
        scores = []

        def self_attention(h):
            out = self.self_attention(
                h, h, attention_mask=attention_mask, return_attention_scores=return_attention_scores, training=training
            )
            if return_attention_scores:
                out, weights = out
                scores.append(weights)
            return out

        x = residual(x, self_attention, self.self_attention_norm, self.dropout_layer, self.norm_first, training)
        x = residual(x, self.feed_forward, self.feed_forward_norm, self.dropout_layer, self.norm_first, training)
        if return_attention_scores:
            return x, scores[0]
        return x

    def compute_output_shape(self, input_shape):
        return input_shape

    def compute_output_spec(self, x, *args, return_attention_scores=False, **kwargs):
        # compute_output_shape knows one output; the weights are a second one.
        output = super().compute_output_spec(x, *args, **kwargs)
        return (output, attention_spec(self, x, x)) if return_attention_scores else output

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
        -> `[batch, source_len, d_model]`; with `return_attention_scores=True`,
        `(output, scores)` where `scores` holds one
        `[batch, num_heads, source_len, source_len]` tensor per layer, first
        layer first.

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

    def call(self, x, padding_mask=None, training=None, return_attention_scores=False):
        if padding_mask is None:
            padding_mask = keras_mask(x)
        scores = []
        for layer in self.encoder_layers:
            x = layer(x, padding_mask=padding_mask, training=training, return_attention_scores=return_attention_scores)
            if return_attention_scores:
                x, weights = x
                scores.append(weights)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if return_attention_scores:
            return x, scores
        return x

    def compute_output_shape(self, input_shape):
        return input_shape

    def compute_output_spec(self, x, *args, return_attention_scores=False, **kwargs):
        output = super().compute_output_spec(x, *args, **kwargs)
        if not return_attention_scores:
            return output
        return output, [attention_spec(self, x, x) for _ in self.encoder_layers]

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
