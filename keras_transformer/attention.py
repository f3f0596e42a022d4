"""Multi-head attention (paper section 3.2) with a key/value cache for decoding."""

import keras
import tensorflow as tf

from keras_transformer.linear import is_plain, matmul_2d, weight
from keras_transformer.masking import causal_mask
from keras_transformer.tf_internals import eigen_batch_matmul, in_xla_context


@keras.saving.register_keras_serializable(package="keras_transformer")
class MultiHeadAttention(keras.layers.MultiHeadAttention):
    """Keras' `MultiHeadAttention` plus a key/value cache for incremental decoding.

    MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O, with
    head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V) and
    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V  (paper equation 1).
    In the paper d_k = d_v = d_model / h, so pass `key_dim=d_model // num_heads`.

    Without `cache` the layer computes exactly what
    `keras.layers.MultiHeadAttention` computes: same arguments, same weights,
    and the Keras masks (`query_mask`, `value_mask`, `key_mask`,
    `use_causal_mask`) work as usual (an explicit `query_mask` is honoured too;
    Keras' layer reads only the Keras mask of `query`). It computes it faster in training: the
    projections are plain 2-D matrix multiplications (Q, K and V fused into one
    in self-attention), where Keras' `EinsumDense` broadcasts the kernel over
    the batch and sums its gradient back per sentence. Options this does not
    cover (`use_gate`, `sliding_window`, other `attention_axes`, quantized
    kernels) run Keras' own code.

    With `cache` it runs one decoding step and reuses earlier work. The cache is
    a pair `(keys, values)` of projected heads, each
    `[batch, num_heads, cache_length, key_dim]`: heads before positions, the
    layout the attention's batched matrix multiplications read, so a step
    never transposes the cache (that transpose was a quarter of a decoding
    step's time on CPU).

    - Self-attention: pass `cache_index=t`. The projected keys/values of the
      new query positions are written at positions `t, t + 1, ...`, and the
      query at `t + i` attends to cache positions `<= t + i` (causal). Start
      from `empty_cache(batch, max_length)`:
      - `max_length=0`: the cache grows by the new positions at each call
        (write at `t` = its length). A step then copies and reads only the
        positions decoded so far, the fastest outside XLA.
      - `max_length=n`: a fixed buffer of n positions. Its shape never
        changes, which XLA (`jit_compile=True`) needs; there the write is an
        in-place `dynamic_update_slice`.
      In your own `tf.while_loop` (outside XLA), a cache whose length the
      shape invariant leaves free (`None`) is taken to grow; keep a fixed
      buffer's length in the invariant.
    - Cross-attention: build the cache once with `compute_cache(encoder_output)`
      and pass it with `cache_index=None`; keys and values are then
      never projected again. A one-position query may have g consecutive
      rows per cached sentence (beam search's g hypotheses): `query`
      `[batch * g, 1, dim]` over a cache of `batch` sentences, with
      `attention_mask` `[batch, 1, source_len]`; the cache is then not
      repeated per hypothesis.

    In cached mode the call returns `(output, cache)` (or
    `(output, scores, cache)` with `return_attention_scores=True`), and the
    only mask used is `attention_mask` (`[batch, query_len, cache_length]`,
    combined with the causal rule for self-attention). Pass the padding mask
    explicitly: Keras masks do not survive a `tf.function` boundary.

    Example:

    ```python
    mha = MultiHeadAttention(num_heads=8, key_dim=64)
    y = mha(x, x, use_causal_mask=True)           # full pass, [b, t, 512]
    cache = mha.empty_cache(batch_size=b, max_length=0)
    for i in range(t):                             # the same, one step at a time (the cache grows)
        y_i, cache = mha(x[:, i:i+1], x[:, i:i+1], cache=cache, cache_index=i)
    ```
    """

    def empty_cache(self, batch_size, max_length=0):
        """`(keys, values)` zeros, each `[batch_size, num_heads, max_length, key_dim]`, for self-attention.

        `max_length=0` (the default): an empty cache that grows at each step;
        `max_length=n`: a fixed buffer of n positions (for XLA).
        """
        shape = [batch_size, self.num_heads, max_length, self.key_dim]
        return tf.zeros(shape, dtype=self.compute_dtype), tf.zeros(shape, dtype=self.compute_dtype)

    def compute_cache(self, value, key=None):
        """Projects `key`/`value` `[batch, length, dim]` once, for cross-attention.

        Returns `(keys, values)`, each `[batch, num_heads, length, key_dim]`.
        """
        return tuple(_heads_first(h) for h in self._project_keys_values(value, value if key is None else key))

    def call(self, query, value, key=None, query_mask=None, value_mask=None, key_mask=None, attention_mask=None,
             return_attention_scores=False, training=None, use_causal_mask=False, cache=None, cache_index=None):
        if not self._is_plain():
            if cache is not None:
                raise ValueError(
                    "The key/value cache supports plain multi-head attention only, not use_gate, "
                    "sliding_window, attention_axes other than the sequence axis, or quantized kernels."
                )
            return super().call(query, value, key=key, query_mask=query_mask, value_mask=value_mask, key_mask=key_mask,
                                attention_mask=attention_mask, return_attention_scores=return_attention_scores,
                                training=training, use_causal_mask=use_causal_mask)

        key = value if key is None else key
        if cache is None:
            attention_mask = self._compute_attention_mask(
                query,
                value,
                query_mask=query_mask,
                value_mask=value_mask,
                key_mask=key_mask,
                attention_mask=attention_mask,
                use_causal_mask=use_causal_mask,
            )
            query_heads, key_heads, value_heads = self._project_heads(query, value, key)
            output, scores = self._compute_attention(query_heads, key_heads, value_heads, attention_mask, training)
        elif cache_index is None and query.shape[1] == 1:  # cross-attention, one position per row
            output, scores = self._attend_source(query, cache, attention_mask, training)
        else:
            if cache_index is None:  # cross-attention: keys and values were projected once
                query_heads = _project(query, self._query_dense)
                key_heads, value_heads = cache
            else:  # self-attention: write this step's keys and values into the cache
                query_heads, new_keys, new_values = self._project_heads(query, value, key)
                grows = _grows(cache[0])
                key_heads = _write_at(cache[0], cache_index, _heads_first(new_keys), grows)
                value_heads = _write_at(cache[1], cache_index, _heads_first(new_values), grows)
                cache = (key_heads, value_heads)
                # One new query at the end of a growing cache may attend to all of it: no causal
                # mask to build (the ops of a mask cost more than its arithmetic at one position).
                if not (grows and query.shape[1] == 1):
                    causal = causal_mask(tf.shape(query)[1], tf.shape(key_heads)[2], start=cache_index)
                    attention_mask = (
                        causal
                        if attention_mask is None
                        else tf.logical_and(tf.cast(attention_mask, tf.bool), causal)
                    )
            output, scores = self._attend(
                _heads_first(query_heads), key_heads, value_heads, attention_mask, training
            )
            output = _heads_first(output)  # [batch, num_heads, q, d] -> [batch, q, num_heads, d]: its own inverse
        output = _project_output(output, self._output_dense)
        outputs = (output, scores) if return_attention_scores else (output,)
        if cache is not None:
            outputs += (cache,)
        return outputs[0] if len(outputs) == 1 else outputs

    def _project_heads(self, query, value, key):
        """Q W^Q, K W^K, V W^V as `[batch, length, num_heads, dim]`; one matmul for those sharing an input."""
        if query is value and key is value:
            return _project_fused(query, [self._query_dense, self._key_dense, self._value_dense])
        return (_project(query, self._query_dense), *self._project_keys_values(value, key))

    def _project_keys_values(self, value, key):
        """K W^K, V W^V as `[batch, length, num_heads, dim]`; one matmul when `key is value`."""
        if key is value:
            return tuple(_project_fused(value, [self._key_dense, self._value_dense]))
        return _project(key, self._key_dense), _project(value, self._value_dense)

    def _compute_attention(
        self, query, key, value, attention_mask=None, training=None, return_attention_scores=False, **kwargs
    ):
        """softmax(Q K^T / sqrt(d_k)) V (paper equation 1) on heads `[batch, length, num_heads, dim]`.

        Returns the output `[batch, query_len, num_heads, value_dim]` and the
        weights `[batch, num_heads, query_len, key_len]`. Batched matrix
        multiplications over `[batch, num_heads]`; `attention_mask`
        `[batch or 1, query_len, key_len]` is True where attention is allowed.
        """
        if not self._is_plain():
            return super()._compute_attention(
                query, key, value, attention_mask, training, return_attention_scores, **kwargs
            )
        output, scores = self._attend(
            _heads_first(query), _heads_first(key), _heads_first(value), attention_mask, training
        )
        return _heads_first(output), scores

    def _attend_source(self, query, cache, attention_mask, training):
        """Cross-attention of one position per row `query` `[rows, 1, dim]` over a cache of
        `sentences` sentences, rows = sentences * g (g >= 1 consecutive rows per sentence).

        A sentence's g rows (beam search's hypotheses) read its keys and values
        through broadcasting, so they are neither repeated per hypothesis in
        the cache nor transposed at each step. Returns the output
        `[rows, 1, num_heads, value_dim]` and the weights `[rows, num_heads, 1, source_len]`.
        """
        keys, values = cache
        sentences, source_len = tf.shape(keys)[0], tf.shape(keys)[2]
        query_heads = tf.reshape(
            _project(query, self._query_dense), [sentences, -1, self.num_heads, 1, self.key_dim]
        )
        mask = None if attention_mask is None else attention_mask[:, None]  # [sentences, 1, 1, source_len]
        output, scores = self._attend(query_heads, keys[:, None], values[:, None], mask, training)
        return (
            tf.reshape(output, [-1, 1, self.num_heads, self.value_dim]),
            tf.reshape(scores, tf.stack([-1, self.num_heads, 1, source_len])),
        )

    def _attend(self, query, key, value, attention_mask, training):
        """Equation 1 on heads-first tensors: query `[batch, num_heads, query_len, dim]`,
        key and value `[batch, num_heads, key_len, dim]` -> output
        `[batch, num_heads, query_len, value_dim]` and the weights."""
        query = query * tf.cast(self._inverse_sqrt_key_dim, query.dtype)
        mask = None if attention_mask is None else tf.cast(attention_mask, tf.bool)[:, None]
        if query.shape[-2] == 1 and not in_xla_context() and not (training and self._dropout > 0.0):
            return _attend_one_position(query, key, value, mask)
        scores = tf.matmul(query, key, transpose_b=True)
        if mask is None:
            scores = tf.nn.softmax(scores)
        else:
            # As Keras' Softmax does: -1e9 before, and exact zeros after, so that
            # a row with nothing to attend to gets zero weights, not uniform ones.
            scores = tf.nn.softmax(tf.where(mask, scores, tf.cast(-1e9, scores.dtype)))
            scores = tf.where(mask, scores, tf.zeros_like(scores))
        weights = self._dropout_layer(scores, training=training) if self._dropout > 0.0 else scores
        return tf.matmul(weights, value), scores

    def _is_plain(self):
        """True when the layer uses no option beyond the paper's attention (see the class docstring)."""
        return (
            not getattr(self, "_use_gate", False)  # gate and sliding window are newer than keras 3.12
            and getattr(self, "_sliding_window", None) is None
            and tuple(self._attention_axes) == (1,)
            and all(
                is_plain(dense) for dense in (self._query_dense, self._key_dense, self._value_dense, self._output_dense)
            )
        )


