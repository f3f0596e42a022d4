"""What a search computes: the token rules and the search strategies, defined once for every loop that runs them.

A search is a strategy (`Greedy`, `Beam`) plus a loop. The strategy says *what*
a step does with the decoder's logits: `choose(state, logits, ...)` picks each
row's next token by the rules below (never padding; only the end token at a
row's length limit; a target prefix's tokens first; a drawn token when
sampling; no repeated n-gram), and keeps the beam's bookkeeping. The loop says
*how* the steps run: `keras_transformer.decoding.search_loop` runs them with
fixed shapes in `keras.ops` on every backend; the TensorFlow serving engine
(`export/search.py`) runs the same `choose` in a `tf.while_loop` whose rows leave
the batch and whose cache grows. A strategy's array operations that an engine
may run another way (a top-k, a per-row gather) are a `SearchOps` object, a
field of the strategy: `SearchOps()` is `keras.ops`; an engine passes its own.

A state is a NamedTuple of tensors (or nests of them) whose first field is the
scalar `index`, the decoder position read this step. Every other field has the
batch first, so a loop may drop or reorder rows of every field but `index` and
`cache`. The per-row inputs of a search (each row's length limit, its target
prefix, its sampling settings) are fields of the state, not of the strategy, so
they leave the batch with their rows. `()` marks an option not used.

Scores are log P(output | source) / lp(output), with the length penalty
lp(y) = ((5 + |y|) / 6)^alpha (Wu et al., 2016; tensor2tensor), |y| counting
the end token.
"""

from typing import Any, NamedTuple

import keras
from keras import ops

from keras_transformer.counter_noise import gumbel_noise
from keras_transformer.masking import MASKED_SCORE, PAD_ID

NOT_USED = ()  # the value of a state field whose option a search does not use (a loop carries it for free)


def used(option):
    """True unless `option` is `NOT_USED`."""
    return not (isinstance(option, tuple) and len(option) == 0)


def _int32_if_used(option):
    """`option` as int32, or `NOT_USED` as it is."""
    return ops.cast(option, "int32") if used(option) else option


def check_options(prefix_ids=NOT_USED, no_repeat_ngram_size=0):
    """A clear `ValueError` for a search option of the wrong kind: `no_repeat_ngram_size` an int >= 0, and
    `prefix_ids` (`NOT_USED` or None: no prefix) of shape `[batch, prefix_len]`."""
    if not isinstance(no_repeat_ngram_size, int) or no_repeat_ngram_size < 0:
        raise ValueError(f"no_repeat_ngram_size must be an int >= 0 (0: no ban), got {no_repeat_ngram_size!r}")
    if prefix_ids is not None and used(prefix_ids):
        shape = tuple(ops.convert_to_tensor(prefix_ids).shape)
        if len(shape) != 2:
            raise ValueError(f"prefix_ids must have shape [batch, prefix_len], got shape {shape}")


def length_penalty(length, alpha):
    """((5 + length) / 6)^alpha, as a float32 tensor shaped like `length`; alpha: the length penalty's exponent
    (Wu et al., 2016)."""
    return ops.power((5.0 + ops.cast(length, "float32")) / 6.0, alpha)


class SearchOps:
    """The array operations of the strategies that a loop may supply its own way; `keras.ops` here.

    Subclass it to run a strategy on another engine: the TensorFlow serving
    engine's (`export.search.GraphSearchOps`) takes a top-k by blocks of the
    vocabulary and a one-op `tf.gather`. Each must compute exactly what this
    class computes: the strategies' results do not depend on the ops.
    """

    def top_k(self, values, k):
        """The `k` largest of each row of `values` `[rows, n]` and their indices (int32), best first, ties to
        the lower index."""
        top, index = ops.top_k(values, k)
        return top, ops.cast(index, "int32")

    def argmax(self, values):
        """The index (int32) of the largest of each row of `values` `[rows, n]`, ties to the lower index."""
        return ops.cast(ops.argmax(values, axis=-1), "int32")

    def take_rows(self, x, index):
        """`x` `[batch, n, ...]` -> `[batch, m, ...]`: each batch entry's rows `index` `[batch, m]` (int32)."""
        extra_axes = len(x.shape) - 2
        if extra_axes:
            index = ops.broadcast_to(ops.reshape(index, (*ops.shape(index), *([1] * extra_axes))),
                                     (*ops.shape(index), *ops.shape(x)[2:]))
        return ops.take_along_axis(x, index, axis=1)

    def gather(self, x, index):
        """`x` `[n, ...]` -> `[m, ...]`: its rows `index` `[m]` (int32, each in 0 ... n - 1)."""
        return ops.take(x, index, axis=0)


