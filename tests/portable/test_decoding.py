"""Greedy decoding and beam search: cache-exact, batch-independent, and beam >= greedy, on every backend."""

import numpy as np
import pytest
from keras import ops

import keras_transformer as kt
from conftest import (a_sentence_and_a_batch_holding_it, assert_length_penalised_log_probs, copy_sources,
                      full_pass_decoder, never_ending_model,
                      random_ids, random_model, sources_of_2_and_6_tokens, trimmed, uncached_greedy)
from keras_transformer.decoding import _beam_search, _greedy_decode
from keras_transformer.strategies import most_likely_token, next_tokens
from keras_transformer.text import END_ID as END
from keras_transformer.text import START_ID as START
from portable.conftest import jit, to_numpy


@pytest.mark.parametrize("seed, vocab", [(0, 24), (1, 24), (0, 240)])
def test_cached_greedy_equals_uncached_greedy(seed, vocab):
    model = random_model(seed, vocab)
    source = random_ids(np.random.default_rng(seed), 4, 6, high=24)
    source[1, 3:] = 0
    tokens, _ = jit(lambda s: kt.greedy_decode(model, s, START, END, max_output_length=12))(source)
    tokens = to_numpy(tokens)
    expected = uncached_greedy(model, source, max_output_length=12)
    np.testing.assert_array_equal(tokens[:, : expected.shape[1]], expected)
    assert (tokens[:, expected.shape[1] :] == 0).all()


@pytest.mark.parametrize("beam_size", [None, 1, 3])
def test_cached_decoding_equals_the_full_pass_every_step(copy_model, beam_size):
    """The same search over the cache and over a full decoder pass each step (the definition)."""
    source = copy_sources(8, 16)
    full_pass = full_pass_decoder(START)
    if beam_size is None:
        cached = jit(lambda s: kt.greedy_decode(copy_model, s, START, END))
        uncached = jit(lambda s: _greedy_decode(copy_model, s, START, END, None, 0.6, full_pass))
    else:
        cached = jit(lambda s: kt.beam_search(copy_model, s, START, END, beam_size=beam_size))
        uncached = jit(lambda s: _beam_search(copy_model, s, START, END, beam_size, 0.6, None, full_pass))
    cached_tokens, cached_scores = cached(source)
    uncached_tokens, uncached_scores = uncached(source)
    np.testing.assert_array_equal(to_numpy(cached_tokens), to_numpy(uncached_tokens))
    np.testing.assert_allclose(to_numpy(cached_scores), to_numpy(uncached_scores), rtol=1e-4)


@pytest.mark.parametrize("beam_size", [None, 3])
def test_compiled_decoding_equals_eager_decoding(copy_model, beam_size):
    source = copy_sources(9, 16)
    if beam_size is None:
        decode = lambda s: kt.greedy_decode(copy_model, s, START, END)  # noqa: E731
    else:
        decode = lambda s: kt.beam_search(copy_model, s, START, END, beam_size=beam_size)  # noqa: E731
    tokens, scores = decode(source)
    compiled_tokens, compiled_scores = jit(decode)(source)
    np.testing.assert_array_equal(to_numpy(compiled_tokens), to_numpy(tokens))
    np.testing.assert_allclose(to_numpy(compiled_scores), to_numpy(scores), rtol=1e-4)


def test_next_tokens_follow_the_log_softmax_never_padding_and_only_the_end_at_the_limit():
    rng = np.random.default_rng(0)
    logits = rng.normal(scale=3.0, size=(5, 240)).astype("float32")
    logits[0, 0] = 100.0  # padding would be the most likely token
    at_limit = np.array([False, True, False, False, True])
    best = next_tokens(ops.convert_to_tensor(logits), ops.convert_to_tensor(at_limit), END, 4)
    most_likely = most_likely_token(ops.convert_to_tensor(logits), ops.convert_to_tensor(at_limit), END)
    log_probs = to_numpy(ops.log_softmax(logits))  # over the whole vocabulary, padding included
    allowed = log_probs.copy()
    allowed[:, 0] = -np.inf
    expected = np.argsort(-allowed, axis=-1, kind="stable")[:, :4]
    free = ~at_limit
    tokens, best_log_prob = to_numpy(best.token), to_numpy(best.log_prob)
    np.testing.assert_array_equal(tokens[free], expected[free])
    np.testing.assert_allclose(best_log_prob[free], np.take_along_axis(log_probs, expected, axis=-1)[free], rtol=1e-5)
    np.testing.assert_array_equal(tokens[at_limit, 0], END)
    np.testing.assert_allclose(best_log_prob[at_limit, 0], log_probs[at_limit, END], rtol=1e-5)
    assert (best_log_prob[at_limit, 1:] < -1e8).all()
    # The greedy choice is the first of them.
    np.testing.assert_array_equal(to_numpy(most_likely.token), tokens[:, 0])
    np.testing.assert_allclose(to_numpy(most_likely.log_prob), best_log_prob[:, 0], rtol=1e-6)


