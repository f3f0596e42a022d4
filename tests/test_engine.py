"""The TensorFlow serving engine (`export/step.py`, `export/search.py`): its step over the caches equals the
model's full pass, its searches decode what the library's searches decode, and its speed-ups (a cache that
grows, sentences that leave the batch, a top-k by blocks, loops in parallel, a fixed-shape loop under XLA)
change no output."""

import inspect
import re

import numpy as np
import pytest
import tensorflow as tf

import keras_transformer as kt
from conftest import (a_sentence_and_a_batch_holding_it, assert_length_penalised_log_probs, copy_prefixes, copy_sources,
                      multi30k_lines, needs_multi30k, never_ending_model,
                      random_ids, random_model, sources_of_2_and_6_tokens, trimmed, uncached_greedy)
from export import search, step
from export.engine_weights import engine_model
from export.search import GRAPH_OPS, _block_length, _top_k, engine_beam_search, engine_greedy_decode
from export.translator import load_model_dir
from keras_transformer.attention import AttentionOps
from keras_transformer.strategies import most_likely_token, next_tokens
from keras_transformer.text import END_ID as END
from keras_transformer.text import START_ID as START


def _greedy(model, **kwargs):
    return tf.function(lambda s: engine_greedy_decode(model, s, START, END, **kwargs))


def _beam(model, beam_size, **kwargs):
    return tf.function(lambda s: engine_beam_search(model, s, START, END, beam_size=beam_size, **kwargs))


# ------------------------------------------------------------------ the contract: the library's searches


def test_one_contract_per_search_name():
    """docs/library.md, "The two searches": a name has one meaning. A public function of `export.search` named as
    a public one of `keras_transformer.decoding` or `keras_transformer` is that very function (re-exported:
    `prepare`, `output_bound`, ...); the engine's own searches are named apart, take the library's arguments in
    its order (names and defaults) and their own options keyword-only (and, as the library's, read the old argument
    names through `renamed_max_output_length`), and call the decoder step with the library's `NextLogits` order,
    then the memory."""
    from keras_transformer import decoding

    library = {name: getattr(decoding, name) for name in decoding.__all__}
    library.update((name, getattr(kt, name)) for name in dir(kt) if not name.startswith("_"))
    shared = sorted(name for name, value in vars(search).items()
                    if not name.startswith("_") and callable(value) and name in library)
    assert [name for name in shared if vars(search)[name] is not library[name]] == []
    for engine, library_search in ((engine_greedy_decode, kt.greedy_decode), (engine_beam_search, kt.beam_search)):
        engine_parameters = list(inspect.signature(engine).parameters.values())
        library_parameters = list(inspect.signature(library_search).parameters.values())
        # Both wrapped by the decorator that reads `max_length=` (decoding.renamed_max_output_length).
        assert hasattr(engine, "__wrapped__") and hasattr(library_search, "__wrapped__"), engine.__name__
        assert engine_parameters[:len(library_parameters)] == library_parameters, engine.__name__
        assert {p.kind for p in engine_parameters[len(library_parameters):]} == {inspect.Parameter.KEYWORD_ONLY}
    for use_cache in (True, False):
        next_logits = search._next_logits_fn(None, START, use_cache, fixed_shapes=False)
        assert list(inspect.signature(next_logits).parameters) == [
            "last", "index", "outputs", "cache", "encoder_output", "source_mask"]


def _assert_engine_decodes_what_the_library_decodes(model, source):
    """Greedy and beam 4, each with the library's defaults: the same tokens, the same scores to float precision."""
    searches = {
        "greedy": (lambda s: kt.greedy_decode(model, s, START, END),
                   lambda s: engine_greedy_decode(model, s, START, END)),
        "beam 4": (lambda s: kt.beam_search(model, s, START, END), lambda s: engine_beam_search(model, s, START, END)),
    }
    for name, (library, engine) in searches.items():
        library_tokens, library_scores = tf.function(library)(source)
        engine_tokens, engine_scores = tf.function(engine)(source)
        np.testing.assert_array_equal(trimmed(engine_tokens), trimmed(library_tokens), err_msg=name)
        np.testing.assert_allclose(np.asarray(engine_scores), np.asarray(library_scores), rtol=1e-4, atol=1e-4,
                                   err_msg=name)
    return trimmed(engine_tokens)


def test_the_engine_decodes_what_the_library_decodes_on_the_copy_task(copy_model):
    source = copy_sources(21, 64)
    source[::4, 3:] = 0  # shorter sentences too
    source[::4, 3] = END
    tokens = _assert_engine_decodes_what_the_library_decodes(copy_model, source)
    assert ((tokens == END).sum(axis=1) == 1).all()  # every output ended: the comparison is not of limits


