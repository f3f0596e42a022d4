"""Greedy decoding, sampling, beam search and greedy generation over the key/value cache: one loop, four searches.

Written in `keras.ops`, so they run on the JAX, PyTorch and TensorFlow
backends and compile (`jax.jit`, `tf.function`). One loop (`search_loop`)
drives every search; a search supplies its state (a NamedTuple whose first
field is `index`, the position the decoder reads), its step and its stop
test, as OpenNMT-tf's `dynamic_decode` takes a decoding strategy and
keras-hub's samplers plug into one sampling loop. Every shape is fixed before
the loop: the self-attention cache is a buffer of the most output positions,
written in place, and every row stays in the batch until the loop ends.
(The TensorFlow serving engine in `export/` decodes the same searches with
TensorFlow-only speed-ups: a growing cache, rows that leave the batch.)

Padding masks come from the source ids (pad id 0), never from Keras masks.

Scores are log P(output | source) / lp(output), with the length penalty
lp(y) = ((5 + |y|) / 6)^alpha (Wu et al., 2016; tensor2tensor), |y| counting
the end token. Beam search ranks finished hypotheses by it; greedy decoding
reports the same quantity so the two compare.
"""

import contextlib
from typing import Any, Callable, NamedTuple

import keras
from keras import ops

from keras_transformer.counter_noise import gumbel_noise
from keras_transformer.masking import MASKED_SCORE, PAD_ID, padding_mask

# Default room for the output: source length + 50 tokens (paper section 6.1).
EXTRA_OUTPUT_LENGTH = 50


def length_penalty(length, alpha):
    """((5 + length) / 6)^alpha, as a float32 tensor shaped like `length`."""
    return ops.power((5.0 + ops.cast(length, "float32")) / 6.0, alpha)


def output_bound(model, source_length, max_length=None):
    """The most output tokens (end token included) for a source of `source_length` real tokens.

    Source length + `EXTRA_OUTPUT_LENGTH`, or `max_length` when given; never
    past a learned position table (output i is read from decoder position i);
    at least 1. `source_length` may be a Python int (the result is then one:
    a shape known when the search compiles) or an int tensor `[batch]`.
    """
    bound = source_length + EXTRA_OUTPUT_LENGTH if max_length is None else max_length
    if model.learned_positions:
        bound = _minimum(bound, model.max_length)
    return max(bound, 1) if isinstance(bound, int) else ops.maximum(bound, 1)


