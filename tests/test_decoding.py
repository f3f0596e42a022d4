"""Greedy decoding and beam search: cache-exact, batch-independent, and beam >= greedy."""

import re

import numpy as np
import pytest
import tensorflow as tf

import keras_transformer as kt
from conftest import copy_task, random_ids
from keras_transformer.decoding import _block_length, _most_likely_token, _next_tokens, _top_k
from keras_transformer.text import END_ID as END
from keras_transformer.text import START_ID as START


@pytest.fixture(scope="module")
def copy_model():
    """Trained one epoch on the copy task: it has learned END but is still unsure,
    so beams really differ (a random model never says END)."""
    model = kt.Transformer.from_preset("tiny", vocab_size=16, dropout=0.0)
    model.compile(optimizer=kt.paper_adam(model.d_model, 100), loss=kt.MaskedSparseCategoricalCrossentropy())
    x, y = copy_task(np.random.default_rng(0), 2048)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    return model


def _sources(seed, n):
    return copy_task(np.random.default_rng(seed), n)[0][0]


def _model(seed, vocab=24):
    # A random model spreads its probability, so beams really differ.
    model = kt.Transformer.from_preset("tiny", vocab_size=vocab, dropout=0.0)
    model.build()
    rng = np.random.default_rng(seed)
    for weight in model.weights:
        weight.assign(rng.normal(scale=0.5, size=weight.shape).astype("float32"))
    return model


def _uncached_greedy(model, source, max_length):
    """Greedy decoding by the definition: a full forward pass for every new token."""
    target = np.full((len(source), 1), START, "int32")
    finished = np.zeros(len(source), bool)
    for t in range(max_length):
        log_probs = tf.nn.log_softmax(model((source, target))[:, -1]).numpy()
        log_probs[:, 0] = -np.inf  # padding is never produced
        if t + 1 == max_length:
            log_probs[:, np.arange(log_probs.shape[1]) != END] = -np.inf
        token = np.where(finished, 0, log_probs.argmax(-1))
        target = np.concatenate([target, token[:, None].astype("int32")], axis=1)
        finished |= token == END
        if finished.all():
            break
    return target[:, 1:]


# A vocabulary of 240 picks the best tokens by blocks (decoding._top_k), one of 24 by a plain top_k.
@pytest.mark.parametrize("seed, vocab", [(0, 24), (1, 24), (0, 240)])
def test_cached_greedy_equals_uncached_greedy(seed, vocab):
    model = _model(seed, vocab)
    source = random_ids(np.random.default_rng(seed), 4, 6, high=24)
    source[1, 3:] = 0
    tokens, _ = tf.function(lambda s: kt.greedy_decode(model, s, START, END, max_length=12))(source)
    expected = _uncached_greedy(model, source, max_length=12)
    np.testing.assert_array_equal(tokens.numpy(), expected[:, : tokens.shape[1]])
    assert (expected[:, tokens.shape[1] :] == 0).all()


@pytest.mark.parametrize("beam_size", [None, 1, 3])
def test_cached_decoding_equals_uncached_decoding(copy_model, beam_size):
    source = _sources(8, 16)
    if beam_size is None:
        cached = tf.function(lambda s: kt.greedy_decode(copy_model, s, START, END))
        uncached = tf.function(lambda s: kt.greedy_decode(copy_model, s, START, END, use_cache=False))
    else:
        cached = tf.function(lambda s: kt.beam_search(copy_model, s, START, END, beam_size=beam_size))
        uncached = tf.function(
            lambda s: kt.beam_search(copy_model, s, START, END, beam_size=beam_size, use_cache=False)
        )
    cached_tokens, cached_scores = cached(source)
    uncached_tokens, uncached_scores = uncached(source)
    np.testing.assert_array_equal(cached_tokens.numpy(), uncached_tokens.numpy())
    np.testing.assert_allclose(cached_scores.numpy(), uncached_scores.numpy(), rtol=1e-4)


