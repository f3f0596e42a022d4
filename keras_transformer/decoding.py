"""Greedy decoding and beam search over the Transformer's key/value cache.

Both are plain TensorFlow (a `tf.while_loop` over `Transformer.decode_step`),
so they run inside a `tf.function` and export to a SavedModel. Padding
masks come from the source ids, never from Keras masks.

Scores are log P(output | source) / lp(output), with the length penalty
lp(y) = ((5 + |y|) / 6)^alpha (Wu et al., 2016; tensor2tensor), |y| counting
the end token. Beam search ranks finished hypotheses by it; greedy decoding
reports the same quantity so the two compare.
"""

import tensorflow as tf

from keras_transformer.embedding import PAD_ID
from keras_transformer.model import padding_mask

# Default room for the output: source length + 50 tokens (paper section 6.1).
EXTRA_OUTPUT_LENGTH = 50
_NEG = -1e9


def length_penalty(length, alpha):
    """((5 + length) / 6)^alpha, as a float32 tensor shaped like `length`."""
    return tf.pow((5.0 + tf.cast(length, tf.float32)) / 6.0, alpha)


def _prepare(model, source_ids, max_length):
    """Encoder output, padding mask and per-sentence output limits `[batch]`."""
    source_ids = tf.convert_to_tensor(source_ids)
    if source_ids.shape.rank != 2:
        raise ValueError(f"Decoding expects source_ids of shape [batch, source_len], got shape {source_ids.shape}.")
    source_ids = tf.cast(source_ids, tf.int32)
    source_mask = padding_mask(source_ids)
    if max_length is None:
        # Per sentence, so a sentence decodes the same alone or in any batch.
        limits = tf.reduce_sum(tf.cast(source_mask, tf.int32), axis=1) + EXTRA_OUTPUT_LENGTH
    else:
        limits = tf.fill([tf.shape(source_ids)[0]], tf.cast(max_length, tf.int32))
    limits = tf.maximum(limits, 1)
    steps = tf.reduce_max(tf.concat([limits, [1]], axis=0))  # 1 for an empty batch
    return model.encode(source_ids, training=False), source_mask, limits, steps


def _next_token_log_probs(logits, at_limit, end_id):
    """log-softmax over the vocabulary; never padding, and only `end_id` at the limit."""
    log_probs = tf.nn.log_softmax(logits, axis=-1)
    vocab = tf.range(tf.shape(log_probs)[-1])
    banned = tf.logical_or(
        tf.equal(vocab, PAD_ID)[None, :],
        tf.logical_and(at_limit[:, None], tf.not_equal(vocab, end_id)[None, :]),
    )
    return tf.where(banned, _NEG, log_probs)


def _next_logits_fn(model, encoder_output, source_mask, start_id, use_cache):
    """`(t, last [rows], outputs [rows, steps], cache) -> (logits [rows, vocab], cache)`.

    With the cache, one decoder step for the token at position t. Without it,
    the whole prefix again (start id + outputs so far), as decoding is defined:
    the slow reference the cache must equal.
    """
    if use_cache:
        def next_logits(t, last, outputs, cache):
            return model.decode_step(last, t, encoder_output, source_mask, cache)
    else:
        def next_logits(t, last, outputs, cache):
            start = tf.fill([tf.shape(outputs)[0], 1], tf.cast(start_id, tf.int32))
            prefix = tf.concat([start, outputs[:, :t]], axis=1)
            return model.decode(prefix, encoder_output, source_mask)[:, t], cache
    return next_logits


def _greedy_choice(log_probs, finished):
    """The most likely token of each row and its log-probability; PAD and 0 once finished."""
    token = tf.argmax(log_probs, axis=-1, output_type=tf.int32)
    token_log_prob = tf.gather(log_probs, token, batch_dims=1)
    return tf.where(finished, PAD_ID, token), tf.where(finished, 0.0, token_log_prob)


def _write_column(tokens, t, column):
    """tokens `[..., steps]` with position `t` set to `column` `[...]`."""
    return tf.where(tf.range(tf.shape(tokens)[-1]) == t, column[..., None], tokens)


def _first(n, size):
    """bool `[size]`, True at the first `n` positions."""
    return tf.range(size) < n


def _while_loop(cond, body, state):
    """`tf.while_loop` over (step, per-sentence tensors and caches...) with a free batch size.

    The batch is the first axis of every state tensor but the step; static
    sizes elsewhere are kept.
    """

    def free_batch(x):
        return tf.TensorShape([None] + x.shape.as_list()[1:])

    invariants = (tf.TensorShape([]), *tf.nest.map_structure(free_batch, state[1:]))
    return tf.while_loop(cond, body, state, shape_invariants=invariants)