def _minimum(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else ops.minimum(a, b)


def _no_gradient():
    """A context in which the backend records no gradient: a search has none. On PyTorch, autograd
    would otherwise keep every step of the loop (and hand back tensors that require grad); JAX and
    TensorFlow record only inside a gradient transform or tape, which a search is not called in."""
    if keras.backend.backend() == "torch":
        import torch

        return torch.no_grad()
    return contextlib.nullcontext()


# ------------------------------------------------------------------ the loop


def search_loop(search, state, steps):
    """`state` after `search.step` has run while `state.index < steps` and not `search.done(state)`.

    `state` is a NamedTuple whose fields are tensors (or nests of them, the
    cache) of fixed shapes and dtypes, the scalar `index` first; `steps` is
    the loop's bound on `index`. One `keras.ops.while_loop`: `jax.lax.while_loop`
    on JAX, `tf.while_loop` on TensorFlow, a Python loop on PyTorch.
    """
    fields = type(state)

    def not_done(*values):
        state = fields(*values)
        return ops.logical_and(state.index < steps, ops.logical_not(search.done(state)))

    def step(*values):
        return tuple(search.step(fields(*values)))

    return fields(*ops.while_loop(not_done, step, tuple(state)))


# A decoder step: (last tokens [rows], index, outputs [rows, steps], cache) -> (logits [rows, vocab], cache).
NextLogits = Callable[[Any, Any, Any, Any], Any]


def cached_decoder(model, encoder_output, source_mask, steps, rows=1):
    """`(cache, next_logits)`: the model's decoder over its key/value cache, one position a call.

    `rows` hypotheses per sentence (beam search's k + 1), sentence-major: the
    encoder output and its mask are repeated per row, and the self-attention
    cache has `steps` positions per row. `next_logits` ignores `outputs` (the
    cache holds what it needs of them).
    """
    if rows > 1:
        encoder_output, source_mask = (ops.repeat(x, rows, axis=0) for x in (encoder_output, source_mask))
    cache = model.init_decoding_cache(encoder_output, steps)

    def next_logits(last, index, outputs, cache):
        return model.decode_step(last, index, encoder_output, source_mask, cache)

    return cache, next_logits


class _Prepared(NamedTuple):
    """A batch of sources, encoded once for any search."""

    encoder_output: Any  # [batch, source_len, d_model]
    source_mask: Any  # [batch, source_len] bool
    limits: Any  # [batch] int32: each sentence's most output tokens
    steps: Any  # the loop's bound: the largest limit any sentence of this source length may have


def _prepare(model, source_ids, max_length):
    """Encoder output, padding mask, per-sentence output limits `[batch]` and the loop's bound."""
    source_ids = ops.convert_to_tensor(source_ids)
    if len(source_ids.shape) != 2:
        raise ValueError(f"Decoding expects source_ids of shape [batch, source_len], got shape {source_ids.shape}.")
    source_ids = ops.cast(source_ids, "int32")
    source_mask = padding_mask(source_ids)
    # Per sentence, so a sentence decodes the same alone or in any batch.
    limits = output_bound(model, ops.sum(ops.cast(source_mask, "int32"), axis=1), max_length)
    limits = ops.broadcast_to(ops.cast(limits, "int32"), ops.shape(source_ids)[:1])
    # From the padded length: a bound known when the search compiles, so every buffer has a fixed shape.
    length = source_ids.shape[1] if source_ids.shape[1] is not None else ops.shape(source_ids)[1]
    steps = output_bound(model, length, max_length)
    return _Prepared(model.encode(source_ids, training=False), source_mask, limits, steps)


# ------------------------------------------------------------ next tokens


class _NextTokens(NamedTuple):
    """Each row's most likely next tokens, best first, each `[rows, n]`."""

    log_prob: Any  # log P(token | the row so far): log-softmax over the whole vocabulary
    token: Any


def _padding_bias(vocab_size):
    """`[vocab]`: MASKED_SCORE at the padding id, 0 elsewhere."""
    return ops.where(ops.arange(vocab_size) == PAD_ID, MASKED_SCORE, 0.0)


def _most_likely_token(logits, at_limit, end_id, forced=None, bias=None):
    """Each row's most likely next token (`_NextTokens` `[rows]`) from float32 logits `[rows, vocab]`.

    Never padding; at its limit (`at_limit` `[rows]` bool, or None for no
    limits) a row may only end; otherwise a row with a `forced` token
    (`[rows]` int32, -1 for none: a target prefix) takes it. `bias`
    (`[rows, vocab]`, MASKED_SCORE at banned tokens) shifts the choice, not the
    log-probability, which is the log-softmax over the whole vocabulary.
    """
    log_probs = ops.log_softmax(logits, axis=-1)
    ranked = log_probs + _padding_bias(ops.shape(logits)[-1])
    token = ops.cast(ops.argmax(ranked if bias is None else ranked + bias, axis=-1), "int32")
    if forced is not None:
        token = ops.where(forced >= 0, forced, token)
    if at_limit is not None:
        token = ops.where(at_limit, ops.cast(end_id, "int32"), token)
    return _NextTokens(ops.take_along_axis(log_probs, token[:, None], axis=-1)[:, 0], token)


def _next_tokens(logits, at_limit, end_id, n, forced=None, bias=None):
    """Each row's `n` most likely next tokens (`_NextTokens` `[rows, n]`) from float32 logits `[rows, vocab]`.

    Never padding; at its limit (`at_limit` `[rows]` bool) a row may only end:
    `end_id`, then `MASKED_SCORE` entries; so may a row with a `forced` token
    (`[rows]` int32, -1 for none: a target prefix) only take that one.
    Log-probabilities are the log-softmax over the whole vocabulary; `bias`
    (`[rows, vocab]`, MASKED_SCORE at banned tokens) is added to them before the top n.
    """
    n = min(n, logits.shape[-1] - 1) if logits.shape[-1] is not None else n
    log_probs = ops.log_softmax(logits, axis=-1)
    top, tokens = ops.top_k(log_probs if bias is None else log_probs + bias, n + 1)  # one more: padding may be there
    tokens = ops.cast(tokens, "int32")
    log_prob, keep = ops.top_k(ops.where(tokens == PAD_ID, MASKED_SCORE, top), n)
    only = ops.full(ops.shape(at_limit), -1, "int32") if forced is None else forced
    only = ops.where(at_limit, ops.cast(end_id, "int32"), only)  # the limit before a prefix
    only_log_prob = ops.take_along_axis(log_probs, ops.maximum(only, 0)[:, None], axis=1)
    first, forced_rows = ops.arange(n) == 0, (only >= 0)[:, None]
    return _NextTokens(
        log_prob=ops.where(forced_rows, ops.where(first, only_log_prob, MASKED_SCORE), log_prob),
        token=ops.where(forced_rows, ops.where(first, only[:, None], PAD_ID),
                        ops.take_along_axis(tokens, ops.cast(keep, "int32"), axis=1)),
    )


class Sampling(NamedTuple):
    """How `sample_decode` draws each token, per row, each `[rows]`."""

    seed: Any  # int32: the row's seed (the same seed, the same sample)
    temperature: Any  # float32 > 0: the log-probabilities are divided by it (1: the model's distribution)
    top_k: Any  # int32: draw among the k most likely tokens only; 0: among all


def _sampled_token(logits, at_limit, end_id, sampling, step, bias=None):
    """Each row's next token (`_NextTokens` `[rows]`) drawn from softmax(log_probs / temperature) over its
    `top_k` most likely tokens (`sampling`, a `Sampling`), by the Gumbel-max trick with
    `counter_noise.gumbel_noise(seed, step)`. Never padding; at its limit only the end. The log-probability
    is the model's own (the log-softmax of `logits` `[rows, vocab]`), whatever the temperature."""
    log_probs = ops.log_softmax(logits, axis=-1)
    vocab_size = logits.shape[-1]
    allowed = log_probs + _padding_bias(vocab_size)
    if bias is not None:
        allowed = allowed + bias
    # The k-th largest of a row (k at most vocab - 1: never the padding id, the smallest).
    k = ops.where(sampling.top_k <= 0, vocab_size - 1, ops.minimum(sampling.top_k, vocab_size - 1))
    kth = ops.take_along_axis(ops.sort(allowed, axis=-1), (vocab_size - k)[:, None], axis=1)
    perturbed = allowed / sampling.temperature[:, None] + gumbel_noise(sampling.seed, step, vocab_size)
    token = ops.cast(ops.argmax(ops.where(allowed >= kth, perturbed, float("-inf")), axis=-1), "int32")
    if at_limit is not None:
        token = ops.where(at_limit, ops.cast(end_id, "int32"), token)
    return _NextTokens(ops.take_along_axis(log_probs, token[:, None], axis=-1)[:, 0], token)


def _prefix_tokens(prefix_ids, column):
    """Each row's prefix token at output `column` (`[rows]` int32), or -1 past its prefix.

    `prefix_ids` `[rows, p]`: the tokens each output must begin with, 0-padded (p may be 0).
    """
    prefix_ids = ops.pad(ops.cast(prefix_ids, "int32"), [[0, 0], [0, 1]])  # a 0 past every prefix
    token = ops.take(prefix_ids, ops.minimum(column, ops.shape(prefix_ids)[1] - 1), axis=1)
    return ops.where(token == PAD_ID, -1, token)


def _repeated_ngram_bias(outputs, length, n, vocab_size):
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


def _write_column(tokens, position, column):
    """tokens `[..., steps]` with `position` set to `column` `[...]`."""
    return ops.where(ops.arange(ops.shape(tokens)[-1]) == position, column[..., None], tokens)


# ------------------------------------------------------------------ greedy


class _GreedyState(NamedTuple):
    """The greedy loop's state; every field but `index` has the batch first."""

    index: Any  # scalar int32: the position the decoder reads this step (of `last`)
    last: Any  # [batch] the newest token, not read yet
    finished: Any  # [batch] bool: the end token is out
    log_prob: Any  # [batch] log P(output so far)
    lengths: Any  # [batch] output tokens, the end token included
    tokens: Any  # [batch, columns] the output so far; 0 after the end token
    cache: Any  # the decoder's cache


class _Greedy(NamedTuple):
    """Greedy search: each row grows by its most likely token (never padding; at its limit, only the end).

    The decoder reads position `index`; its token goes to output column
    `index - offset` (0 for a translation, prompt length - 1 for generation).
    Options: a target prefix (`prefix_ids` `[batch, p]`: the first tokens,
    forced), a ban on repeating an n-gram (`no_repeat_ngram_size` n > 0), and
    a token drawn from the model's distribution in place of the most likely
    (`sampling`, a `Sampling`).
    """

    next_logits: NextLogits
    end_id: int
    limits: Any = None  # [batch] most output tokens per row, or None
    offset: Any = 0
    prefix_ids: Any = None
    no_repeat_ngram_size: int = 0
    sampling: Any = None

    def step(self, state):
        logits, cache = self.next_logits(state.last, state.index, state.tokens, state.cache)
        return self.choose(state._replace(cache=cache), logits, state.index - self.offset)._replace(
            index=state.index + 1)

    def choose(self, state, logits, column):
        """`state` with every unfinished row's next token from `logits` `[batch, vocab]` at `column`."""
        at_limit = None if self.limits is None else column + 1 >= self.limits
        logits = ops.cast(logits, "float32")
        bias = None
        if self.no_repeat_ngram_size:
            bias = _repeated_ngram_bias(state.tokens, column, self.no_repeat_ngram_size, logits.shape[-1])
        if self.sampling is not None:
            best = _sampled_token(logits, at_limit, self.end_id, self.sampling, column, bias)
        else:
            forced = None if self.prefix_ids is None else _prefix_tokens(self.prefix_ids, column)
            best = _most_likely_token(logits, at_limit, self.end_id, forced, bias)
        token = ops.where(state.finished, PAD_ID, best.token)
        return state._replace(
            last=token,
            finished=state.finished | (token == self.end_id),
            log_prob=state.log_prob + ops.where(state.finished, 0.0, best.log_prob),
            lengths=state.lengths + ops.cast(ops.logical_not(state.finished), "int32"),
            tokens=_write_column(state.tokens, column, token),
        )

    def done(self, state):
        return ops.all(state.finished)


def _greedy_state(batch_size, columns, first_token, cache, index=0):
    return _GreedyState(
        index=ops.convert_to_tensor(index, "int32"),
        last=ops.full((batch_size,), first_token, "int32"),
        finished=ops.zeros((batch_size,), "bool"),
        log_prob=ops.zeros((batch_size,), "float32"),
        lengths=ops.zeros((batch_size,), "int32"),
        tokens=ops.zeros((batch_size, columns), "int32"),
        cache=cache,
    )


def greedy_decode(model, source_ids, start_id, end_id, max_length=None, alpha=0.6, prefix_ids=None,
                  no_repeat_ngram_size=0):
    """Batched greedy decoding with the key/value cache.

    Args:
        model: a `Transformer`.
        source_ids: int `[batch, source_len]`, padded with 0.
        start_id, end_id: the target's start and end token ids.
        max_length: most output tokens (end token included); by default each
            sentence gets its own source length + 50. Never more than the
            model's `max_length` with learned positions (its table ends there).
        alpha: length-penalty exponent for the reported score.
        prefix_ids: optional int `[batch, p]`: the tokens each output must
            begin with (no start or end id), 0-padded; the search goes on
            from there. Their log-probabilities count in the score.
        no_repeat_ngram_size: n > 0 bans any token that would make an n-gram
            (n consecutive output tokens) appear twice in an output.

    Returns:
        tokens: int32 `[batch, steps]`, ending with `end_id` (unless cut at
            the limit) and padded with 0 after it; no start token. `steps` is
            the loop's bound, source_len + 50 by default (fixed shapes, so the
            search compiles): trim the all-zero columns at the end if you like.
        scores: float32 `[batch]`, log-probability / length penalty.

    Compile it for speed, e.g. `jax.jit(lambda ids: greedy_decode(model, ids, 2, 3))`
    on JAX or `tf.function(...)` on TensorFlow.
    """
    _check_options(prefix_ids, no_repeat_ngram_size)
    with _no_gradient():
        return _greedy_decode(model, source_ids, start_id, end_id, max_length, alpha, cached_decoder,
                              prefix_ids=prefix_ids, no_repeat_ngram_size=no_repeat_ngram_size)


def sample_decode(model, source_ids, start_id, end_id, seed=0, temperature=1.0, top_k=0, max_length=None,
                  alpha=0.6, no_repeat_ngram_size=0):
    """Batched sampling with the key/value cache: each token drawn from the model's distribution.

    The greedy loop with a random choice: at each step a row's token is drawn
    from softmax(log P(token | row so far) / temperature) over its `top_k`
    most likely tokens (never padding; at the length limit, only the end),
    the standard way to back-translate monolingual text (Edunov et al., 2018).
    The randomness is a hash of (seed, position, token id)
    (`keras_transformer.counter_noise`), so a sentence with a given seed gets
    the same output alone or in any batch, on every backend, every time.

    Args:
        model, source_ids, start_id, end_id, max_length, alpha,
            no_repeat_ngram_size: as in `greedy_decode`.
        seed: int, or int `[batch]`: one seed per sentence.
        temperature: float > 0, or float `[batch]`. Below 1 sharpens the
            distribution, above 1 flattens it.
        top_k: int, or int `[batch]`: draw among the k most likely tokens
            (ties at the k-th included); 0 (default): among all. 1 is greedy
            decoding.

    Returns:
        tokens: int32 `[batch, steps]`, as `greedy_decode`'s.
        scores: float32 `[batch]`, the output's log-probability under the model
            (temperature 1, the whole vocabulary) / length penalty.

    Example:

    ```python
    tokens, scores = kt.sample_decode(model, source_ids, START_ID, END_ID, seed=np.arange(len(source_ids)),
                                      temperature=0.8, top_k=10)
    ```
    """
    if isinstance(temperature, (int, float)) and temperature <= 0:
        raise ValueError(f"temperature must be > 0 (top_k=1 is greedy decoding), got {temperature}")
    if isinstance(top_k, int) and top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: every token), got {top_k}")
    _check_options(None, no_repeat_ngram_size)
    with _no_gradient():
        return _greedy_decode(model, source_ids, start_id, end_id, max_length, alpha, cached_decoder,
                              no_repeat_ngram_size=no_repeat_ngram_size, sampling=(seed, temperature, top_k))


