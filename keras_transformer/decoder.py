"""The decoder: a stack of N identical layers (paper section 3.1), or, without cross-attention, a GPT-style one."""

import keras
from keras import ops

from keras_transformer.attention import attention_spec
from keras_transformer.feed_forward import FeedForward
from keras_transformer.layer_base import TransformerLayerBase, TransformerStackBase
from keras_transformer.masking import causal_mask, first_mask
from keras_transformer.residual import add_and_norm_after, norm_before


def _check_encoder_inputs(layer, encoder_output, encoder_padding_mask=None, cross_attention_cache=None):
    """A clear error when the encoder inputs of a call do not suit `layer.use_cross_attention`.

    Without it, a missing encoder output fails deep inside the attention
    layer, and an unexpected one would be silently ignored.
    """
    name = type(layer).__name__
    if layer.use_cross_attention:
        if encoder_output is None and cross_attention_cache is None:
            raise ValueError(
                f"{name} '{layer.name}' has cross-attention (use_cross_attention=True) and needs "
                f"encoder_output [batch, source_len, d_model] (or, in a cached step, cross_attention_cache). "
                f"For a decoder-only (GPT-style) model, "
                f"create it with use_cross_attention=False."
            )
        return
    given = {
        "encoder_output": encoder_output,
        "encoder_padding_mask": encoder_padding_mask,
        "cross_attention_cache": cross_attention_cache,
    }
    given = [argument for argument, value in given.items() if value is not None]
    if given:
        raise ValueError(
            f"{name} '{layer.name}' has no cross-attention (use_cross_attention=False), so it takes no "
            f"{', '.join(given)}. Create it with use_cross_attention=True to attend to an encoder output."
        )


def _checked_output_spec(layer, output_spec, x, encoder_output, args, kwargs):
    """`output_spec(x, encoder_output, ...)` after `_check_encoder_inputs`: the functional API calls
    compute_output_spec, not call(), so the same check runs at model-building time."""
    _check_encoder_inputs(layer, encoder_output, kwargs.get("encoder_padding_mask"), kwargs.get("cross_attention_cache"))
    return output_spec(x, encoder_output, *args, **kwargs)


