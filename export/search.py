"""The serving engine's searches: greedy decoding and beam search as `tf.while_loop`s over
`export.step.decode_step`, and `parallel_decode`, a batch in N loops at once.

They are the library's searches (`keras_transformer.greedy_decode` / `beam_search`: in float32 the
same tokens, and the same scores to float precision, tests/test_engine.py), written for a TensorFlow
serving graph on CPU, which is why they live in `export/`:

- with growing shapes (the default), sentences that are done leave the batch (about a third of a length-sorted batch's
  row-steps were spent on sentences already done), and the self-attention cache grows with the output;
  with `fixed_shapes=True`, for XLA (`tf.function(jit_compile=True)`, `kt-export --xla-max-batch`;
  the caller that decides XLA passes it, `check_shapes`), every shape is fixed: every
  row stays, the cache is a buffer for the longest output, and the output bound is read from the
  source's static padded length;
- each step reads the vocabulary twice (the log-softmax, then a top-k by blocks, `_top_k`), and the
  bans (padding; only the end token at the length limit) apply to each row's best few tokens;
- `parallel_decode` splits a batch into independent loops the executor runs at once.

Everything is core TensorFlow (plus XLA's ops only under `jit_compile`), so the loops export to a
SavedModel that the stock TF Serving model server runs. Padding masks come from the source ids.

Scores are log P(output | source) / lp(output), with the length penalty
lp(y) = ((5 + |y|) / 6)^alpha (Wu et al., 2016; tensor2tensor), |y| counting
the end token. Beam search ranks finished hypotheses by it; greedy decoding
reports the same quantity so the two compare.
"""

from typing import Any, NamedTuple

import tensorflow as tf

from export.step import decode_step, init_cache, uncached_logits
from export.tf_internals import in_xla_context
from keras_transformer.decoding import EXTRA_OUTPUT_LENGTH, length_penalty, output_bound  # noqa: F401 (re-exported)
from keras_transformer.decoding import (  # the beam's bookkeeping and the options' rules, the library's own
    Sampling, _beam_update, _prefix_tokens, _sampled_token, _write_column)
from keras_transformer.masking import MASKED_SCORE, PAD_ID


# ------------------------------------------------------------------ greedy decoding


class _GreedyState(NamedTuple):
    """The greedy loop's state. The fields from `rows` to `cache` are the rows still decoding (all
    rows under XLA; outside it, finished rows leave, so a step computes only what is still needed);
    `tokens`, `log_prob_out` and `lengths_out` hold every row of the batch."""

    cache_index: tf.Tensor  # scalar: the position the decoder reads this step (0: the start token)
    rows: tf.Tensor  # [active] each active row's row in the batch
    last: tf.Tensor  # [active] the token at `cache_index`
    finished: tf.Tensor  # [active] bool: the end token is out (always False once rows leave)
    log_prob: tf.Tensor  # [active] log P(output so far)
    lengths: tf.Tensor  # [active] output tokens, the end token included
    memory: Any  # (encoder output, source padding mask, output limits, sampling or ()) of the active rows
    cache: Any  # export.step.init_cache of the active rows, or {} without the cache
    tokens: tf.Tensor  # [batch, steps] the output, padding after the end token
    log_prob_out: tf.Tensor  # [batch] each row's log_prob, as of its last step
    lengths_out: tf.Tensor  # [batch] each row's length, as of its last step


# The greedy fields of the active rows, which a finished row leaves.
_GREEDY_ROW_FIELDS = ("rows", "last", "finished", "log_prob", "lengths", "memory")