def _check_options(prefix_ids, no_repeat_ngram_size):
    if not isinstance(no_repeat_ngram_size, int) or no_repeat_ngram_size < 0:
        raise ValueError(f"no_repeat_ngram_size must be an int >= 0 (0: no ban), got {no_repeat_ngram_size!r}")
    if prefix_ids is not None and len(ops.shape(prefix_ids)) != 2:
        raise ValueError(f"prefix_ids must have shape [batch, prefix_len], got shape {ops.shape(prefix_ids)}")


def _per_row(value, batch_size, dtype):
    """A scalar or `[batch]` value as a `[batch]` tensor of `dtype`."""
    return ops.broadcast_to(ops.cast(ops.convert_to_tensor(value), dtype), (batch_size,))


def _greedy_decode(model, source_ids, start_id, end_id, max_length, alpha, decoder, prefix_ids=None,
                   no_repeat_ngram_size=0, sampling=None):
    """`greedy_decode` (or, with `sampling` = (seed, temperature, top_k), `sample_decode`) over
    `decoder(model, encoder_output, source_mask, steps, rows)` -> (cache, next_logits)."""
    prepared = _prepare(model, source_ids, max_length)
    batch_size = ops.shape(prepared.encoder_output)[0]
    cache, next_logits = decoder(model, prepared.encoder_output, prepared.source_mask, prepared.steps)
    if sampling is not None:
        sampling = Sampling(*(_per_row(value, batch_size, dtype)
                              for value, dtype in zip(sampling, ("int32", "float32", "int32"))))
    search = _Greedy(next_logits, end_id, prepared.limits, prefix_ids=prefix_ids,
                     no_repeat_ngram_size=no_repeat_ngram_size, sampling=sampling)
    state = search_loop(search, _greedy_state(batch_size, prepared.steps, start_id, cache), prepared.steps)
    return state.tokens, state.log_prob / length_penalty(state.lengths, alpha)


