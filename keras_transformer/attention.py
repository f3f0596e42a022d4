"""Multi-head attention (paper section 3.2) with a key/value cache for decoding."""

import math

import keras
from keras import ops

from keras_transformer.keras_internals import (
    AttentionProjections,
    MultiHeadAttentionWithHook,
    attention_dropout_layer,
    attention_is_plain,
    attention_mask_of_call,
    attention_projections,
)
from keras_transformer.linear import project_heads, project_output
from keras_transformer.masking import MASKED_SCORE, causal_mask


@keras.saving.register_keras_serializable(package="keras_transformer")
class MultiHeadAttention(MultiHeadAttentionWithHook):
    """Keras' `MultiHeadAttention` plus a key/value cache for incremental decoding.

    MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O, with
    head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V) and
    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V  (paper equation 1).
    In the paper d_k = d_v = d_model / h, so pass `key_dim=d_model // num_heads`.
    `key_dim` is d_k, the size per head of the queries and keys; `value_dim`
    (Keras' argument; `key_dim` when not given) is d_v, the size per head of
    the values and of each head's output (table 3's rows B change d_k alone).

    Without `cache` the layer computes exactly what
    `keras.layers.MultiHeadAttention` computes: same arguments, same weights,
    and the Keras masks (`query_mask`, `value_mask`, `key_mask`,
    `use_causal_mask`) work as usual (an explicit `query_mask` is honoured too;
    Keras' layer reads only the Keras mask of `query`). It computes it faster in
    training: the projections are plain 2-D matrix multiplications (Q, K and V
    fused into one in self-attention), where Keras' `EinsumDense` broadcasts the
    kernel over the batch and sums its gradient back per sentence. Options this
    does not cover (`use_gate`, `sliding_window`, other `attention_axes`,
    quantized kernels) run Keras' own code. Written in `keras.ops`: it runs on
    the JAX, PyTorch and TensorFlow backends.

    The cache is a pair `(keys, values)` of projected heads: keys
    `[batch, num_heads, length, key_dim]`, values
    `[batch, num_heads, length, value_dim]`. Three modes, chosen by the arguments
    alone (as keras-hub's `CachedMultiHeadAttention`):

    - `cache=None`: no cache, the full pass.
    - `cache` and `cache_index=t`: self-attention over a fixed buffer from
      `empty_cache(batch, cache_length)`. The projected keys/values of the new
      query positions are written at positions `t, t + 1, ...`, and the query
      at `t + i` attends to cache positions `<= t + i` (causal; the slots
      after it are never read). The buffer keeps its shape, so the call
      compiles (`jax.jit`, XLA).
    - `cache` and `cache_index=None`: cross-attention over keys/values
      projected once by `compute_cache(encoder_output)`; `value` is not
      projected again.

    In cached mode the call returns `(output, cache)` (or
    `(output, scores, cache)` with `return_attention_scores=True`), and the
    only mask used is `attention_mask` (`[batch, query_len, cache_length]`,
    combined with the causal rule for self-attention). Pass the padding mask
    explicitly: Keras masks do not cross a compiled function's boundary.

    A cross-attention cache may hold one entry per group of `g` consecutive
    query rows (beam search's hypotheses of one sentence): `query`
    `[entries * g, query_len, dim]` reads entry `i` from rows `i * g` to
    `i * g + g - 1`, with `attention_mask` `[entries, 1, cache_length]`, so
    the source is neither projected nor stored once per hypothesis.

    How a cached call computes is `attention_ops` (an `AttentionOps`): the
    default writes a fixed buffer and computes with `keras.ops`;
    `AttentionOps(growing_cache=True)` appends to a cache that starts empty
    (`empty_cache(batch, 0)`), and a runtime may subclass it to specialise
    the attention product (the TensorFlow serving engine does, in
    `export/step.py`).

    Example:

    ```python
    mha = MultiHeadAttention(num_heads=8, key_dim=64)
    y = mha(x, x, use_causal_mask=True)           # full pass, [b, t, 512]
    cache = mha.empty_cache(batch_size=b, cache_length=t)
    for i in range(t):                             # the same, one position at a time
        y_i, cache = mha(x[:, i:i+1], x[:, i:i+1], cache=cache, cache_index=i)
    memory_cache = mha.compute_cache(memory)      # cross-attention: memory projected once
    z, _ = mha(x, memory, cache=memory_cache, attention_mask=source_mask[:, None, :])
    ```

    Reference: Vaswani et al., "Attention Is All You Need", 2017, section 3.2.
    """

    @property
    def projections(self) -> AttentionProjections:
        """The layer's W^Q, W^K, W^V and W^O (`EinsumDense` layers, Keras' own weights), e.g. to compute
        with them elsewhere, as the TensorFlow serving engine does (`export/step.py`)."""
        return attention_projections(self)

    def is_plain(self):
        """True when the layer uses no option beyond the paper's attention (no `use_gate`,
        `sliding_window`, other `attention_axes` or quantized kernels): what the cache supports."""
        return attention_is_plain(self)

    def empty_cache(self, batch_size, cache_length):
        """`(keys, values)` zeros, keys `[batch_size, num_heads, cache_length, key_dim]` and values
        `[batch_size, num_heads, cache_length, value_dim]`, for self-attention (`cache_length` 0 for a cache
        that grows, `AttentionOps(growing_cache=True)`)."""
        return tuple(ops.zeros((batch_size, self.num_heads, cache_length, size), dtype=self.compute_dtype)
                     for size in (self.key_dim, self.value_dim))

    def compute_cache(self, value, key=None):
        """Projects `key`/`value` `[batch, length, dim]` once, for cross-attention.

        Returns `(keys, values)`: `[batch, num_heads, length, key_dim]` and `[batch, num_heads, length, value_dim]`.
        """
        return tuple(_heads_first(h) for h in self._project_keys_values(value, value if key is None else key))

    def call(self, query, value, key=None, query_mask=None, value_mask=None, key_mask=None, attention_mask=None,
             return_attention_scores=False, training=None, use_causal_mask=False, cache=None, cache_index=None,
             attention_ops=None):
        if not self.is_plain():
            if cache is not None:
                raise ValueError(
                    "The key/value cache supports plain multi-head attention only, not use_gate, "
                    f"sliding_window, attention_axes other than the sequence axis, or quantized kernels "
                    f"(layer '{self.path}')."
                )
            return super().call(query, value, key=key, query_mask=query_mask, value_mask=value_mask, key_mask=key_mask,
                                attention_mask=attention_mask, return_attention_scores=return_attention_scores,
                                training=training, use_causal_mask=use_causal_mask)

        attention_ops = attention_ops or KERAS_ATTENTION_OPS
        key = value if key is None else key
        groups = None  # cross-attention: the shape of `query`'s heads, read by groups of rows
        if cache is None:
            attention_mask = attention_mask_of_call(
                self, query, value, query_mask=query_mask, value_mask=value_mask, key_mask=key_mask,
                attention_mask=attention_mask, use_causal_mask=use_causal_mask,
            )
            query_heads, key_heads, value_heads = (_heads_first(h) for h in self._project_heads(query, value, key))
        elif cache_index is None:  # cross-attention: keys and values were projected once, one entry per g rows
            # [rows, heads, query_len, d] -> [entries, g, heads, query_len, d], read against the entries'
            # keys and values broadcast over the g axis: a reshape, no copy of the cache per row.
            query_heads = _heads_first(_project(query, self.projections.query))
            entries, rows, groups = ops.shape(cache[0])[0], query_heads.shape[0], _sizes(query_heads, 1)
            # g is inferred (-1) from dynamic shapes; static ones state it (an empty batch leaves nothing to infer).
            static = isinstance(entries, int) and isinstance(rows, int)
            g = (rows // entries if entries else 1) if static else -1
            query_heads = ops.reshape(query_heads, (entries, g, *groups))
            key_heads, value_heads = (ops.expand_dims(heads, 1) for heads in cache)
            if attention_mask is not None:
                attention_mask = ops.expand_dims(attention_mask, 1)
        else:  # self-attention: this call's keys and values written into the cache
            query_heads, new_keys, new_values = (
                _heads_first(h) for h in self._project_heads(query, value, key, attention_ops))
            key_heads = attention_ops.write(cache[0], cache_index, new_keys)
            value_heads = attention_ops.write(cache[1], cache_index, new_values)
            cache = (key_heads, value_heads)
            # A growing cache holds only the positions up to this call's: one new query may attend to all of it.
            if not (attention_ops.growing_cache and query.shape[1] == 1):
                causal = causal_mask(ops.shape(query)[1], ops.shape(key_heads)[2], start=cache_index)
                attention_mask = causal if attention_mask is None else ops.logical_and(
                    ops.cast(attention_mask, "bool"), causal)
        output, scores = self._attend(query_heads, key_heads, value_heads, attention_mask, training, attention_ops)
        if groups is not None:  # back to one row per query row: [rows, heads, query_len, ...]
            output = ops.reshape(output, (-1, *_sizes(output, 2)))
            scores = ops.reshape(scores, (-1, *_sizes(scores, 2))) if return_attention_scores else scores
        output = project_output(_heads_first(output), self.projections.output)
        outputs = (output, scores) if return_attention_scores else (output,)
        if cache is not None:
            outputs += (cache,)
        return outputs[0] if len(outputs) == 1 else outputs

    def _project_heads(self, query, value, key, attention_ops=None):
        """Q W^Q, K W^K, V W^V as `[batch, length, num_heads, dim]`; one matmul for those sharing an input, or
        however `attention_ops.project` runs the three of a self-attention call."""
        w = self.projections
        if query is value and key is value:
            return (attention_ops or KERAS_ATTENTION_OPS).project(query, [w.query, w.key, w.value])
        return (_project(query, w.query), *self._project_keys_values(value, key))

    def _project_keys_values(self, value, key):
        """K W^K, V W^V as `[batch, length, num_heads, dim]`; one matmul when `key is value`."""
        w = self.projections
        if key is value:
            return tuple(project_heads(value, [w.key, w.value]))
        return _project(key, w.key), _project(value, w.value)

    def attention_of_heads(
        self, query, key, value, attention_mask=None, training=None, return_attention_scores=False, **kwargs
    ):
        """softmax(Q K^T / sqrt(d_k)) V (paper equation 1) on heads `[batch, length, num_heads, dim]`: the step
        of Keras' `call` between the projections (`MultiHeadAttentionWithHook`).

        Returns the output `[batch, query_len, num_heads, value_dim]` and the
        weights `[batch, num_heads, query_len, key_len]`; `attention_mask`
        `[batch or 1, query_len, key_len]` is True where attention is allowed.
        """
        if not self.is_plain():
            return self.keras_attention_of_heads(
                query, key, value, attention_mask, training, return_attention_scores, **kwargs
            )
        output, scores = self._attend(
            _heads_first(query), _heads_first(key), _heads_first(value), attention_mask, training
        )
        return _heads_first(output), scores

    def _attend(self, query, key, value, attention_mask, training, attention_ops=None):
        """Equation 1 on heads-first tensors: query `[batch, num_heads, query_len, dim]`,
        key and value `[batch, num_heads, key_len, dim]` -> output
        `[batch, num_heads, query_len, value_dim]` and the weights."""
        query = query * ops.cast(1.0 / math.sqrt(float(self.key_dim)), query.dtype)
        mask = None if attention_mask is None else ops.cast(attention_mask, "bool")[:, None]
        if training and self.dropout > 0.0:
            weights = attention_weights(query, key, mask)
            return ops.matmul(attention_dropout_layer(self)(weights, training=training), value), weights
        return (attention_ops or KERAS_ATTENTION_OPS).attend(query, key, value, mask)


class AttentionOps:
    """How `MultiHeadAttention`'s cached calls compute: documented extension API, as `strategies.SearchOps`.

    The layer decides what a cached call computes (the projections, the
    causal rule, equation 1); this object decides how its three array steps
    run, so that a runtime can specialise them without copying the layer:

    - `project(x, denses)`: a cached self-attention call's Q, K and V
      projections of `x` `[batch, length, dim]` by the `EinsumDense` layers
      `denses`, one `[batch, length, num_heads, head_dim]` each. Default: one
      matmul with the three kernels side by side (`linear.project_heads`).
    - `write(heads, index, update)`: the cache `heads`
      `[batch, num_heads, length, dim]` (keys: key_dim, values: value_dim)
      with `update` `[batch, num_heads, n, dim]` at positions
      `index ... index + n - 1`.
    - `attend(query, key, value, mask)`: softmax(query key^T) value on
      heads-first tensors, the query already scaled by 1 / sqrt(d_k); `mask`
      None or bool, broadcastable to the weights `[..., query_len, key_len]`.
      Returns `(output [..., query_len, value_dim], weights)`.

    Args:
        growing_cache: False (default): a self-attention cache is a fixed
            buffer from `empty_cache(batch, cache_length)`, written in place
            (`ops.slice_update`), so every shape stays fixed (`jax.jit`,
            XLA) and the causal rule hides the slots not written yet. True:
            the cache starts empty (`empty_cache(batch, 0)`) and grows by each
            call's positions (a concatenation, which needs no XLA kernel), so
            it holds only the positions decoded so far.

    Example:

    ```python
    cache = mha.empty_cache(batch_size=b, cache_length=0)
    for i in range(t):
        y_i, cache = mha(x[:, i:i+1], x[:, i:i+1], cache=cache, cache_index=i,
                         attention_ops=AttentionOps(growing_cache=True))
    ```
    """

    def __init__(self, growing_cache=False):
        self.growing_cache = growing_cache

    def project(self, x, denses):
        return project_heads(x, denses)

    def write(self, heads, index, update):
        update = ops.cast(update, heads.dtype)
        if self.growing_cache:
            return ops.concatenate([heads, update], axis=2)
        return ops.slice_update(heads, (0, 0, ops.cast(index, "int32"), 0), update)

    def attend(self, query, key, value, mask):
        weights = attention_weights(query, key, mask)
        return ops.matmul(weights, value), weights


KERAS_ATTENTION_OPS = AttentionOps()


def attention_weights(query, key, mask):
    """softmax(query key^T) where `mask` allows: query `[..., query_len, dim]` (already scaled), key
    `[..., key_len, dim]` -> weights `[..., query_len, key_len]`."""
    return masked_softmax(ops.matmul(query, ops.swapaxes(key, -1, -2)), mask)


def masked_softmax(scores, mask):
    """softmax over the last axis where `mask` (bool, broadcastable; None: everywhere) allows.

    As Keras' Softmax does: `MASKED_SCORE` before, and exact zeros after, so
    that a row with nothing to attend to gets zero weights, not uniform ones.
    """
    if scores.shape[-1] == 1:
        # One key (the first step of a cached decode, a one-token source): its weight is 1.
        # keras.ops.softmax would warn at every such call that a softmax over one position "is
        # likely not what you intended", which here it is; its gradient is zero either way.
        weights = ops.ones_like(scores)
    elif mask is None:
        weights = ops.softmax(scores, axis=-1)
    else:
        weights = ops.softmax(ops.where(mask, scores, ops.cast(MASKED_SCORE, scores.dtype)), axis=-1)
    return weights if mask is None else ops.where(mask, weights, ops.zeros_like(weights))


def _project(x, dense):
    """`x` `[batch, length, dim]` through a head projection `dense` as one 2-D matmul: `[batch, length, heads, head_dim]`."""
    (heads,) = project_heads(x, [dense])
    return heads


def _sizes(x, start):
    """The sizes of `x`'s axes from `start` on: the static ones as ints, so that a graph with them all
    known runs no shape op at every step; read at run time where one is not."""
    static = tuple(x.shape)[start:]
    return static if None not in static else tuple(ops.shape(x))[start:]


def _heads_first(x):
    """`[batch, length, num_heads, dim]` <-> `[batch, num_heads, length, dim]` (its own inverse).

    With a length of 1 (a decoding step) the swap moves no data: a reshape, not a transpose (in a
    TensorFlow graph a Transpose op at every step of every layer).
    """
    _, a, b, dim = x.shape
    if 1 in (a, b) and None not in (a, b, dim):
        return ops.reshape(x, (-1, b, a, dim))
    return ops.transpose(x, (0, 2, 1, 3))


def head_size(d_model, num_heads):
    """d_k = d_model / h (paper section 3.2.2); a clear error when it does not divide."""
    if d_model % num_heads:
        raise ValueError(
            f"d_model must be divisible by num_heads (d_k = d_model / num_heads), "
            f"got d_model={d_model} and num_heads={num_heads}."
        )
    return d_model // num_heads


def attention_spec(layer, query, key):
    """Symbolic attention weights `[batch, num_heads, query_len, key_len]` (functional API, `keras.Input`)."""
    return keras.KerasTensor((query.shape[0], layer.num_heads, query.shape[1], key.shape[1]), dtype=layer.compute_dtype)