def test_beam_size_one_is_greedy(copy_model):
    source = copy_sources(2, 32)
    greedy_tokens, greedy_scores = jit(lambda s: kt.greedy_decode(copy_model, s, START, END))(source)
    beam_tokens, beam_scores = jit(lambda s: kt.beam_search(copy_model, s, START, END, beam_size=1))(source)
    np.testing.assert_array_equal(to_numpy(beam_tokens), to_numpy(greedy_tokens))
    np.testing.assert_allclose(to_numpy(beam_scores), to_numpy(greedy_scores), rtol=1e-5)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_beam_score_is_never_below_greedy(copy_model, policy):
    """beam_search's docstring: never below in float32; in mixed_bfloat16, where the beam's greedy row (in a
    batch of k + 1 rows per sentence) may round otherwise than greedy_decode's, mostly at most bfloat16's
    relative precision (2^-8) of the score below, and rarely more, where the rounding turns a near-tie and the
    greedy row takes another path (JAX on the CPU rounds by batch shape; TensorFlow and PyTorch do not)."""
    model = copy_model
    if policy != "float32":
        model = kt.Transformer.from_config({**copy_model.get_config(), "dtype": policy})
        model.build()
        model.set_weights(copy_model.get_weights())
    source = copy_sources(3, 128)
    _, greedy_scores = jit(lambda s: kt.greedy_decode(model, s, START, END))(source)
    _, beam_scores = jit(lambda s: kt.beam_search(model, s, START, END, beam_size=4))(source)
    greedy_scores, beam_scores = to_numpy(greedy_scores), to_numpy(beam_scores)
    if policy == "float32":
        assert (beam_scores >= greedy_scores - 1e-5).all()
    else:
        # "Rarely": at most 1 sentence in 100 (docs/benchmarks-log.md, "Beam against greedy in bfloat16").
        assert (beam_scores < greedy_scores - 2.0 ** -8 * np.abs(greedy_scores)).sum() <= len(source) // 100
    assert (beam_scores > greedy_scores + 1e-3).sum() > 10  # the beam finds better ones


def test_scores_are_length_penalised_log_probabilities(copy_model):
    source = copy_sources(4, 6)
    tokens, scores = jit(lambda s: kt.beam_search(copy_model, s, START, END, beam_size=3, length_penalty=0.6))(source)
    assert_length_penalised_log_probs(copy_model, source, tokens, scores, alpha=0.6)


def test_n_best_is_sorted_distinct_scored_and_led_by_the_best(copy_model):
    """The n-best list: best first, its first entry beam search's output, its entries different outputs,
    each scored as the length-penalised log-probability of that output."""
    source = copy_sources(5, 16)
    best_tokens, best_scores = jit(lambda s: kt.beam_search(copy_model, s, START, END, beam_size=4))(source)
    tokens, scores = jit(lambda s: kt.beam_search(copy_model, s, START, END, beam_size=4, n_best=4))(source)
    tokens, scores = to_numpy(tokens), to_numpy(scores)
    assert tokens.shape[:2] == scores.shape == (16, 4)
    np.testing.assert_array_equal(tokens[:, 0], to_numpy(best_tokens))
    np.testing.assert_allclose(scores[:, 0], to_numpy(best_scores), rtol=1e-6)
    assert (np.diff(scores, axis=1) <= 0).all()
    assert (scores > -1e8).all()  # every sentence has its 4 hypotheses
    for i in range(len(source)):
        outputs = {tuple(row[row != 0]) for row in tokens[i]}
        assert len(outputs) == 4, tokens[i]
        assert_length_penalised_log_probs(copy_model, np.repeat(source[i : i + 1], 4, axis=0), tokens[i], scores[i],
                                          alpha=0.6)
    with pytest.raises(ValueError, match="n_best must be from 1 to beam_size"):
        kt.beam_search(copy_model, source, START, END, beam_size=2, n_best=3)