KERAS_OPS = SearchOps()


# ------------------------------------------------------------------ the token rules


class NextTokens(NamedTuple):
    """Each row's next tokens, best first, each `[rows]` or `[rows, n]`."""

    log_prob: Any  # log P(token | the row so far): log-softmax over the whole vocabulary
    token: Any


class Sampling(NamedTuple):
    """How `sample_decode` draws each token, per row, each `[rows]`."""

    seed: Any  # int32: the row's seed (the same seed, the same sample)
    temperature: Any  # float32 > 0: the log-probabilities are divided by it (1: the model's distribution)
    top_k: Any  # int32: draw among the k most likely tokens only; 0: among all


def padding_bias(vocab_size):
    """`[vocab]`: MASKED_SCORE at the padding id, 0 elsewhere."""
    return ops.where(ops.arange(vocab_size) == PAD_ID, MASKED_SCORE, 0.0)


def most_likely_token(logits, at_limit, end_id, forced=None, bias=None, search_ops=KERAS_OPS):
    """Each row's most likely next token (`NextTokens` `[rows]`) from float32 logits `[rows, vocab]`.

    Never padding; at its limit (`at_limit` `[rows]` bool, or None for no
    limits) a row may only end; otherwise a row with a `forced` token
    (`[rows]` int32, -1 for none: a target prefix) takes it. `bias`
    (`[rows, vocab]`, MASKED_SCORE at banned tokens) shifts the choice, not the
    log-probability, which is the log-softmax over the whole vocabulary.
    """
    log_probs = ops.log_softmax(logits, axis=-1)
    ranked = log_probs + padding_bias(logits.shape[-1])
    token = search_ops.argmax(ranked if bias is None else ranked + bias)
    if forced is not None:
        token = ops.where(forced >= 0, forced, token)
    if at_limit is not None:
        token = ops.where(at_limit, ops.cast(end_id, "int32"), token)
    return NextTokens(search_ops.take_rows(log_probs, token[:, None])[:, 0], token)


def next_tokens(logits, at_limit, end_id, n, forced=None, bias=None, search_ops=KERAS_OPS):
    """Each row's `n` most likely next tokens (`NextTokens` `[rows, n]`) from float32 logits `[rows, vocab]`.

    Never padding; at its limit (`at_limit` `[rows]` bool) a row may only end:
    `end_id`, then `MASKED_SCORE` entries; so may a row with a `forced` token
    (`[rows]` int32, -1 for none: a target prefix) only take that one.
    Log-probabilities are the log-softmax over the whole vocabulary; `bias`
    (`[rows, vocab]`, MASKED_SCORE at banned tokens) is added to them before the
    top n. Only the log-softmax and one top-k pass over `[rows, vocab]`; the
    bans apply to the n + 1 best.
    """
    n = min(n, logits.shape[-1] - 1) if logits.shape[-1] is not None else n
    log_probs = ops.log_softmax(logits, axis=-1)
    top, tokens = search_ops.top_k(log_probs if bias is None else log_probs + bias, n + 1)  # padding may be there
    log_prob, keep = search_ops.top_k(ops.where(tokens == PAD_ID, MASKED_SCORE, top), n)
    only = ops.full(ops.shape(at_limit), -1, "int32") if forced is None else forced
    only = ops.where(at_limit, ops.cast(end_id, "int32"), only)  # the limit before a prefix
    only_log_prob = search_ops.take_rows(log_probs, ops.maximum(only, 0)[:, None])
    first, forced_rows = ops.arange(n) == 0, (only >= 0)[:, None]
    return NextTokens(
        log_prob=ops.where(forced_rows, ops.where(first, only_log_prob, MASKED_SCORE), log_prob),
        token=ops.where(forced_rows, ops.where(first, only[:, None], PAD_ID), search_ops.take_rows(tokens, keep)),
    )


