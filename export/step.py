"""One decoder step of the TensorFlow serving engine, over its key/value caches.

`decode_step` turns the token at position t into the logits of position t + 1: the target embedding at
t, each decoder layer (self-attention over the cache of earlier positions, cross-attention over the
source's keys and values, projected once by `init_cache`, the feed-forward network), the final norm
and the output projection. It reads the weights of the library's layers (`keras_transformer.Transformer`)
but computes with TensorFlow ops chosen for a CPU serving graph; the library itself stays portable
(`keras.ops`), and its own decoding is the reference this one must equal (tests/test_engine.py).

Why a step is written this way: at batch 1 it costs its ops' dispatch, not its FLOPs (~9 MFLOP), so a
greedy step went from ~510 to ~330 executed ops:

- projections as plain 2-D matmuls on the weights of Keras' `EinsumDense`/`Dense`, the library's own
  (`keras_transformer.linear`: Q, K and V fused into one in self-attention, K and V in cross-attention),
  where Keras' layers are tensordots and einsums with several ops of shape plumbing each;
- caches laid out heads-first, `[batch, heads, length, d_k]`, the layout the attention's batched
  matmuls read (a transpose of the cache was a quarter of a step on CPU), and constant-shape reshapes
  instead of transposes for the one new position;
- with growing shapes (`fixed_shapes=False`, the graph the stock model server runs) the self-attention
  cache grows by the new position (a concat of core ops) and is read without a causal mask; with fixed
  shapes (`fixed_shapes=True`, for `tf.function(jit_compile=True)`) it is a fixed buffer written in
  place with `keras.ops.slice_update`, whose TensorFlow kernel `XlaDynamicUpdateSlice` the stock TF
  Serving model server runs only with `--xla_cpu_compilation_enabled`;
- the one new position's attention on Eigen's float32 batched matmul with the softmax written out
  (`_attend_one_position`);
- beam hypotheses read their sentence's cross-attention keys and values by broadcasting.

`uncached_logits` is the decoder by its definition, the library's own full pass (no cache): the slow
reference of `--no-cache` exports. The caches are the library's layers' own (`empty_cache`,
`compute_cache`).
"""

import math

import keras
import tensorflow as tf

from export.tf_internals import eigen_batch_matmul
from keras_transformer.linear import project_heads, project_output
from keras_transformer.masking import MASKED_SCORE, causal_mask


# ------------------------------------------------------------------ the step


def init_cache(model, encoder_output, max_length):
    """The caches `decode_step` reads: empty self-attention keys/values, and the cross-attention
    keys/values of `encoder_output`, projected once here.

    `max_length`: 0 for a self-attention cache that grows at each step (outside XLA), or the most
    target positions, a fixed buffer (under XLA, which needs fixed shapes).

    Returns `{"self_attention": [...], "cross_attention": [...]}`, one `(keys, values)` pair per
    decoder layer, each tensor `[batch, num_heads, length, key_dim]`: batch first everywhere, so
    beam search reorders every tensor on axis 0.
    """
    layers = model.decoder.decoder_layers
    for layer in layers:
        for attention in (layer.self_attention, layer.cross_attention):
            _check_plain(attention)
    batch_size = tf.shape(encoder_output)[0]
    return {
        "self_attention": [layer.self_attention.empty_cache(batch_size, max_length) for layer in layers],
        "cross_attention": [layer.cross_attention.compute_cache(encoder_output) for layer in layers],
    }


def decode_step(model, token_ids, cache_index, source_mask, cache, fixed_shapes=False):
    """One step of incremental decoding.

    Args:
        model: a built `keras_transformer.Transformer`.
        token_ids: `[rows]` the target token at position `cache_index`.
        cache_index: scalar int, its position (0 for the start token), where its keys and values are
            written in the self-attention cache.
        source_mask: `[sentences, source_len]` bool, True at real source tokens; `rows` is a multiple
            of `sentences` (beam search's hypotheses, consecutive rows of a sentence).
        cache: from `init_cache` or the previous step: self-attention per row, cross-attention per
            sentence.
        fixed_shapes: True for XLA (`tf.function(jit_compile=True)`, which needs every shape fixed): the
            self-attention cache is `init_cache`'s buffer of `max_length` positions, written in place,
            and read under a causal mask. False (default): the cache grows by one position a step,
            with core ops only, the graph the stock TF Serving model server runs.

    Returns:
        (float32 logits `[rows, vocab]` for position `cache_index + 1`, the updated cache).
    """
    x = model.target_embedding(token_ids[:, None], start_index=cache_index, training=False)
    self_attention_cache = []
    for layer, self_cache, source_cache in zip(
        model.decoder.decoder_layers, cache["self_attention"], cache["cross_attention"]
    ):
        x, self_cache = _decoder_layer_step(layer, x, cache_index, source_mask, self_cache, source_cache,
                                            fixed_shapes)
        self_attention_cache.append(self_cache)
    if model.decoder.final_norm is not None:
        x = model.decoder.final_norm(x)
    cache = {"self_attention": self_attention_cache, "cross_attention": cache["cross_attention"]}
    return project(model, x)[:, 0], cache