def _assert_engine_copy_decodes_what_the_library_decodes(model, copy):
    """The engine's greedy and beam searches on `copy` decode what the library's decode on `model`."""
    source = random_ids(np.random.default_rng(4), 6, 7, high=24)
    source[2, 4:] = 0
    for library, engine in ((lambda s: kt.greedy_decode(model, s, START, END, max_output_length=9),
                             lambda s: engine_greedy_decode(copy, s, START, END, max_output_length=9)),
                            (lambda s: kt.beam_search(model, s, START, END, max_output_length=9),
                             lambda s: engine_beam_search(copy, s, START, END, max_output_length=9))):
        library_tokens, library_scores = tf.function(library)(source)
        engine_tokens, engine_scores = tf.function(engine)(source)
        np.testing.assert_array_equal(trimmed(engine_tokens), trimmed(library_tokens))
        np.testing.assert_allclose(np.asarray(engine_scores), np.asarray(library_scores), rtol=1e-4, atol=1e-4)


def test_the_engine_serves_a_key_size_apart_from_the_value_size():
    """A model whose queries and keys are 3 wide a head and values 8 (`key_dim=3`, the paper's table 3, rows B):
    the engine's copy (`engine_model`, as `Translator` makes it: untied, in column blocks) keeps the key size and
    every weight, and its greedy and beam searches decode what the library decodes on the model itself."""
    model = random_model(4, key_dim=3)
    copy = engine_model(model, "float32", untie_output_projection=True, output_blocks=2)
    assert copy is not model and copy.key_dim == 3
    key, value = copy.decoder.decoder_layers[0].self_attention.projections[1:3]
    assert (key.kernel.shape, value.kernel.shape) == ((32, 4, 3), (32, 4, 8))
    _assert_engine_copy_decodes_what_the_library_decodes(model, copy)


def test_the_engine_serves_marians_shape_with_the_output_bias_in_its_untied_projection():
    """SiLU feed-forward networks, sinusoids in halves, LayerNorms of epsilon 1e-5 and a bias on the tied output
    projection (Marian's): the engine's untied copy keeps them, holds the embedding transposed and the model's bias
    (random, nonzero) in its column blocks, and decodes what the library decodes."""
    model = random_model(5, activation="silu", sinusoid_layout="halves", output_bias=True, layer_norm_epsilon=1e-5)
    bias = model.logits_bias.numpy()
    assert np.abs(bias).min() > 0
    copy = engine_model(model, "float32", untie_output_projection=True, output_blocks=2)
    assert (copy.activation, copy.sinusoid_layout, copy.layer_norm_epsilon, copy.output_bias, copy.logits_bias) == (
        "silu", "halves", 1e-5, False, None)
    np.testing.assert_array_equal(np.concatenate([b.numpy() for b in copy.output_projection.biases]), bias)
    x = np.random.default_rng(6).normal(size=(3, 32)).astype("float32")
    np.testing.assert_allclose(copy.project(x).numpy(), model.project(x).numpy(), rtol=1e-5, atol=1e-5)
    _assert_engine_copy_decodes_what_the_library_decodes(model, copy)


@pytest.mark.parametrize("n_best", [1, 3, 4])
def test_the_engines_n_best_list_is_the_librarys(copy_model, n_best):
    """n-best lists: the same hypotheses in the same order, with the same scores, in one loop and in two."""
    source = copy_sources(22, 32)
    source[::4, 3:] = 0
    source[::4, 3] = END
    library_tokens, library_scores = tf.function(
        lambda s: kt.beam_search(copy_model, s, START, END, beam_size=4, n_best=n_best))(source)
    library_tokens = np.asarray(library_tokens)
    for loops in (1, 2):
        tokens, scores = tf.function(lambda s: search.parallel_decode(
            lambda ids: engine_beam_search(copy_model, ids, START, END, beam_size=4, n_best=n_best), s, loops))(source)
        tokens = np.asarray(tokens)
        assert tokens.shape[:2] == (32, n_best)
        np.testing.assert_array_equal(tokens, library_tokens[..., :tokens.shape[-1]])
        assert (library_tokens[..., tokens.shape[-1]:] == 0).all()
        np.testing.assert_allclose(np.asarray(scores), np.asarray(library_scores), rtol=1e-4, atol=1e-4)
    # The first of the list is the single best, as serving_default decodes it.
    best, _ = _beam(copy_model, 4)(source)
    np.testing.assert_array_equal(tokens[:, 0, :best.shape[1]], np.asarray(best))


@pytest.mark.parametrize("search_name, options", [
    ("beam", {"prefix": True}), ("greedy", {"prefix": True}),
    ("beam", {"no_repeat_ngram_size": 1}), ("greedy", {"no_repeat_ngram_size": 1}),
    ("beam", {"no_repeat_ngram_size": 2, "prefix": True})])