@pytest.mark.parametrize("beam_size", [None, 3])
def test_decoding_under_xla_equals_decoding_without(copy_model, beam_size):
    # Inside jit_compile the cache is written with XLA's dynamic_update_slice, outside with a core op.
    source = _sources(9, 16)
    if beam_size is None:
        decode = lambda s: kt.greedy_decode(copy_model, s, START, END)  # noqa: E731
    else:
        decode = lambda s: kt.beam_search(copy_model, s, START, END, beam_size=beam_size)  # noqa: E731
    tokens, scores = tf.function(decode)(source)
    xla_tokens, xla_scores = tf.function(decode, jit_compile=True)(source)
    np.testing.assert_array_equal(xla_tokens.numpy(), tokens.numpy())
    np.testing.assert_allclose(xla_scores.numpy(), scores.numpy(), rtol=1e-4)


@pytest.mark.parametrize("vocab", [24, 240])
def test_beam_search_under_xla_sorts_no_vocabulary_row(vocab):
    # XLA on CPU keeps a top_k as its TopK kernel only while no slice is taken of the
    # result; otherwise it sorts the whole row, every step (once 8x slower than no XLA
    # at batch 64, when the row was a sentence's beam * vocab candidates).
    model = _model(0, vocab)
    source = random_ids(np.random.default_rng(0), 4, 6, high=24)
    decode = tf.function(lambda s: kt.beam_search(model, s, START, END, beam_size=3), jit_compile=True)
    hlo = decode.experimental_get_compiler_ir(source)(stage="optimized_hlo")
    sorts = [line for line in hlo.splitlines() if " sort(" in line]
    shapes = [[int(d) for d in shape.split(",")] for line in sorts for shape in re.findall(r"\[([\d,]+)\]", line)]
    assert not [shape for shape in shapes if max(shape) >= vocab], sorts


@pytest.mark.parametrize("vocab, n", [(8000, 9), (8000, 2), (240, 5), (241, 3)])
def test_blockwise_top_k_equals_top_k_ties_included(vocab, n):
    # Integer values: each row's largest tie many times, and top_k breaks ties to the lower id.
    values = tf.constant(np.random.default_rng(vocab + n).integers(-40, 40, size=(6, vocab)).astype("float32"))
    assert (_block_length(vocab, n) is None) == (vocab == 241)  # a prime size has no blocks
    top, ids = _top_k(values, n)
    expected = tf.math.top_k(values, n)
    np.testing.assert_array_equal(top.numpy(), expected.values.numpy())
    np.testing.assert_array_equal(ids.numpy(), expected.indices.numpy())


def test_next_tokens_follow_the_log_softmax_never_padding_and_only_the_end_at_the_limit():
    rng = np.random.default_rng(0)
    logits = rng.normal(scale=3.0, size=(5, 240)).astype("float32")
    logits[0, 0] = 100.0  # padding would be the most likely token
    at_limit = np.array([False, True, False, False, True])
    best = _next_tokens(tf.constant(logits), tf.constant(at_limit), END, 4)
    most_likely = _most_likely_token(tf.constant(logits), tf.constant(at_limit), END)
    log_probs = tf.nn.log_softmax(logits).numpy()  # over the whole vocabulary, padding included
    allowed = log_probs.copy()
    allowed[:, 0] = -np.inf
    expected = np.argsort(-allowed, axis=-1, kind="stable")[:, :4]
    free = ~at_limit
    np.testing.assert_array_equal(best.token.numpy()[free], expected[free])
    np.testing.assert_allclose(
        best.log_prob.numpy()[free], np.take_along_axis(log_probs, expected, axis=-1)[free], rtol=1e-5
    )
    np.testing.assert_array_equal(best.token.numpy()[at_limit, 0], END)
    np.testing.assert_allclose(best.log_prob.numpy()[at_limit, 0], log_probs[at_limit, END], rtol=1e-5)
    assert (best.log_prob.numpy()[at_limit, 1:] < -1e8).all()
    # The greedy choice is the first of them.
    np.testing.assert_array_equal(most_likely.token.numpy(), best.token.numpy()[:, :1])
    np.testing.assert_allclose(most_likely.log_prob.numpy(), best.log_prob.numpy()[:, :1], rtol=1e-6)