def greedy_generate(embedding, decoder, output_projection, prompt_ids, max_new_tokens, end_id=None):
    """Greedy continuation of prompts by a decoder-only (GPT-style) model, with the key/value cache.

    The model is `output_projection(decoder(embedding(ids)))`, the functional
    language model of the README: the prompt runs through the decoder once,
    filling the self-attention cache, then each new token is one cached step
    (its keys and values written at its position), and the most likely next
    token is appended. Never the pad id 0: the model's full pass masks it out.

    Args:
        embedding: `PositionalEmbedding` (or a layer called as
            `embedding(ids [batch, n], start_index=position)` -> `[batch, n, d_model]`).
        decoder: a `Decoder(..., use_cross_attention=False)`.
        output_projection: hidden states `[batch, n, d_model]` -> logits
            `[batch, n, vocab]`: a `keras.layers.Dense`, or for a projection
            tied to the embedding e.g.
            `lambda h: keras.ops.matmul(h, keras.ops.transpose(embedding.token_embedding.embeddings))`.
        prompt_ids: int `[batch, prompt_len]`, prompt_len >= 1 and known when
            the call is traced. Every prompt has the same length and no
            padding (id 0): the cache takes each earlier position for a real token.
        max_new_tokens: how many tokens to generate (a Python int >= 1).
        end_id: optional; a row that produces it stops there (0 after it).
            The loop ends early once every row has.

    Returns:
        tokens: int32 `[batch, max_new_tokens]`, the continuation only (no
            prompt), padded with 0 after `end_id`.
        log_prob: float32 `[batch]`, log P(tokens | prompt) under the model.

    Compile it for speed, e.g. `jax.jit(lambda ids: greedy_generate(embedding, decoder, dense, ids, 100))`.
    """
    prompt_ids = ops.convert_to_tensor(prompt_ids)
    if len(prompt_ids.shape) != 2:
        raise ValueError(f"greedy_generate expects prompt_ids of shape [batch, prompt_len], got {prompt_ids.shape}.")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"greedy_generate needs max_new_tokens, a Python int >= 1, got {max_new_tokens!r}.")
    prompt_ids = ops.cast(prompt_ids, "int32")
    batch_size, prompt_length = ops.shape(prompt_ids)[0], prompt_ids.shape[1]
    if prompt_length is None:
        raise ValueError("greedy_generate needs the prompt length known when it is traced (a fixed-size cache).")
    end_id = -1 if end_id is None else end_id  # -1: no token ends a row

    def next_logits(token_ids, index, outputs, cache):
        """Tokens `[batch, n]` at positions from `index` -> the logits after the last one `[batch, vocab]`."""
        if len(token_ids.shape) == 1:
            token_ids = token_ids[:, None]
        x = embedding(token_ids, start_index=index, training=False)
        x, cache = decoder(x, self_attention_cache=cache, cache_index=index, training=False)
        return output_projection(x[:, -1:])[:, 0], cache

    # The whole prompt in one pass; the last generated token is never read, hence the - 1.
    steps = prompt_length + max_new_tokens - 1
    search = _Greedy(next_logits, end_id, offset=prompt_length - 1)
    with _no_gradient():
        state = _greedy_state(batch_size, max_new_tokens, PAD_ID, decoder.empty_cache(batch_size, steps),
                              index=prompt_length)
        logits, cache = next_logits(prompt_ids, 0, state.tokens, state.cache)
        state = search.choose(state._replace(cache=cache), logits, 0)
        state = search_loop(search, state, steps)
    return state.tokens, state.log_prob


