"""Multi-head attention (paper section 3.2) with a key/value cache for decoding."""

import keras
import tensorflow as tf
from tensorflow.python.ops import control_flow_util


@keras.saving.register_keras_serializable(package="keras_transformer")
class MultiHeadAttention(keras.layers.MultiHeadAttention):
    """Keras' `MultiHeadAttention` plus a key/value cache for incremental decoding.

    MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O, with
    head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V) and
    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V  (paper equation 1).
    In the paper d_k = d_v = d_model / h, so pass `key_dim=d_model // num_heads`.

    Without `cache` the layer is exactly `keras.layers.MultiHeadAttention`:
    same arguments, same weights, and the Keras masks (`query_mask`,
    `value_mask`, `key_mask`, `use_causal_mask`) work as usual.

    With `cache` it runs one decoding step and reuses earlier work. The cache is
    a pair `(keys, values)` of projected heads, each
    `[batch, cache_length, num_heads, key_dim]` (two tensors rather than one
    stacked tensor: a decoding step then writes and reorders them without
    copying the whole cache several times):

    - Self-attention: start from `empty_cache(batch, max_length)` and pass
      `cache_update_index=t`. The projected key/value of the new query
      positions are written at `t`, and the query at `t + i` attends to cache
      positions `<= t + i` (causal). The shape stays fixed, so the loop that
      calls it compiles once (XLA, `tf.while_loop`).
    - Cross-attention: build the cache once with `compute_cache(encoder_output)`
      and pass it with `cache_update_index=None`; keys and values are then
      never projected again.

    In cached mode the call returns `(output, cache)` (or
    `(output, scores, cache)` with `return_attention_scores=True`), and the
    only mask used is `attention_mask` (`[batch, query_len, cache_length]`,
    combined with the causal rule for self-attention). Pass the padding mask
    explicitly: Keras masks do not survive a `tf.function` boundary.

    Example:

    ```python
    mha = MultiHeadAttention(num_heads=8, key_dim=64)
    y = mha(x, x, use_causal_mask=True)           # full pass, [b, t, 512]
    cache = mha.empty_cache(batch_size=b, max_length=t)
    for i in range(t):                             # the same, one step at a time
        y_i, cache = mha(x[:, i:i+1], x[:, i:i+1], cache=cache,
                         cache_update_index=i)
    ```
    """

    def empty_cache(self, batch_size, max_length):
        """`(keys, values)` zeros, each `[batch_size, max_length, num_heads, key_dim]`, for self-attention."""
        shape = [batch_size, max_length, self.num_heads, self.key_dim]
        return tf.zeros(shape, dtype=self.compute_dtype), tf.zeros(shape, dtype=self.compute_dtype)

    def compute_cache(self, value, key=None):
        """Projects `key`/`value` `[batch, length, dim]` once, for cross-attention.

        Returns `(keys, values)`, each `[batch, length, num_heads, key_dim]`.
        """
        key = value if key is None else key
        return self._key_dense(_without_keras_mask(key)), self._value_dense(_without_keras_mask(value))

    def call(
        self,
        query,
        value,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        return_attention_scores=False,
        training=None,
        use_causal_mask=False,
        cache=None,
        cache_update_index=None,
    ):
        if cache is None:
            return super().call(
                query,
                value,
                key=key,
                query_mask=query_mask,
                value_mask=value_mask,
                key_mask=key_mask,
                attention_mask=attention_mask,
                return_attention_scores=return_attention_scores,
                training=training,
                use_causal_mask=use_causal_mask,
            )

        # Masks play no part here; dropping them keeps the projections quiet.
        query_heads = self._query_dense(_without_keras_mask(query))
        key_heads, value_heads = cache
        if cache_update_index is not None:
            key = _without_keras_mask(value if key is None else key)
            value = _without_keras_mask(value)
            key_heads = _write_at(key_heads, cache_update_index, self._key_dense(key))
            value_heads = _write_at(value_heads, cache_update_index, self._value_dense(value))
            cache = (key_heads, value_heads)
            causal = _cached_causal_mask(
                query_length=tf.shape(query)[1],
                cache_length=tf.shape(key_heads)[1],
                start=cache_update_index,
            )
            attention_mask = (
                causal
                if attention_mask is None
                else tf.logical_and(tf.cast(attention_mask, tf.bool), causal)
            )

        output, scores = self._compute_attention(
            query_heads,
            key_heads,
            value_heads,
            attention_mask,
            training,
            return_attention_scores,
        )
        output = self._output_dense(output)
        if return_attention_scores:
            return output, scores, cache
        return output, cache


def _write_at(heads, index, update):
    """`heads` `[batch, length, num_heads, key_dim]` with `update` written from position `index`.

    Outside XLA, a core op (`TensorStridedSliceUpdate`), not `keras.ops.slice_update`,
    whose TensorFlow kernel is the XLA op `XlaDynamicUpdateSlice`: the stock TF
    Serving model server will not run that outside XLA. Inside a
    `tf.function(jit_compile=True)` it is the other way round: XLA needs the
    strided slice's bounds at compile time, and `dynamic_update_slice` is its
    native cache write.
    """
    update = tf.cast(update, heads.dtype)
    begin = tf.stack([0, tf.cast(index, tf.int32), 0, 0])
    if _in_xla_context():
        return keras.ops.slice_update(heads, begin, update)
    end = begin + tf.shape(update, out_type=tf.int32)
    return tf.raw_ops.TensorStridedSliceUpdate(
        input=heads, begin=begin, end=end, strides=tf.ones_like(begin), value=update
    )


def _in_xla_context():
    """True while tracing inside `tf.function(jit_compile=True)` (TensorFlow has no public test for it)."""
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def _without_keras_mask(x):
    """The same values with no Keras mask attached (a new tensor)."""
    return tf.identity(x) if getattr(x, "_keras_mask", None) is not None else x


def _cached_causal_mask(query_length, cache_length, start):
    """`[1, query_length, cache_length]`: query `start + i` sees cache slots `<= start + i`."""
    query_positions = start + tf.range(query_length)[:, None]
    key_positions = tf.range(cache_length)[None, :]
    return (key_positions <= query_positions)[None]


def head_size(d_model, num_heads):
    """d_k = d_model / h (paper section 3.2.2); a clear error when it does not divide."""
    if d_model % num_heads:
        raise ValueError(
            f"d_model must be divisible by num_heads (d_k = d_model / num_heads), "
            f"got d_model={d_model} and num_heads={num_heads}."
        )
    return d_model // num_heads
