"""The export's signatures beyond translation (sample, prefix, greedy_prefix, score, align), through the TF1
session loader TF Serving uses: each answers what the library's search or scoring answers for the same source
ids, and keeps the promises of its definition."""

import base64
import functools

import numpy as np
import pytest
import tensorflow as tf

import keras_transformer as kt
from conftest import QUICK_MODEL_MAX_SENTENCE_LENGTH as MAX_SOURCE_LENGTH
from conftest import LONG_TEXT, load_saved_model, multi30k_lines, needs_multi30k, run_tf1
from export.engine_weights import engine_model
from export.translator import decode_policy, load_model_dir
from keras_transformer.text import END_ID, START_ID

pytestmark = needs_multi30k


@pytest.fixture(scope="module")
def reference(quick_model_dir):
    """The exported model as the export decodes it (float32, `decode_policy("auto")` on every CPU), its tokenizer,
    and the library's searches on it: in float32 the export must decode what the library decodes."""
    import sentencepiece as spm

    loaded, _, config = load_model_dir(quick_model_dir)
    model = engine_model(loaded, decode_policy("auto")[0])
    sp = spm.SentencePieceProcessor(model_file=str(quick_model_dir / "tokenizer.model"))

    def padded(rows):
        out = np.zeros((len(rows), max(map(len, rows), default=0)), "int32")
        for i, row in enumerate(rows):
            out[i, :len(row)] = row
        return out

    def source_ids(texts):
        """The export's source: at most max_source_length - 1 pieces, then the end id."""
        return padded([sp.encode(t)[: config["max_source_length"] - 1] + [END_ID] for t in texts])

    def pieces(texts):
        return padded([sp.encode(t) for t in texts])

    def too_long(texts):
        return [len(sp.encode(t)) > config["max_source_length"] - 1 for t in texts]

    def detokenize(tokens):  # as `common.tokenizer.decode_output`: no whitespace at either end (ASCII's, as TF's)
        rows = [list(row) for row in np.asarray(tokens)]
        return [sp.decode([int(i) for i in (row[: row.index(END_ID)] if END_ID in row else row) if i != 0]).strip(
            " \t\n\v\f\r") for row in rows]

    @tf.function
    def sample(source, seed, temperature, top_k):
        return kt.sample_decode(model, source, START_ID, END_ID, seed=seed, temperature=temperature, top_k=top_k)

    @tf.function
    def prefixed(source, prefix):
        return kt.beam_search(model, source, START_ID, END_ID, beam_size=4, prefix_ids=prefix)

    @tf.function
    def greedy_prefixed(source, prefix):
        return kt.greedy_decode(model, source, START_ID, END_ID, prefix_ids=prefix, length_penalty=0.6)

    return {"model": model, "source_ids": source_ids, "pieces": pieces, "sample": sample, "prefixed": prefixed,
            "greedy_prefixed": greedy_prefixed, "detokenize": detokenize, "too_long": too_long}


def _texts(run, name):
    return [base64.b64decode(t).decode("utf-8") for t in run[name]]