def greedy_decode(model, source_ids, start_id, end_id, max_length=None, alpha=0.6, use_cache=True, sampling=None,
                  fixed_shapes=False):
    """`keras_transformer.greedy_decode` (the same tokens and scores) on the engine's step.

    Rows that end leave the batch (outside XLA). Arguments as the library's, plus `use_cache=False`: a
    full pass every step (same tokens, slower; the reference of `--no-cache` exports), and `sampling`:
    a `keras_transformer.decoding.Sampling` of `[batch]` tensors for `keras_transformer.sample_decode`
    (the same draws: the library's own choice of token, `_sampled_token`). `fixed_shapes`: see
    `check_shapes`.

    Returns:
        tokens: int32 `[batch, length]`, ending with `end_id` (unless cut at the limit), padded with 0
            after it and trimmed to the longest; no start token.
        scores: float32 `[batch]`, log-probability / length penalty.

    Wrap the call in `tf.function`.
    """
    check_shapes(fixed_shapes)
    encoder_output, source_mask, limits, steps = _prepare(model, source_ids, max_length, fixed_shapes)
    batch_size = tf.shape(encoder_output)[0]
    next_logits = _next_logits_fn(model, start_id, use_cache, fixed_shapes)

    def step(state):
        encoder_output, source_mask, limits, row_sampling = state.memory
        outputs = tf.gather(state.tokens, state.rows) if not use_cache else None
        logits, cache = next_logits(state.cache_index, state.last, outputs, state.cache, encoder_output, source_mask)
        at_limit = state.cache_index + 1 >= limits
        if sampling is None:
            best = _most_likely_token(logits, at_limit, end_id)
        else:
            drawn = _sampled_token(tf.cast(logits, tf.float32), at_limit, end_id, row_sampling, state.cache_index)
            best = _NextTokens(drawn.log_prob[:, None], drawn.token[:, None])
        token, _, log_prob, ends = _greedy_step(
            best, state.cache_index, None, state.log_prob, state.finished, end_id
        )
        lengths = state.lengths + tf.cast(~state.finished, tf.int32)
        at = tf.stack([state.rows, tf.fill(tf.shape(state.rows), state.cache_index)], axis=1)
        state = state._replace(
            cache_index=state.cache_index + 1,
            last=token,
            finished=state.finished | ends,
            log_prob=log_prob,
            lengths=lengths,
            cache=cache,
            tokens=tf.tensor_scatter_nd_update(state.tokens, at, token),
            log_prob_out=tf.tensor_scatter_nd_update(state.log_prob_out, state.rows[:, None], log_prob),
            lengths_out=tf.tensor_scatter_nd_update(state.lengths_out, state.rows[:, None], lengths),
        )
        # Finished rows leave (outside XLA): rows that were finished left at their last step, so the
        # rows finished now are those that just ended.
        return _leave_when_done(state, state.finished, _GREEDY_ROW_FIELDS, fixed_shapes)

    def not_done(state):
        return tf.logical_and(state.cache_index < steps, tf.logical_not(tf.reduce_all(state.finished)))

    state = _GreedyState(
        cache_index=tf.constant(0),
        rows=tf.range(batch_size),
        last=tf.fill([batch_size], tf.cast(start_id, tf.int32)),
        finished=tf.zeros([batch_size], tf.bool),
        log_prob=tf.zeros([batch_size], tf.float32),
        lengths=tf.zeros([batch_size], tf.int32),
        # The sampling settings leave with their rows; () without sampling.
        memory=(encoder_output, source_mask, limits, () if sampling is None else Sampling(*sampling)),
        cache=init_cache(model, encoder_output, steps if fixed_shapes else 0) if use_cache else {},
        tokens=tf.zeros([batch_size, steps], tf.int32),
        log_prob_out=tf.zeros([batch_size], tf.float32),
        lengths_out=tf.zeros([batch_size], tf.int32),
    )
    state = _while_loop(not_done, step, state)
    return _trim(state.tokens), state.log_prob_out / length_penalty(state.lengths_out, alpha)


# ------------------------------------------------------------------ beam search