def sampled_token(logits, at_limit, end_id, sampling, step, bias=None, search_ops=KERAS_OPS):
    """Each row's next token (`NextTokens` `[rows]`) drawn from softmax(log_probs / temperature) over its
    `top_k` most likely tokens (`sampling`, a `Sampling`), by the Gumbel-max trick with
    `counter_noise.gumbel_noise(seed, step)`. Never padding; at its limit only the end. The log-probability
    is the model's own (the log-softmax of `logits` `[rows, vocab]`), whatever the temperature."""
    log_probs = ops.log_softmax(logits, axis=-1)
    vocab_size = logits.shape[-1]
    allowed = log_probs + padding_bias(vocab_size)
    if bias is not None:
        allowed = allowed + bias
    # The k-th largest of a row (k at most vocab - 1: never the padding id, the smallest).
    k = ops.where(sampling.top_k <= 0, vocab_size - 1, ops.minimum(sampling.top_k, vocab_size - 1))
    kth = ops.take_along_axis(ops.sort(allowed, axis=-1), (vocab_size - k)[:, None], axis=1)
    perturbed = allowed / sampling.temperature[:, None] + gumbel_noise(sampling.seed, step, vocab_size)
    token = search_ops.argmax(ops.where(allowed >= kth, perturbed, float("-inf")))
    if at_limit is not None:
        token = ops.where(at_limit, ops.cast(end_id, "int32"), token)
    return NextTokens(search_ops.take_rows(log_probs, token[:, None])[:, 0], token)


def prefix_tokens(prefix_ids, column):
    """Each row's prefix token at output `column` (`[rows]` int32), or -1 past its prefix.

    `prefix_ids` `[rows, p]`: the tokens each output must begin with, 0-padded (p may be 0).
    """
    prefix_ids = ops.pad(ops.cast(prefix_ids, "int32"), [[0, 0], [0, 1]])  # a 0 past every prefix
    token = ops.take(prefix_ids, ops.minimum(column, ops.shape(prefix_ids)[1] - 1), axis=1)
    return ops.where(token == PAD_ID, -1, token)


def repeated_ngram_bias(outputs, length, n, vocab_size):
    """`[rows, vocab]`: MASKED_SCORE at each token that, written at column `length` of `outputs` `[rows, columns]`
    (its first `length` columns written), would repeat one of the row's n-grams; 0 elsewhere.

    The n-gram starting at column j is written if j + n <= length; it bans its last token when its
    first n - 1 are the row's last n - 1 (for n = 1: every token written).
    """
    rows, columns = ops.shape(outputs)[0], outputs.shape[1]
    if columns is None:  # a length known only when the search runs (TensorFlow, no static source length)
        starts = ops.maximum(ops.shape(outputs)[1] - n + 1, 0)
    elif columns < n:  # no n-gram fits in the buffer
        return ops.zeros((rows, vocab_size), "float32")
    else:
        starts = columns - n + 1  # the n-grams that fit in the buffer
    match = ops.broadcast_to((ops.arange(starts) + n <= length)[None], (rows, starts))
    for i in range(n - 1):
        last = ops.take(outputs, ops.maximum(length - n + 1 + i, 0), axis=1)  # [rows]
        match = match & (outputs[:, i:i + starts] == last[:, None])
    # A banned token's index, or the extra column `vocab_size` for an n-gram that does not match.
    banned = ops.where(match, outputs[:, n - 1:], vocab_size)
    row = ops.broadcast_to(ops.arange(rows, dtype="int32")[:, None], (rows, starts))
    indices = ops.stack([ops.reshape(row, (-1,)), ops.reshape(ops.cast(banned, "int32"), (-1,))], axis=1)
    bias = ops.scatter_update(ops.zeros((rows, vocab_size + 1), "float32"), indices,
                              ops.full((rows * starts,), MASKED_SCORE, "float32"))
    return bias[:, :vocab_size]


def write_column(tokens, position, column):
    """tokens `[..., steps]` with `position` set to `column` `[...]`."""
    return ops.where(ops.arange(ops.shape(tokens)[-1]) == position, column[..., None], tokens)


# ------------------------------------------------------------------ greedy