def test_the_sample_signature_draws_what_the_library_draws(exported, reference, tmp_path):
    """Per-row seeds, temperatures and top-k: the library's tokens and scores; top-k 1 is the greedy signature's
    output; a seed gives the same sample twice and alone; a temperature of 0 is refused by name."""
    texts = multi30k_lines("test_2016_flickr.en", 12)
    seeds = list(range(100, 112))
    temperatures = [0.7, 1.0, 1.5] * 4
    top_ks = [0, 5, 1, 0] * 3
    inputs = {"seed": seeds, "temperature": temperatures, "top_k": top_ks}
    greedy_inputs = {"seed": seeds, "temperature": [1.0] * 12, "top_k": [1] * 12}
    result = run_tf1(exported, [("sample", texts, inputs), ("sample", texts, inputs), ("greedy", texts),
                                ("sample", texts, greedy_inputs),
                                ("sample", texts[3:4], {k: v[3:4] for k, v in inputs.items()})], tmp_path)
    first, again, greedy, top_1, alone = result["runs"]
    tokens, scores = reference["sample"](reference["source_ids"](texts), np.array(seeds, "int32"),
                                         np.array(temperatures, "float32"), np.array(top_ks, "int32"))
    assert _texts(first, "translation") == reference["detokenize"](tokens)
    np.testing.assert_allclose(first["score"], np.asarray(scores), rtol=1e-4, atol=1e-4)
    assert first == again
    assert _texts(top_1, "translation") == _texts(greedy, "translation")
    np.testing.assert_allclose(top_1["score"], greedy["score"], rtol=1e-5)
    assert _texts(alone, "translation") == _texts(first, "translation")[3:4]
    assert _texts(first, "translation") != _texts(greedy, "translation")  # the draws are not the greedy choice

    loaded = load_saved_model(exported)
    with pytest.raises(tf.errors.InvalidArgumentError, match="temperature must be > 0"):
        loaded.signatures["sample"](text=tf.constant(texts[:2]), seed=tf.constant([1, 2], tf.int64),
                                    temperature=tf.constant([1.0, 0.0]), top_k=tf.constant([0, 0]))


@pytest.mark.parametrize("signature, plain, search", [("prefix", "serving_default", "prefixed"),
                                                      ("greedy_prefix", "greedy", "greedy_prefixed")])
def test_a_prefix_signature_honours_the_prefix_and_an_empty_one_is_its_plain_search(signature, plain, search,
                                                                                    exported, reference, tmp_path):
    """prefix (beam search) and greedy_prefix (greedy decoding): each output begins with its row's prefix pieces,
    and its tokens and scores are the library's search with `prefix_ids` (through the text: the same detokenized
    tokens); a blank prefix gives exactly the plain signature's output."""
    texts = multi30k_lines("test_2016_flickr.en", 8) + ["", LONG_TEXT]
    prefixes = ["Ein Hund", "Zwei Männer", "", "Eine Frau mit", "", "Ein", "Ein kleines Mädchen", "", "Ein", "Ein"]
    result = run_tf1(exported, [(signature, texts, {"prefix": prefixes}), (plain, texts),
                                (signature, texts, {"prefix": [""] * 10})], tmp_path)
    prefixed, best, empty = result["runs"]
    translations = _texts(prefixed, "translation")
    for text, prefix, translation in zip(texts, prefixes, translations):
        assert translation.startswith(prefix) if text else translation == ""
    tokens, scores = reference[search](reference["source_ids"](texts), reference["pieces"](prefixes))
    decoded = [i for i, text in enumerate(texts) if text]  # "" is answered "" without a search
    assert [translations[i] for i in decoded] == [reference["detokenize"](tokens)[i] for i in decoded]
    np.testing.assert_allclose(np.array(prefixed["score"])[decoded], np.asarray(scores)[decoded], rtol=1e-4,
                               atol=1e-4)
    assert translations != _texts(best, "translation")  # the prefixes changed outputs: they were forced
    assert prefixed["truncated"] == best["truncated"] and best["truncated"][9]
    assert _texts(empty, "translation") == _texts(best, "translation")
    np.testing.assert_allclose(empty["score"], best["score"], rtol=1e-6)