class _BeamState(NamedTuple):
    """The beam loop's state; every field but `cache_index` has the batch (sentences) first.

    A sentence has k + 1 rows: its k beams, then its greedy hypothesis. The
    batch is the sentences still searching (all of them under XLA; outside
    it, a sentence leaves once it is done), except in `best_tokens` and
    `best_scores`, which hold every sentence of the input.
    """

    cache_index: tf.Tensor  # scalar: the position the decoder reads this step (0: the start token)
    last: tf.Tensor  # [batch, k + 1] each row's token at `cache_index`
    alive_tokens: tf.Tensor  # [batch, k, steps] the beams' outputs so far
    alive_log_prob: tf.Tensor  # [batch, k] their log-probabilities, best first
    finished_tokens: tf.Tensor  # [batch, k, steps] the best finished hypotheses
    finished_scores: tf.Tensor  # [batch, k] their scores, best first; MASKED_SCORE for none
    num_finished: tf.Tensor  # [batch] how many beams have ended
    beam_done: tf.Tensor  # [batch] bool: the beams can change nothing more
    greedy_tokens: tf.Tensor  # [batch, steps] the greedy hypothesis
    greedy_log_prob: tf.Tensor  # [batch]
    greedy_done: tf.Tensor  # [batch] bool: it has ended, or cannot win any more
    sentences: tf.Tensor  # [batch] each sentence's row in the input batch
    limits: tf.Tensor  # [batch] each sentence's most output tokens
    memory: Any  # (encoder output, source mask, prefix ids or ()), one per sentence
    cache: Any  # init_cache: self-attention per row [batch * (k + 1)], cross-attention per sentence; or {}
    best_tokens: tf.Tensor  # [input batch, steps] each input sentence's best finished hypothesis ([.., n, steps]: n best)
    best_scores: tf.Tensor  # [input batch] its score ([input batch, n]: theirs)


# The beam fields of the sentences still searching, which a done sentence leaves.
_BEAM_SENTENCE_FIELDS = (
    "last", "alive_tokens", "alive_log_prob", "finished_tokens", "finished_scores", "num_finished",
    "beam_done", "greedy_tokens", "greedy_log_prob", "greedy_done", "sentences", "limits", "memory")