# -------------------------------------------------------------------- beam


class _BeamState(NamedTuple):
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
    cache: Any  # the decoder's cache, one row per hypothesis [batch * (k + 1), ...]


class _Candidates(NamedTuple):
    """The 2k best one-token extensions of a sentence's k beams, best first, each `[batch, 2k, ...]`."""

    log_prob: Any  # [batch, 2k]
    beam: Any  # [batch, 2k] the beam it extends
    token: Any  # [batch, 2k] the token it adds
    tokens: Any  # [batch, 2k, steps] its whole output
    ends: Any  # [batch, 2k] bool: the token is the end token


class _Beam(NamedTuple):
    """Beam search of `k` hypotheses per sentence, plus the sentence's greedy hypothesis as one more row."""

    next_logits: NextLogits
    end_id: int
    k: int
    alpha: float
    limits: Any  # [batch] most output tokens per sentence
    n_best: Any = None  # None: the best hypothesis; n: the n best, all different (`_beam_update`)
    prefix_ids: Any = None  # [batch, p] the first output tokens, forced; or None
    no_repeat_ngram_size: int = 0  # n > 0: no hypothesis repeats an n-gram

    def step(self, state):
        k, rows, index = self.k, self.k + 1, state.index
        # Explicit sizes, no -1: a reshape cannot infer an axis of an empty batch.
        batch_size, steps = ops.shape(state.last)[0], ops.shape(state.greedy_tokens)[1]
        outputs = ops.reshape(ops.concatenate([state.alive_tokens, state.greedy_tokens[:, None]], axis=1),
                              (batch_size * rows, steps))
        logits, cache = self.next_logits(ops.reshape(state.last, (-1,)), index, outputs, state.cache)
        logits = ops.cast(logits, "float32")
        at_limit = ops.repeat(index + 1 >= self.limits, rows, axis=0)
        forced = None if self.prefix_ids is None else ops.repeat(_prefix_tokens(self.prefix_ids, index), rows, axis=0)
        bias = None
        if self.no_repeat_ngram_size:
            bias = _repeated_ngram_bias(outputs, index, self.no_repeat_ngram_size, logits.shape[-1])
        best = _next_tokens(logits, at_limit, self.end_id, 2 * k, forced, bias)
        best = _NextTokens(*(ops.reshape(x, (batch_size, rows, x.shape[-1])) for x in best))

        state, source_row = _beam_update(state, best, index, self.limits, self.end_id, k, self.alpha,
                                         n_best=self.n_best)
        return state._replace(index=index + 1, cache=_reorder_rows(cache, source_row))

    def done(self, state):
        return ops.all(state.beam_done & state.greedy_done)