def test_beam_size_one_is_greedy(copy_model):
    source = _sources(2, 32)
    greedy = tf.function(lambda s: kt.greedy_decode(copy_model, s, START, END))
    beam_of_one = tf.function(lambda s: kt.beam_search(copy_model, s, START, END, beam_size=1))
    greedy_tokens, greedy_scores = greedy(source)
    beam_tokens, beam_scores = beam_of_one(source)
    np.testing.assert_array_equal(beam_tokens.numpy(), greedy_tokens.numpy())
    np.testing.assert_allclose(beam_scores.numpy(), greedy_scores.numpy(), rtol=1e-5)


def test_beam_score_is_never_below_greedy(copy_model):
    source = _sources(3, 128)
    greedy = tf.function(lambda s: kt.greedy_decode(copy_model, s, START, END))
    beam = tf.function(lambda s: kt.beam_search(copy_model, s, START, END, beam_size=4))
    _, greedy_scores = greedy(source)
    _, beam_scores = beam(source)
    assert (beam_scores.numpy() >= greedy_scores.numpy() - 1e-5).all()
    assert (beam_scores.numpy() > greedy_scores.numpy() + 1e-3).sum() > 10  # the beam finds better ones


def test_scores_are_length_penalised_log_probabilities(copy_model):
    source = _sources(4, 6)
    beam = tf.function(lambda s: kt.beam_search(copy_model, s, START, END, beam_size=3, alpha=0.6))
    tokens, scores = beam(source)
    # Recompute each sentence's log-probability with a full forward pass.
    for i, row in enumerate(tokens.numpy()):
        output = row[row != 0]
        assert output[-1] == END
        target_in = np.concatenate([[START], output[:-1]])[None].astype("int32")
        log_probs = tf.nn.log_softmax(copy_model((source[i : i + 1], target_in))[0]).numpy()
        log_prob = log_probs[np.arange(len(output)), output].sum()
        assert scores.numpy()[i] == pytest.approx(log_prob / ((5 + len(output)) / 6) ** 0.6, rel=1e-4)


@pytest.mark.parametrize("decode", ["greedy", "beam"])
def test_a_sentence_decodes_the_same_alone_and_in_any_batch(copy_model, decode):
    rng = np.random.default_rng(7)
    sentence = np.array([[5, 9, 12, 4, 7, END]], "int32")
    batch = np.zeros((4, 9), "int32")
    batch[0] = np.append(rng.integers(4, 16, 8), END)  # longer
    batch[1, :6] = sentence[0]
    batch[2, :2] = [6, END]  # shorter
    batch[3, :4] = [11, 5, 8, END]
    if decode == "greedy":
        run = tf.function(lambda s: kt.greedy_decode(copy_model, s, START, END))
    else:
        run = tf.function(lambda s: kt.beam_search(copy_model, s, START, END, beam_size=4))
    alone_tokens, alone_score = run(sentence)
    batch_tokens, batch_scores = run(batch)
    alone = alone_tokens.numpy()[0]
    np.testing.assert_array_equal(batch_tokens.numpy()[1][: len(alone)], alone)
    assert (batch_tokens.numpy()[1][len(alone) :] == 0).all()
    assert float(batch_scores[1]) == pytest.approx(float(alone_score[0]), rel=1e-5)


@pytest.mark.parametrize("decode", ["greedy", "beam"])
def test_parallel_loops_decode_what_one_loop_decodes(copy_model, decode):
    """Each of the loops is its own `tf.while_loop` in the graph, and the rows come back in place."""
    if decode == "greedy":
        search = lambda s: kt.greedy_decode(copy_model, s, START, END)  # noqa: E731
    else:
        search = lambda s: kt.beam_search(copy_model, s, START, END, beam_size=3)  # noqa: E731
    spec = [tf.TensorSpec([None, None], tf.int32)]
    one_loop = tf.function(search, input_signature=spec)
    sources = _sources(11, 7)
    sources[::3, 4:] = 0  # sentences of different lengths: the loops' outputs differ in length
    sources[::3, 3] = END
    for num_loops in (2, 3):
        run = tf.function(lambda s: kt.parallel_decode(search, s, num_loops), input_signature=spec)
        for n in (0, 1, 2, 7):
            tokens, scores = run(sources[:n])
            expected_tokens, expected_scores = one_loop(sources[:n])
            np.testing.assert_array_equal(tokens.numpy(), expected_tokens.numpy())
            np.testing.assert_allclose(scores.numpy(), expected_scores.numpy(), rtol=1e-5)
        graph = run.get_concrete_function().graph.as_graph_def()
        assert sum(node.op in ("While", "StatelessWhile") for node in graph.node) == num_loops
    with pytest.raises(ValueError, match="num_loops must be >= 1, got 0"):
        kt.parallel_decode(search, sources, 0)