def beam_search(model, source_ids, start_id, end_id, beam_size=4, alpha=0.6, max_length=None, use_cache=True,
                n_best=None, prefix_ids=None, fixed_shapes=False):
    """`keras_transformer.beam_search` (the same hypotheses, scores and early stop) on the engine's step.

    Each sentence's k beams and its greedy hypothesis are k + 1 rows of one loop; a sentence whose rows
    can change nothing more leaves the batch (outside XLA). The beam's bookkeeping is the library's own
    (`keras_transformer.decoding`), gathering rows with one `tf.gather` op.

    Args:
        model: a `keras_transformer.Transformer`.
        source_ids: int `[batch, source_len]`, padded with 0.
        start_id, end_id: the target's start and end token ids.
        beam_size: hypotheses kept per sentence (4 in the paper).
        alpha: length-penalty exponent (0.6 in the paper).
        max_length: most output tokens; by default source length + 50.
        use_cache: False recomputes the whole prefix every step (same result, slower; the reference
            of `--no-cache` exports).
        n_best: None, or the n (1 to `beam_size`) best different finished hypotheses, as the library's.
        prefix_ids: None, or int32 `[batch, p]`, the tokens each output begins with, as the library's.
        fixed_shapes: see `check_shapes`.

    Returns:
        tokens: int32 `[batch, length]`, the best finished hypothesis, padded with 0 after `end_id`,
            trimmed to the longest; with `n_best`, `[batch, n_best, length]`.
        scores: float32 `[batch]`, its log-probability / length penalty; with `n_best`, `[batch, n_best]`.

    Wrap the call in `tf.function`.
    """
    k = beam_size
    if n_best is not None and not 1 <= n_best <= k:
        raise ValueError(f"n_best must be from 1 to beam_size ({k}), got {n_best}")
    # The single-best search keeps its own (smaller) fields: its graph is what serving_default runs.
    best = (lambda x: x[:, 0]) if n_best is None else (lambda x: x[:, :n_best])
    best_shape = [] if n_best is None else [n_best]
    rows = k + 1  # per sentence: k beams, then the greedy hypothesis
    check_shapes(fixed_shapes)
    encoder_output, source_mask, limits, steps = _prepare(model, source_ids, max_length, fixed_shapes)
    batch_size = tf.shape(encoder_output)[0]
    cache = init_cache(model, encoder_output, steps if fixed_shapes else 0) if use_cache else {}
    if use_cache:
        # Every hypothesis gets a row of the self-attention cache: [batch * rows, ...], sentence-major.
        # The cross-attention cache stays one per sentence: a sentence's rows attend to it together.
        cache["self_attention"] = tf.nest.map_structure(lambda c: tf.repeat(c, rows, axis=0), cache["self_attention"])
    # The prefix leaves with its sentence; () without one.
    memory = (encoder_output, source_mask, () if prefix_ids is None else tf.cast(prefix_ids, tf.int32))
    next_logits = _next_logits_fn(model, start_id, use_cache, fixed_shapes)

    def step(state):
        cache_index, limits, (encoder_output, source_mask, prefix) = state.cache_index, state.limits, state.memory
        batch_size = tf.shape(state.last)[0]
        outputs = tf.concat([state.alive_tokens, state.greedy_tokens[:, None]], axis=1)
        outputs = tf.reshape(outputs, [batch_size * rows, -1])
        logits, cache = next_logits(
            cache_index, tf.reshape(state.last, [-1]), outputs, state.cache, encoder_output, source_mask
        )
        forced = None if prefix_ids is None else tf.repeat(_prefix_tokens(prefix, cache_index), rows)
        best_next = _next_tokens(logits, cache_index + 1 >= tf.repeat(limits, rows), end_id, 2 * k, forced)
        n = -1 if best_next.token.shape[-1] is None else best_next.token.shape[-1]  # static: no shape ops per step
        best_next = _NextTokens(*(tf.reshape(x, [batch_size, rows, n]) for x in best_next))

        state, source_row = _beam_update(state, best_next, cache_index, limits, end_id, k, alpha, _gather_rows,
                                         n_best=n_best)
        sentences = state.sentences[:, None]
        state = state._replace(
            cache_index=cache_index + 1,
            cache=_reorder_cache(cache, source_row) if use_cache else cache,
            best_tokens=tf.tensor_scatter_nd_update(state.best_tokens, sentences, best(state.finished_tokens)),
            best_scores=tf.tensor_scatter_nd_update(state.best_scores, sentences, best(state.finished_scores)),
        )
        return _leave_when_done(state, state.beam_done & state.greedy_done, _BEAM_SENTENCE_FIELDS, fixed_shapes,
                                rows)

    def not_done(state):
        return tf.logical_and(
            state.cache_index < steps, tf.logical_not(tf.reduce_all(state.beam_done & state.greedy_done))
        )

    first_beam_only = tf.concat([[0.0], tf.fill([k - 1], MASKED_SCORE)], axis=0)
    state = _BeamState(
        cache_index=tf.constant(0),
        last=tf.fill([batch_size, rows], tf.cast(start_id, tf.int32)),
        alive_tokens=tf.zeros([batch_size, k, steps], tf.int32),
        alive_log_prob=tf.tile(first_beam_only[None], [batch_size, 1]),
        finished_tokens=tf.zeros([batch_size, k, steps], tf.int32),
        finished_scores=tf.fill([batch_size, k], MASKED_SCORE),
        num_finished=tf.zeros([batch_size], tf.int32),
        beam_done=tf.zeros([batch_size], tf.bool),
        greedy_tokens=tf.zeros([batch_size, steps], tf.int32),
        greedy_log_prob=tf.zeros([batch_size], tf.float32),
        greedy_done=tf.zeros([batch_size], tf.bool),
        sentences=tf.range(batch_size),
        limits=limits,
        memory=memory,
        cache=cache,
        best_tokens=tf.zeros([batch_size, *best_shape, steps], tf.int32),
        best_scores=tf.fill([batch_size, *best_shape], MASKED_SCORE),
    )
    state = _while_loop(not_done, step, state)
    return _trim(state.best_tokens), state.best_scores


def _gather_rows(x, index):
    """`x` `[batch, n, ...]` -> `[batch, m, ...]`: each sentence's rows `index` `[batch, m]`, as one op."""
    return tf.gather(x, index, batch_dims=1)