def _trim(tokens):
    """Drop the all-padding columns at the end of `[batch, steps]` tokens."""
    length = tf.reduce_max(tf.concat([tf.reduce_sum(tf.cast(tokens != PAD_ID, tf.int32), axis=-1), [0]], 0))
    return tokens[:, :length]


def greedy_decode(model, source_ids, start_id, end_id, max_length=None, alpha=0.6, use_cache=True):
    """Batched greedy decoding with the key/value cache.

    Args:
        model: a `Transformer`.
        source_ids: int `[batch, source_len]`, padded with 0.
        start_id, end_id: the target's start and end token ids.
        max_length: most output tokens (end token included); by default each
            sentence gets its own source length + 50.
        alpha: length-penalty exponent for the reported score.
        use_cache: False recomputes the whole prefix every step (same tokens,
            slower; for checks and benchmarks).

    Returns:
        tokens: int32 `[batch, length]`, ending with `end_id` (unless cut at
            the limit) and padded with 0 after it; no start token.
        scores: float32 `[batch]`, log-probability / length penalty.

    Wrap the call in `tf.function` for speed.
    """
    encoder_output, source_mask, limits, steps = _prepare(model, source_ids, max_length)
    batch_size = tf.shape(encoder_output)[0]
    next_logits = _next_logits_fn(model, encoder_output, source_mask, start_id, use_cache)

    def step(t, last, finished, log_prob, lengths, tokens, cache):
        logits, cache = next_logits(t, last, tokens, cache)
        log_probs = _next_token_log_probs(logits, t + 1 >= limits, end_id)
        token, token_log_prob = _greedy_choice(log_probs, finished)
        log_prob += token_log_prob
        lengths += tf.cast(tf.logical_not(finished), tf.int32)
        tokens = _write_column(tokens, t, token)
        finished = tf.logical_or(finished, tf.equal(token, end_id))
        return t + 1, token, finished, log_prob, lengths, tokens, cache

    def not_done(t, last, finished, *_):
        return tf.logical_and(t < steps, tf.logical_not(tf.reduce_all(finished)))

    state = (
        tf.constant(0),
        tf.fill([batch_size], tf.cast(start_id, tf.int32)),
        tf.zeros([batch_size], tf.bool),
        tf.zeros([batch_size], tf.float32),
        tf.zeros([batch_size], tf.int32),
        tf.zeros([batch_size, steps], tf.int32),
        model.init_decoding_cache(encoder_output, steps) if use_cache else {},
    )
    _, _, _, log_prob, lengths, tokens, _ = _while_loop(not_done, step, state)
    return _trim(tokens), log_prob / length_penalty(lengths, alpha)