class GreedyState(NamedTuple):
    """The greedy loop's state; every field but `index` has the batch first."""

    index: Any  # scalar int32: the position the decoder reads this step (of `last`)
    last: Any  # [batch] the newest token, not read yet
    finished: Any  # [batch] bool: the end token is out
    log_prob: Any  # [batch] log P(output so far)
    lengths: Any  # [batch] output tokens, the end token included
    tokens: Any  # [batch, columns] the output so far; 0 after the end token
    cache: Any  # the decoder's cache
    limits: Any = NOT_USED  # [batch] int32 most output tokens per row
    prefix_ids: Any = NOT_USED  # [batch, p] int32 the first output tokens, forced, 0-padded
    sampling: Any = NOT_USED  # a `Sampling` of [batch] tensors: draw each token


class Greedy(NamedTuple):
    """Greedy search: each row grows by its most likely token (never padding; at its limit, only the end).

    The decoder reads position `index`; its token goes to output column
    `index - offset` (0 for a translation, prompt length - 1 for generation).
    The state's options: `limits`, a target prefix (`prefix_ids`, forced) and
    `sampling` (a token drawn from the model's distribution in place of the most
    likely); the strategy's: a ban on repeating an n-gram (`no_repeat_ngram_size` n > 0).
    """

    end_id: int
    offset: Any = 0
    no_repeat_ngram_size: int = 0
    search_ops: SearchOps = KERAS_OPS

    def start(self, batch_size, columns, first_token, cache, index=0, limits=NOT_USED, prefix_ids=NOT_USED,
              sampling=NOT_USED):
        """The state before the first step: `batch_size` rows of `first_token`, room for `columns` output tokens."""
        return GreedyState(
            index=ops.convert_to_tensor(index, "int32"),
            last=ops.full((batch_size,), first_token, "int32"),
            finished=ops.zeros((batch_size,), "bool"),
            log_prob=ops.zeros((batch_size,), "float32"),
            lengths=ops.zeros((batch_size,), "int32"),
            tokens=ops.zeros((batch_size, columns), "int32"),
            cache=cache,
            limits=_int32_if_used(limits),
            prefix_ids=_int32_if_used(prefix_ids),
            sampling=sampling,
        )

    def step(self, state, next_logits):
        """One step: `next_logits(last, index, tokens, cache)` -> (logits, cache), then `choose`."""
        logits, cache = next_logits(state.last, state.index, state.tokens, state.cache)
        return self.choose(state._replace(cache=cache), logits, state.index - self.offset)._replace(
            index=state.index + 1)

    def choose(self, state, logits, column):
        """`state` with every unfinished row's next token from `logits` `[batch, vocab]` at output `column`."""
        at_limit = column + 1 >= state.limits if used(state.limits) else None
        logits = ops.cast(logits, "float32")
        bias = None
        if self.no_repeat_ngram_size:
            bias = repeated_ngram_bias(state.tokens, column, self.no_repeat_ngram_size, logits.shape[-1])
        if used(state.sampling):
            best = sampled_token(logits, at_limit, self.end_id, state.sampling, column, bias, self.search_ops)
        else:
            forced = prefix_tokens(state.prefix_ids, column) if used(state.prefix_ids) else None
            best = most_likely_token(logits, at_limit, self.end_id, forced, bias, self.search_ops)
        token = ops.where(state.finished, PAD_ID, best.token)
        return state._replace(
            last=token,
            finished=state.finished | (token == self.end_id),
            log_prob=state.log_prob + ops.where(state.finished, 0.0, best.log_prob),
            lengths=state.lengths + ops.cast(ops.logical_not(state.finished), "int32"),
            tokens=write_column(state.tokens, column, token),
        )

    def done(self, state):
        """`[batch]` bool: the rows that can change nothing more."""
        return state.finished


# -------------------------------------------------------------------- beam


