"""The serving engine's loops: the library's search strategies run as `tf.while_loop`s over
`export.step.decode_step` (`engine_greedy_decode`, `engine_beam_search`), and `parallel_decode`, a batch in
N loops at once.

Not the library's `keras_transformer.greedy_decode` / `beam_search`, whose tokens these decode: they take
the library's arguments in the library's order plus keyword-only engine options (`use_cache`,
`fixed_shapes`, and `sampling`, a `Sampling` tuple, where the library has `sample_decode`), and return
tokens trimmed to the longest output, where the library's have the loop's fixed width. The two side by
side: docs/library.md, "The two searches: the library's and the serving engine's".

*What* a search computes is the library's (`keras_transformer.strategies`: `Greedy` and `Beam`
choose each token and keep the beam's bookkeeping), so in float32 the engine decodes the library's
tokens, with its scores to float precision (tests/test_engine.py). *How* the loop runs is the
engine's, for a TensorFlow serving graph on CPU:

- with growing shapes (the default), sentences that are done leave the batch with their state
  (about a third of a length-sorted batch's row-steps were spent on sentences already done), and the
  self-attention cache grows with the output; with `fixed_shapes=True`, for XLA
  (`tf.function(jit_compile=True)`, `kt-export --xla-max-batch`; the caller that decides XLA passes
  it, `check_shapes`), every sentence stays and the cache is a buffer for the longest output;
- the strategies' top-k runs by blocks of the vocabulary and their per-row gathers as one op
  (`GraphSearchOps`);
- `parallel_decode` splits a batch into independent loops the executor runs at once.

Everything is core TensorFlow (plus XLA's ops only under `jit_compile`), so the loops export to a
SavedModel that the stock TF Serving model server runs. Padding masks come from the source ids.
"""

from typing import Any, NamedTuple

import tensorflow as tf

from export.step import decode_step, uncached_logits
from export.tf_internals import in_xla_context
from keras_transformer.decoding import EXTRA_OUTPUT_LENGTH, output_bound, prepare  # noqa: F401
from keras_transformer.decoding import length_penalty as penalty_of_length
from keras_transformer.decoding import renamed_search_arguments
from keras_transformer.masking import PAD_ID
from keras_transformer.strategies import NOT_USED, Beam, Greedy, Sampling, SearchOps, check_options, reorder_rows


class GraphSearchOps(SearchOps):
    """The strategies' array ops on a TensorFlow CPU graph: a top-k by blocks of the vocabulary (`_top_k`), a
    per-row gather and a gather of rows as one `tf.gather` op each (`take_along_axis` is a dozen ops and
    `keras.ops.take` four, and a step at batch 1 costs its ops' dispatch) and TensorFlow's own argmax
    (`keras.ops.argmax` adds four passes over `[rows, vocab]` to rank -0.0 below 0.0, which changes a choice
    only where both tie at the top of a row). They compute what `keras.ops` computes, ties included."""

    def top_k(self, values, k):
        return _top_k(values, k)

    def argmax(self, values):
        return tf.argmax(values, axis=-1, output_type=tf.int32)

    def take_rows(self, x, index):
        return tf.gather(x, index, batch_dims=1)

    def gather(self, x, index):
        return tf.gather(x, index)


GRAPH_OPS = GraphSearchOps()


def graph_function(fn, **kwargs):
    """`tf.function` without AutoGraph, for the engine's searches and the export's signatures. Their loops are
    `tf.while_loop`s and their branches `tf.cond`s (the library's strategies run under `jax.jit` too, where
    Python control flow on tensors cannot be), so AutoGraph's conversion of the Python functions a search
    calls changes no graph and was most of the time of tracing one."""
    return tf.function(fn, autograph=False, **kwargs)


# ------------------------------------------------------------------ greedy decoding