def beam_search(model, source_ids, start_id, end_id, beam_size=4, alpha=0.6, max_length=None, use_cache=True):
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

    Args:
        model: a `Transformer`.
        source_ids: int `[batch, source_len]`, padded with 0.
        start_id, end_id: the target's start and end token ids.
        beam_size: hypotheses kept per sentence (4 in the paper).
        alpha: length-penalty exponent (0.6 in the paper).
        max_length: most output tokens; by default source length + 50.
        use_cache: False recomputes the whole prefix every step (same result,
            slower; for checks and benchmarks).

    Returns:
        tokens: int32 `[batch, length]`, the best finished hypothesis, padded
            with 0 after `end_id`.
        scores: float32 `[batch]`, its log-probability / length penalty.

    Wrap the call in `tf.function` for speed.
    """
    k = beam_size
    rows = k + 1  # per sentence: k beams, then the greedy hypothesis
    encoder_output, source_mask, limits, steps = _prepare(model, source_ids, max_length)
    batch_size = tf.shape(encoder_output)[0]
    cache = model.init_decoding_cache(encoder_output, steps) if use_cache else {}
    # Every hypothesis gets a row: [batch * rows, ...], sentence-major.
    cache = tf.nest.map_structure(lambda c: tf.repeat(c, rows, axis=0), cache)
    encoder_output = tf.repeat(encoder_output, rows, axis=0)
    source_mask = tf.repeat(source_mask, rows, axis=0)
    row_limits = tf.repeat(limits, rows, axis=0)
    next_logits = _next_logits_fn(model, encoder_output, source_mask, start_id, use_cache)

    def step(t, last, alive_tokens, alive_log_prob, finished_tokens, finished_scores, num_finished, beam_done,
             greedy_tokens, greedy_log_prob, greedy_done, cache):
        outputs = tf.reshape(tf.concat([alive_tokens, greedy_tokens[:, None]], axis=1), [batch_size * rows, -1])
        logits, cache = next_logits(t, tf.reshape(last, [-1]), outputs, cache)
        log_probs = _next_token_log_probs(logits, t + 1 >= row_limits, end_id)
        vocab_size = tf.shape(log_probs)[-1]
        log_probs = tf.reshape(log_probs, [batch_size, rows, vocab_size])
        penalty = length_penalty(t + 1, alpha)

        # The greedy row.
        greedy_token, token_log_prob = _greedy_choice(log_probs[:, k], greedy_done)
        greedy_log_prob += token_log_prob
        greedy_tokens = _write_column(greedy_tokens, t, greedy_token)
        greedy_ends = tf.equal(greedy_token, end_id)
        greedy_done = greedy_done | greedy_ends

        # The beam rows.
        candidates = alive_log_prob[:, :, None] + log_probs[:, :k]
        top_log_prob, top_index = tf.math.top_k(tf.reshape(candidates, [batch_size, -1]), 2 * k)
        top_beam, top_token = top_index // vocab_size, top_index % vocab_size
        top_tokens = _write_column(tf.gather(alive_tokens, top_beam, batch_dims=1), t, top_token)
        ends = tf.equal(top_token, end_id)

        # Finish the ending candidates among the best k, and a greedy hypothesis that ends.
        # "Among the best k" is a mask over the 2k, not a slice `[:, :k]`: XLA on CPU
        # runs a top_k as its fast TopK kernel only if no slice is taken of the result
        # (`TopkRewriter`); with one, it sorts all of [batch, k * vocab] every step.
        # The k extra candidates score _NEG after the finished ones, so no choice changes.
        newly_finished = ends & _first(k, 2 * k) & ~beam_done[:, None] & (top_log_prob > _NEG / 2)
        new_scores = tf.where(newly_finished, top_log_prob / penalty, _NEG)
        greedy_score = tf.where(greedy_ends, greedy_log_prob / penalty, _NEG)
        finished_scores, best = tf.math.top_k(tf.concat([finished_scores, new_scores, greedy_score[:, None]], 1), k)
        finished_tokens = tf.gather(
            tf.concat([finished_tokens, top_tokens, greedy_tokens[:, None]], 1), best, batch_dims=1
        )
        num_finished += tf.reduce_sum(tf.cast(newly_finished, tf.int32), axis=1)
        beam_done = beam_done | (num_finished >= k) | (t + 1 >= limits)

        # Keep the best k that did not end.
        alive_log_prob, keep = tf.math.top_k(tf.where(ends, _NEG, top_log_prob), k)
        alive_tokens = tf.gather(top_tokens, keep, batch_dims=1)
        source_row = tf.concat([tf.gather(top_beam, keep, batch_dims=1), tf.fill([batch_size, 1], k)], axis=1)
        if use_cache:
            reorder = tf.reshape(tf.range(batch_size)[:, None] * rows + source_row, [-1])
            cache = {
                "self_attention": tf.nest.map_structure(lambda c: tf.gather(c, reorder), cache["self_attention"]),
                # Identical for every row of a sentence: nothing to reorder.
                "cross_attention": cache["cross_attention"],
            }
        last = tf.concat([tf.gather(top_token, keep, batch_dims=1), greedy_token[:, None]], axis=1)

        # Stop early where nothing alive can still win: a log-probability only
        # falls as a hypothesis grows, so its best possible score is now over
        # the largest penalty it can reach. The result is unchanged.
        largest_penalty = tf.maximum(length_penalty(t + 1, alpha), length_penalty(limits, alpha))
        beam_done = beam_done | (alive_log_prob[:, 0] / largest_penalty < finished_scores[:, 0])
        greedy_done = greedy_done | (greedy_log_prob / largest_penalty < finished_scores[:, 0])
        return (t + 1, last, alive_tokens, alive_log_prob, finished_tokens, finished_scores, num_finished,
                beam_done, greedy_tokens, greedy_log_prob, greedy_done, cache)

    def not_done(t, *state):
        beam_done, greedy_done = state[6], state[9]
        return tf.logical_and(t < steps, tf.logical_not(tf.reduce_all(beam_done & greedy_done)))

    first_beam_only = tf.concat([[0.0], tf.fill([k - 1], _NEG)], axis=0)
    state = (
        tf.constant(0),
        tf.fill([batch_size, rows], tf.cast(start_id, tf.int32)),
        tf.zeros([batch_size, k, steps], tf.int32),
        tf.tile(first_beam_only[None], [batch_size, 1]),
        tf.zeros([batch_size, k, steps], tf.int32),
        tf.fill([batch_size, k], _NEG),
        tf.zeros([batch_size], tf.int32),
        tf.zeros([batch_size], tf.bool),
        tf.zeros([batch_size, steps], tf.int32),
        tf.zeros([batch_size], tf.float32),
        tf.zeros([batch_size], tf.bool),
        cache,
    )
    state = _while_loop(not_done, step, state)
    finished_tokens, finished_scores = state[4], state[5]
    return _trim(finished_tokens[:, 0]), finished_scores[:, 0]