def _decoder_layer_step(layer, x, cache_index, source_mask, self_cache, source_cache, fixed_shapes):
    """A decoder layer on one position per row: `x` `[rows, 1, d_model]` -> (output, updated self-attention cache)."""
    x, self_cache = _residual_block(
        layer, layer.self_attention_norm, x, lambda h: _self_attention_step(layer.self_attention, h, self_cache,
                                                                             cache_index, fixed_shapes))
    x, _ = _residual_block(
        layer, layer.cross_attention_norm, x,
        lambda h: (_cross_attention_step(layer.cross_attention, h, source_cache, source_mask, fixed_shapes),
                   None))
    x, _ = _residual_block(layer, layer.feed_forward_norm, x, lambda h: (layer.feed_forward(h), None))
    return x, self_cache


def _residual_block(layer, norm, x, sublayer):
    """`sublayer` (-> (output, extra)) in its residual block: post-norm `norm(x + sublayer(x))`,
    pre-norm `x + sublayer(norm(x))`; dropout is off at inference. Returns (x, extra)."""
    y, extra = sublayer(norm(x) if layer.norm_first else x)
    x = x + y
    return (x if layer.norm_first else norm(x)), extra


def project(model, x):
    """Decoder output `[..., d_model]` -> float32 logits `[..., target_vocab]`: the output projection, or
    the tied target embedding as one 2-D matmul (`transpose_b`: the embedding is never transposed)."""
    if model.output_projection is not None:
        logits = model.output_projection(x)
    else:
        embeddings = tf.cast(model.target_embedding.token_embedding.embeddings, x.dtype)
        shape = tf.shape(x)
        logits = tf.matmul(tf.reshape(x, [-1, shape[-1]]), embeddings, transpose_b=True)
        logits = tf.reshape(logits, tf.concat([shape[:-1], tf.shape(embeddings)[:1]], axis=0))
    # float32 logits keep the log-softmax exact under bfloat16.
    return tf.cast(logits, tf.float32)


# ------------------------------------------------------------------ attention over the caches


def _check_plain(attention):
    """A clear error for an attention layer with options beyond the paper's (the engine computes the paper's)."""
    if not attention.is_plain():
        raise ValueError(
            f"The serving engine decodes plain multi-head attention only, not use_gate, sliding_window, "
            f"attention_axes other than the sequence axis, or quantized kernels (layer '{attention.path}')."
        )


def _self_attention_step(attention, x, cache, cache_index, fixed_shapes):
    """Self-attention of one new position per row, `x` `[rows, 1, dim]`, written into `cache` at `cache_index`.

    Returns (output `[rows, 1, dim]`, the cache with the new position's keys and values).
    """
    query, new_keys, new_values = project_heads(
        x, [attention.projections.query, attention.projections.key, attention.projections.value])
    keys = _write_at(cache[0], cache_index, _heads_first(new_keys), fixed_shapes)
    values = _write_at(cache[1], cache_index, _heads_first(new_values), fixed_shapes)
    mask = None
    if fixed_shapes:  # a fixed buffer: the positions after `cache_index` are not written yet
        mask = causal_mask(tf.shape(query)[1], tf.shape(keys)[2], start=cache_index)
    # One new query at the end of a growing cache may attend to all of it: no causal
    # mask to build (the ops of a mask cost more than its arithmetic at one position).
    output = _attend(attention, _heads_first(query), keys, values, mask, fixed_shapes)
    output = _heads_first(output)  # [rows, num_heads, 1, d] -> [rows, 1, num_heads, d]: its own inverse
    return project_output(output, attention.projections.output), (keys, values)


def _cross_attention_step(attention, x, cache, source_mask, fixed_shapes):
    """Cross-attention of one position per row, `x` `[rows, 1, dim]`, over a cache of `sentences`
    sentences, rows = sentences * g (g >= 1 consecutive rows per sentence).

    A sentence's g rows (beam search's hypotheses) read its keys and values through broadcasting, so
    they are neither repeated per hypothesis in the cache (nor copied when sentences leave the batch)
    nor transposed at each step. Returns the output `[rows, 1, dim]`.
    """
    keys, values = cache
    sentences = tf.shape(keys)[0]
    query = tf.reshape(
        project_heads(x, [attention.projections.query])[0], [sentences, -1, attention.num_heads, 1, attention.key_dim]
    )
    mask = source_mask[:, None, :][:, None]  # [sentences, 1, 1, source_len]
    output = _attend(attention, query, keys[:, None], values[:, None], mask, fixed_shapes)
    output = tf.reshape(output, [-1, 1, attention.num_heads, attention.value_dim])
    return project_output(output, attention.projections.output)