def _attend_one_position(query, key, value, mask):
    """Equation 1 for one query position (a decoding step), outside XLA.

    query `[..., num_heads, 1, dim]`, key and value `[..., num_heads, key_len, dim]` (the
    leading axes broadcast), mask None or bool broadcastable to `[..., num_heads, 1, key_len]`.
    The products run on Eigen's batched matmul in float32 (`eigen_batch_matmul`: oneDNN's
    pays a fixed cost for each of the step's ~100 one-row products); scores, weights and
    output are rounded to `value`'s dtype where the full pass rounds them. The softmax is
    written out: oneDNN's softmax kernel costs ~40 us a call on a
    2-core EPYC whatever its size, a tenth of a batch-1 decoding step for 6 attentions.
    Elementwise products and sums were 3-5x cheaper at batch 1, but a
    sentence's result then depended on its batch (the cheaper form pays only below a size)
    and the cached step no longer equalled the full pass token for token.
    """
    # Scores and weights are rounded to the layer's dtype, as the full pass's matmuls round them: in
    # bfloat16, float32 scores and weights made a step differ from the full pass (a greedy output
    # changed token), and a sentence's score depend on its batch (served in batches of 64 and 16).
    dtype = value.dtype
    scores = tf.cast(tf.cast(eigen_batch_matmul(query, key, adjoint_b=True), dtype), tf.float32)
    if mask is not None:
        scores = tf.where(mask, scores, -1e9)
    weights = tf.exp(scores - tf.reduce_max(scores, axis=-1, keepdims=True))
    weights = weights / tf.reduce_sum(weights, axis=-1, keepdims=True)
    if mask is not None:  # a row with nothing to attend to gets zero weights, as in the full pass
        weights = tf.where(mask, weights, 0.0)
    weights = tf.cast(weights, dtype)
    return tf.cast(eigen_batch_matmul(weights, value), dtype), weights