@renamed_search_arguments
def engine_greedy_decode(model, source_ids, start_id, end_id, max_output_length=None, length_penalty=0.6, prefix_ids=None,
                         no_repeat_ngram_size=0, extra_output_length=EXTRA_OUTPUT_LENGTH, *, use_cache=True,
                         fixed_shapes=False, sampling=None):
    """`keras_transformer.greedy_decode`'s tokens and scores on the engine's step and loop.

    The library's strategy (`keras_transformer.strategies.Greedy`) chooses each token; rows that end
    leave the batch (outside XLA). The library's arguments in its order, plus, keyword-only,
    `use_cache=False`: a full pass every step (same tokens, slower; the reference of `--no-cache`
    exports), `fixed_shapes`: see `check_shapes`, and `sampling`: a `keras_transformer.strategies.Sampling`
    of `[batch]` tensors, for `keras_transformer.sample_decode`'s draws (no `prefix_ids` with it).
    `max_length=` is `max_output_length`'s old name, still accepted (with a `DeprecationWarning`).

    Returns:
        tokens: int32 `[batch, length]`, ending with `end_id` (unless cut at the limit), padded with 0
            after it and trimmed to the longest; no start token.
        scores: float32 `[batch]`, log-probability / length penalty.

    Wrap the call in `tf.function`.
    """
    check_options(prefix_ids, no_repeat_ngram_size)
    if sampling is not None and prefix_ids is not None:
        raise ValueError("Sampling takes no target prefix (pass sampling or prefix_ids, not both)")
    check_shapes(fixed_shapes)
    encoder_output, source_mask, limits, steps = _prepare(model, source_ids, max_output_length, extra_output_length,
                                                          fixed_shapes)
    strategy = Greedy(end_id, no_repeat_ngram_size=no_repeat_ngram_size, search_ops=GRAPH_OPS)
    cache = model.init_decoding_cache(encoder_output, steps if fixed_shapes else 0) if use_cache else {}
    state = strategy.start(tf.shape(encoder_output)[0], steps, start_id, cache, limits=limits,
                           prefix_ids=NOT_USED if prefix_ids is None else prefix_ids,
                           sampling=NOT_USED if sampling is None else Sampling(*sampling))
    next_logits = _next_logits_fn(model, start_id, use_cache, fixed_shapes)

    def step(state, memory):
        logits, cache = next_logits(state.last, state.index, state.tokens, state.cache, *memory)
        return strategy.choose(state._replace(cache=cache), logits, state.index)._replace(index=state.index + 1)

    tokens, log_prob, lengths = _run(strategy, step, state, (encoder_output, source_mask), steps, fixed_shapes,
                                     lambda state: (state.tokens, state.log_prob, state.lengths))
    return _trim(tokens), log_prob / penalty_of_length(lengths, length_penalty)


# ------------------------------------------------------------------ beam search


@renamed_search_arguments
def engine_beam_search(model, source_ids, start_id, end_id, beam_size=4, length_penalty=0.6, max_output_length=None,
                       n_best=None, prefix_ids=None, no_repeat_ngram_size=0, extra_output_length=EXTRA_OUTPUT_LENGTH, *,
                       use_cache=True, fixed_shapes=False):
    """`keras_transformer.beam_search`'s hypotheses, scores and early stop on the engine's step and loop.

    The library's strategy (`keras_transformer.strategies.Beam`) keeps the hypotheses; each sentence's k
    beams and its greedy hypothesis are k + 1 rows of the engine's loop, and a sentence whose rows can
    change nothing more leaves the batch (outside XLA).

    Args:
        model: a `keras_transformer.Transformer`.
        source_ids: int `[batch, source_len]`, padded with 0.
        start_id, end_id: the target's start and end token ids.
        beam_size: hypotheses kept per sentence (4 in the paper).
        length_penalty: the length penalty's exponent alpha (Wu et al., 2016; 0.6 in the paper); `alpha=` is its
            old name.
        max_output_length: most output tokens; by default source length + `extra_output_length`.
            `max_length=` is its old name, still accepted (with a `DeprecationWarning`).
        n_best: None, or the n (1 to `beam_size`) best different finished hypotheses, as the library's.
        prefix_ids: None, or int32 `[batch, p]`, the tokens each output begins with, as the library's.
        no_repeat_ngram_size: n > 0: no hypothesis repeats an n-gram, as the library's.
        extra_output_length: the output's room beyond the source's length (50), as the library's.
        use_cache: keyword-only; False recomputes the whole prefix every step (same result, slower; the
            reference of `--no-cache` exports).
        fixed_shapes: keyword-only; see `check_shapes`.

    Returns:
        tokens: int32 `[batch, length]`, the best finished hypothesis, padded with 0 after `end_id`,
            trimmed to the longest; with `n_best`, `[batch, n_best, length]`.
        scores: float32 `[batch]`, its log-probability / length penalty; with `n_best`, `[batch, n_best]`.

    Wrap the call in `tf.function`.
    """
    k = beam_size
    if k < 1:
        raise ValueError(f"beam_size must be >= 1, got {k}")
    if n_best is not None and not 1 <= n_best <= k:
        raise ValueError(f"n_best must be from 1 to beam_size ({k}), got {n_best}")
    check_options(prefix_ids, no_repeat_ngram_size)
    check_shapes(fixed_shapes)
    encoder_output, source_mask, limits, steps = _prepare(model, source_ids, max_output_length, extra_output_length,
                                                          fixed_shapes)
    # Every hypothesis gets a row of the self-attention cache: [batch * (k + 1), ...], sentence-major.
    # The cross-attention cache stays one per sentence: a sentence's rows attend to it together.
    cache = model.init_decoding_cache(encoder_output, steps if fixed_shapes else 0,
                                      rows_per_sentence=k + 1) if use_cache else {}
    strategy = Beam(end_id, k, length_penalty, n_best=n_best, no_repeat_ngram_size=no_repeat_ngram_size, search_ops=GRAPH_OPS)
    state = strategy.start(tf.shape(encoder_output)[0], steps, start_id, cache, limits,
                           prefix_ids=NOT_USED if prefix_ids is None else prefix_ids)
    next_logits = _next_logits_fn(model, start_id, use_cache, fixed_shapes)

    def step(state, memory):
        outputs = strategy.outputs(state) if not use_cache else None
        logits, cache = next_logits(tf.reshape(state.last, [-1]), state.index, outputs, state.cache, *memory)
        state, source_row = strategy.choose(state._replace(cache=cache), logits)
        return state._replace(index=state.index + 1, cache=reorder_rows(cache, source_row, GRAPH_OPS))

    # The single-best search keeps its own (smaller) results: its graph is what serving_default runs.
    best = (lambda x: x[:, 0]) if n_best is None else (lambda x: x[:, :n_best])
    tokens, scores = _run(strategy, step, state, (encoder_output, source_mask), steps, fixed_shapes,
                          lambda state: (best(state.finished_tokens), best(state.finished_scores)), k + 1)
    return _trim(tokens), scores