def test_without_distinct_hypotheses_the_greedy_one_can_be_there_twice(copy_model, monkeypatch):
    """Why `distinct`: the greedy hypothesis is often also a beam's, and the pool then holds it twice.
    (If this stopped finding a copy, the n-best test above would no longer test distinctness.)"""
    from keras_transformer.strategies import Beam

    finish = Beam._finish  # with n_best, it adds the greedy hypothesis only if no beam found it
    monkeypatch.setattr(Beam, "_finish", lambda self, *args: finish(self._replace(n_best=None), *args))
    tokens, _ = kt.beam_search(copy_model, copy_sources(5, 16), START, END, beam_size=4, n_best=4)
    assert any(len({tuple(row[row != 0]) for row in rows}) < 4 for rows in to_numpy(tokens))


@pytest.mark.parametrize("decode", ["greedy", "beam"])
def test_a_sentence_decodes_the_same_alone_and_in_any_batch(copy_model, decode):
    sentence, batch = a_sentence_and_a_batch_holding_it()
    if decode == "greedy":
        run = jit(lambda s: kt.greedy_decode(copy_model, s, START, END))
    else:
        run = jit(lambda s: kt.beam_search(copy_model, s, START, END, beam_size=4))
    alone_tokens, alone_score = run(sentence)
    batch_tokens, batch_scores = run(batch)
    alone = trimmed(alone_tokens)[0]
    batch_tokens = to_numpy(batch_tokens)
    np.testing.assert_array_equal(batch_tokens[1][: len(alone)], alone)
    assert (batch_tokens[1][len(alone) :] == 0).all()
    assert float(to_numpy(batch_scores)[1]) == pytest.approx(float(to_numpy(alone_score)[0]), rel=1e-5)


def test_default_limit_is_source_length_plus_50():
    model = never_ending_model()
    source = sources_of_2_and_6_tokens()
    for decode in (kt.greedy_decode, kt.beam_search):
        tokens = to_numpy(jit(lambda s: decode(model, s, START, END))(source)[0])
        assert tokens.shape == (2, 6 + 50)  # the loop's bound: the padded source length + 50
        assert list((tokens != 0).sum(axis=1)) == [2 + 50, 6 + 50]
        assert tokens[0, 51] == END and tokens[1, 55] == END


def test_extra_output_length_sets_the_room_beyond_each_source():
    """`extra_output_length=N`: each output has at most its source's length + N tokens (the paper's parsing: +300),
    in every search; a bad value is refused, naming it."""
    model = never_ending_model()
    source = sources_of_2_and_6_tokens()
    for decode in (kt.greedy_decode, kt.beam_search, kt.sample_decode):
        tokens = to_numpy(jit(lambda s: decode(model, s, START, END, extra_output_length=7))(source)[0])
        assert tokens.shape == (2, 6 + 7)
        assert list((tokens != 0).sum(axis=1)) == [2 + 7, 6 + 7]
        assert tokens[0, 8] == END and tokens[1, 12] == END
    # max_output_length, when given, is the limit.
    assert tuple(kt.greedy_decode(model, source, START, END, max_output_length=4, extra_output_length=7)[0].shape) == (2, 4)
    for bad in (-1, 2.5, None):
        with pytest.raises(ValueError, match=rf"extra_output_length must be an int >= 0 .*got {bad!r}"):
            kt.beam_search(model, source, START, END, extra_output_length=bad)


def test_learned_positions_cap_the_output_at_the_position_table():
    """The default limit (source length + 50) is past a 12-position table: decoding stops at the table's end."""
    model = never_ending_model(learned_positions=True, max_positions=12)
    source = sources_of_2_and_6_tokens()
    for decode in (kt.greedy_decode, kt.beam_search):
        tokens = to_numpy(jit(lambda s: decode(model, s, START, END))(source)[0])
        assert list((tokens != 0).sum(axis=1)) == [12, 12]
        assert (tokens[:, 11] == END).all()
    # An explicit limit past the table is capped too; one within it is kept.
    assert tuple(kt.greedy_decode(model, source, START, END, max_output_length=30)[0].shape) == (2, 12)
    assert tuple(kt.greedy_decode(model, source, START, END, max_output_length=5)[0].shape) == (2, 5)