def _project(x, dense):
    """`x` `[batch, length, dim]` through a head projection `dense` as one 2-D matmul: `[batch, length, heads, head_dim]`."""
    (heads,) = _project_fused(x, [dense])
    return heads


def _project_fused(x, denses):
    """`x` through several head projections at once: one matmul with their kernels side by side.

    Each `dense` is an `EinsumDense` "abc,cde->abde" with kernel
    `[dim, heads, head_dim]` and bias `[heads, head_dim]`; returns one
    `[batch, length, heads, head_dim]` per dense.
    """
    dtype = denses[0].compute_dtype
    x = tf.cast(x, dtype)
    dim = x.shape[-1]
    kernels = [tf.reshape(weight(dense.kernel, dtype), [dim, -1]) for dense in denses]
    y = tf.matmul(tf.reshape(x, [-1, dim]), kernels[0] if len(kernels) == 1 else tf.concat(kernels, axis=1))
    if denses[0].bias is not None:
        biases = [tf.reshape(weight(dense.bias, dtype), [-1]) for dense in denses]
        y = tf.nn.bias_add(y, biases[0] if len(biases) == 1 else tf.concat(biases, axis=0))
    outputs = tf.split(y, [kernel.shape[1] for kernel in kernels], axis=1) if len(kernels) > 1 else [y]
    return [tf.reshape(out, _batch_and_length(x) + list(dense.kernel.shape[1:])) for out, dense in zip(outputs, denses)]