# The beam's bookkeeping (`_beam_update` and its parts), shared with the TensorFlow serving engine
# (export/search.py). It passes `take_rows=` a one-op `tf.gather(batch_dims=1)`, since `take_along_axis`
# broadcasts, swaps axes and fixes negative indices (a dozen ops), and a decoding step at batch 1 costs
# its ops' dispatch. Each works on any state with the fields of `_BeamState` it reads.


def _take_rows(x, index):
    """`x` `[batch, n, ...]` -> `[batch, m, ...]`: each sentence's rows `index` `[batch, m]` (int32)."""
    extra_axes = len(x.shape) - 2
    if extra_axes:
        index = ops.broadcast_to(ops.reshape(index, (*ops.shape(index), *([1] * extra_axes))),
                                 (*ops.shape(index), *ops.shape(x)[2:]))
    return ops.take_along_axis(x, index, axis=1)


def _beam_candidates(state, best, index, end_id, k, take_rows=_take_rows):
    """Every alive beam (`state.alive_log_prob` `[batch, k]`, `state.alive_tokens` `[batch, k, steps]`)
    extended by its best tokens (`best`: `_NextTokens` `[batch, k, n]`) at position `index`: the best 2k,
    as `_Candidates`.

    2k, so that k remain alive even if k of them end. A beam's 2k best
    tokens are all its candidates that can be among them.
    """
    batch_size = ops.shape(state.alive_log_prob)[0]
    n = best.token.shape[-1] if best.token.shape[-1] is not None else ops.shape(best.token)[-1]
    log_prob, flat = ops.top_k(ops.reshape(state.alive_log_prob[:, :, None] + best.log_prob, (batch_size, k * n)),
                               2 * k)
    flat = ops.cast(flat, "int32")
    beam, token = flat // n, take_rows(ops.reshape(best.token, (batch_size, k * n)), flat)
    tokens = _write_column(take_rows(state.alive_tokens, beam), index, token)
    return _Candidates(log_prob, beam, token, tokens, token == end_id)


def _finish_hypotheses(state, candidates, greedy_tokens, greedy_log_prob, greedy_ends, penalty, k,
                       take_rows=_take_rows, distinct=False):
    """The best k finished hypotheses once the ending candidates among the best k, and a
    greedy hypothesis that ends, are scored (log-probability / `penalty`) and added.

    The greedy hypothesis can be a beam's too; with `distinct` it is then not
    added twice, so the k finished hypotheses are k different outputs (the
    n-best list). The best one is the same either way.

    Returns finished tokens `[batch, k, steps]`, their scores `[batch, k]` and
    the sentences' counts of finished beams `[batch]`.
    """
    # "Among the best k" is a mask over the 2k, not a slice `[:, :k]`: XLA on CPU
    # runs a top_k as its fast TopK kernel only if no slice is taken of the result
    # (`TopkRewriter`); with one, it sorts all of [batch, k * vocab] every step.
    # The k extra candidates score MASKED_SCORE after the finished ones, so no choice changes.
    newly_finished = (candidates.ends & (ops.arange(2 * k) < k)[None] & ops.logical_not(state.beam_done)[:, None]
                      & (candidates.log_prob > MASKED_SCORE / 2))
    new_scores = ops.where(newly_finished, candidates.log_prob / penalty, MASKED_SCORE)
    if distinct:
        # A hypothesis ends at its length, so a beam's copy of the greedy one can only end at the same step.
        copies = ops.all(candidates.tokens == greedy_tokens[:, None], axis=-1) & newly_finished
        greedy_ends = greedy_ends & ops.logical_not(ops.any(copies, axis=1))
    greedy_score = ops.where(greedy_ends, greedy_log_prob / penalty, MASKED_SCORE)
    scores, best = ops.top_k(ops.concatenate([state.finished_scores, new_scores, greedy_score[:, None]], 1), k)
    pool = ops.concatenate([state.finished_tokens, candidates.tokens, greedy_tokens[:, None]], 1)
    num_finished = state.num_finished + ops.sum(ops.cast(newly_finished, "int32"), axis=1)
    return take_rows(pool, ops.cast(best, "int32")), scores, num_finished


