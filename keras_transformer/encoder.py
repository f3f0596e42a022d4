"""The encoder: a stack of N identical layers (paper section 3.1)."""

import keras

from keras_transformer.attention import attention_spec
from keras_transformer.feed_forward import FeedForward
from keras_transformer.layer_base import TransformerLayerBase, TransformerStackBase
from keras_transformer.masking import first_mask
from keras_transformer.residual import add_and_norm_after, norm_before


@keras.saving.register_keras_serializable(package="keras_transformer")
class EncoderLayer(TransformerLayerBase):
    """Self-attention then feed-forward, each in a residual block.

    Args:
        d_model: model width.
        num_heads: attention heads h; d_model must be divisible by it.
        d_ff: feed-forward inner width.
        dropout: residual dropout rate (P_drop).
        norm_first: pre-norm instead of the paper's post-norm.
        attention_dropout: dropout on the attention weights in training
            (keyword only; not in the paper, 0 by default).
        activation_dropout: dropout on the feed-forward's inner activations
            in training (keyword only; not in the paper, 0 by default).
        key_dim: d_k, the attention's query and key size per head (keyword
            only). None (default): d_model // num_heads, the paper's. The
            value size per head, d_v, stays d_model // num_heads (paper
            table 3, rows B: d_k apart from d_v). W^Q and W^K are then
            `[d_model, num_heads, key_dim]`, W^V `[d_model, num_heads,
            d_model // num_heads]`, and the scores are scaled by
            1 / sqrt(key_dim).
        activation: the feed-forward network's activation, the name of a
            Keras activation (keyword only): "relu" (default, the paper's),
            "silu"/"swish" (Marian's), "gelu", ... (`FeedForward`).
        layer_norm_epsilon: every LayerNorm's epsilon (keyword only; 1e-6 by
            default, `residual.LAYER_NORM_EPSILON`; Marian's is 1e-5).

    Shapes:
        call(x `[batch, source_len, d_model]`, padding_mask `[batch, source_len]`
        bool, True at real tokens) -> `[batch, source_len, d_model]`.
        Without `padding_mask` the Keras mask of `x` is used (for example the
        one `PositionalEmbedding` attaches; Keras passes it as `mask`); without
        either, nothing is masked.

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
        super().__init__(d_model, num_heads, d_ff, dropout, norm_first, **kwargs)
        self.self_attention = self._attention("self_attention")
        self.self_attention_norm = self._norm("self_attention_norm")
        self.feed_forward = FeedForward(
            d_model, d_ff, dropout=self.activation_dropout, activation=self.activation, dtype=self.dtype_policy,
            name="feed_forward"
        )
        self.feed_forward_norm = self._norm("feed_forward_norm")
        self.dropout_layer = keras.layers.Dropout(dropout, dtype=self.dtype_policy)

    def build(self, input_shape):
        self.self_attention.build(input_shape, input_shape)
        self.self_attention_norm.build(input_shape)
        self.feed_forward.build(input_shape)
        self.feed_forward_norm.build(input_shape)
        self.built = True

    def call(self, x, padding_mask=None, training=None, return_attention_scores=False, mask=None):
        padding_mask = first_mask(padding_mask, mask)
        attention_mask = None if padding_mask is None else padding_mask[:, None, :]

        residual = x
        x = norm_before(x, self.self_attention_norm, self.norm_first)
        x = self.self_attention(
            x, x, attention_mask=attention_mask, return_attention_scores=return_attention_scores, training=training
        )
        x, scores = x if return_attention_scores else (x, None)
        x = add_and_norm_after(residual, x, self.self_attention_norm, self.dropout_layer, self.norm_first, training)

        residual = x
        x = norm_before(x, self.feed_forward_norm, self.norm_first)
        x = self.feed_forward(x, training=training)
        x = add_and_norm_after(residual, x, self.feed_forward_norm, self.dropout_layer, self.norm_first, training)
        return (x, scores) if return_attention_scores else x

    def compute_output_spec(self, x, *args, return_attention_scores=False, **kwargs):
        # compute_output_shape knows one output; the weights are a second one.
        output = super().compute_output_spec(x, *args, **kwargs)
        return (output, attention_spec(self, x, x)) if return_attention_scores else output


@keras.saving.register_keras_serializable(package="keras_transformer")
class Encoder(TransformerStackBase):
    """N `EncoderLayer`s (plus a final LayerNorm when `norm_first`).

    Takes embedded tokens, not ids: `PositionalEmbedding` comes before it.

    Args:
        num_layers: N (6 in the paper).
        d_model, num_heads, d_ff, dropout, norm_first, attention_dropout,
            activation_dropout, key_dim, activation, layer_norm_epsilon: as in
            `EncoderLayer`.

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
        super().__init__(num_layers, d_model, num_heads, d_ff, dropout, norm_first, **kwargs)
        self.encoder_layers = self._identical_layers(EncoderLayer)
        self.final_norm = self._final_norm()

    def build(self, input_shape):
        self._build_stack(self.encoder_layers, input_shape)

    def call(self, x, padding_mask=None, training=None, return_attention_scores=False, mask=None):
        padding_mask = first_mask(padding_mask, mask)
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

    def compute_output_spec(self, x, *args, return_attention_scores=False, **kwargs):
        output = super().compute_output_spec(x, *args, **kwargs)
        if not return_attention_scores:
            return output
        return output, [attention_spec(self, x, x) for _ in self.encoder_layers]
