"""The searches' options, by their definitions, on every backend: sampling, a target prefix, no repeated n-gram,
and the teacher-forced score and alignment of given outputs."""

import math

import numpy as np
import pytest
from keras import ops

import keras_transformer as kt
from conftest import (a_sentence_and_a_batch_holding_it, copy_prefixes, copy_sources, never_ending_model, random_model,
                      trimmed)
from keras_transformer.counter_noise import hash32, uniform_noise
from keras_transformer.text import END_ID as END
from keras_transformer.text import START_ID as START
from portable.conftest import jit, to_numpy

# ------------------------------------------------------------------ sampling


def numpy_lowbias32(x):
    """The reference hash (C. Wellons' lowbias32) in uint32 arithmetic."""
    x = np.asarray(x).astype(np.uint32)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint32(16)
        x *= np.uint32(0x7FEB352D)
        x ^= x >> np.uint32(15)
        x *= np.uint32(0x846CA68B)
        x ^= x >> np.uint32(16)
    return x


def test_the_noise_is_the_same_integer_hash_on_every_backend():
    values = np.array([0, 1, 2, 3, 7, 12345, 2**31 - 1, -1, -2, -(2**31), 987654321, -123456789], "int64")
    got = to_numpy(hash32(ops.convert_to_tensor(values.astype("int32")))).astype(np.int64) & 0xFFFFFFFF
    np.testing.assert_array_equal(got, numpy_lowbias32(values.astype(np.int32).view(np.uint32)).astype(np.int64))
    noise = to_numpy(uniform_noise(ops.convert_to_tensor(np.arange(64, dtype="int32")), 5, 300))
    assert ((noise > 0) & (noise < 1)).all()
    assert abs(noise.mean() - 0.5) < 0.01 and abs(noise.var() - 1 / 12) < 0.005
    # Another step or seed gives other numbers.
    assert (to_numpy(uniform_noise(ops.convert_to_tensor([3], "int32"), 6, 300)) != noise[3]).mean() > 0.99


def test_sampling_with_top_k_1_is_greedy_decoding(copy_model):
    source = copy_sources(11, 16)
    greedy_tokens, greedy_scores = jit(lambda s: kt.greedy_decode(copy_model, s, START, END))(source)
    tokens, scores = jit(lambda s: kt.sample_decode(copy_model, s, START, END, seed=np.arange(16), top_k=1,
                                                    temperature=2.0))(source)
    np.testing.assert_array_equal(to_numpy(tokens), to_numpy(greedy_tokens))
    np.testing.assert_allclose(to_numpy(scores), to_numpy(greedy_scores), rtol=1e-5)


def test_a_seed_gives_the_same_sample_twice_and_alone_or_in_a_batch(copy_model):
    sentence, batch = a_sentence_and_a_batch_holding_it()
    run = jit(lambda s, seed: kt.sample_decode(copy_model, s, START, END, seed=seed, temperature=1.5))
    seeds = np.array([4, 7, 9, 11], "int32")
    first, first_scores = run(batch, seeds)
    again, again_scores = run(batch, seeds)
    # The score is the output's log-probability under the model itself (temperature 1), length-penalised.
    np.testing.assert_allclose(to_numpy(first_scores),
                               to_numpy(kt.score_targets(copy_model, batch, first, START)[0]), rtol=1e-4)
    np.testing.assert_array_equal(to_numpy(first), to_numpy(again))
    np.testing.assert_array_equal(to_numpy(first_scores), to_numpy(again_scores))
    alone = trimmed(run(sentence, seeds[1:2])[0])[0]
    np.testing.assert_array_equal(to_numpy(first)[1][: len(alone)], alone)
    # Other seeds, other samples (at temperature 1.5 the copy model is unsure).
    many = to_numpy(run(np.repeat(sentence, 32, axis=0), np.arange(32, dtype="int32"))[0])
    assert len({tuple(row) for row in many}) > 8