def test_the_searches_take_their_old_max_length_argument_as_max_output_length_with_a_deprecation_warning():
    model = never_ending_model()  # every output runs to the limit
    source = sources_of_2_and_6_tokens()
    expected = to_numpy(kt.greedy_decode(model, source, START, END, max_output_length=5)[0])
    with pytest.warns(DeprecationWarning,
                      match=r"^greedy_decode\(max_length=\.\.\.\) is now greedy_decode\(max_output_length=") as caught:
        tokens = to_numpy(kt.greedy_decode(model, source, START, END, max_length=5)[0])
    # The warning points at the call that used the old name.
    assert [w.filename for w in caught if "max_length" in str(w.message)] == [__file__]
    assert tokens.shape == (2, 5)
    np.testing.assert_array_equal(tokens, expected)
    for search in (kt.sample_decode, kt.beam_search):
        with pytest.warns(DeprecationWarning, match=rf"^{search.__name__}\(max_length=\.\.\.\) is now "):
            assert to_numpy(search(model, source, START, END, max_length=2)[0]).shape == (2, 2)
    with pytest.raises(ValueError, match="got max_output_length=5 and max_length=5: max_length is max_output_length's"):
        kt.greedy_decode(model, source, START, END, max_output_length=5, max_length=5)
    # Both names given is refused whatever the values: the new one at its default (None) too.
    with pytest.raises(ValueError, match="got max_output_length=None and max_length=5"):
        kt.beam_search(model, source, START, END, max_output_length=None, max_length=5)
    with pytest.raises(TypeError, match=r"beam_search\(\) got an unexpected keyword argument 'max_len'"):
        kt.beam_search(model, source, START, END, max_len=5)


def test_the_searches_and_scoring_take_their_old_alpha_argument_as_length_penalty_with_a_deprecation_warning():
    """`alpha=`, the length penalty's old keyword: the same scores as `length_penalty=`, a warning at the call;
    both names refused whatever the values (0.6 is the default)."""
    model = random_model(9)
    source = sources_of_2_and_6_tokens()
    short = dict(max_output_length=4)  # the names are the point, not the search: eager decoding is slow
    for search in (kt.greedy_decode, kt.sample_decode, kt.beam_search):
        expected = to_numpy(search(model, source, START, END, length_penalty=1.3, **short)[1])
        with pytest.warns(DeprecationWarning,
                          match=rf"^{search.__name__}\(alpha=\.\.\.\) is now {search.__name__}\(length_penalty="):
            scores = to_numpy(search(model, source, START, END, alpha=1.3, **short)[1])
        np.testing.assert_allclose(scores, expected, rtol=1e-6)
        with pytest.raises(ValueError, match="got length_penalty=0.6 and alpha=1.3: alpha is length_penalty's old"):
            search(model, source, START, END, length_penalty=0.6, alpha=1.3, **short)
    tokens = kt.greedy_decode(model, source, START, END, **short)[0]
    with pytest.warns(DeprecationWarning, match=r"^score_targets\(alpha=\.\.\.\) is now score_targets\(length_penalty="):
        old = to_numpy(kt.score_targets(model, source, tokens, START, alpha=1.3)[0])
    np.testing.assert_allclose(old, to_numpy(kt.score_targets(model, source, tokens, START, length_penalty=1.3)[0]),
                               rtol=1e-6)


def test_empty_batch_and_bad_rank():
    model = random_model(9)
    tokens, scores = kt.greedy_decode(model, np.zeros((0, 4), "int32"), START, END)
    assert tokens.shape[0] == 0 and tuple(scores.shape) == (0,)
    tokens, scores = kt.beam_search(model, np.zeros((0, 4), "int32"), START, END)
    assert tokens.shape[0] == 0 and tuple(scores.shape) == (0,)
    with pytest.raises(ValueError, match=r"source_ids of shape \[batch, source_len\]"):
        kt.greedy_decode(model, np.zeros((4,), "int32"), START, END)
    with pytest.raises(ValueError, match="beam_size must be >= 1, got 0"):
        kt.beam_search(model, np.zeros((1, 4), "int32"), START, END, beam_size=0)