def test_the_score_signature_is_the_teacher_forced_score(exported, reference, tmp_path):
    """The score of (text, target) is the library's teacher-forced log-probability over the length penalty of the
    target's pieces, and scoring serving_default's own translation gives back serving_default's score wherever its
    output pieces are the tokenizer's pieces of that translation."""
    texts = multi30k_lines("test_2016_flickr.en", 10)
    targets = multi30k_lines("test_2016_flickr.de", 10)
    best_run = run_tf1(exported, [("serving_default", texts)], tmp_path)["runs"][0]
    translations = _texts(best_run, "translation")
    result = run_tf1(exported, [("score", texts + ["", texts[0]], {"target": targets + [targets[0], LONG_TEXT]}),
                                ("score", texts, {"target": translations})], tmp_path)
    scored, rescored = result["runs"]
    source, target = reference["source_ids"](texts + ["", texts[0]]), reference["source_ids"](targets + [targets[0],
                                                                                                      LONG_TEXT])
    expected, log_prob, _ = kt.score_targets(reference["model"], source, target, START_ID)
    np.testing.assert_allclose(scored["score"], np.asarray(expected), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(scored["log_prob"], np.asarray(log_prob), rtol=1e-4, atol=1e-4)
    # The source or the target was longer than the model's limit.
    sources_cut = reference["too_long"](texts + ["", texts[0]])
    targets_cut = reference["too_long"](targets + [targets[0], LONG_TEXT])
    assert scored["truncated"] == [a or b for a, b in zip(sources_cut, targets_cut)] and scored["truncated"][-1]
    assert target.shape[1] == MAX_SOURCE_LENGTH

    # Where detokenizing and tokenizing again gives the beam's own pieces, the score is the beam's.
    beam_tokens, _ = reference["prefixed"](reference["source_ids"](texts), tf.zeros([10, 0], tf.int32))
    retokenized = reference["source_ids"](translations)
    same = [i for i in range(10) if list(np.trim_zeros(np.asarray(beam_tokens)[i], "b"))
            == list(np.trim_zeros(retokenized[i], "b"))]
    assert len(same) >= 3, "too few canonical outputs to compare"
    np.testing.assert_allclose(np.array(rescored["score"])[same], np.array(best_run["score"])[same], rtol=1e-4)


def test_the_align_signature_names_one_source_piece_per_output_piece(exported, reference, tmp_path):
    texts = multi30k_lines("test_2016_flickr.en", 8) + ["", LONG_TEXT]
    aligned, best = run_tf1(exported, [("align", texts), ("serving_default", texts)], tmp_path)["runs"]
    assert _texts(aligned, "translation") == _texts(best, "translation") and aligned["score"] == best["score"]
    batch, length = aligned["alignment_shape"]
    alignment = np.array(aligned["alignment"]).reshape(batch, length)
    target_pieces = np.array(_texts(aligned, "target_pieces"), dtype=object).reshape(batch, length)
    source_pieces = np.array(_texts(aligned, "source_pieces"), dtype=object).reshape(aligned["source_pieces_shape"])
    assert aligned["target_pieces_shape"] == [batch, length] and batch == 10
    for i in range(10):
        real = target_pieces[i] != ""
        n_pieces = sum(1 for p in source_pieces[i] if p not in ("", "</s>"))
        assert (alignment[i][~real] == -1).all()
        assert ((alignment[i][real] >= 0) & (alignment[i][real] < n_pieces)).all()
        if texts[i]:
            assert target_pieces[i][real][-1] == "</s>" and "".join(target_pieces[i][real][:-1]).replace(
                "\u2581", " ").strip() == _texts(best, "translation")[i]
    assert not (target_pieces[8] != "").any() and (alignment[8] == -1).all()  # nothing to translate
    # The library's alignment of the same output tokens.
    source = reference["source_ids"](texts)
    tokens, _ = reference["prefixed"](source, tf.zeros([10, 0], tf.int32))
    expected = np.asarray(kt.align_targets(reference["model"], source, tokens, START_ID, END_ID))[:, :length]
    np.testing.assert_array_equal(alignment[:8], expected[:8])
    np.testing.assert_array_equal(alignment[9], expected[9])


def test_an_export_with_extra_output_length_bounds_every_search_as_the_library(quick_model_dir, reference):
    """`kt-export --extra-output-length N` (`Translator(extra_output_length=N)`): greedy and beam outputs are the
    library's searches with the same room, at most each source's length + N pieces (the end included)."""
    from export.translator import Translator

    texts = multi30k_lines("test_2016_flickr.en", 12)
    translator = Translator.from_model_dir(quick_model_dir, beam_size=3, extra_output_length=1)
    source = reference["source_ids"](texts)
    model, detokenize = reference["model"], reference["detokenize"]
    for name, search in (("greedy", kt.greedy_decode), ("beam", functools.partial(kt.beam_search, beam_size=3))):
        bounded = tf.function(lambda s: search(model, s, START_ID, END_ID, length_penalty=0.6,
                                               extra_output_length=1))(source)[0]
        served = (translator.translate_greedy if name == "greedy" else translator.translate)(tf.constant(texts))
        assert [t.decode() for t in served["translation"].numpy()] == detokenize(bounded), name
        lengths = (np.asarray(bounded) != 0).sum(axis=1)
        assert (lengths <= (np.asarray(source) != 0).sum(axis=1) + 1).all(), name
        unbounded = tf.function(lambda s: search(model, s, START_ID, END_ID, length_penalty=0.6))(source)[0]
        assert detokenize(unbounded) != detokenize(bounded), name  # the room matters to these sentences
    ids = translator.translate_ids(source)["tokens"].numpy()
    assert ids.shape[1] <= np.asarray(source).shape[1] + 1


def test_an_export_with_no_repeat_ngram_size_bans_repeats_in_every_search_as_the_library(quick_model_dir, reference):
    """`kt-export --no-repeat-ngram-size N` (`Translator(no_repeat_ngram_size=N)`): the greedy, beam and n-best
    outputs are the library's searches with the same ban, and no output repeats a piece."""
    from export.translator import Translator

    texts = multi30k_lines("test_2016_flickr.en", 24)
    translator = Translator.from_model_dir(quick_model_dir, beam_size=4, no_repeat_ngram_size=1, parallel_loops=2)
    source = reference["source_ids"](texts)
    model, detokenize = reference["model"], reference["detokenize"]
    library = {
        "greedy": tf.function(lambda s: kt.greedy_decode(model, s, START_ID, END_ID, length_penalty=0.6,
                                                         no_repeat_ngram_size=1))(source)[0],
        "beam": tf.function(lambda s: kt.beam_search(model, s, START_ID, END_ID, beam_size=4, length_penalty=0.6,
                                                     no_repeat_ngram_size=1))(source)[0],
        "n_best": tf.function(lambda s: kt.beam_search(model, s, START_ID, END_ID, beam_size=4, length_penalty=0.6, n_best=4,
                                                       no_repeat_ngram_size=1))(source)[0],
    }
    served = {"greedy": translator.translate_greedy(tf.constant(texts))["translation"],
              "beam": translator.translate(tf.constant(texts))["translation"],
              "n_best": translator.translate_n_best(tf.constant(texts))["translations"]}
    assert [t.decode() for t in served["greedy"].numpy()] == detokenize(library["greedy"])
    assert [t.decode() for t in served["beam"].numpy()] == detokenize(library["beam"])
    n_best = np.asarray(library["n_best"])
    assert [[t.decode() for t in row] for row in served["n_best"].numpy()] == [
        list(row) for row in zip(*(detokenize(n_best[:, i]) for i in range(4)))]
    plain = tf.function(lambda s: kt.greedy_decode(model, s, START_ID, END_ID))(source)[0]
    assert detokenize(plain) != detokenize(library["greedy"])  # the quick model repeats pieces: the ban matters
    for tokens in (library["greedy"], library["beam"], n_best.reshape(-1, n_best.shape[-1])):
        for row in np.asarray(tokens):
            pieces = [int(i) for i in row if i not in (0, END_ID)]
            assert len(pieces) == len(set(pieces))
    with pytest.raises(ValueError, match="no_repeat_ngram_size must be an int >= 0"):
        Translator.from_model_dir(quick_model_dir, no_repeat_ngram_size=-1)