def chi2_quantile(df, z=3.09):
    """The 0.999 quantile of chi-square with `df` degrees of freedom (Wilson-Hilferty; z: the normal's 0.999)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 0), (1.0, 5)])
def test_sampled_first_tokens_follow_the_models_softmax(temperature, top_k):
    """4000 draws of one sentence's first token (seeds 0-3999) against softmax(log P / temperature) over the
    top_k most likely (padding never): the chi-square statistic stays below its 0.999 quantile (tokens expected
    fewer than 5 times are pooled), and no token outside the top k is ever drawn."""
    model = random_model(3, vocab=24)
    source = np.repeat(np.array([[5, 9, 12, 7, END]], "int32"), 4000, axis=0)
    tokens, _ = jit(lambda s: kt.sample_decode(model, s, START, END, seed=np.arange(4000), temperature=temperature,
                                               top_k=top_k, max_output_length=2))(source)
    first = to_numpy(tokens)[:, 0]
    log_probs = to_numpy(ops.log_softmax(model((source[:1], np.array([[START]], "int32")))[0, 0]))
    log_probs[0] = -np.inf  # padding
    allowed = np.argsort(-log_probs)[: top_k or 23]
    expected = np.zeros(24)
    expected[allowed] = np.exp(log_probs[allowed] / temperature)
    expected *= 4000 / expected.sum()
    counts = np.bincount(first, minlength=24)
    assert counts[expected == 0].sum() == 0
    big = expected >= 5
    observed_bins = np.append(counts[big], counts[~big].sum())
    expected_bins = np.append(expected[big], expected[~big].sum())
    keep = expected_bins > 0
    statistic = ((observed_bins[keep] - expected_bins[keep]) ** 2 / expected_bins[keep]).sum()
    assert statistic < chi2_quantile(keep.sum() - 1), (statistic, counts, expected.round(1))


def test_sampling_rejects_a_temperature_of_zero_and_a_negative_top_k(copy_model):
    source = copy_sources(1, 2)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        kt.sample_decode(copy_model, source, START, END, temperature=0.0)
    with pytest.raises(ValueError, match="top_k must be >= 0"):
        kt.sample_decode(copy_model, source, START, END, top_k=-1)


# ------------------------------------------------------------------ target prefix


@pytest.mark.parametrize("decode", ["greedy", "beam"])
def test_a_prefix_is_honoured_scored_and_an_empty_one_changes_nothing(copy_model, decode):
    source = copy_sources(12, 16)
    prefix = copy_prefixes(0, 16)
    lengths = (prefix != 0).sum(axis=1)
    if decode == "greedy":
        run = jit(lambda s, p: kt.greedy_decode(copy_model, s, START, END, prefix_ids=p))
        plain = jit(lambda s: kt.greedy_decode(copy_model, s, START, END))
    else:
        run = jit(lambda s, p: kt.beam_search(copy_model, s, START, END, beam_size=4, prefix_ids=p))
        plain = jit(lambda s: kt.beam_search(copy_model, s, START, END, beam_size=4))
    tokens, scores = (to_numpy(x) for x in run(source, prefix))
    for i, n in enumerate(lengths):
        np.testing.assert_array_equal(tokens[i, :n], prefix[i, :n])
        assert END in tokens[i]
    # The prefix's log-probabilities count in the score: the teacher-forced score of the output.
    np.testing.assert_allclose(scores, to_numpy(kt.score_targets(copy_model, source, tokens, START)[0]), rtol=1e-4)
    # The copy model would not start most of these outputs so: the prefix changed them.
    plain_tokens, plain_scores = (to_numpy(x) for x in plain(source))
    assert (tokens != plain_tokens).any(axis=1).sum() >= (lengths > 0).sum() // 2
    for empty in (np.zeros((16, 3), "int32"), np.zeros((16, 0), "int32")):
        empty_tokens, empty_scores = run(source, empty)
        np.testing.assert_array_equal(to_numpy(empty_tokens), plain_tokens)
        np.testing.assert_allclose(to_numpy(empty_scores), plain_scores, rtol=1e-6)
    # The length limit comes first: a 3-token prefix with room for 2 tokens gives its first token, then the end.
    decode = kt.greedy_decode if decode == "greedy" else kt.beam_search
    cut = to_numpy(decode(copy_model, source[:2], START, END, max_output_length=2, prefix_ids=np.array([[5, 6, 7]] * 2))[0])
    np.testing.assert_array_equal(cut, [[5, END], [5, END]])


# ------------------------------------------------------------------ repeated n-grams


def ngrams(row, n):
    output = [int(t) for t in row if t != 0]
    return [tuple(output[i:i + n]) for i in range(len(output) - n + 1)]


@pytest.mark.parametrize("n", [2, 3])
def test_no_repeat_ngram_size_leaves_no_repeated_ngram(n):
    """A random model that never ends loops; with the ban, no output repeats an n-gram, in either search."""
    model = never_ending_model()
    source = copy_sources(13, 4)
    for decode in (kt.greedy_decode, lambda *a, **k: kt.beam_search(*a, beam_size=3, **k)):
        looping = to_numpy(jit(lambda s: decode(model, s, START, END, max_output_length=24))(source)[0])
        assert any(len(set(ngrams(row, n))) < len(ngrams(row, n)) for row in looping)  # the test can fail
        banned = to_numpy(jit(lambda s: decode(model, s, START, END, max_output_length=24, no_repeat_ngram_size=n))(
            source)[0])
        for row in banned:
            grams = ngrams(row, n)
            assert len(grams) == 24 - n + 1 and len(set(grams)) == len(grams), row
    with pytest.raises(ValueError, match="no_repeat_ngram_size must be an int >= 0"):
        kt.greedy_decode(model, source, START, END, no_repeat_ngram_size=-1)


# ------------------------------------------------------------------ scoring and alignment


def test_a_score_is_the_teacher_forced_log_probability_over_the_length_penalty(copy_model):
    """score_targets against the definition, sentence by sentence (one full pass each, no padding), for any
    target; and over beam search's n-best list, the first scores highest and every score is the search's."""
    source = copy_sources(14, 8)
    rng = np.random.default_rng(1)
    targets = np.zeros((8, 9), "int32")
    for i in range(8):
        n = rng.integers(1, 9)
        targets[i, : n - 1] = rng.integers(4, 16, n - 1)
        targets[i, n - 1] = END
    scores, log_prob, token_log_probs = (to_numpy(x) for x in kt.score_targets(copy_model, source, targets, START,
                                                                                length_penalty=0.8))
    for i in range(8):
        target = targets[i][targets[i] != 0]
        target_in = np.concatenate([[START], target[:-1]])[None].astype("int32")
        log_probs = to_numpy(ops.log_softmax(copy_model((source[i:i + 1], target_in))[0]))
        expected = log_probs[np.arange(len(target)), target]
        np.testing.assert_allclose(token_log_probs[i, : len(target)], expected, rtol=1e-4, atol=1e-5)
        assert log_prob[i] == pytest.approx(expected.sum(), rel=1e-4)
        assert scores[i] == pytest.approx(expected.sum() / ((5 + len(target)) / 6) ** 0.8, rel=1e-4)
    assert (token_log_probs[targets == 0] == 0).all()

    tokens, beam_scores = (to_numpy(x) for x in kt.beam_search(copy_model, source, START, END, beam_size=4,
                                                               n_best=4))
    rescored = to_numpy(kt.score_targets(copy_model, np.repeat(source, 4, axis=0), tokens.reshape(32, -1), START)[0])
    np.testing.assert_allclose(rescored.reshape(8, 4), beam_scores, rtol=1e-4)
    assert (rescored.reshape(8, 4)[:, :1] >= rescored.reshape(8, 4)[:, 1:] - 1e-5).all()


def test_alignments_name_one_source_piece_per_output_token(copy_model):
    """One index per output token, inside the source's pieces (never its end id or padding), -1 at padding: the
    piece with the largest head-averaged cross-attention weight of the last layer, at the predicting position."""
    source = copy_sources(15, 8)
    source[2, 4:] = 0  # a shorter source: its end id is gone with the rest, so only 4 pieces remain
    source[2, 3] = END
    tokens = to_numpy(kt.beam_search(copy_model, source, START, END, beam_size=4)[0])
    alignment = to_numpy(kt.align_targets(copy_model, source, tokens, START, END))
    assert alignment.shape == tokens.shape and alignment.dtype == np.int32
    pieces = ((source != 0) & (source != END)).sum(axis=1)
    real = tokens != 0
    assert (alignment[~real] == -1).all()
    assert ((alignment >= 0) & (alignment < pieces[:, None]))[real].all()
    target_in = np.concatenate([np.full((8, 1), START, "int32"), tokens[:, :-1]], axis=1)
    weights = to_numpy(copy_model.attention_scores(source, target_in)["decoder_cross_attention"][-1]).mean(axis=1)
    weights[np.broadcast_to(((source == 0) | (source == END))[:, None], weights.shape)] = -1
    np.testing.assert_array_equal(alignment[real], weights.argmax(-1)[real])
    # A source with no piece (only its end id) has no alignment.
    empty = np.zeros_like(source[:1])
    empty[0, 0] = END
    assert (to_numpy(kt.align_targets(copy_model, empty, tokens[:1], START, END)) == -1).all()


def test_scoring_and_alignment_answer_an_empty_batch(copy_model):
    """A batch of 0 sources and targets of length 0 (what an empty request becomes): empty answers, no error."""
    empty = np.zeros((0, 0), "int32")
    scores, log_prob, token_log_probs = jit(lambda s, t: kt.score_targets(copy_model, s, t, START))(empty, empty)
    assert tuple(scores.shape) == tuple(log_prob.shape) == (0,) and tuple(token_log_probs.shape) == (0, 0)
    alignment = jit(lambda s, t: kt.align_targets(copy_model, s, t, START, END))(empty, np.zeros((0, 3), "int32"))
    assert tuple(alignment.shape) == (0, 3)