class BeamState(NamedTuple):
    """The beam loop's state; every field but `index` has the batch (sentences) first.

    A sentence has k + 1 rows: its k beams, then its greedy hypothesis.
    """

    index: Any  # scalar int32: the position the decoder reads this step (0: the start token)
    last: Any  # [batch, k + 1] each row's token at `index`
    alive_tokens: Any  # [batch, k, steps] the beams' outputs so far
    alive_log_prob: Any  # [batch, k] their log-probabilities, best first
    finished_tokens: Any  # [batch, k, steps] the best finished hypotheses
    finished_scores: Any  # [batch, k] their scores, best first; MASKED_SCORE for none
    num_finished: Any  # [batch] how many beams have ended
    beam_done: Any  # [batch] bool: the beams can change nothing more
    greedy_tokens: Any  # [batch, steps] the greedy hypothesis
    greedy_log_prob: Any  # [batch]
    greedy_done: Any  # [batch] bool: it has ended, or cannot win any more
    cache: Any  # the decoder's cache, a row per hypothesis [batch * (k + 1), ...] (cross-attention: maybe per sentence)
    limits: Any  # [batch] int32 most output tokens per sentence
    prefix_ids: Any = NOT_USED  # [batch, p] int32 the first output tokens, forced, 0-padded


class _Candidates(NamedTuple):
    """The 2k best one-token extensions of a sentence's k beams, best first, each `[batch, 2k, ...]`."""

    log_prob: Any  # [batch, 2k]
    beam: Any  # [batch, 2k] the beam it extends
    token: Any  # [batch, 2k] the token it adds
    tokens: Any  # [batch, 2k, steps] its whole output
    ends: Any  # [batch, 2k] bool: the token is the end token