def _never_ending_model(**kwargs):
    """A random model whose end token always loses: only the length limit stops decoding."""
    model = kt.Transformer.from_preset("tiny", vocab_size=24, tie_output_embedding=False, **kwargs)
    model.build()
    bias = model.output_projection.bias
    bias.assign(np.where(np.arange(24) == END, -1e4, bias.numpy()).astype("float32"))
    return model


def _sources_of_2_and_6_tokens():
    source = np.zeros((2, 6), "int32")
    source[0, :2] = [5, 6]
    source[1, :6] = [5, 6, 7, 8, 9, 10]
    return source


@pytest.mark.parametrize("decode", ["greedy", "beam"])
def test_finished_sentences_leave_the_batch(decode, monkeypatch):
    """Outside XLA a step decodes only the sentences still going: once the shorter source reaches its
    limit (source length + 50), the decoder gets one sentence's rows (1 for greedy, k + 1 for beam)."""
    model = _never_ending_model()
    rows_per_step = []
    decode_step = model.decode_step

    def counting_decode_step(token_ids, *args):
        rows_per_step.append(int(tf.shape(token_ids)[0]))
        return decode_step(token_ids, *args)

    monkeypatch.setattr(model, "decode_step", counting_decode_step)
    source = _sources_of_2_and_6_tokens()
    if decode == "greedy":
        tokens, _ = kt.greedy_decode(model, source, START, END)  # eagerly: the loop runs in Python
        rows = 1
    else:
        tokens, _ = kt.beam_search(model, source, START, END, beam_size=2)
        rows = 3
    assert rows_per_step == [2 * rows] * 52 + [rows] * 4
    assert (tokens.numpy()[0, 52:] == 0).all() and tokens.shape[1] == 56


def test_default_limit_is_source_length_plus_50():
    model = _never_ending_model()
    source = _sources_of_2_and_6_tokens()
    for decode in (kt.greedy_decode, kt.beam_search):
        tokens = tf.function(lambda s: decode(model, s, START, END))(source)[0].numpy()
        assert list((tokens != 0).sum(axis=1)) == [2 + 50, 6 + 50]
        assert tokens[0, 51] == END and tokens[1, 55] == END


def test_learned_positions_cap_the_output_at_the_position_table():
    """The default limit (source length + 50) is past a 12-position table: decoding stops at the table's end."""
    model = _never_ending_model(learned_positions=True, max_length=12)
    source = _sources_of_2_and_6_tokens()
    for decode in (kt.greedy_decode, kt.beam_search):
        tokens = tf.function(lambda s: decode(model, s, START, END))(source)[0].numpy()
        assert list((tokens != 0).sum(axis=1)) == [12, 12]
        assert (tokens[:, 11] == END).all()
    # An explicit limit past the table is capped too; one within it is kept.
    assert kt.greedy_decode(model, source, START, END, max_length=30)[0].shape == (2, 12)
    assert kt.greedy_decode(model, source, START, END, max_length=5)[0].shape == (2, 5)


def test_empty_batch_and_bad_rank():
    model = _model(9)
    tokens, scores = kt.greedy_decode(model, np.zeros((0, 4), "int32"), START, END)
    assert tokens.shape[0] == 0 and scores.shape == (0,)
    tokens, scores = kt.beam_search(model, np.zeros((0, 4), "int32"), START, END)
    assert tokens.shape[0] == 0 and scores.shape == (0,)
    with pytest.raises(ValueError, match=r"source_ids of shape \[batch, source_len\]"):
        kt.greedy_decode(model, np.zeros((4,), "int32"), START, END)