def _keep_alive(candidates, k, take_rows=_take_rows):
    """The best k candidates that did not end: log-probabilities `[batch, k]`, tokens
    `[batch, k, steps]`, and the beam and the token each came from `[batch, k]`."""
    log_prob, keep = ops.top_k(ops.where(candidates.ends, MASKED_SCORE, candidates.log_prob), k)
    keep = ops.cast(keep, "int32")
    return (log_prob, *(take_rows(values, keep) for values in (candidates.tokens, candidates.beam, candidates.token)))


def _stop_early(state, index, limits, alpha, n=1):
    """`state` with its beams, and greedy hypotheses, done where they can no longer win (or, for an
    n-best list, no longer enter its first `n` places).

    A log-probability only falls as a hypothesis grows, so its best possible
    score is now over the largest penalty it can still reach (it has
    `index` tokens now, its limit `limits` `[batch]` at most). The result is
    unchanged; the loop just ends sooner.
    """
    largest_penalty = ops.maximum(length_penalty(index, alpha), length_penalty(limits, alpha))
    nth_finished = state.finished_scores[:, n - 1]
    return state._replace(
        beam_done=state.beam_done | (state.alive_log_prob[:, 0] / largest_penalty < nth_finished),
        greedy_done=state.greedy_done | (state.greedy_log_prob / largest_penalty < nth_finished),
    )


def _beam_update(state, best, index, limits, end_id, k, alpha, take_rows=_take_rows, n_best=None):
    """The beam's bookkeeping for one step: each row's best next tokens `best` (`_NextTokens`
    `[batch, k + 1, 2k]`, the k beams then the greedy hypothesis) at position `index` grow the
    hypotheses; those that end are scored and finished, the best k that do not stay alive, and a
    sentence is done once it has k finished, reaches its limit (`limits` `[batch]`) or can no longer win.

    Returns `state` with its hypothesis fields updated (not its index or cache), and the row
    `[batch, k + 1]` of its sentence whose cache each row takes. With `n_best`, the finished
    hypotheses are all different (`_finish_hypotheses`' `distinct`), and a sentence searches on until
    no hypothesis can enter its first `n_best` places.
    """
    greedy_done = state.greedy_done
    greedy_token = ops.where(greedy_done, PAD_ID, best.token[:, k, 0])
    greedy_log_prob = state.greedy_log_prob + ops.where(greedy_done, 0.0, best.log_prob[:, k, 0])
    greedy_tokens = _write_column(state.greedy_tokens, index, greedy_token)
    greedy_ends = greedy_token == end_id

    candidates = _beam_candidates(state, _NextTokens(best.log_prob[:, :k], best.token[:, :k]), index, end_id, k,
                                  take_rows)
    finished_tokens, finished_scores, num_finished = _finish_hypotheses(
        state, candidates, greedy_tokens, greedy_log_prob, greedy_ends, length_penalty(index + 1, alpha), k, take_rows,
        n_best is not None)
    alive_log_prob, alive_tokens, alive_beam, alive_token = _keep_alive(candidates, k, take_rows)
    state = _stop_early(state._replace(
        last=ops.concatenate([alive_token, greedy_token[:, None]], axis=1),
        alive_tokens=alive_tokens,
        alive_log_prob=alive_log_prob,
        finished_tokens=finished_tokens,
        finished_scores=finished_scores,
        num_finished=num_finished,
        beam_done=state.beam_done | (num_finished >= k) | (index + 1 >= limits),
        greedy_tokens=greedy_tokens,
        greedy_log_prob=greedy_log_prob,
        greedy_done=greedy_done | greedy_ends,
    ), index + 1, limits, alpha, n_best or 1)
    return state, ops.concatenate([alive_beam, ops.full((ops.shape(alive_beam)[0], 1), k, "int32")], axis=1)


def _reorder_rows(cache, source_row):
    """Each hypothesis row takes the cache of row `source_row` `[batch, rows]` of its sentence.

    The cross-attention cache is the same for every row of a sentence: nothing to reorder.
    """
    batch_size, rows = ops.shape(source_row)[0], ops.shape(source_row)[1]
    reorder = ops.reshape(ops.arange(batch_size, dtype="int32")[:, None] * rows + source_row, (-1,))
    if not cache:  # a decoder without a cache (a full pass each step)
        return cache
    return {
        "self_attention": keras.tree.map_structure(lambda c: ops.take(c, reorder, axis=0), cache["self_attention"]),
        "cross_attention": cache["cross_attention"],
    }