class Beam(NamedTuple):
    """Beam search of `k` hypotheses per sentence, plus the sentence's greedy hypothesis as one more row.

    Each step extends every live hypothesis by every token and keeps the 2k
    best by log-probability. A candidate that ends among the best k is
    finished and scored with the length penalty; the best k that do not end
    stay alive. A sentence is done when it has k finished hypotheses, reaches
    its limit, or no live hypothesis can still beat (or, with `n_best`, enter
    the first `n_best` places of) its finished ones. The greedy row competes
    with the finished hypotheses, so the result never scores below greedy
    decoding's, and k = 1 is greedy decoding.
    """

    end_id: int
    k: int
    alpha: float  # the length penalty's exponent (Wu et al., 2016)
    n_best: Any = None  # None: the best hypothesis; n: the n best, all different
    no_repeat_ngram_size: int = 0  # n > 0: no hypothesis repeats an n-gram
    search_ops: SearchOps = KERAS_OPS

    def start(self, batch_size, steps, start_id, cache, limits, prefix_ids=NOT_USED):
        """The state before the first step: each sentence's k beams (only the first alive) and its greedy row."""
        k = self.k
        first_beam_only = ops.where(ops.arange(k) == 0, 0.0, MASKED_SCORE)
        return BeamState(
            index=ops.convert_to_tensor(0, "int32"),
            last=ops.full((batch_size, k + 1), start_id, "int32"),
            alive_tokens=ops.zeros((batch_size, k, steps), "int32"),
            alive_log_prob=ops.broadcast_to(first_beam_only[None], (batch_size, k)),
            finished_tokens=ops.zeros((batch_size, k, steps), "int32"),
            finished_scores=ops.full((batch_size, k), MASKED_SCORE, "float32"),
            num_finished=ops.zeros((batch_size,), "int32"),
            beam_done=ops.zeros((batch_size,), "bool"),
            greedy_tokens=ops.zeros((batch_size, steps), "int32"),
            greedy_log_prob=ops.zeros((batch_size,), "float32"),
            greedy_done=ops.zeros((batch_size,), "bool"),
            cache=cache,
            limits=ops.cast(limits, "int32"),
            prefix_ids=_int32_if_used(prefix_ids),
        )

    def outputs(self, state):
        """Every row's output so far, `[batch * (k + 1), steps]`, sentence-major."""
        # Explicit sizes, no -1: a reshape cannot infer an axis of an empty batch.
        batch_size, steps = ops.shape(state.last)[0], ops.shape(state.greedy_tokens)[1]
        return ops.reshape(ops.concatenate([state.alive_tokens, state.greedy_tokens[:, None]], axis=1),
                           (batch_size * (self.k + 1), steps))

    def step(self, state, next_logits):
        """One step: `next_logits(last [rows], index, outputs, cache)` -> (logits, cache), `choose`, and each
        row's cache taken from the row it grew from (`reorder_rows`)."""
        logits, cache = next_logits(ops.reshape(state.last, (-1,)), state.index, self.outputs(state), state.cache)
        state, source_row = self.choose(state, logits)
        return state._replace(index=state.index + 1, cache=reorder_rows(cache, source_row, self.search_ops))

    def choose(self, state, logits):
        """The beam's step from `logits` `[batch * (k + 1), vocab]` (rows sentence-major).

        Returns `state` with its hypothesis fields updated (not its index or
        cache), and the row `[batch, k + 1]` of its sentence whose cache each
        row now takes.
        """
        k, rows, index = self.k, self.k + 1, state.index
        batch_size = ops.shape(state.last)[0]
        logits = ops.cast(logits, "float32")
        at_limit = ops.repeat(index + 1 >= state.limits, rows, axis=0)
        forced = ops.repeat(prefix_tokens(state.prefix_ids, index), rows, axis=0) if used(state.prefix_ids) else None
        bias = None
        if self.no_repeat_ngram_size:
            bias = repeated_ngram_bias(self.outputs(state), index, self.no_repeat_ngram_size, logits.shape[-1])
        best = next_tokens(logits, at_limit, self.end_id, 2 * k, forced, bias, self.search_ops)
        best = NextTokens(*(ops.reshape(x, (batch_size, rows, x.shape[-1])) for x in best))
        return self._update(state, best)

    def done(self, state):
        """`[batch]` bool: the sentences that can change nothing more."""
        return state.beam_done & state.greedy_done

    # The bookkeeping of one step, in parts.

    def _update(self, state, best):
        """Each row's best next tokens `best` (`NextTokens` `[batch, k + 1, 2k]`, the k beams then the greedy
        hypothesis) grow the hypotheses; those that end are scored and finished, the best k that do not
        stay alive, and a sentence is done once it has k finished, reaches its limit or can no longer win."""
        k, index, end_id = self.k, state.index, self.end_id
        greedy_done = state.greedy_done
        greedy_token = ops.where(greedy_done, PAD_ID, best.token[:, k, 0])
        greedy_log_prob = state.greedy_log_prob + ops.where(greedy_done, 0.0, best.log_prob[:, k, 0])
        greedy_tokens = write_column(state.greedy_tokens, index, greedy_token)
        greedy_ends = greedy_token == end_id

        candidates = self._candidates(state, NextTokens(best.log_prob[:, :k], best.token[:, :k]))
        finished_tokens, finished_scores, num_finished = self._finish(
            state, candidates, greedy_tokens, greedy_log_prob, greedy_ends, length_penalty(index + 1, self.alpha))
        alive_log_prob, alive_tokens, alive_beam, alive_token = self._keep_alive(candidates)
        state = self._stop_early(state._replace(
            last=ops.concatenate([alive_token, greedy_token[:, None]], axis=1),
            alive_tokens=alive_tokens,
            alive_log_prob=alive_log_prob,
            finished_tokens=finished_tokens,
            finished_scores=finished_scores,
            num_finished=num_finished,
            beam_done=state.beam_done | (num_finished >= k) | (index + 1 >= state.limits),
            greedy_tokens=greedy_tokens,
            greedy_log_prob=greedy_log_prob,
            greedy_done=greedy_done | greedy_ends,
        ), index + 1)
        return state, ops.concatenate([alive_beam, ops.full((ops.shape(alive_beam)[0], 1), k, "int32")], axis=1)

    def _candidates(self, state, best):
        """Every alive beam extended by its best tokens (`best` `[batch, k, n]`): the best 2k, as `_Candidates`.

        2k, so that k remain alive even if k of them end. A beam's 2k best
        tokens are all its candidates that can be among them.
        """
        k, take_rows = self.k, self.search_ops.take_rows
        batch_size = ops.shape(state.alive_log_prob)[0]
        n = best.token.shape[-1] if best.token.shape[-1] is not None else ops.shape(best.token)[-1]
        log_prob, flat = self.search_ops.top_k(
            ops.reshape(state.alive_log_prob[:, :, None] + best.log_prob, (batch_size, k * n)), 2 * k)
        beam, token = flat // n, take_rows(ops.reshape(best.token, (batch_size, k * n)), flat)
        tokens = write_column(take_rows(state.alive_tokens, beam), state.index, token)
        return _Candidates(log_prob, beam, token, tokens, token == self.end_id)

    def _finish(self, state, candidates, greedy_tokens, greedy_log_prob, greedy_ends, penalty):
        """The best k finished hypotheses once the ending candidates among the best k, and a greedy
        hypothesis that ends, are scored (log-probability / `penalty`) and added.

        With `n_best` a greedy hypothesis that a beam also found is not added
        twice, so the k finished hypotheses are k different outputs (the n-best
        list). The best one is the same either way.

        Returns finished tokens `[batch, k, steps]`, their scores `[batch, k]` and
        the sentences' counts of finished beams `[batch]`.
        """
        k = self.k
        # "Among the best k" is a mask over the 2k, not a slice `[:, :k]`: XLA on CPU
        # runs a top_k as its fast TopK kernel only if no slice is taken of the result
        # (`TopkRewriter`); with one, it sorts all of [batch, k * vocab] every step.
        # The k extra candidates score MASKED_SCORE after the finished ones, so no choice changes.
        newly_finished = (candidates.ends & (ops.arange(2 * k) < k)[None] & ops.logical_not(state.beam_done)[:, None]
                          & (candidates.log_prob > MASKED_SCORE / 2))
        new_scores = ops.where(newly_finished, candidates.log_prob / penalty, MASKED_SCORE)
        if self.n_best is not None:
            # A hypothesis ends at its length, so a beam's copy of the greedy one can only end at the same step.
            copies = ops.all(candidates.tokens == greedy_tokens[:, None], axis=-1) & newly_finished
            greedy_ends = greedy_ends & ops.logical_not(ops.any(copies, axis=1))
        greedy_score = ops.where(greedy_ends, greedy_log_prob / penalty, MASKED_SCORE)
        scores, best = self.search_ops.top_k(
            ops.concatenate([state.finished_scores, new_scores, greedy_score[:, None]], 1), k)
        pool = ops.concatenate([state.finished_tokens, candidates.tokens, greedy_tokens[:, None]], 1)
        num_finished = state.num_finished + ops.sum(ops.cast(newly_finished, "int32"), axis=1)
        return self.search_ops.take_rows(pool, best), scores, num_finished

    def _keep_alive(self, candidates):
        """The best k candidates that did not end: log-probabilities `[batch, k]`, tokens
        `[batch, k, steps]`, and the beam and the token each came from `[batch, k]`."""
        log_prob, keep = self.search_ops.top_k(ops.where(candidates.ends, MASKED_SCORE, candidates.log_prob), self.k)
        return (log_prob, *(self.search_ops.take_rows(values, keep)
                            for values in (candidates.tokens, candidates.beam, candidates.token)))

    def _stop_early(self, state, index):
        """`state` with its beams, and greedy hypotheses, done where they can no longer win (or, for an
        n-best list, no longer enter its first `n_best` places).

        A log-probability only falls as a hypothesis grows, so its best possible
        score is now over the largest penalty it can still reach (it has
        `index` tokens now, its limit at most). The result is unchanged; the
        loop just ends sooner.
        """
        largest_penalty = ops.maximum(length_penalty(index, self.alpha), length_penalty(state.limits, self.alpha))
        nth_finished = state.finished_scores[:, (self.n_best or 1) - 1]
        return state._replace(
            beam_done=state.beam_done | (state.alive_log_prob[:, 0] / largest_penalty < nth_finished),
            greedy_done=state.greedy_done | (state.greedy_log_prob / largest_penalty < nth_finished),
        )


def reorder_rows(cache, source_row, search_ops=KERAS_OPS):
    """Each hypothesis row takes the self-attention cache of row `source_row` `[batch, rows]` of its sentence
    (`search_ops.gather`).

    The cross-attention cache is the same for every row of a sentence: nothing to reorder.
    """
    if not cache:  # a decoder without a cache (a full pass each step)
        return cache
    batch_size, rows = ops.shape(source_row)[0], ops.shape(source_row)[1]
    reorder = ops.reshape(ops.arange(batch_size, dtype="int32")[:, None] * rows + source_row, (-1,))
    return {
        "self_attention": keras.tree.map_structure(lambda c: search_ops.gather(c, reorder),
                                                   cache["self_attention"]),
        "cross_attention": cache["cross_attention"],
    }