def _attend(attention, query, key, value, attention_mask, fixed_shapes=False):
    """Equation 1 on heads-first tensors: query `[..., num_heads, query_len, dim]`, key and value
    `[..., num_heads, key_len, dim]` -> output `[..., num_heads, query_len, value_dim]`; `attention_mask`
    None or True where attention is allowed, broadcastable to `[..., query_len, key_len]` once a
    heads axis is inserted after its first axis. One query position takes `_attend_one_position` in the
    graph, which works around oneDNN's cost per matrix there; with `fixed_shapes` XLA compiles the
    products itself, and the plain form is kept."""
    query = query * tf.cast(1.0 / math.sqrt(float(attention.key_dim)), query.dtype)
    mask = None if attention_mask is None else tf.cast(attention_mask, tf.bool)[:, None]
    if query.shape[-2] == 1 and not fixed_shapes:
        output, _ = _attend_one_position(query, key, value, mask)
        return output
    scores = tf.matmul(query, key, transpose_b=True)
    if mask is None:
        scores = tf.nn.softmax(scores)
    else:
        # As Keras' Softmax does: MASKED_SCORE before, and exact zeros after, so that
        # a row with nothing to attend to gets zero weights, not uniform ones.
        scores = tf.nn.softmax(tf.where(mask, scores, tf.cast(MASKED_SCORE, scores.dtype)))
        scores = tf.where(mask, scores, tf.zeros_like(scores))
    return tf.matmul(scores, value)


def _attend_one_position(query, key, value, mask):
    """Equation 1 for one query position (a decoding step), outside XLA.

    query `[..., num_heads, 1, dim]`, key and value `[..., num_heads, key_len, dim]` (the
    leading axes broadcast), mask None or bool broadcastable to `[..., num_heads, 1, key_len]`.
    The products run on Eigen's batched matmul in float32 (`eigen_batch_matmul`: oneDNN's
    pays a fixed cost for each of the step's ~100 one-row products); scores, weights and
    output are rounded to `value`'s dtype where the full pass rounds them. The softmax is
    written out: oneDNN's softmax kernel pays a fixed cost a call on a
    2-core EPYC whatever its size, a visible part of a batch-1 decoding step for 6 attentions.
    Elementwise products and sums were several times cheaper at batch 1, but a
    sentence's result then depended on its batch (the cheaper form pays only below a size)
    and the cached step no longer equalled the full pass token for token (docs/benchmarks-log.md,
    "Again after cutting the ops of a step").
    Returns the output and the weights.
    """
    # Scores and weights are rounded to the layer's dtype, as the full pass's matmuls round them: in
    # bfloat16, float32 scores and weights made a step differ from the full pass (a greedy output
    # changed token), and a sentence's score depend on its batch (served in batches of 64 and 16).
    dtype = value.dtype
    scores = tf.cast(tf.cast(eigen_batch_matmul(query, key, adjoint_b=True), dtype), tf.float32)
    if mask is not None:
        scores = tf.where(mask, scores, MASKED_SCORE)
    weights = tf.exp(scores - tf.reduce_max(scores, axis=-1, keepdims=True))
    weights = weights / tf.reduce_sum(weights, axis=-1, keepdims=True)
    if mask is not None:  # a row with nothing to attend to gets zero weights, as in the full pass
        weights = tf.where(mask, weights, 0.0)
    weights = tf.cast(weights, dtype)
    return tf.cast(eigen_batch_matmul(weights, value), dtype), weights


def _write_at(heads, index, update, fixed_shapes):
    """`heads` `[batch, num_heads, length, key_dim]` with `update` `[batch, num_heads, 1, key_dim]` written at
    position `index`.

    With growing shapes the cache has length `index` and grows: a concat of core ops, not
    `keras.ops.slice_update`, whose TensorFlow kernel is the XLA op `XlaDynamicUpdateSlice`: the stock
    TF Serving model server will not run that outside XLA. The concat copies the cache, as any write
    outside XLA does, but a growing cache holds only the positions decoded so far (not room for the
    longest possible output, source length + 50, when outputs average 16 tokens on Multi30k). With
    `fixed_shapes` (for `tf.function(jit_compile=True)`) the cache is a fixed buffer and this is XLA's
    in-place `dynamic_update_slice`.
    """
    update = tf.cast(update, heads.dtype)
    index = tf.cast(index, tf.int32)
    if fixed_shapes:
        return keras.ops.slice_update(heads, tf.stack([0, 0, index, 0]), update)
    return tf.concat([heads, update], axis=2)


# ------------------------------------------------------------------ heads


def _heads_first(x):
    """`[batch, length, num_heads, dim]` <-> `[batch, num_heads, length, dim]` (its own inverse).

    With a length of 1 (a decoding step) the swap moves no data: a reshape to a
    constant shape, not a Transpose op.
    """
    _, a, b, dim = x.shape
    if 1 in (a, b) and None not in (a, b, dim):
        return tf.reshape(x, [-1, b, a, dim])
    return tf.transpose(x, [0, 2, 1, 3])


# ------------------------------------------------------------------ without the cache


def uncached_logits(model, target_ids, encoder_output, source_mask):
    """The decoder by its definition: logits `[rows, target_len, vocab]` of every position of `target_ids`
    `[rows, target_len]` (start id first): the library's own full pass (`Transformer.decode`), no cache.

    The slow reference the cached step must equal (`use_cache=False`). `encoder_output` and `source_mask`
    are one per row.
    """
    return model.decode(target_ids, encoder_output, source_mask, training=False)
