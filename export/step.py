"""One decoder step of the TensorFlow serving engine: the library's own cached step, specialised for a CPU graph.

`decode_step` turns the token at position t into the logits of position t + 1 with the library's layers
(`keras_transformer.Transformer`): the target embedding, the decoder's cached call (each layer's
self-attention over its cache, cross-attention over the source's keys and values projected once, the
feed-forward network, the residual blocks, the final norm), then the output projection. What a step
computes is the library's (`Transformer.decode_step`); the engine chooses how two parts of it run,
through the layers' documented extension API (`keras_transformer.attention.AttentionOps`):

- fixed or growing shapes is the caller's explicit `fixed_shapes` (decided where the export decides
  XLA). Growing (the graph the stock model server runs): the self-attention cache starts empty and
  grows by the new position, a concat of core ops, and one new query reads it without a causal mask.
  Fixed (for `tf.function(jit_compile=True)`): the cache is a buffer written in place with
  `keras.ops.slice_update`, whose TensorFlow kernel `XlaDynamicUpdateSlice` the stock TF Serving model
  server runs only with `--xla_cpu_compilation_enabled`;
- outside XLA, the attention product of a step on Eigen's float32 batched matmul with the softmax
  written out (`GraphAttentionOps`).

Outside XLA a step's Q, K and V projections are three matmuls (`GraphAttentionOps.project`: no copy of
the kernels at every step), and the output projection reads a `[d_model, vocab]` kernel, stored so by
`engine_model(..., untie_output_projection=True)`, which `Translator` passes for every decoder: oneDNN's
matmul reads the tied embedding, `[vocab, d_model]`, transposed, and more slowly (docs/design.md, "How the
engine stores its weights"). `Translator.from_model_dir` also stores that kernel
as one column block per decoding loop (`engine_weights.ColumnBlocks`): independent matmuls, which the
inter-op threads a lone loop leaves idle run at once.

Beam hypotheses read their sentence's cross-attention keys and values by broadcasting (the layer's
grouped cross-attention cache), so the cache is neither repeated per hypothesis nor copied when
sentences leave the batch. `uncached_logits` is the decoder by its definition, the library's full pass
(no cache): the slow reference of `--no-cache` exports. The library's own decoding is the reference
this step must equal (tests/test_engine.py).
"""

import tensorflow as tf

from export.tf_internals import eigen_batch_matmul
from keras_transformer.attention import AttentionOps
from keras_transformer.linear import project_heads
from keras_transformer.masking import MASKED_SCORE


class GraphAttentionOps(AttentionOps):
    """The cached attention of a step on a TensorFlow CPU graph. With growing shapes (outside XLA): the
    Q, K and V projections as three matmuls, and the product on Eigen's batched matmul (`attend_on_eigen`);
    with fixed shapes XLA compiles the layer's own.

    The layer's default projection puts the three kernels side by side for one matmul: in a TensorFlow
    while loop that concatenation (3 d_model^2 weights) runs again in every layer at every step. Three
    matmuls read each kernel where it is stored."""

    def project(self, x, denses):
        if not self.growing_cache:
            return super().project(x, denses)
        return [project_heads(x, [dense])[0] for dense in denses]

    def attend(self, query, key, value, mask):
        if not self.growing_cache:
            return super().attend(query, key, value, mask)
        return attend_on_eigen(query, key, value, mask)


def decode_step(model, token_ids, cache_index, source_mask, cache, fixed_shapes=False):
    """One step of incremental decoding.

    Args:
        model: a built `keras_transformer.Transformer`.
        token_ids: `[rows]` the target token at position `cache_index`.
        cache_index: scalar int, its position (0 for the start token), where its keys and values are
            written in the self-attention cache.
        source_mask: `[sentences, source_len]` bool, True at real source tokens; `rows` is a multiple
            of `sentences` (beam search's hypotheses, consecutive rows of a sentence).
        cache: `model.init_decoding_cache(encoder_output, cache_length)` (`cache_length` 0 with growing
            shapes) or the previous step's: self-attention per row, cross-attention per sentence.
        fixed_shapes: True for XLA (`tf.function(jit_compile=True)`, which needs every shape fixed): the
            self-attention cache is a buffer of `cache_length` positions, written in place, and read under
            a causal mask. False (default): the cache grows by one position a step, with core ops only,
            the graph the stock TF Serving model server runs.

    Returns:
        (float32 logits `[rows, vocab]` for position `cache_index + 1`, the updated cache).
    """
    return model.decode_step(token_ids, cache_index, None, source_mask, cache,
                             attention_ops=GraphAttentionOps(growing_cache=not fixed_shapes))


def attend_on_eigen(query, key, value, mask):
    """Equation 1 for a decoding step's queries, outside XLA (`AttentionOps.attend`'s contract).

    query `[..., num_heads, query_len, dim]` (already scaled), key and value `[..., num_heads, key_len, dim]`
    (the leading axes broadcast), mask None or bool broadcastable to the weights. The products run on
    Eigen's batched matmul in float32 (`eigen_batch_matmul`: oneDNN's pays a fixed cost for each of the
    step's ~100 small products); scores, weights and output are rounded to `value`'s dtype where the
    full pass rounds them. The softmax is written out: oneDNN's softmax kernel pays a fixed cost a call
    whatever its size, a visible part of a batch-1 step. Elementwise products and sums were cheaper still
    at batch 1, but a sentence's result then depended on its batch, and the cached step no longer equalled
    the full pass token for token (docs/design.md, "The one-position attention on Eigen").
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


def uncached_logits(model, target_ids, encoder_output, source_mask):
    """The decoder by its definition: logits `[rows, target_len, vocab]` of every position of `target_ids`
    `[rows, target_len]` (start id first): the library's own full pass (`Transformer.decode`), no cache.

    The slow reference the cached step must equal (`use_cache=False`). `encoder_output` and `source_mask`
    are one per row.
    """
    return model.decode(target_ids, encoder_output, source_mask, training=False)