def _reorder_cache(cache, source_row):
    """Each row takes the self-attention keys/values of row `source_row` `[batch, rows]` of its sentence."""
    batch_size, rows = tf.shape(source_row)[0], tf.shape(source_row)[1]
    reorder = tf.reshape(tf.range(batch_size)[:, None] * rows + source_row, [-1])
    return {
        "self_attention": tf.nest.map_structure(lambda c: tf.gather(c, reorder), cache["self_attention"]),
        # Identical for every row of a sentence: nothing to reorder.
        "cross_attention": cache["cross_attention"],
    }


# ------------------------------------------------------------------ what both searches share


def check_shapes(fixed_shapes):
    """Checks the searches' `fixed_shapes` against where they are traced.

    `fixed_shapes` is how the search runs, decided by the caller that decides XLA (`Translator`):
    True for `tf.function(jit_compile=True)`, where XLA needs every shape fixed (every row stays in
    the batch to the end, the self-attention cache is a buffer for the longest output, the loop's bound
    comes from the source's static padded length); False for the graph that the stock model server
    runs (rows that are done leave the batch, the cache grows). Growing shapes cannot compile under
    XLA: that mistake gets this error rather than XLA's.
    """
    if in_xla_context() and not fixed_shapes:
        raise ValueError("This search is traced inside tf.function(jit_compile=True): pass fixed_shapes=True "
                         "(XLA needs every shape fixed; the default, growing shapes, is the graph TF Serving runs)")


def _prepare(model, source_ids, max_length, fixed_shapes):
    """Encoder output, padding mask, per-sentence output limits `[batch]` and the loop's most steps."""
    source_ids = tf.convert_to_tensor(source_ids)
    if source_ids.shape.rank != 2:
        raise ValueError(f"Decoding expects source_ids of shape [batch, source_len], got shape {source_ids.shape}.")
    source_ids = tf.cast(source_ids, tf.int32)
    source_mask = tf.not_equal(source_ids, PAD_ID)
    if not model.built:  # a model never called: decoding may be the first thing it does
        model.build()

    # The library's rule (source length + 50, or max_length; within a learned table; at least 1), per
    # sentence, so a sentence decodes the same alone or in any batch.
    limits = tf.broadcast_to(
        tf.cast(output_bound(model, tf.reduce_sum(tf.cast(source_mask, tf.int32), axis=1), max_length), tf.int32),
        [tf.shape(source_ids)[0]])
    if fixed_shapes:
        # A bound XLA knows when it compiles for this input shape. The batch's largest limit is read
        # from the data, and buffers sized by it made the compiled loop much slower (greedy, batch 64;
        # BENCHMARKS.md, "With small batches under XLA").
        steps = tf.cast(output_bound(model, tf.shape(source_ids)[1], max_length), tf.int32)
    else:
        steps = tf.reduce_max(tf.concat([limits, [1]], axis=0))  # 1 for an empty batch
    return model.encode(source_ids, training=False), source_mask, limits, steps


def _next_logits_fn(model, start_id, use_cache, fixed_shapes):
    """`(cache_index, last [rows], outputs [rows, steps], cache, encoder_output, source_mask)
    -> (logits [rows, vocab], cache)`.

    With the cache, one decoder step for the token at position `cache_index`.
    Without it, the whole prefix again (start id + outputs so far), as
    decoding is defined: the slow reference the cache must equal.
    """
    if use_cache:
        def next_logits(cache_index, last, outputs, cache, encoder_output, source_mask):
            return decode_step(model, last, cache_index, source_mask, cache, fixed_shapes)
    else:
        def next_logits(cache_index, last, outputs, cache, encoder_output, source_mask):
            start = tf.fill([tf.shape(outputs)[0], 1], tf.cast(start_id, tf.int32))
            prefix = tf.concat([start, outputs[:, :cache_index]], axis=1)
            # The sentence's memory once per row (beam search keeps one per sentence).
            rows = tf.shape(outputs)[0] // tf.shape(encoder_output)[0]
            encoder_output, source_mask = (tf.repeat(x, rows, axis=0) for x in (encoder_output, source_mask))
            return uncached_logits(model, prefix, encoder_output, source_mask)[:, cache_index], cache
    return next_logits