def test_the_engines_options_are_the_librarys(copy_model, search_name, options):
    """A target prefix per sentence and a ban on repeated n-grams, in greedy decoding and beam search: the
    same tokens and scores, in one loop and in two (sentences leave the batch with their prefix), the cache
    and no cache. (The copy task repeats tokens of its source: the ban changes outputs.)"""
    source = copy_sources(23, 32)
    source[::4, 3:] = 0
    source[::4, 3] = END
    prefix = copy_prefixes(0, 32)
    options = dict(options)
    with_prefix, n = options.pop("prefix", False), options.get("no_repeat_ngram_size", 0)
    beam_size = {"beam_size": 4} if search_name == "beam" else {}
    library_search, engine_search = {"beam": (kt.beam_search, engine_beam_search),
                                     "greedy": (kt.greedy_decode, engine_greedy_decode)}[search_name]
    library_tokens, library_scores = tf.function(lambda s, p: library_search(
        copy_model, s, START, END, prefix_ids=p if with_prefix else None, **beam_size, **options))(source, prefix)
    if n:
        plain, _ = tf.function(lambda s: library_search(copy_model, s, START, END, **beam_size))(source)
        assert trimmed(plain).tolist() != trimmed(library_tokens).tolist()
    for loops, use_cache in ((1, True), (2, True), (1, False)):
        tokens, scores = tf.function(lambda s, p: search.parallel_decode(lambda ids, prefix: engine_search(
            copy_model, ids, START, END, use_cache=use_cache, prefix_ids=prefix if with_prefix else None, **beam_size,
            **options),
            s, loops, p))(source, prefix)
        np.testing.assert_array_equal(trimmed(tokens), trimmed(library_tokens))
        np.testing.assert_allclose(np.asarray(scores), np.asarray(library_scores), rtol=1e-4, atol=1e-4)


def test_the_engines_samples_are_the_librarys(copy_model):
    """Sampling with per-sentence seeds, temperatures and top-k: the same draws (the same hash noise), in one loop
    and in two (rows leave the batch with their settings)."""
    from keras_transformer.strategies import Sampling

    source = copy_sources(24, 32)
    source[::4, 3:] = 0
    source[::4, 3] = END
    rng = np.random.default_rng(1)
    settings = (rng.integers(0, 1000, 32).astype("int32"), rng.uniform(0.5, 2.0, 32).astype("float32"),
                rng.integers(0, 6, 32).astype("int32"))
    library_tokens, library_scores = tf.function(lambda s, seed, temperature, top_k: kt.sample_decode(
        copy_model, s, START, END, seed=seed, temperature=temperature, top_k=top_k))(source, *settings)
    for loops in (1, 2):
        tokens, scores = tf.function(lambda s, *settings: search.parallel_decode(
            lambda ids, *row_settings: engine_greedy_decode(copy_model, ids, START, END,
                                                            sampling=Sampling(*row_settings)),
            s, loops, *settings))(source, *settings)
        np.testing.assert_array_equal(trimmed(tokens), trimmed(library_tokens))
        np.testing.assert_allclose(np.asarray(scores), np.asarray(library_scores), rtol=1e-4, atol=1e-4)
    assert len({tuple(row) for row in trimmed(library_tokens)}) > 16  # they are samples, not one output


@needs_multi30k
def test_the_engine_decodes_what_the_library_decodes_on_100_multi30k_sentences(quick_model_dir):
    from common.tokenizer import encode_source

    model, tokenizer, config = load_model_dir(quick_model_dir)
    model = engine_model(model, "float32")
    sources = tf.constant(multi30k_lines("val.en", 100))
    source = encode_source(tokenizer, sources, config["max_source_length"]).to_tensor(0)
    tokens = _assert_engine_decodes_what_the_library_decodes(model, source)
    assert (tokens == END).sum() > 50  # a trained model: its outputs end


# ------------------------------------------------------------------ the step over the caches


def _step_by_step_logits(model, source, target):
    encoder_output = model.encode(source, training=False)
    mask = tf.not_equal(source, 0)
    cache = model.init_decoding_cache(encoder_output, 0)
    steps = []
    for t in range(target.shape[1]):  # eagerly: the cache grows
        logits, cache = step.decode_step(model, tf.constant(target[:, t]), t, mask, cache)
        steps.append(logits.numpy())
    assert cache["self_attention"][0][0].shape[2] == target.shape[1]
    return np.stack(steps, axis=1)


@pytest.mark.parametrize("kwargs", [{}, dict(norm_first=True, tie_output_embedding=False), dict(key_dim=3),
                                    dict(activation="silu", sinusoid_layout="halves")])
def test_the_step_equals_the_full_pass(kwargs):
    """Post-norm with a tied projection, pre-norm (a final norm) with an untied one, queries and keys 3 wide a
    head beside values 8 wide (`key_dim`), Marian's SiLU feed-forward networks and sinusoid layout; the uncached
    reference too."""
    rng = np.random.default_rng(2)
    model = kt.Transformer.from_preset("tiny", vocab_size=40, **kwargs)
    model.build()
    source = random_ids(rng, 3, 7)
    source[2, 5:] = 0
    target = random_ids(rng, 3, 6)
    full = model((source, target)).numpy()
    np.testing.assert_allclose(_step_by_step_logits(model, source, target), full, atol=1e-5)
    encoder_output = model.encode(source, training=False)
    uncached = step.uncached_logits(model, tf.constant(target), encoder_output, tf.not_equal(source, 0))
    np.testing.assert_allclose(uncached.numpy(), full, atol=1e-5)


