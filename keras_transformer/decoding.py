"""Greedy decoding, sampling, beam search and greedy generation over the key/value cache: one loop, four searches.

Written in `keras.ops`, so they run on the JAX, PyTorch and TensorFlow
backends and compile (`jax.jit`, `tf.function`). One loop (`search_loop`)
drives every search; what a step computes is a strategy of
`keras_transformer.strategies` (`Greedy`, `Beam`), as OpenNMT-tf's
`dynamic_decode` takes a decoding strategy and keras-hub's samplers plug into
one sampling loop. Every shape is fixed before the loop: the self-attention
cache is a buffer of the most output positions, written in place, and every
row stays in the batch until the loop ends. (The TensorFlow serving engine in
`export/` runs the same strategies in its own loop: a growing cache, rows that
leave the batch. Its searches are named apart, `export.search.engine_greedy_decode`
and `engine_beam_search`: these functions' arguments plus engine options, and
outputs trimmed to the longest; both side by side in docs/library.md, "The two
searches: the library's and the serving engine's".)

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

from keras_transformer.masking import PAD_ID, padding_mask
from keras_transformer.renamed import renamed_arguments
from keras_transformer.strategies import Beam, Greedy, Sampling, check_options, length_penalty

__all__ = ["EXTRA_OUTPUT_LENGTH", "NextLogits", "Prepared", "Sampling", "beam_search", "cached_decoder",
           "greedy_decode", "greedy_generate", "length_penalty", "output_bound", "prepare", "sample_decode",
           "search_loop"]

# Default room for the output: source length + 50 tokens (paper section 6.1; its parsing experiment, section
# 6.3, gives the output source length + 300: `extra_output_length=300`).
EXTRA_OUTPUT_LENGTH = 50


def check_extra_output_length(extra_output_length):
    """Raises a ValueError naming a bad `extra_output_length` (an int >= 0)."""
    if isinstance(extra_output_length, bool) or not isinstance(extra_output_length, int) or extra_output_length < 0:
        raise ValueError(f"extra_output_length must be an int >= 0 (the output's room beyond the source's "
                         f"length), got {extra_output_length!r}")


def output_bound(model, source_length, max_output_length=None, extra_output_length=EXTRA_OUTPUT_LENGTH):
    """The most output tokens (end token included) for a source of `source_length` real tokens.

    Source length + `extra_output_length` (`EXTRA_OUTPUT_LENGTH`, 50, by
    default), or `max_output_length` when given; never past a learned
    position table (`model.max_positions`: output i is read from decoder
    position i); at least 1. `source_length` may be a Python int (the result
    is then one: a shape known when the search compiles) or an int tensor
    `[batch]`.
    """
    check_extra_output_length(extra_output_length)
    bound = source_length + extra_output_length if max_output_length is None else max_output_length
    if model.learned_positions:
        bound = _minimum(bound, model.max_positions)
    return max(bound, 1) if isinstance(bound, int) else ops.maximum(bound, 1)


def _minimum(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else ops.minimum(a, b)


# A search's `max_output_length=` was `max_length=`: the old name is still read (`renamed_arguments`). The
# library's searches and the serving engine's (`export.search`) take it through this decorator.
# The searches' old keywords: `max_length=` (the output limit) and `alpha=` (the length penalty's exponent).
renamed_search_arguments = renamed_arguments(max_length="max_output_length", alpha="length_penalty")


def _no_gradient():
    """A context in which the backend records no gradient: a search has none. On PyTorch, autograd
    would otherwise keep every step of the loop (and hand back tensors that require grad); JAX and
    TensorFlow record only inside a gradient transform or tape, which a search is not called in."""
    if keras.backend.backend() == "torch":
        import torch

        return torch.no_grad()
    return contextlib.nullcontext()


# ------------------------------------------------------------------ the loop


def search_loop(search, next_logits, state, steps):
    """`state` after `search.step(state, next_logits)` has run while `state.index < steps` and some row of
    `search.done(state)` is not.

    `search` is a strategy (`keras_transformer.strategies.Greedy` or `Beam`),
    `next_logits` the model's decoder step (`NextLogits`). `state` is a
    NamedTuple whose fields are tensors (or nests of them, the cache) of fixed
    shapes and dtypes, the scalar `index` first; `steps` is the loop's bound on
    `index`. One `keras.ops.while_loop`: `jax.lax.while_loop` on JAX,
    `tf.while_loop` on TensorFlow, a Python loop on PyTorch.
    """
    fields = type(state)

    def not_done(*values):
        state = fields(*values)
        return ops.logical_and(state.index < steps, ops.logical_not(ops.all(search.done(state))))

    def step(*values):
        return tuple(search.step(fields(*values), next_logits))

    return fields(*ops.while_loop(not_done, step, tuple(state)))


# A decoder step: (last tokens [rows], index, outputs [rows, steps], cache) -> (logits [rows, vocab], cache).
NextLogits = Callable[[Any, Any, Any, Any], Any]


def cached_decoder(model, encoder_output, source_mask, steps, rows=1):
    """`(cache, next_logits)`: the model's decoder over its key/value cache, one position a call.

    `rows` hypotheses per sentence (beam search's k + 1), sentence-major: the
    self-attention cache has `steps` positions per row, and a sentence's rows
    read its cross-attention cache together. `next_logits` ignores `outputs`
    (the cache holds what it needs of them).
    """
    cache = model.init_decoding_cache(encoder_output, steps, rows_per_sentence=rows)

    def next_logits(last, index, outputs, cache):
        return model.decode_step(last, index, encoder_output, source_mask, cache)

    return cache, next_logits


class Prepared(NamedTuple):
    """A batch of sources, encoded once for any search (`prepare`)."""

    encoder_output: Any  # [batch, source_len, d_model]
    source_mask: Any  # [batch, source_len] bool
    limits: Any  # [batch] int32: each sentence's most output tokens
    steps: Any  # the loop's bound: the largest limit any sentence of this source length may have


def prepare(model, source_ids, max_output_length=None, extra_output_length=EXTRA_OUTPUT_LENGTH):
    """`Prepared`: the encoder output, padding mask, per-sentence output limits `[batch]` and the loop's bound
    of `source_ids` `[batch, source_len]` (int, 0-padded); the limits as `output_bound`'s."""
    source_ids = ops.convert_to_tensor(source_ids)
    if len(source_ids.shape) != 2:
        raise ValueError(f"Decoding expects source_ids of shape [batch, source_len], got shape {source_ids.shape}.")
    source_ids = ops.cast(source_ids, "int32")
    source_mask = padding_mask(source_ids)
    # Per sentence, so a sentence decodes the same alone or in any batch.
    limits = output_bound(model, ops.sum(ops.cast(source_mask, "int32"), axis=1), max_output_length,
                          extra_output_length)
    limits = ops.broadcast_to(ops.cast(limits, "int32"), ops.shape(source_ids)[:1])
    # From the padded length: a bound known when the search compiles, so every buffer has a fixed shape.
    length = source_ids.shape[1] if source_ids.shape[1] is not None else ops.shape(source_ids)[1]
    steps = output_bound(model, length, max_output_length, extra_output_length)
    return Prepared(model.encode(source_ids, training=False), source_mask, limits, steps)




@renamed_search_arguments
def greedy_decode(model, source_ids, start_id, end_id, max_output_length=None, length_penalty=0.6, prefix_ids=None,
                  no_repeat_ngram_size=0, extra_output_length=EXTRA_OUTPUT_LENGTH):
    """Batched greedy decoding with the key/value cache.

    Args:
        model: a `Transformer`.
        source_ids: int `[batch, source_len]`, padded with 0.
        start_id, end_id: the target's start and end token ids.
        max_output_length: most output tokens (end token included); by
            default each sentence gets its own source length +
            `extra_output_length`. Never more
            than the model's `max_positions` with learned positions (its table
            ends there). `max_length=` is its old name, still accepted (with a
            `DeprecationWarning`).
        length_penalty: the length penalty's exponent alpha (Wu et al., 2016)
            for the reported score: log P / ((5 + length) / 6)^alpha. `alpha=`
            is its old name, still accepted (with a `DeprecationWarning`).
        prefix_ids: optional int `[batch, p]`: the tokens each output must
            begin with (no start or end id), 0-padded; the search goes on
            from there. Their log-probabilities count in the score.
        no_repeat_ngram_size: n > 0 bans any token that would make an n-gram
            (n consecutive output tokens) appear twice in an output.
        extra_output_length: the room beyond the source's length the output
            gets when `max_output_length` is None: 50 by default (the
            paper's translation), 300 in its parsing experiment.

    Returns:
        tokens: int32 `[batch, steps]`, ending with `end_id` (unless cut at
            the limit) and padded with 0 after it; no start token. `steps` is
            the loop's bound, source_len + `extra_output_length` by default (fixed shapes, so the
            search compiles): trim the all-zero columns at the end if you like.
        scores: float32 `[batch]`, log-probability / length penalty.

    Compile it for speed, e.g. `jax.jit(lambda ids: greedy_decode(model, ids, 2, 3))`
    on JAX or `tf.function(...)` on TensorFlow.
    """
    check_options(prefix_ids, no_repeat_ngram_size)
    with _no_gradient():
        return _greedy_decode(model, source_ids, start_id, end_id, max_output_length, length_penalty, cached_decoder,
                              prefix_ids=prefix_ids, no_repeat_ngram_size=no_repeat_ngram_size,
                              extra_output_length=extra_output_length)


@renamed_search_arguments
def sample_decode(model, source_ids, start_id, end_id, seed=0, temperature=1.0, top_k=0, max_output_length=None,
                  length_penalty=0.6, no_repeat_ngram_size=0, extra_output_length=EXTRA_OUTPUT_LENGTH):
    """Batched sampling with the key/value cache: each token drawn from the model's distribution.

    The greedy loop with a random choice: at each step a row's token is drawn
    from softmax(log P(token | row so far) / temperature) over its `top_k`
    most likely tokens (never padding; at the length limit, only the end),
    the standard way to back-translate monolingual text (Edunov et al., 2018).
    The randomness is a hash of (seed, position, token id)
    (`keras_transformer.counter_noise`), so a sentence with a given seed gets
    the same output alone or in any batch, on every backend, every time.

    Args:
        model, source_ids, start_id, end_id, max_output_length, length_penalty,
            no_repeat_ngram_size, extra_output_length: as in `greedy_decode` (`max_length=` and
            `alpha=` too).
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
    check_options(None, no_repeat_ngram_size)
    with _no_gradient():
        return _greedy_decode(model, source_ids, start_id, end_id, max_output_length, length_penalty, cached_decoder,
                              no_repeat_ngram_size=no_repeat_ngram_size, sampling=(seed, temperature, top_k),
                              extra_output_length=extra_output_length)



def _per_row(value, batch_size, dtype):
    """A scalar or `[batch]` value as a `[batch]` tensor of `dtype`."""
    return ops.broadcast_to(ops.cast(ops.convert_to_tensor(value), dtype), (batch_size,))


def _greedy_decode(model, source_ids, start_id, end_id, max_output_length, alpha, decoder, prefix_ids=None,
                   no_repeat_ngram_size=0, sampling=None, extra_output_length=EXTRA_OUTPUT_LENGTH):
    """`greedy_decode` (or, with `sampling` = (seed, temperature, top_k), `sample_decode`) over
    `decoder(model, encoder_output, source_mask, steps, rows)` -> (cache, next_logits)."""
    prepared = prepare(model, source_ids, max_output_length, extra_output_length)
    batch_size = ops.shape(prepared.encoder_output)[0]
    cache, next_logits = decoder(model, prepared.encoder_output, prepared.source_mask, prepared.steps)
    options = {"limits": prepared.limits}
    if sampling is not None:
        options["sampling"] = Sampling(*(_per_row(value, batch_size, dtype)
                                         for value, dtype in zip(sampling, ("int32", "float32", "int32"))))
    if prefix_ids is not None:
        options["prefix_ids"] = prefix_ids
    search = Greedy(end_id, no_repeat_ngram_size=no_repeat_ngram_size)
    state = search_loop(search, next_logits, search.start(batch_size, prepared.steps, start_id, cache, **options),
                        prepared.steps)
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
    search = Greedy(end_id, offset=prompt_length - 1)
    with _no_gradient():
        state = search.start(batch_size, max_new_tokens, PAD_ID, decoder.empty_cache(batch_size, steps),
                             index=prompt_length)
        logits, cache = next_logits(prompt_ids, 0, state.tokens, state.cache)
        state = search.choose(state._replace(cache=cache), logits, 0)
        state = search_loop(search, next_logits, state, steps)
    return state.tokens, state.log_prob


# -------------------------------------------------------------------- beam


@renamed_search_arguments
def beam_search(model, source_ids, start_id, end_id, beam_size=4, length_penalty=0.6, max_output_length=None, n_best=None,
                prefix_ids=None, no_repeat_ngram_size=0, extra_output_length=EXTRA_OUTPUT_LENGTH):
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
    GPUs do), so the score can fall below `greedy_decode`'s by that rounding,
    mostly by at most bfloat16's relative precision (2^-8) of the score; and
    where that rounding turns a near-tie the other way, the greedy row takes
    another path, which may end lower than that (rare: docs/benchmarks-log.md,
    "Beam against greedy in bfloat16").

    Args:
        model: a `Transformer`.
        source_ids: int `[batch, source_len]`, padded with 0.
        start_id, end_id: the target's start and end token ids.
        beam_size: hypotheses kept per sentence (4 in the paper).
        length_penalty: the length penalty's exponent alpha (Wu et al., 2016;
            0.6 in the paper): hypotheses rank by log P / ((5 + length) / 6)^alpha.
            `alpha=` is its old name, still accepted (with a `DeprecationWarning`).
        max_output_length: most output tokens; by default source length +
            `extra_output_length`. Never more than the model's `max_positions` with learned
            positions. `max_length=` is its old name, still accepted (with a
            `DeprecationWarning`).
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
        extra_output_length: as in `greedy_decode` (50; the paper's parsing
            experiment: 300).

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
    check_options(prefix_ids, no_repeat_ngram_size)
    with _no_gradient():
        return _beam_search(model, source_ids, start_id, end_id, beam_size, length_penalty, max_output_length, cached_decoder,
                            n_best, prefix_ids, no_repeat_ngram_size, extra_output_length)


def _beam_search(model, source_ids, start_id, end_id, beam_size, alpha, max_output_length, decoder, n_best=None,
                 prefix_ids=None, no_repeat_ngram_size=0, extra_output_length=EXTRA_OUTPUT_LENGTH):
    """`beam_search` over `decoder(model, encoder_output, source_mask, steps, rows)` -> (cache, next_logits)."""
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    if n_best is not None and not 1 <= n_best <= beam_size:
        raise ValueError(f"n_best must be from 1 to beam_size ({beam_size}), got {n_best}")
    k, rows = beam_size, beam_size + 1  # per sentence: k beams, then the greedy hypothesis
    prepared = prepare(model, source_ids, max_output_length, extra_output_length)
    batch_size, steps = ops.shape(prepared.encoder_output)[0], prepared.steps
    cache, next_logits = decoder(model, prepared.encoder_output, prepared.source_mask, steps, rows)
    search = Beam(end_id, k, alpha, n_best=n_best, no_repeat_ngram_size=no_repeat_ngram_size)
    state = search.start(batch_size, steps, start_id, cache, prepared.limits,
                         **({} if prefix_ids is None else {"prefix_ids": prefix_ids}))
    state = search_loop(search, next_logits, state, steps)
    if n_best is not None:
        return state.finished_tokens[:, :n_best], state.finished_scores[:, :n_best]
    return state.finished_tokens[:, 0], state.finished_scores[:, 0]