class _NextTokens(NamedTuple):
    """Each row's most likely next tokens, best first, each `[rows, n]`."""

    log_prob: tf.Tensor  # log P(token | the row so far): log-softmax over the whole vocabulary
    token: tf.Tensor


def _block_length(vocab_size, n):
    """The block length `_top_k` splits a row of `vocab_size` logits into, for its `n` largest.

    A divisor d of the vocabulary size, so the row reshapes into blocks
    without a copy, with the fewest elements for the two small top_k's
    (vocab / d block maxima, then n blocks of d); None where no divisor
    halves the elements of a top_k over the whole row (a prime size).
    """
    if vocab_size is None:
        return None
    cost = {d: vocab_size // d + n * d for d in range(2, vocab_size // n + 1) if vocab_size % d == 0}
    best = min(cost, key=cost.get, default=None)
    return best if best is not None and cost[best] < vocab_size // 2 else None


def _top_k(values, n):
    """`tf.math.top_k(values, n)` of `[rows, vocab]`: the n largest of each row and their ids, best
    first, ties to the lower id.

    TF's CPU TopK costs the same per element whatever n is, so over
    [320, 8000] (beam 4 at batch 64, Multi30k's vocabulary) it is a costly
    part of a step. The n largest lie in the n blocks with the largest maxima,
    so top_k runs over the block maxima, then over those n blocks only:
    several times faster, and exact (BENCHMARKS.md, "Beam search without
    [hypotheses, vocab] passes").
    """
    block = _block_length(values.shape[-1], n)
    if block is None:
        return tf.math.top_k(values, n)
    rows, num_blocks = tf.shape(values)[0], values.shape[-1] // block
    blocks = tf.reshape(values, [rows, num_blocks, block])
    _, best_blocks = tf.math.top_k(tf.reduce_max(blocks, axis=-1), n)
    best_blocks = tf.sort(best_blocks, axis=-1)  # in id order, so ties still go to the lower id
    top, index = tf.math.top_k(tf.reshape(tf.gather(blocks, best_blocks, batch_dims=1), [rows, n * block]), n)
    return top, tf.gather(best_blocks, index // block, batch_dims=1) * block + index % block


def _most_likely_token(logits, at_limit, end_id):
    """Each row's most likely next token (`_NextTokens` `[rows, 1]`) from float32 logits `[rows, vocab]`.

    Never padding; at its limit (`at_limit` `[rows]` bool, or None for no
    limits) a row may only end. Its log-probability is the log-softmax over
    the whole vocabulary. The bans cost a pass over [rows, vocab] for the
    padding column and none for the limit, where a mask of every banned
    token cost three.
    """
    log_probs = tf.nn.log_softmax(logits, axis=-1)
    token = tf.argmax(log_probs + _padding_bias(logits), axis=-1, output_type=tf.int32)
    if at_limit is not None:
        token = tf.where(at_limit, end_id, token)
    return _NextTokens(tf.gather(log_probs, token, batch_dims=1)[:, None], token[:, None])


def _padding_bias(logits):
    """`[vocab]` for logits `[rows, vocab]`: MASKED_SCORE at the padding id, 0 elsewhere (a constant if vocab is static)."""
    vocab_size = logits.shape[-1] if logits.shape[-1] is not None else tf.shape(logits)[-1]
    return tf.one_hot(PAD_ID, vocab_size, on_value=MASKED_SCORE, off_value=0.0)


def _next_tokens(logits, at_limit, end_id, n, forced=None):
    """Each row's `n` most likely next tokens (`_NextTokens` `[rows, n]`) from float32 logits `[rows, vocab]`.

    Never padding; at its limit (`at_limit` `[rows]` bool) a row may only end:
    `end_id`, then `MASKED_SCORE` entries; so may a row with a `forced` token (`[rows]`
    int32, -1 for none: a target prefix; None: no prefix) only take that one.
    Log-probabilities are the log-softmax over the whole vocabulary. Only the
    log-softmax and the top-k pass over [rows, vocab]; the bans are applied to
    the n + 1 best.
    """
    n = min(n, logits.shape[-1] - 1) if logits.shape[-1] is not None else n
    log_probs = tf.nn.log_softmax(logits, axis=-1)
    top, tokens = _top_k(log_probs, n + 1)  # one more: padding may be among them
    log_prob, keep = tf.math.top_k(tf.where(tokens == PAD_ID, MASKED_SCORE, top), n)
    first = tf.range(n) == 0
    tokens = tf.gather(tokens, keep, batch_dims=1)
    if forced is not None:  # a prefix's token, where a row has one (before the limit's end, which comes first)
        forced_log_prob = tf.gather(log_probs, tf.maximum(forced, 0), batch_dims=1)[:, None]
        log_prob = tf.where((forced >= 0)[:, None], tf.where(first, forced_log_prob, MASKED_SCORE), log_prob)
        tokens = tf.where((forced >= 0)[:, None], tf.where(first, forced[:, None], PAD_ID), tokens)
    end_log_prob = tf.gather(log_probs, end_id, axis=1)
    return _NextTokens(
        log_prob=tf.where(at_limit[:, None], tf.where(first, end_log_prob[:, None], MASKED_SCORE), log_prob),
        token=tf.where(at_limit[:, None], tf.where(first, end_id, PAD_ID), tokens),
    )


def _greedy_step(best, cache_index, tokens, log_prob, done, end_id):
    """A greedy hypothesis grows by its most likely token (`best`, `_NextTokens`; PAD, log-probability 0, once done).

    Returns the token `[rows]`, the tokens with it written at `cache_index`,
    the new log-probability, and whether the token ends the hypothesis.
    """
    token, token_log_prob = tf.where(done, PAD_ID, best.token[:, 0]), tf.where(done, 0.0, best.log_prob[:, 0])
    tokens = None if tokens is None else _write_column(tokens, cache_index, token)
    return token, tokens, log_prob + token_log_prob, tf.equal(token, end_id)


def _while_loop(cond, body, state):
    """`tf.while_loop` over a `NamedTuple` state with a free batch size.

    `cond` and `body` take the state; the batch is the first axis of every
    field but the scalar `cache_index`, and static sizes elsewhere are kept,
    except the cache's length axis (`[batch, num_heads, length, key_dim]`),
    which grows outside XLA.
    """

    def free_batch(x):
        return tf.TensorShape([None] + x.shape.as_list()[1:])

    def free_length(x):
        return tf.TensorShape([None, x.shape[1], None, x.shape[3]])

    invariants = tf.nest.map_structure(free_batch, state)._replace(
        cache_index=tf.TensorShape([]), cache=tf.nest.map_structure(free_length, state.cache)
    )
    fields = type(state)
    return tf.while_loop(
        lambda *s: cond(fields(*s)), lambda *s: body(fields(*s)), state, shape_invariants=invariants
    )


def _leave_when_done(state, done, names, fixed_shapes, rows_per_sentence=1):
    """`state` without its sentences `done` `[batch]` bool (see `_without`); with `fixed_shapes`
    (XLA), `state` itself: every sentence stays."""
    if fixed_shapes:
        return state
    return tf.cond(tf.reduce_any(done), lambda: _without(state, done, names, rows_per_sentence), lambda: state)


def _without(state, done, names, rows_per_sentence):
    """`state` without its sentences `done` `[batch]` bool, whose results are in the state's
    batch-wide fields: the fields `names` cut to the other sentences, and so is the cache, the
    self-attention cache's `rows_per_sentence` rows per sentence (greedy: 1, beam search: k + 1) and the
    cross-attention cache's one entry per sentence."""
    keep = tf.reshape(tf.where(~done), [-1])
    keep_rows = keep
    if rows_per_sentence > 1:
        rows = rows_per_sentence
        keep_rows = tf.reshape(keep[:, None] * rows + tf.range(rows, dtype=keep.dtype)[None], [-1])
    state = _gather_fields(state, keep, names)
    cache = state.cache
    if cache:
        cache = {
            "self_attention": tf.nest.map_structure(lambda c: tf.gather(c, keep_rows), cache["self_attention"]),
            "cross_attention": tf.nest.map_structure(lambda c: tf.gather(c, keep), cache["cross_attention"]),
        }
    return state._replace(cache=cache)


def _gather_fields(state, index, names):
    """`state` with the fields `names` (tensors, or nests of them) cut to the rows `index` `[n]`."""
    return state._replace(**{
        name: tf.nest.map_structure(lambda x: tf.gather(x, index), getattr(state, name)) for name in names
    })


def _trim(tokens):
    """Drop the all-padding columns at the end of `[batch, steps]` (or `[batch, n, steps]`) tokens."""
    lengths = tf.reshape(tf.reduce_sum(tf.cast(tokens != PAD_ID, tf.int32), axis=-1), [-1])
    return tokens[..., :tf.reduce_max(tf.concat([lengths, [0]], 0))]


# ------------------------------------------------------------------ parallel loops


def parallel_decode(search, source_ids, num_loops, *row_inputs):
    """`search(source_ids, *row_inputs)` as `num_loops` independent decoding loops, each over every
    num_loops-th row.

    Args:
        search: `(source_ids [n, source_len], *row_inputs) -> (tokens [n, length], scores [n])`,
            e.g. `lambda ids: greedy_decode(model, ids, start_id, end_id)`;
            it must decode a sentence the same in any batch, as
            `greedy_decode` and `beam_search` do.
        source_ids: int `[batch, source_len]`, padded with 0.
        num_loops: how many loops (1: `search(source_ids, *row_inputs)` itself).
        row_inputs: more per-sentence tensors `[batch, ...]` (a target prefix,
            sampling settings), split into the loops with their rows.

    Returns:
        What `search(source_ids)` returns: tokens `[batch, length]` (0-padded)
        and scores `[batch]`, row for row.

    Why: outside XLA, a decoding step is some 400 small ops that TensorFlow's
    executor runs one after another, so one loop keeps about one core busy,
    however many threads a matmul may split over. Independent loops in one
    graph run at once on the executor's inter-op threads. Row i goes to loop
    i mod num_loops, so the loops of a length-sorted batch get sentences of
    the same lengths and end together. Give the session N inter-op threads
    and 1 intra-op thread: served on a 2-core EPYC at batch 64, side by side
    on those threads, 2 loops decoded faster than one loop, greedy and beam 4;
    on TensorFlow's default threads (2 of each) they gained
    little: each loop's matmuls then wait for intra-op
    threads the other loop holds (BENCHMARKS.md, "Two decoding loops per
    batch"). Under XLA the whole search is one compiled program: pass 1.
    """
    if num_loops < 1:
        raise ValueError(f"num_loops must be >= 1, got {num_loops}")
    if num_loops == 1:
        return search(source_ids, *row_inputs)
    source_ids = tf.convert_to_tensor(source_ids)
    batch_size = tf.shape(source_ids)[0]
    # A loop past the batch's last row gets none (Range rejects a start past its limit).
    rows = [tf.range(loop, tf.maximum(batch_size, loop), num_loops) for loop in range(num_loops)]
    results = [search(*(tf.gather(x, loop_rows) for x in (source_ids, *row_inputs))) for loop_rows in rows]
    length = tf.reduce_max(tf.stack([tf.shape(tokens)[-1] for tokens, _ in results]))
    # Tokens `[n, length]`, or `[n, n_best, length]`: padded on their last axis to the longest loop's.
    tokens = [tf.pad(tokens, [[0, 0]] * (tokens.shape.rank - 1) + [[0, length - tf.shape(tokens)[-1]]])
              for tokens, _ in results]
    return tf.dynamic_stitch(rows, tokens), tf.dynamic_stitch(rows, [scores for _, scores in results])