def _project_output(heads, dense):
    """Heads `[batch, length, heads, head_dim]` through W^O (`EinsumDense` "abcd,cde->abe") as one 2-D matmul."""
    num_heads, head_dim, dim = dense.kernel.shape
    y = matmul_2d(tf.reshape(heads, [-1, num_heads * head_dim]), dense, num_heads * head_dim)
    return tf.reshape(y, _batch_and_length(heads) + [dim])


def _batch_and_length(x):
    """The first two axes of `x` as a shape prefix: `[-1, length]` when the length is static (a decoding
    step: a constant shape, so no shape ops at every step), else both read from `tf.shape(x)`."""
    if x.shape[1] is not None:
        return [-1, x.shape[1]]
    shape = tf.shape(x)
    return [shape[0], shape[1]]


def _heads_first(x):
    """`[batch, length, num_heads, dim]` <-> `[batch, num_heads, length, dim]` (its own inverse).

    With a length of 1 (a decoding step) the swap moves no data: a reshape to a
    constant shape, not a Transpose op.
    """
    _, a, b, dim = x.shape
    if 1 in (a, b) and None not in (a, b, dim):
        return tf.reshape(x, [-1, b, a, dim])
    return tf.transpose(x, [0, 2, 1, 3])


def _grows(heads):
    """Whether a self-attention cache grows by each write, decided when the call is traced.

    Yes when its length is unknown outside XLA: the decoding loops'
    `tf.while_loop` leaves the length of their growing caches free. A cache of
    known length may be a fixed buffer (`empty_cache(batch, n)`), and under
    XLA every cache is one: those are written in place.
    """
    return heads.shape[2] is None and not in_xla_context()


def _write_at(heads, index, update, grows):
    """`heads` `[batch, num_heads, length, key_dim]` with `update` `[batch, num_heads, n, key_dim]`
    written at positions `index ... index + n - 1`; a cache of length `index` grows by n.

    A cache that `grows` (see `_grows`) has length `index`: the write is an append.

    Inside `tf.function(jit_compile=True)` the cache is a fixed buffer and this
    is XLA's in-place `dynamic_update_slice`. Outside XLA it is a concat of
    core ops, not `keras.ops.slice_update`, whose TensorFlow kernel is the XLA
    op `XlaDynamicUpdateSlice`: the stock TF Serving model server will not run
    that outside XLA. The concat copies the cache, as any write outside XLA
    does, but a growing cache holds only the positions decoded so far.
    """
    update = tf.cast(update, heads.dtype)
    index = tf.cast(index, tf.int32)
    if grows:
        return tf.concat([heads, update], axis=2)
    if in_xla_context():
        return keras.ops.slice_update(heads, tf.stack([0, 0, index, 0]), update)
    return tf.concat([heads[:, :, :index], update, heads[:, :, index + tf.shape(update)[2]:]], axis=2)


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