# The engine's attention outside XLA: the layer's cached call on a cache that grows, products on Eigen.
GROWING = step.GraphAttentionOps(growing_cache=True)


def _producer(tensor, passing=("Identity", "Cast")):
    """The op that made `tensor`, looking back through ops of the types in `passing` (which change no value's
    place in a weight)."""
    op = tensor.op
    while op.type in passing:
        op = op.inputs[0].op
    return op


def _weights_moved(graph):
    """The ops of `graph` that concatenate or transpose a variable's value (through reshapes and casts)."""
    return sorted(op.name for op in graph.get_operations()
                  if op.type in ("ConcatV2", "Transpose")
                  and any(_producer(x, ("Reshape", "Identity", "Cast")).type == "ReadVariableOp" for x in op.inputs))


def test_a_served_step_reads_its_weights_where_they_are_stored():
    """Outside XLA a step runs in a TensorFlow while loop, where nothing is hoisted out of it: what a step does
    to its weights it does at every step. The engine's step (the model `Translator` decodes with, its
    attention ops) concatenates no kernels (the layer's Q, K, V projection as one matmul would) and transposes
    none (a tied output projection would read the embedding transposed), and still equals the full pass."""
    rng = np.random.default_rng(3)
    model = kt.Transformer.from_preset("tiny", vocab_size=40)
    model.build()
    source, target = random_ids(rng, 2, 5), random_ids(rng, 2, 4)
    served = engine_model(model, "float32", untie_output_projection=True)
    encoder_output = served.encode(source, training=False)
    mask = tf.not_equal(source, 0)

    @tf.function
    def one_step(token_ids, cache):
        return step.decode_step(served, token_ids, 1, mask, cache)

    cache = served.init_decoding_cache(encoder_output, 0)
    _, cache = step.decode_step(served, tf.constant(target[:, 0]), 0, mask, cache)
    graph = one_step.get_concrete_function(tf.constant(target[:, 1]), cache).graph
    assert _weights_moved(graph) == []
    # The library's own ops (the projection as one matmul) on the tied model move both, so the check can fail.
    library_step = tf.function(lambda ids, cache: model.decode_step(
        ids, 1, None, mask, cache, attention_ops=AttentionOps(growing_cache=True)))
    library_graph = library_step.get_concrete_function(tf.constant(target[:, 1]), cache).graph
    assert {library_graph.get_operation_by_name(name).type for name in _weights_moved(library_graph)} == {
        "ConcatV2", "Transpose"}
    full = model((source, target)).numpy()
    np.testing.assert_allclose(_step_by_step_logits(served, source, target), full, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_the_output_projection_in_column_blocks_is_independent_matmuls_of_the_same_logits(tied):
    """`engine_model(..., output_blocks=2)` (what `Translator.from_model_dir` asks for with 2 decoding loops):
    a step's output projection is 2 matmuls, neither reading the other's output, so the inter-op threads can run
    them at once; the logits are the full pass's, and the blocks hold every column once (a trained bias too)."""
    rng = np.random.default_rng(4)
    model = kt.Transformer.from_preset("tiny", vocab_size=41, tie_output_embedding=tied)
    model.build()
    if not tied:  # a trained untied projection has a bias: give it one the blocks must carry
        model.output_projection.bias.assign(rng.normal(size=41).astype("float32"))
    source, target = random_ids(rng, 2, 5), random_ids(rng, 2, 4)
    served = engine_model(model, "float32", untie_output_projection=True, output_blocks=2)
    np.testing.assert_allclose(_step_by_step_logits(served, source, target), model((source, target)).numpy(),
                               atol=1e-5)
    mask = tf.not_equal(source, 0)
    cache = served.init_decoding_cache(served.encode(source, training=False), 0)
    graph = tf.function(lambda ids, cache: step.decode_step(served, ids, 0, mask, cache)).get_concrete_function(
        tf.constant(target[:, 0]), cache).graph
    reads_a_block = _reads_of(graph, served.output_projection.kernels)
    output_matmuls = [op for op in graph.get_operations()
                      if op.type in ("MatMul", "BatchMatMulV2") and any(reads_a_block(x) for x in op.inputs)]
    assert sorted(op.outputs[0].shape[-1] for op in output_matmuls) == [20, 21]
    first, second = output_matmuls
    assert first not in _ancestors(second) and second not in _ancestors(first)
    with pytest.raises(ValueError, match="output_blocks must be >= 1, and 1 for a tied output projection"):
        engine_model(model, "float32", output_blocks=2) if tied else engine_model(model, "float32", output_blocks=0)


def _reads_of(graph, variables):
    """A predicate: whether a tensor of `graph` is (through identities and casts) a read of one of `variables`."""
    handles = {id(variable.handle) for variable in variables}
    placeholders = {internal.name for external, internal in graph.captures if id(external) in handles}

    def reads(tensor):
        op = _producer(tensor)
        return op.type == "ReadVariableOp" and op.inputs[0].name in placeholders

    return reads


def _ancestors(op):
    """Every op whose output `op` reads, directly or not."""
    seen, todo = set(), [op]
    while todo:
        for x in todo.pop().inputs:
            if x.op not in seen:
                seen.add(x.op)
                todo.append(x.op)
    return seen


def test_a_cache_of_free_length_grows_in_a_while_loop():
    """Inside `tf.while_loop` with the cache length left free, each write appends (no mask needed)."""
    rng = np.random.default_rng(5)
    x = tf.constant(rng.normal(size=(2, 6, 16)).astype("float32"))
    mha = kt.MultiHeadAttention(num_heads=4, key_dim=4)
    full = mha(x, x, use_causal_mask=True).numpy()

    @tf.function
    def step_by_step(x):
        def body(t, cache, outputs):
            x_t = x[:, t : t + 1]
            y, cache = mha(x_t, x_t, cache=cache, cache_index=t, attention_ops=GROWING)
            return t + 1, cache, outputs.write(t, y[:, 0])

        free = tf.TensorShape([2, 4, None, 4])
        _, cache, outputs = tf.while_loop(
            lambda t, *_: t < 6, body, (0, mha.empty_cache(2, 0), tf.TensorArray(tf.float32, 6)),
            shape_invariants=(tf.TensorShape([]), (free, free), None),
        )
        return tf.transpose(outputs.stack(), [1, 0, 2]), cache

    stepped, cache = step_by_step(x)
    assert cache[0].shape == (2, 4, 6, 4)
    np.testing.assert_allclose(stepped.numpy(), full, atol=1e-5)


def test_a_fixed_buffer_is_written_in_place_under_xla():
    """Under XLA the cache is a buffer of every position, written with XLA's dynamic_update_slice and read with
    a causal mask: the same outputs as the full pass."""
    rng = np.random.default_rng(8)
    x = tf.constant(rng.normal(size=(2, 6, 16)).astype("float32"))
    mha = kt.MultiHeadAttention(num_heads=4, key_dim=4)
    full = mha(x, x, use_causal_mask=True).numpy()

    @tf.function(jit_compile=True)
    def step_by_step(x):
        def body(t, cache, outputs):
            # tf.slice with a constant size: XLA read `x[:, t : t + 1]` as position 0 at every step here.
            x_t = tf.slice(x, [0, t, 0], [2, 1, 16])
            y, cache = mha(x_t, x_t, cache=cache, cache_index=t, attention_ops=step.GraphAttentionOps())
            return t + 1, cache, outputs.write(t, y[:, 0])

        _, cache, outputs = tf.while_loop(
            lambda t, *_: t < 6, body, (0, mha.empty_cache(2, 6), tf.TensorArray(tf.float32, 6)))
        return tf.transpose(outputs.stack(), [1, 0, 2]), cache

    stepped, cache = step_by_step(x)
    assert cache[0].shape == (2, 4, 6, 4)
    np.testing.assert_allclose(stepped.numpy(), full, atol=1e-5)


def test_a_bfloat16_step_hands_back_bfloat16_and_equals_the_full_pass():
    """A one-position step multiplies in float32 (Eigen's batched matmul, see `eigen_batch_matmul`) and
    rounds to the layer's dtype; self- and cross-attention, in a while loop as decoding runs it."""
    rng = np.random.default_rng(7)
    x = tf.constant(rng.normal(size=(2, 6, 16)).astype("float32"))
    memory = tf.constant(rng.normal(size=(2, 5, 16)).astype("float32"))
    memory_mask = tf.constant([[True, True, True, False, False], [True] * 5])
    self_mha = kt.MultiHeadAttention(num_heads=4, key_dim=4, dtype="mixed_bfloat16")
    cross_mha = kt.MultiHeadAttention(num_heads=4, key_dim=4, dtype="mixed_bfloat16")
    full = cross_mha(self_mha(x, x, use_causal_mask=True), memory, attention_mask=memory_mask[:, None, :])

    @tf.function
    def step_by_step(x):
        source_cache = cross_mha.compute_cache(memory)

        def body(t, cache, outputs):
            x_t = x[:, t : t + 1]
            y, cache = self_mha(x_t, x_t, cache=cache, cache_index=t, attention_ops=GROWING)
            y, _ = cross_mha(y, y, cache=source_cache, attention_mask=memory_mask[:, None, :], attention_ops=GROWING)
            return t + 1, cache, outputs.write(t, y[:, 0])

        free = tf.TensorShape([2, 4, None, 4])
        _, _, outputs = tf.while_loop(
            lambda t, *_: t < 6, body, (0, self_mha.empty_cache(2, 0), tf.TensorArray(tf.bfloat16, 6)),
            shape_invariants=(tf.TensorShape([]), (free, free), None),
        )
        return tf.transpose(outputs.stack(), [1, 0, 2])

    stepped = step_by_step(x)
    assert stepped.dtype == full.dtype == tf.bfloat16
    # bfloat16 keeps 8 bits of mantissa: outputs of size ~1 agree to a few hundredths.
    np.testing.assert_allclose(tf.cast(stepped, tf.float32).numpy(), tf.cast(full, tf.float32).numpy(), atol=0.05)


# ------------------------------------------------------------------ the searches


@pytest.mark.parametrize("seed, vocab", [(0, 24), (0, 240)])
def test_greedy_equals_greedy_by_the_definition(seed, vocab):
    model = random_model(seed, vocab)
    source = random_ids(np.random.default_rng(seed), 4, 6, high=24)
    source[1, 3:] = 0
    tokens, _ = _greedy(model, max_output_length=12)(source)
    expected = uncached_greedy(model, source, max_output_length=12)
    np.testing.assert_array_equal(tokens.numpy(), expected[:, : tokens.shape[1]])
    assert (expected[:, tokens.shape[1] :] == 0).all()


@pytest.mark.parametrize("beam_size", [None, 3])
def test_cached_decoding_equals_uncached_decoding(copy_model, beam_size):
    source = copy_sources(8, 16)
    if beam_size is None:
        cached, uncached = _greedy(copy_model), _greedy(copy_model, use_cache=False)
    else:
        cached, uncached = _beam(copy_model, beam_size), _beam(copy_model, beam_size, use_cache=False)
    cached_tokens, cached_scores = cached(source)
    uncached_tokens, uncached_scores = uncached(source)
    np.testing.assert_array_equal(cached_tokens.numpy(), uncached_tokens.numpy())
    np.testing.assert_allclose(cached_scores.numpy(), uncached_scores.numpy(), rtol=1e-4)


@pytest.mark.parametrize("beam_size", [None, 3])
def test_decoding_under_xla_equals_decoding_without(copy_model, beam_size):
    # Inside jit_compile the cache is written with XLA's dynamic_update_slice, outside with a core op.
    source = copy_sources(9, 16)
    if beam_size is None:
        decode = lambda s, fixed: engine_greedy_decode(copy_model, s, START, END, fixed_shapes=fixed)  # noqa: E731
    else:
        decode = lambda s, fixed: engine_beam_search(copy_model, s, START, END, beam_size=beam_size,  # noqa: E731
                                              fixed_shapes=fixed)
    tokens, scores = tf.function(lambda s: decode(s, False))(source)
    xla_tokens, xla_scores = tf.function(lambda s: decode(s, True), jit_compile=True)(source)
    np.testing.assert_array_equal(xla_tokens.numpy(), tokens.numpy())
    np.testing.assert_allclose(xla_scores.numpy(), scores.numpy(), rtol=1e-4)


# Keras 3.15's Model.quantize warns for each built-in layer it leaves as it is (Dropout, LayerNormalization, ...).
@pytest.mark.filterwarnings("ignore:Layer .* does not have a `quantize` method implemented:UserWarning")
def test_the_engine_names_an_attention_it_does_not_compute():
    """The engine computes the paper's attention from the layer's public `projections`; a layer that is not
    plain (`is_plain()`: here int8-quantized kernels) is one clear error naming the layer."""
    model = random_model(0)
    model.quantize("int8")
    with pytest.raises(ValueError, match=r"plain multi-head attention only.*'transformer\w*/decoder/layer_0/self_attention'"):
        engine_greedy_decode(model, random_ids(np.random.default_rng(0), 1, 4, high=24), START, END)


@pytest.mark.parametrize("search", [engine_greedy_decode, engine_beam_search])
def test_growing_shapes_under_xla_are_one_clear_error(copy_model, search):
    """Fixed or growing shapes is the caller's explicit choice (the export decides it where it decides XLA);
    growing shapes traced under jit_compile would fail inside XLA's compiler: this says what to pass."""
    decode = tf.function(lambda s: search(copy_model, s, START, END), jit_compile=True)
    with pytest.raises(ValueError, match="pass fixed_shapes=True"):
        decode(copy_sources(9, 2))


@pytest.mark.parametrize("vocab", [24, 240])
def test_beam_search_under_xla_sorts_no_vocabulary_row(vocab):
    # XLA on CPU keeps a top_k as its TopK kernel only while no slice is taken of the
    # result; otherwise it sorts the whole row, every step (once 8x slower than no XLA
    # at batch 64, when the row was a sentence's beam * vocab candidates).
    model = random_model(0, vocab)
    source = random_ids(np.random.default_rng(0), 4, 6, high=24)
    decode = tf.function(lambda s: engine_beam_search(model, s, START, END, beam_size=3, fixed_shapes=True),
                         jit_compile=True)
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


def test_next_tokens_on_the_engines_ops_follow_the_log_softmax_never_padding_and_only_the_end_at_the_limit():
    """The library's token rules on the engine's array ops (a top-k by blocks: 240 = 16 blocks of 15)."""
    rng = np.random.default_rng(0)
    logits = rng.normal(scale=3.0, size=(5, 240)).astype("float32")
    logits[0, 0] = 100.0  # padding would be the most likely token
    at_limit = np.array([False, True, False, False, True])
    assert _block_length(240, 5) is not None
    best = next_tokens(tf.constant(logits), tf.constant(at_limit), END, 4, search_ops=GRAPH_OPS)
    most_likely = most_likely_token(tf.constant(logits), tf.constant(at_limit), END, search_ops=GRAPH_OPS)
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
    np.testing.assert_array_equal(most_likely.token.numpy(), best.token.numpy()[:, 0])
    np.testing.assert_allclose(most_likely.log_prob.numpy(), best.log_prob.numpy()[:, 0], rtol=1e-6)


def test_beam_size_one_is_greedy_and_beam_4_never_scores_below_greedy(copy_model):
    source = copy_sources(3, 128)
    greedy_tokens, greedy_scores = _greedy(copy_model)(source)
    beam_tokens, beam_scores = _beam(copy_model, 1)(source)
    np.testing.assert_array_equal(beam_tokens.numpy(), greedy_tokens.numpy())
    np.testing.assert_allclose(beam_scores.numpy(), greedy_scores.numpy(), rtol=1e-5)
    _, beam_scores = _beam(copy_model, 4)(source)
    assert (beam_scores.numpy() >= greedy_scores.numpy() - 1e-5).all()
    assert (beam_scores.numpy() > greedy_scores.numpy() + 1e-3).sum() > 10  # the beam finds better ones


def test_scores_are_length_penalised_log_probabilities(copy_model):
    source = copy_sources(4, 6)
    tokens, scores = _beam(copy_model, 3, length_penalty=0.6)(source)
    assert_length_penalised_log_probs(copy_model, source, tokens, scores, alpha=0.6)


@pytest.mark.parametrize("decode", ["greedy", "beam"])
def test_a_sentence_decodes_the_same_alone_and_in_any_batch(copy_model, decode):
    sentence, batch = a_sentence_and_a_batch_holding_it()
    run = _greedy(copy_model) if decode == "greedy" else _beam(copy_model, 4)
    alone_tokens, alone_score = run(sentence)
    batch_tokens, batch_scores = run(batch)
    alone = alone_tokens.numpy()[0]
    np.testing.assert_array_equal(batch_tokens.numpy()[1][: len(alone)], alone)
    assert (batch_tokens.numpy()[1][len(alone) :] == 0).all()
    assert float(batch_scores[1]) == pytest.approx(float(alone_score[0]), rel=1e-5)


@pytest.mark.parametrize("decode", ["greedy", "beam"])
def test_parallel_loops_decode_what_one_loop_decodes(copy_model, decode):
    """The loops are independent calls of one traced search, each running its own `tf.while_loop`, and the
    rows come back in place."""
    if decode == "greedy":
        run = lambda s: engine_greedy_decode(copy_model, s, START, END)  # noqa: E731
    else:
        run = lambda s: engine_beam_search(copy_model, s, START, END, beam_size=3)  # noqa: E731
    spec = [tf.TensorSpec([None, None], tf.int32)]
    one_loop = tf.function(run, input_signature=spec)
    sources = copy_sources(11, 7)
    sources[::3, 4:] = 0  # sentences of different lengths: the loops' outputs differ in length
    sources[::3, 3] = END
    for num_loops in (2, 3):
        parallel = tf.function(lambda s: search.parallel_decode(run, s, num_loops), input_signature=spec)
        for n in (0, 1, 2, 7):
            tokens, scores = parallel(sources[:n])
            expected_tokens, expected_scores = one_loop(sources[:n])
            np.testing.assert_array_equal(tokens.numpy(), expected_tokens.numpy())
            np.testing.assert_allclose(scores.numpy(), expected_scores.numpy(), rtol=1e-5)
        graph = parallel.get_concrete_function().graph.as_graph_def()
        calls = [node.attr["f"].func.name for node in graph.node
                 if node.op in ("PartitionedCall", "StatefulPartitionedCall")]
        assert len(calls) == num_loops and len(set(calls)) == 1, calls
        searched = next(f for f in graph.library.function if f.signature.name == calls[0])
        assert sum(node.op in ("While", "StatelessWhile") for node in searched.node_def) == 1
    with pytest.raises(ValueError, match="num_loops must be >= 1, got 0"):
        search.parallel_decode(run, sources, 0)


@pytest.mark.parametrize("decode", ["greedy", "beam"])
def test_finished_sentences_leave_the_batch(decode, monkeypatch):
    """Outside XLA a step decodes only the sentences still going: once the shorter source reaches its
    limit (source length + 50), the decoder gets one sentence's rows (1 for greedy, k + 1 for beam)."""
    model = never_ending_model()
    rows_per_step = []
    decode_step = step.decode_step

    def counting_decode_step(model, token_ids, *args):
        rows_per_step.append(int(tf.shape(token_ids)[0]))
        return decode_step(model, token_ids, *args)

    monkeypatch.setattr(search, "decode_step", counting_decode_step)
    source = sources_of_2_and_6_tokens()
    if decode == "greedy":
        tokens, _ = engine_greedy_decode(model, source, START, END)  # eagerly: the loop runs in Python
        rows = 1
    else:
        tokens, _ = engine_beam_search(model, source, START, END, beam_size=2)
        rows = 3
    assert rows_per_step == [2 * rows] * 52 + [rows] * 4
    assert (tokens.numpy()[0, 52:] == 0).all() and tokens.shape[1] == 56


def test_default_limit_is_source_length_plus_50():
    model = never_ending_model()
    source = sources_of_2_and_6_tokens()
    for decode in (engine_greedy_decode, engine_beam_search):
        tokens = tf.function(lambda s: decode(model, s, START, END))(source)[0].numpy()
        assert list((tokens != 0).sum(axis=1)) == [2 + 50, 6 + 50]
        assert tokens[0, 51] == END and tokens[1, 55] == END


def test_extra_output_length_sets_the_room_beyond_each_source_as_the_librarys():
    model = never_ending_model()
    source = sources_of_2_and_6_tokens()
    for decode in (engine_greedy_decode, engine_beam_search):
        for jit_compile in (False, True):
            tokens = tf.function(lambda s: decode(model, s, START, END, extra_output_length=80,
                                                  fixed_shapes=jit_compile), jit_compile=jit_compile)(source)[0].numpy()
            assert list((tokens != 0).sum(axis=1)) == [2 + 80, 6 + 80], (decode, jit_compile)
            assert tokens[0, 81] == END and tokens[1, 85] == END


def test_learned_positions_cap_the_output_at_the_position_table():
    """The default limit (source length + 50) is past a 12-position table: decoding stops at the table's end,
    outside XLA and under it (where the bound comes from the padded source length)."""
    model = never_ending_model(learned_positions=True, max_positions=12)
    source = sources_of_2_and_6_tokens()
    for decode in (engine_greedy_decode, engine_beam_search):
        for jit_compile in (False, True):
            tokens = tf.function(lambda s: decode(model, s, START, END, fixed_shapes=jit_compile),
                                 jit_compile=jit_compile)(source)[0].numpy()
            assert list((tokens != 0).sum(axis=1)) == [12, 12]
            assert (tokens[:, 11] == END).all()
    # An explicit limit past the table is capped too; one within it is kept.
    assert engine_greedy_decode(model, source, START, END, max_output_length=30)[0].shape == (2, 12)
    assert engine_greedy_decode(model, source, START, END, max_output_length=5)[0].shape == (2, 5)


def test_the_engine_searches_take_their_old_max_length_argument_with_a_deprecation_warning():
    model = never_ending_model()  # every output runs to the limit
    source = sources_of_2_and_6_tokens()
    expected = engine_greedy_decode(model, source, START, END, max_output_length=5)[0].numpy()
    with pytest.warns(DeprecationWarning, match=r"^engine_greedy_decode\(max_length=\.\.\.\) is now "
                                                r"engine_greedy_decode\(max_output_length=") as caught:
        tokens = engine_greedy_decode(model, source, START, END, max_length=5)[0].numpy()
    assert [w.filename for w in caught if "max_length" in str(w.message)] == [__file__]
    assert tokens.shape == (2, 5)
    np.testing.assert_array_equal(tokens, expected)
    with pytest.warns(DeprecationWarning, match=r"^engine_beam_search\(max_length=\.\.\.\) is now "):
        assert engine_beam_search(model, source, START, END, beam_size=2, max_length=2)[0].shape == (2, 2)
    with pytest.raises(ValueError, match="got max_output_length=5 and max_length=5: max_length is max_output_length's"):
        engine_greedy_decode(model, source, START, END, max_output_length=5, max_length=5)
    with pytest.raises(ValueError, match="got max_output_length=None and max_length=2"):  # whatever the values
        engine_beam_search(model, source, START, END, max_output_length=None, max_length=2)


def test_empty_batch_bad_rank_and_a_model_never_called():
    model = random_model(9)
    tokens, scores = engine_greedy_decode(model, np.zeros((0, 4), "int32"), START, END)
    assert tokens.shape[0] == 0 and scores.shape == (0,)
    tokens, scores = engine_beam_search(model, np.zeros((0, 4), "int32"), START, END)
    assert tokens.shape[0] == 0 and scores.shape == (0,)
    with pytest.raises(ValueError, match=r"source_ids of shape \[batch, source_len\]"):
        engine_greedy_decode(model, np.zeros((4,), "int32"), START, END)
    fresh = kt.Transformer.from_preset("tiny", vocab_size=20)
    tokens, scores = engine_greedy_decode(fresh, np.array([[5, 6, 3]], "int32"), START, END, max_output_length=4)
    assert tokens.shape[0] == 1 and scores.shape == (1,)