def beam_search(model, source_ids, start_id, end_id, beam_size=4, alpha=0.6, max_length=None, n_best=None,
                prefix_ids=None, no_repeat_ngram_size=0):
    """Batched beam search with the key/value cache and a length penalty.

    Each step extends every live hypothesis by every token and keeps the
    `2 * beam_size` best by log-probability. A candidate that ends with
    `end_id` among the best `beam_size` is finished and scored with the length
    penalty; the best `beam_size` that do not end stay alive. A sentence's
    beam is done when it has `beam_size` finished hypotheses (or reaches its
    length limit, where only `end_id` may come), or earlier, as soon as no live
    hypothesis can still beat its best finished one.

    Beam search alone can prune the greedy path and end below it, so each
    sentence also carries its greedy hypothesis as one more row of the same
    loop, and that hypothesis competes with the finished ones: the result is
    never scored below `greedy_decode`'s, and beam size 1 is greedy decoding.
    That holds in float32. In bfloat16 (`mixed_bfloat16`) it cannot be kept
    exactly: the greedy row here runs in a batch of `beam_size + 1` rows per
    sentence, `greedy_decode`'s in a batch of one, and a backend's bfloat16
    matmuls may round a row differently by batch shape (JAX on the CPU and
    GPUs do), so the score can fall below `greedy_decode`'s by that rounding:
    on the CPU, by at most bfloat16's relative precision (2^-8) of the score,
    as tested (BENCHMARKS.md, "Beam against greedy in bfloat16").

    Args:
        model: a `Transformer`.
        source_ids: int `[batch, source_len]`, padded with 0.
        start_id, end_id: the target's start and end token ids.
        beam_size: hypotheses kept per sentence (4 in the paper).
        alpha: length-penalty exponent (0.6 in the paper).
        max_length: most output tokens; by default source length + 50. Never
            more than the model's `max_length` with learned positions.
        n_best: None for the best hypothesis alone; n (1 to `beam_size`) for
            the n best finished hypotheses of each sentence, all different,
            best first. The first is the one `n_best=None` returns.
        prefix_ids: optional int `[batch, p]`: the tokens each output must
            begin with (no start or end id), 0-padded; the beam searches on
            from there, and their log-probabilities count in the score. An
            empty prefix (all 0, or p = 0) changes nothing. The length limit
            comes first: a prefix longer than it is cut.
        no_repeat_ngram_size: n > 0: no hypothesis gets an n-gram (n
            consecutive output tokens) twice, against outputs that loop.

    Returns:
        tokens: int32 `[batch, steps]`, the best finished hypothesis, padded
            with 0 after `end_id` (`steps` as in `greedy_decode`); with
            `n_best`, `[batch, n_best, steps]`.
        scores: float32 `[batch]`, its log-probability / length penalty; with
            `n_best`, `[batch, n_best]`, sorted from the best. A sentence with
            fewer finished hypotheses than `n_best` (a length limit of a few
            tokens) has a score of about -1e9 in the empty places.

    Compile it for speed (`jax.jit`, `tf.function`).

    Example:

    ```python
    tokens, scores = kt.beam_search(model, source_ids, START_ID, END_ID, beam_size=4, n_best=4)
    # tokens [batch, 4, steps]: four different translations of each sentence, best first
    ```
    """
    _check_options(prefix_ids, no_repeat_ngram_size)
    with _no_gradient():
        return _beam_search(model, source_ids, start_id, end_id, beam_size, alpha, max_length, cached_decoder,
                            n_best, prefix_ids, no_repeat_ngram_size)


def _beam_search(model, source_ids, start_id, end_id, beam_size, alpha, max_length, decoder, n_best=None,
                 prefix_ids=None, no_repeat_ngram_size=0):
    """`beam_search` over `decoder(model, encoder_output, source_mask, steps, rows)` -> (cache, next_logits)."""
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    if n_best is not None and not 1 <= n_best <= beam_size:
        raise ValueError(f"n_best must be from 1 to beam_size ({beam_size}), got {n_best}")
    k, rows = beam_size, beam_size + 1
    prepared = _prepare(model, source_ids, max_length)
    batch_size, steps = ops.shape(prepared.encoder_output)[0], prepared.steps
    cache, next_logits = decoder(model, prepared.encoder_output, prepared.source_mask, steps, rows)
    first_beam_only = ops.where(ops.arange(k) == 0, 0.0, MASKED_SCORE)
    state = _BeamState(
        index=ops.convert_to_tensor(0, "int32"),
        last=ops.full((batch_size, rows), start_id, "int32"),
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
    )
    search = _Beam(next_logits, end_id, k, alpha, prepared.limits, n_best=n_best, prefix_ids=prefix_ids,
                   no_repeat_ngram_size=no_repeat_ngram_size)
    state = search_loop(search, state, steps)
    if n_best is not None:
        return state.finished_tokens[:, :n_best], state.finished_scores[:, :n_best]
    return state.finished_tokens[:, 0], state.finished_scores[:, 0]