@keras.saving.register_keras_serializable(package="keras_transformer")
class DecoderLayer(TransformerLayerBase):
    """Masked self-attention, cross-attention over the encoder output, feed-forward.

    Each sub-layer sits in a residual block (dropout, add, LayerNorm). With
    `use_cross_attention=False` the layer has no cross-attention block (and no
    weights for it): masked self-attention and feed-forward only, the layer
    of a decoder-only (GPT-style) language model.

    Args:
        d_model, num_heads, d_ff, dropout, norm_first, attention_dropout,
            activation_dropout, key_dim, activation, layer_norm_epsilon: as in
            `EncoderLayer` (`key_dim` sizes the queries and keys of both
            attentions).
        use_cross_attention: attend to an encoder output (the paper's
            decoder). False for a decoder-only model: the layer is then
            called without `encoder_output`. Fixed at construction (and saved
            in the config), so a `.keras` file builds the same weights.

    Shapes (full pass):
        call(x `[batch, target_len, d_model]`,
             encoder_output `[batch, source_len, d_model]` (None, the default,
             without cross-attention),
             encoder_padding_mask `[batch, source_len]` bool,
             decoder_padding_mask `[batch, target_len]` bool)
        -> `[batch, target_len, d_model]`.
        Missing padding masks fall back to the Keras masks of `x` and
        `encoder_output`. Self-attention is always causal. Passing
        `encoder_output` to a layer without cross-attention, or none to a
        layer with it, raises a ValueError.

    Attention weights: `return_attention_scores=True` (full pass only) makes
    the call return `(output, scores)` with `scores` a dict, keyed like the
    decoding caches:
    `{"self_attention": [batch, num_heads, target_len, target_len],
    "cross_attention": [batch, num_heads, target_len, source_len]}`
    (query by key; 0 above the diagonal and on padding keys; no
    `"cross_attention"` key without cross-attention).

    Incremental decoding: also pass `self_attention_cache` (keys
    `[batch, num_heads, cache_length, key_dim]` and values
    `[batch, num_heads, cache_length, d_model // num_heads]`, from
    `self_attention.empty_cache`), `cache_index` (the position of `x[:, 0]`)
    and, with cross-attention, `cross_attention_cache` (from
    `cross_attention.compute_cache(encoder_output)`; `encoder_output` may
    then be None) or `encoder_output`; the call then returns
    `(output, updated_self_attention_cache)`. `attention_ops` (a
    `MultiHeadAttention` `AttentionOps`) chooses how the cached attentions
    compute, e.g. a cache that grows (`empty_cache(batch, 0)`); a
    cross-attention cache may hold one entry per group of rows
    (`MultiHeadAttention`).

    Keras masks: inside a functional model Keras passes the mask of `x` (and
    of `encoder_output`) as `mask` / `x_mask` / `encoder_output_mask`; explicit
    padding masks come first.

    Example:

    ```python
    y = DecoderLayer(512, 8, 2048)(x, memory, encoder_padding_mask=source_ids != 0)
    y = DecoderLayer(512, 8, 2048, use_cross_attention=False)(x)   # decoder-only
    ```
    """

    def __init__(self, d_model, num_heads, d_ff, dropout=0.1, norm_first=False, use_cross_attention=True, **kwargs):
        super().__init__(d_model, num_heads, d_ff, dropout, norm_first, **kwargs)
        self.use_cross_attention = use_cross_attention
        self.self_attention = self._attention("self_attention")
        self.self_attention_norm = self._norm("self_attention_norm")
        # Same attributes as before the option: a .keras file stores the weights under these names.
        self.cross_attention = self.cross_attention_norm = None
        if use_cross_attention:
            self.cross_attention = self._attention("cross_attention")
            self.cross_attention_norm = self._norm("cross_attention_norm")
        self.feed_forward = FeedForward(
            d_model, d_ff, dropout=self.activation_dropout, activation=self.activation, dtype=self.dtype_policy,
            name="feed_forward"
        )
        self.feed_forward_norm = self._norm("feed_forward_norm")
        self.dropout_layer = keras.layers.Dropout(dropout, dtype=self.dtype_policy)

    def build(self, x_shape, encoder_output_shape=None):
        self.self_attention.build(x_shape, x_shape)
        self.self_attention_norm.build(x_shape)
        if self.cross_attention is not None:
            # Without the encoder's shape (e.g. a config-only rebuild), the paper's: d_model wide.
            self.cross_attention.build(x_shape, encoder_output_shape or x_shape)
            self.cross_attention_norm.build(x_shape)
        self.feed_forward.build(x_shape)
        self.feed_forward_norm.build(x_shape)
        self.built = True

    def call(self, x, encoder_output=None, encoder_padding_mask=None, decoder_padding_mask=None,
             self_attention_cache=None, cache_index=None, cross_attention_cache=None, training=None,
             return_attention_scores=False, mask=None, x_mask=None, encoder_output_mask=None, attention_ops=None):
        _check_encoder_inputs(self, encoder_output, encoder_padding_mask, cross_attention_cache)
        if return_attention_scores and self_attention_cache is not None:
            raise ValueError(
                "DecoderLayer returns attention scores for a full pass only; "
                "call it without self_attention_cache to get them."
            )
        self_mask = None  # with the cache, the causal rule is the cache's; earlier steps are never padding
        if self_attention_cache is None:
            self_mask = causal_mask(ops.shape(x)[1])
            decoder_padding_mask = first_mask(decoder_padding_mask, x_mask, mask)
            if decoder_padding_mask is not None:
                self_mask = ops.logical_and(self_mask, decoder_padding_mask[:, None, :])

        x, self_attention_scores, self_attention_cache = self._attention_block(
            self.self_attention, self.self_attention_norm, x, memory=None, mask=self_mask, training=training,
            return_attention_scores=return_attention_scores, cache=self_attention_cache, cache_index=cache_index,
            attention_ops=attention_ops,
        )
        scores = {"self_attention": self_attention_scores}
        if self.cross_attention is not None:
            encoder_padding_mask = first_mask(encoder_padding_mask, encoder_output_mask)
            cross_mask = None if encoder_padding_mask is None else encoder_padding_mask[:, None, :]
            x, scores["cross_attention"], _ = self._attention_block(
                self.cross_attention, self.cross_attention_norm, x, memory=encoder_output, mask=cross_mask,
                training=training, return_attention_scores=return_attention_scores, cache=cross_attention_cache,
                attention_ops=attention_ops,
            )

        residual = x
        x = norm_before(x, self.feed_forward_norm, self.norm_first)
        x = self.feed_forward(x, training=training)
        x = add_and_norm_after(residual, x, self.feed_forward_norm, self.dropout_layer, self.norm_first, training)
        if self_attention_cache is not None:
            return x, self_attention_cache
        if return_attention_scores:
            return x, scores
        return x

    def _attention_block(
        self, attention, norm, x, memory, mask, training, return_attention_scores, cache=None, cache_index=None,
        attention_ops=None,
    ):
        """The residual block around `attention` from `x` over `memory` (None: over itself).

        Returns `(x, scores or None, cache or None)`. `attention` returns its
        output, `(output, scores)` or, given a `cache`, `(output, cache)`: the
        updated self-attention cache, or the cross-attention cache unchanged.
        """
        residual = x
        x = norm_before(x, norm, self.norm_first)
        x = attention(
            x,
            # The same tensor twice: Q, K and V in one matmul. (A cached cross-attention reads its
            # cache, not `memory`, which a cached step may leave out.)
            x if memory is None else memory,
            attention_mask=mask,
            return_attention_scores=return_attention_scores,
            training=training,
            cache=cache,
            cache_index=cache_index,
            attention_ops=attention_ops,
        )
        if cache is not None:
            (x, cache), scores = x, None
        else:
            x, scores = x if return_attention_scores else (x, None)
        return add_and_norm_after(residual, x, norm, self.dropout_layer, self.norm_first, training), scores, cache

    def compute_output_spec(self, x, encoder_output=None, *args, return_attention_scores=False, **kwargs):
        # compute_output_shape knows one output; the weights are a second one.
        output = _checked_output_spec(self, super().compute_output_spec, x, encoder_output, args, kwargs)
        if not return_attention_scores:
            return output
        scores = {"self_attention": attention_spec(self, x, x)}
        if self.use_cross_attention:
            scores["cross_attention"] = attention_spec(self, x, encoder_output)
        return output, scores

    def get_config(self):
        return {**super().get_config(), "use_cross_attention": self.use_cross_attention}