# ------------------------------------------------------------------ the loop


class _Loop(NamedTuple):
    """The engine's loop state: the strategy's state of the sentences still searching (all of them under XLA;
    outside it, a sentence leaves once it is done), and what the engine keeps beside it."""

    search: Any  # a GreedyState or BeamState of the sentences still searching
    sentences: tf.Tensor  # [active] each one's row in the input batch
    memory: Any  # (encoder output, source mask) of those sentences
    results: Any  # every input sentence's results, written when it leaves and at the end


def _run(strategy, step, state, memory, steps, fixed_shapes, result_of, rows_per_sentence=1):
    """`result_of(state)` for every input sentence, once `step(state, memory) -> state` has run while
    `state.index < steps` and some sentence is not `strategy.done`.

    Outside XLA a sentence that is done leaves the batch (`_leave`), with its fields of the state, its
    memory and its `rows_per_sentence` rows of the self-attention cache, so a step computes only what
    is still needed; with `fixed_shapes` every sentence stays.
    """
    sentences = tf.range(tf.shape(memory[1])[0])
    loop = _Loop(state, sentences, memory, tf.nest.map_structure(tf.zeros_like, result_of(state)))

    def body(loop):
        loop = loop._replace(search=step(loop.search, loop.memory))
        if fixed_shapes:
            return loop
        done = strategy.done(loop.search)
        return tf.cond(tf.reduce_any(done), lambda: _leave(loop, done, result_of, rows_per_sentence), lambda: loop)

    def not_done(loop):
        return tf.logical_and(loop.search.index < steps, tf.logical_not(tf.reduce_all(strategy.done(loop.search))))

    loop = _while_loop(not_done, body, loop)
    return _written(loop.results, loop.sentences, result_of(loop.search))


def _written(results, sentences, values):
    """`results` with the rows `sentences` `[n]` set to `values` `[n, ...]`."""
    return tf.nest.map_structure(lambda out, x: tf.tensor_scatter_nd_update(out, sentences[:, None], x),
                                 results, values)


def _leave(loop, done, result_of, rows_per_sentence):
    """`loop` without its sentences `done` `[batch]` bool, their results written first: every field of the
    search state but `index` and `cache`, the memory, and the cache, the self-attention cache's
    `rows_per_sentence` rows per sentence and the cross-attention cache's one entry per sentence, all cut
    to the other sentences."""
    results = _written(loop.results, loop.sentences, result_of(loop.search))
    keep = tf.reshape(tf.where(~done), [-1])
    keep_rows = keep
    if rows_per_sentence > 1:
        keep_rows = tf.reshape(keep[:, None] * rows_per_sentence + tf.range(rows_per_sentence, dtype=keep.dtype)[None],
                               [-1])

    def cut(x, index=keep):
        return tf.nest.map_structure(lambda x: tf.gather(x, index), x)

    search, cache = loop.search, loop.search.cache
    if cache:
        cache = {"self_attention": cut(cache["self_attention"], keep_rows),
                 "cross_attention": cut(cache["cross_attention"])}
    search = search._replace(cache=cache, **{name: cut(getattr(search, name)) for name in search._fields
                                             if name not in ("index", "cache")})
    return _Loop(search, cut(loop.sentences), cut(loop.memory), results)


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