@keras.saving.register_keras_serializable(package="keras_transformer")
class Decoder(TransformerStackBase):
    """N `DecoderLayer`s (plus a final LayerNorm when `norm_first`).

    Takes embedded target tokens and the encoder output; returns hidden states
    (the output projection to the vocabulary belongs to `Transformer`). With
    `use_cross_attention=False`, a decoder-only (GPT-style) stack: it takes
    the embedded tokens alone.

    Args:
        num_layers: N (6 in the paper).
        d_model, num_heads, d_ff, dropout, norm_first, use_cross_attention,
            attention_dropout, activation_dropout, key_dim, activation,
            layer_norm_epsilon: as in `DecoderLayer`.

    Shapes:
        call(x `[batch, target_len, d_model]`, encoder_output
        `[batch, source_len, d_model]` (None without cross-attention),
        encoder_padding_mask `[batch, source_len]`,
        decoder_padding_mask `[batch, target_len]`)
        -> `[batch, target_len, d_model]`.

    Incremental decoding: one `(keys, values)` pair per layer, keys
    `[batch, num_heads, length, d_k]` and values `[batch, num_heads, length, d_v]`: `empty_cache(batch, cache_length)` (a
    buffer of `cache_length` positions) for self-attention and, with cross-attention,
    `compute_cross_attention_cache(encoder_output)` (length source_len).
    Passing `self_attention_cache`, `cache_index` (and `cross_attention_cache`,
    and `attention_ops`, as in `DecoderLayer`) makes the call return
    `(output, updated_self_attention_cache)`; `decoding.greedy_generate`
    runs this loop for a decoder-only model.

    Attention weights (full pass only): `return_attention_scores=True` makes
    the call return `(output, scores)`, `scores` being
    `{"self_attention": [...], "cross_attention": [...]}` with one tensor per
    layer, first layer first, shaped as in `DecoderLayer`.

    Example:

    ```python
    y = Decoder(6, 512, 8, 2048)(target_embedded, memory, encoder_padding_mask=source_ids != 0)

    ids = keras.Input(shape=(None,), dtype="int32")             # decoder-only language model
    x = Decoder(2, 256, 4, 1024, use_cross_attention=False)(PositionalEmbedding(8000, 256)(ids))
    lm = keras.Model(ids, keras.layers.Dense(8000)(x))
    ```
    """

    def __init__(self, num_layers, d_model, num_heads, d_ff, dropout=0.1, norm_first=False, use_cross_attention=True,
                 **kwargs):
        super().__init__(num_layers, d_model, num_heads, d_ff, dropout, norm_first, **kwargs)
        self.use_cross_attention = use_cross_attention
        self.decoder_layers = self._identical_layers(DecoderLayer, use_cross_attention=use_cross_attention)
        self.final_norm = self._final_norm()

    def build(self, x_shape, encoder_output_shape=None):
        self._build_stack(self.decoder_layers, x_shape, encoder_output_shape)

    def empty_cache(self, batch_size, cache_length):
        """One empty self-attention cache per layer (`MultiHeadAttention.empty_cache`)."""
        return [layer.self_attention.empty_cache(batch_size, cache_length) for layer in self.decoder_layers]

    def compute_cross_attention_cache(self, encoder_output):
        if not self.use_cross_attention:
            raise ValueError(
                f"Decoder '{self.name}' has no cross-attention (use_cross_attention=False): "
                "there is no cross_attention_cache to compute."
            )
        return [layer.cross_attention.compute_cache(encoder_output) for layer in self.decoder_layers]

    def call(self, x, encoder_output=None, encoder_padding_mask=None, decoder_padding_mask=None,
             self_attention_cache=None, cache_index=None, cross_attention_cache=None, training=None,
             return_attention_scores=False, mask=None, x_mask=None, encoder_output_mask=None, attention_ops=None):
        _check_encoder_inputs(self, encoder_output, encoder_padding_mask, cross_attention_cache)
        encoder_padding_mask = first_mask(encoder_padding_mask, encoder_output_mask)
        decoder_padding_mask = first_mask(decoder_padding_mask, x_mask, mask)
        updated_caches = []
        scores = {"self_attention": []}
        if self.use_cross_attention:
            scores["cross_attention"] = []
        for i, layer in enumerate(self.decoder_layers):
            if self_attention_cache is None:
                x = layer(
                    x,
                    encoder_output,
                    encoder_padding_mask=encoder_padding_mask,
                    decoder_padding_mask=decoder_padding_mask,
                    training=training,
                    return_attention_scores=return_attention_scores,
                )
                if return_attention_scores:
                    x, layer_scores = x
                    for name, weights in layer_scores.items():
                        scores[name].append(weights)
            else:
                x, cache = layer(
                    x,
                    encoder_output,
                    encoder_padding_mask=encoder_padding_mask,
                    self_attention_cache=self_attention_cache[i],
                    cache_index=cache_index,
                    cross_attention_cache=None if cross_attention_cache is None else cross_attention_cache[i],
                    training=training,
                    return_attention_scores=return_attention_scores,
                    attention_ops=attention_ops,
                )
                updated_caches.append(cache)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self_attention_cache is not None:
            return x, updated_caches
        if return_attention_scores:
            return x, scores
        return x

    def compute_output_spec(self, x, encoder_output=None, *args, return_attention_scores=False, **kwargs):
        output = _checked_output_spec(self, super().compute_output_spec, x, encoder_output, args, kwargs)
        if not return_attention_scores:
            return output
        scores = {"self_attention": [attention_spec(self, x, x) for _ in self.decoder_layers]}
        if self.use_cross_attention:
            scores["cross_attention"] = [attention_spec(self, x, encoder_output) for _ in self.decoder_layers]
        return output, scores

    def get_config(self):
        return {**super().get_config(), "use_cross_attention": self.use_cross_attention}