def _prepare(model, source_ids, max_output_length, extra_output_length, fixed_shapes):
    """The library's `prepare` (encoder output, padding mask, per-sentence output limits `[batch]`), and the
    loop's most steps: with `fixed_shapes`, the library's bound from the source's padded length, which XLA
    knows when it compiles for this input shape (buffers sized by the batch's largest limit, read from the
    data, made the compiled loop much slower: docs/design.md, "Small batches under XLA, opt-in"); otherwise
    the batch's largest limit."""
    if not model.built:  # a model never called: decoding may be the first thing it does
        model.build()
    prepared = prepare(model, source_ids, max_output_length, extra_output_length)
    steps = prepared.steps if fixed_shapes else tf.reduce_max(tf.concat([prepared.limits, [1]], axis=0))
    return prepared.encoder_output, prepared.source_mask, prepared.limits, steps


def _next_logits_fn(model, start_id, use_cache, fixed_shapes):
    """`(last [rows], index, outputs [rows, steps], cache, encoder_output, source_mask)
    -> (logits [rows, vocab], cache)`: the library's `keras_transformer.decoding.NextLogits`, in its
    argument order, plus the memory of the sentences still in the loop (which shrinks as they leave).

    With the cache, one decoder step for the token at position `index`.
    Without it, the whole prefix again (start id + outputs so far), as
    decoding is defined: the slow reference the cache must equal.
    """
    if use_cache:
        def next_logits(last, index, outputs, cache, encoder_output, source_mask):
            return decode_step(model, last, index, source_mask, cache, fixed_shapes)
    else:
        def next_logits(last, index, outputs, cache, encoder_output, source_mask):
            start = tf.fill([tf.shape(outputs)[0], 1], tf.cast(start_id, tf.int32))
            prefix = tf.concat([start, outputs[:, :index]], axis=1)
            # The sentence's memory once per row (beam search keeps one per sentence).
            rows = tf.shape(outputs)[0] // tf.shape(encoder_output)[0]
            encoder_output, source_mask = (tf.repeat(x, rows, axis=0) for x in (encoder_output, source_mask))
            return uncached_logits(model, prefix, encoder_output, source_mask)[:, index], cache
    return next_logits


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
    several times faster, and exact (docs/design.md, "The top-k by blocks").
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


def _while_loop(cond, body, loop):
    """`tf.while_loop` over a `_Loop` with a free batch size.

    `cond` and `body` take the loop state; the batch is the first axis of
    every field but the search's scalar `index`, and static sizes elsewhere
    are kept, except the cache's length axis (keys `[batch, num_heads,
    length, key_dim]`, values `[..., value_dim]`), which grows outside XLA.
    """

    def free_batch(x):
        return tf.TensorShape([None] + x.shape.as_list()[1:])

    def free_length(x):
        return tf.TensorShape([None, x.shape[1], None, x.shape[3]])

    invariants = tf.nest.map_structure(free_batch, loop)
    invariants = invariants._replace(search=invariants.search._replace(
        index=tf.TensorShape([]), cache=tf.nest.map_structure(free_length, loop.search.cache)))
    return tf.while_loop(cond, lambda loop: (body(loop),), (loop,), shape_invariants=(invariants,))[0]


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
            e.g. `lambda ids: engine_greedy_decode(model, ids, start_id, end_id)`;
            it must decode a sentence the same in any batch, as
            `engine_greedy_decode` and `engine_beam_search` do.
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
    threads the other loop holds (docs/design.md, "Parallel decoding
    loops"). Under XLA the whole search is one compiled program: pass 1.
    """
    if num_loops < 1:
        raise ValueError(f"num_loops must be >= 1, got {num_loops}")
    if num_loops == 1:
        return search(source_ids, *row_inputs)
    # One traced search that every loop calls: the graph, and a SavedModel, hold it once rather than once per
    # loop, which shortens tracing, saving and loading; the executor still runs the loops' calls at once.
    search = graph_function(search)
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
