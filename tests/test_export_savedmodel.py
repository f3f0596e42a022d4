"""The exported SavedModel, tested the way TF Serving uses it.

One small translator is trained (conftest's `quick_model_dir`: "tiny" preset, a
few hundred steps on 2,000 Multi30k pairs, so its outputs end with the end id)
and exported once per session. TF Serving loads SavedModels with the TF1/C++
session loader, so the main checks run `tf.compat.v1.saved_model.loader.load`
in a process of its own that imports only tensorflow and tensorflow_text
(conftest's `run_tf1`: one session per export, as the model server keeps one).
"""

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from conftest import HUGE_TEXT, LONG_TEXT, QUICK_MODEL_MAX_SENTENCE_LENGTH as MAX_SOURCE_LENGTH
from conftest import multi30k_lines as _lines
from conftest import XLA_MAX_BATCH, load_saved_model, needs_multi30k, run_tf1, write_lines
from export import graph_ops
from export.export_model import export, next_version
from export.engine_weights import engine_model
from export.search import engine_beam_search, engine_greedy_decode
from export.translator import decode_policy, load_model_dir
from keras_transformer.text import END_ID, START_ID
from common.tokenizer import encode_source

pytestmark = needs_multi30k


@pytest.fixture(scope="session")
def model_dir(quick_model_dir):
    return quick_model_dir


def _unb64(items):
    return [base64.b64decode(x) for x in items]


def engine_translations(model_dir, texts, beam_size=4):
    """Reference: the serving engine's `engine_beam_search`/`engine_greedy_decode` (export/search.py) in process,
    detokenized with the sentencepiece Python package (no Translator involved), in the precision kt-export decodes in
    here. (That the engine decodes what the library decodes is tests/test_engine.py's contract.)"""
    import sentencepiece as spm

    model, tokenizer, cfg = load_model_dir(model_dir)
    model = engine_model(model, decode_policy("auto")[0])

    @tf.function
    def decode(texts):
        source = encode_source(tokenizer, texts, cfg["max_source_length"]).to_tensor(0)
        if beam_size == 1:
            return engine_greedy_decode(model, source, START_ID, END_ID)
        return engine_beam_search(model, source, START_ID, END_ID, beam_size=beam_size)

    tokens, scores = decode(tf.constant(texts))
    sp = spm.SentencePieceProcessor(model_file=str(Path(model_dir) / "tokenizer.model"))
    out = []
    for row in tokens.numpy().tolist():
        ids = row[: row.index(END_ID)] if END_ID in row else row
        out.append(sp.decode([i for i in ids if i != 0]).encode("utf-8"))
    return out, scores.numpy()


def test_export_layout(exported, model_dir):
    assert exported.name == "1" and exported.parent.name == "translator"
    assert (exported / "saved_model.pb").is_file() and (exported / "variables" / "variables.index").is_file()
    # The tokenizer model ships as an asset, byte for byte.
    assert (exported / "assets" / "tokenizer.model").read_bytes() == (Path(model_dir) / "tokenizer.model").read_bytes()
    # Nothing but integer versions (no leftover temporary directory) under the model's base path.
    assert [p.name for p in exported.parent.iterdir()] == ["1"]


def test_next_version(tmp_path):
    assert next_version(tmp_path / "missing") == 1
    for name in ("1", "7", "12", ".tmp-13-x", "latest"):
        (tmp_path / name).mkdir()
    (tmp_path / "99").write_text("a file, not a version")
    assert next_version(tmp_path) == 13


def test_tf1_session_loader_serves_text_like_the_engine_in_process(exported, model_dir, tmp_path):
    """Must-show 1 and 4, and batch invariance (3) through the TF1 loader TF Serving uses."""
    sentences = _lines("val.en", 512)
    few = sentences[:6]
    bad = ["", "   ", "\t \n ", HUGE_TEXT, b"\xff\xfe\xfd", b"caf\xc3", b"ok \x80 bytes", "a\x00b"]
    replaced = ["\ufffd\ufffd\ufffd", "caf\ufffd", "ok \ufffd bytes"]  # what invalid UTF-8 is replaced with
    # Sentences translated alone, then inside a batch of longer and shorter sentences.
    lengths = [len(s.split()) for s in sentences]
    alone = [sentences[int(np.argmin(lengths))], sentences[int(np.argmax(lengths))], sentences[10]]
    requests = [("serving_default", few), ("greedy", few), ("serving_default", bad),
                ("serving_default", replaced), ("tokenize", [HUGE_TEXT, "", b"\xff"]),
                ("serving_default", []), ("serving_default", sentences)]
    requests += [("serving_default", [s]) for s in alone]
    result = run_tf1(exported, requests, tmp_path)
    assert result["loaded_python_modules"] == []  # only tensorflow and tensorflow_text were imported
    assert {"serving_default", "greedy", "translate_ids", "tokenize"} <= set(result["signatures"])
    beam, greedy, bad_out, replaced_out, tokenized, empty, batch_512 = result["runs"][:7]
    singles = result["runs"][7:]

    # 1. Same translations as the in-process engine (beam 4 and greedy), scores to float precision.
    ref_beam, ref_beam_scores = engine_translations(model_dir, few, beam_size=4)
    ref_greedy, ref_greedy_scores = engine_translations(model_dir, few, beam_size=1)
    assert _unb64(beam["translation"]) == ref_beam
    np.testing.assert_allclose(beam["score"], ref_beam_scores, rtol=1e-4, atol=1e-4)
    assert _unb64(greedy["translation"]) == ref_greedy
    np.testing.assert_allclose(greedy["score"], ref_greedy_scores, rtol=1e-4, atol=1e-4)
    assert all(t for t in ref_beam)  # the model translates into something: the comparison is not vacuous
    # Beam search never scores below greedy decoding (3).
    assert all(b >= g - 1e-5 for b, g in zip(beam["score"], greedy["score"]))

    # 4. Bad input: one string and one finite score per input, dense [batch].
    assert bad_out["translation_shape"] == [len(bad)] and bad_out["score_shape"] == [len(bad)]
    assert np.isfinite(bad_out["score"]).all()
    # Empty and whitespace-only texts are one and the same source (just the end id).
    assert len(set(_unb64(bad_out["translation"])[:3])) == 1
    # Invalid UTF-8 is translated as its U+FFFD replacement.
    assert _unb64(bad_out["translation"])[4:7] == _unb64(replaced_out["translation"])
    # The 10,000-character input is truncated to max_source_length source tokens (end id last); empty input is [end].
    ids = np.array(tokenized["source_ids"])
    assert tokenized["source_ids_shape"] == [3, MAX_SOURCE_LENGTH]
    assert ids[0, -1] == 3 and (ids[0] != 0).all()
    assert ids[1].tolist() == [3] + [0] * (MAX_SOURCE_LENGTH - 1)
    # A batch of 0 and a batch of 512.
    assert empty["translation_shape"] == [0] and empty["score_shape"] == [0]
    assert batch_512["translation_shape"] == [512] and batch_512["score_shape"] == [512]

    # 3. A sentence alone and inside the batch of 512 (shorter and longer ones) gets the same translation.
    translations_512 = _unb64(batch_512["translation"])
    for text, single in zip(alone, singles):
        i = sentences.index(text)
        assert _unb64(single["translation"]) == [translations_512[i]]
        np.testing.assert_allclose(single["score"], [batch_512["score"][i]], rtol=1e-4, atol=1e-4)
    assert translations_512[:6] == _unb64(beam["translation"])


def test_every_op_is_core_tensorflow_or_tensorflow_text(exported):
    """Must-show 2: every op of the graph and of its function library is servable."""
    ops = graph_ops.saved_model_ops(exported)
    registered = graph_ops.registered_ops()  # from a process that imported only tensorflow, then tensorflow_text
    assert "MatMul" in registered["core"] and "SentencepieceOp" not in registered["core"]
    assert "SentencepieceOp" in registered["tensorflow_text"]
    assert graph_ops.unservable_ops(ops, registered) == []
    graph_ops.registered_ops()["core"].clear()  # the caller's lists: the next call (from the process's memo) is whole
    assert graph_ops.registered_ops() == registered
    # The tokenizer and the decoding loop are in the graph (so the check covered them) ...
    assert {"SentencepieceOp", "SentencepieceTokenizeOp", "SentencepieceDetokenizeOp", "While"} <= set(ops)
    # ... the key/value cache grows with core ops (a concat), not Keras' XlaDynamicUpdateSlice ...
    assert "ConcatV2" in ops and not any(graph_ops.needs_xla(op) for op in ops)
    # ... and the check does reject what the model server lacks.
    assert graph_ops.unservable_ops({"MatMul": 1, "XlaDynamicUpdateSlice": 1, "EagerPyFunc": 1, "NotAnOp": 1},
                                    registered) == ["EagerPyFunc", "NotAnOp", "XlaDynamicUpdateSlice"]


def test_small_batches_decode_under_xla_through_the_export(model_dir, exported, xla_exported, xla_tf1_runs):
    """kt-export --xla-max-batch 4 (`xla_exported`): through the TF1 session loader (TF Serving's), a batch of 1 to 4
    sentences gets what the engine's search compiled with XLA in float32 gives each sentence alone
    (its source padded to 16 tokens: the batch padding changes nothing), a larger batch what the export
    without XLA gives; the op check passes its XLA ops only when told the server runs XLA."""
    import sentencepiece as spm

    assert 3 <= XLA_MAX_BATCH < 6  # the batches below straddle the threshold
    path = xla_exported
    requests, served = xla_tf1_runs["small_batches"]
    texts = requests[-1][1]
    assert [(sig, len(batch)) for sig, batch in requests] == [(sig, n) for sig in ("greedy", "serving_default")
                                                              for n in (1, 3, 6)]

    model, tokenizer, cfg = load_model_dir(model_dir)
    model = engine_model(model, "float32")
    sp = spm.SentencePieceProcessor(model_file=str(Path(model_dir) / "tokenizer.model"))
    compiled = {"greedy": tf.function(lambda s: engine_greedy_decode(model, s, START_ID, END_ID, fixed_shapes=True),
                                      jit_compile=True),
                "serving_default": tf.function(lambda s: engine_beam_search(model, s, START_ID, END_ID, beam_size=4,
                                                                            fixed_shapes=True), jit_compile=True)}

    def alone_under_xla(signature, text):
        source = encode_source(tokenizer, tf.constant([text]), cfg["max_source_length"]).to_tensor(0)
        source = tf.pad(source, [[0, 0], [0, -source.shape[1] % 16]])
        tokens, score = compiled[signature](source)
        row = tokens.numpy()[0].tolist()
        return sp.decode([i for i in row[: row.index(END_ID)] if i != 0]).encode("utf-8"), float(score[0])

    for signature in ("greedy", "serving_default"):
        expected = [alone_under_xla(signature, t) for t in texts[:3]]
        for run in served[:2] if signature == "greedy" else served[3:5]:
            n = len(run["translation"])
            assert _unb64(run["translation"]) == [t for t, _ in expected[:n]], (signature, n)
            np.testing.assert_allclose(run["score"], [s for _, s in expected[:n]], rtol=1e-5, atol=1e-5)
    # 6 sentences: the graph decoder, as the export without XLA decodes them (here in process).
    without_xla = load_saved_model(exported)
    for signature, run in (("greedy", served[2]), ("serving_default", served[5])):
        got = without_xla.signatures[signature](text=tf.constant(texts))
        assert _unb64(run["translation"]) == got["translation"].numpy().tolist(), signature
        np.testing.assert_allclose(run["score"], got["score"].numpy(), rtol=1e-6, atol=1e-6)

    ops = graph_ops.saved_model_ops(path)
    registered = graph_ops.registered_ops()
    xla_ops = sorted(op for op in ops if graph_ops.needs_xla(op))
    assert xla_ops and graph_ops.unservable_ops(ops, registered) == xla_ops
    assert graph_ops.unservable_ops(ops, registered, allow_xla=True) == []


def test_cached_uncached_and_beam_one_through_the_export(model_dir, exported, tmp_path):
    """Must-show 3 through exported SavedModels: an export decoding without the cache and with beam 1
    (`kt-export --no-cache --beam-size 1`) gives the default export's cached greedy tokens and scores from
    both its greedy and its beam signatures (uncached == cached, beam 1 == greedy); beam 4 never scores
    below greedy. (In process, tests/test_engine.py compares cached and uncached beam 4 too.)"""
    slow_one = export(model_dir, tmp_path, use_cache=False, beam_size=1, check_ops=False)
    assert slow_one.name == "1"  # the first version in an empty folder
    main, slow = load_saved_model(exported), tf.saved_model.load(str(slow_one))
    texts = tf.constant(_lines("val.en", 24)[12:] + ["", "Two"])
    source = main.signatures["tokenize"](text=texts)["source_ids"]

    greedy = main.signatures["greedy"](text=texts)
    for signature in ("greedy", "serving_default"):
        got = slow.signatures[signature](text=texts)
        assert got["translation"].numpy().tolist() == greedy["translation"].numpy().tolist(), signature
        np.testing.assert_allclose(got["score"].numpy(), greedy["score"].numpy(), rtol=1e-5, atol=1e-5)
    beam4 = main.signatures["serving_default"](text=texts)  # the text signatures score a blank line 0
    assert (beam4["score"].numpy() >= greedy["score"].numpy() - 1e-5).all()
    one = slow.signatures["translate_ids"](source_ids=source)["tokens"].numpy()
    assert ((one == 3).sum(axis=1) == 1).all()  # every output ended, so the limits did not decide


@pytest.mark.parametrize("signature", ["serving_default", "greedy"])
def test_a_sentence_translates_the_same_alone_and_among_1_63_or_511_others(exported, signature):
    """What TF Serving's batching does to a request: its sentences decode among whatever other requests arrived
    with them. In the precision the default export decodes in (float32, on every CPU: `decode_policy`), each
    sentence's translation and score alone equal those it gets in batches of 2, 64 and 512."""
    assert decode_policy("auto")[0] == "float32"
    val = _lines("val.en", 520)
    sentences, others = val[:6], val[6:]
    translate = load_saved_model(exported).signatures[signature]

    def run(texts):
        out = translate(text=tf.constant(texts))
        return out["translation"].numpy().tolist(), out["score"].numpy().tolist()

    alone = [run([sentence]) for sentence in sentences]
    for size in (2, 64, 512):
        if size == 2:  # each sentence beside another one
            cases = [([others[i], sentence], [1]) for i, sentence in enumerate(sentences)]
        else:  # the six among size - 6 others, first, last and between
            positions = [int(p) for p in np.linspace(0, size - 1, len(sentences))]
            batch = list(others[:size])
            for position, sentence in zip(positions, sentences):
                batch[position] = sentence
            cases = [(batch, positions)]
        got = []
        for batch, positions in cases:
            translations, scores = run(batch)
            got += [(translations[p], scores[p]) for p in positions]
        for i, (translation, score) in enumerate(got):
            ([alone_translation], [alone_score]) = alone[i]
            assert translation == alone_translation, (size, sentences[i])
            assert score == pytest.approx(alone_score, rel=1e-5, abs=1e-6), (size, sentences[i])


def test_every_signature_says_whether_the_source_was_truncated(model_dir, exported, tmp_path):
    """`truncated` is True exactly when the source has more than max_source_length - 1 pieces (the end id takes the
    last place), in every signature, through the TF1 loader TF Serving uses."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(Path(model_dir) / "tokenizer.model"))
    short = _lines("val.en", 1)[0]
    texts = [short, LONG_TEXT, "", b"\xff"]
    result = run_tf1(exported, [("serving_default", texts), ("greedy", texts), ("tokenize", texts)], tmp_path)
    for run in result["runs"]:
        assert run["truncated"] == [False, True, False, False] and run["truncated_shape"] == [4]
    # At the limit exactly: max_source_length - 1 pieces fit, one more does not (translate_ids, ids in).
    pieces = sp.encode(LONG_TEXT)
    loaded = load_saved_model(exported)
    sources = tf.ragged.constant([pieces[:MAX_SOURCE_LENGTH - 1] + [END_ID], pieces[:MAX_SOURCE_LENGTH] + [END_ID],
                                  pieces[:MAX_SOURCE_LENGTH - 1]]).to_tensor(0)
    assert loaded.signatures["translate_ids"](source_ids=sources)["truncated"].numpy().tolist() == [False, True, False]


def test_the_n_best_list_is_sorted_distinct_and_led_by_serving_default(exported, tmp_path):
    """The n_best signature, through the TF1 loader TF Serving uses: per sentence the beam's 4 different
    translations, best first, the first serving_default's own; an empty input gets empty entries."""
    sentences = _lines("val.en", 24)
    result = run_tf1(exported, [("n_best", sentences + ["", LONG_TEXT]), ("serving_default", sentences)],
                     tmp_path)
    n_best, best = result["runs"]
    assert n_best["translations_shape"] == n_best["scores_shape"] == [26, 4]
    translations = np.array(_unb64(n_best["translations"]), dtype=object).reshape(26, 4)
    scores = np.array(n_best["scores"])
    assert list(translations[:24, 0]) == _unb64(best["translation"])
    np.testing.assert_allclose(scores[:24, 0], best["score"], rtol=1e-5, atol=1e-5)
    assert (np.diff(scores[:24], axis=1) <= 0).all() and (scores[:24] > -1e8).all()
    # Different outputs (as token sequences; two may still detokenize alike): almost always different text.
    assert sum(len(set(row)) == 4 for row in translations[:24]) >= 20
    assert list(translations[24]) == [b""] * 4 and list(scores[24]) == [0.0] * 4
    assert n_best["truncated"] == best["truncated"] + [False, True]


def test_kt_evaluate_scores_the_served_graph(model_dir, exported, tmp_path):
    """The BLEU kt-evaluate prints is the export's: on 100 test sentences, its hypotheses and BLEU equal
    those of the SavedModel's serving_default run by the TF1 session loader TF Serving uses."""
    from keras_transformer.text import read_lines
    from training.evaluate import main, score

    sources, refs = _lines("test_2016_flickr.en", 100), _lines("test_2016_flickr.de", 100)
    source, reference = write_lines(tmp_path / "src.en", sources), write_lines(tmp_path / "ref.de", refs)
    out = tmp_path / "hyp.de"
    # The export's settings: beam 4, length penalty 0.6 (kt-export's and kt-evaluate's defaults).
    assert main(["--model-dir", str(model_dir), "--source-file", str(source), "--references", str(reference),
                 "--output", str(out)]) == 0
    evaluated = json.loads(Path(f"{out}.scores.json").read_text())
    served = run_tf1(exported, [("serving_default", sources)], tmp_path)["runs"][0]
    served_hypotheses = [t.decode("utf-8") for t in _unb64(served["translation"])]
    assert read_lines(out) == served_hypotheses
    assert evaluated["bleu"] == score(served_hypotheses, refs)["bleu"]
    assert evaluated["chrf"] == score(served_hypotheses, refs)["chrf"] > 5  # a real, non-empty comparison


def test_translate_ids_truncates_the_source_like_the_text_signatures(model_dir, exported):
    """translate_ids decodes the source the text signatures decode: at most max_source_length - 1 pieces, then the
    end id, whatever length the client sends (with or without its end id)."""
    import sentencepiece as spm

    loaded = load_saved_model(exported)
    sp = spm.SentencePieceProcessor(model_file=str(Path(model_dir) / "tokenizer.model"))
    long_text = " ".join(_lines("val.en", 40))
    pieces = sp.encode(long_text)
    assert len(pieces) > 4 * MAX_SOURCE_LENGTH
    short = _lines("val.en", 1)[0]
    sources = tf.ragged.constant([pieces + [END_ID], sp.encode(short) + [END_ID], pieces]).to_tensor(0)
    got = loaded.signatures["translate_ids"](source_ids=sources)
    truncated = loaded.signatures["tokenize"](text=tf.constant([long_text, short, long_text]))["source_ids"]
    assert truncated.shape[1] == MAX_SOURCE_LENGTH
    expected = loaded.signatures["translate_ids"](source_ids=truncated)
    np.testing.assert_array_equal(got["tokens"].numpy(), expected["tokens"].numpy())
    np.testing.assert_allclose(got["score"].numpy(), expected["score"].numpy(), rtol=1e-5, atol=1e-5)
    # ... and that is what serving_default translates.
    text = loaded.signatures["serving_default"](text=tf.constant([long_text]))
    np.testing.assert_allclose(text["score"].numpy(), expected["score"].numpy()[:1], rtol=1e-5, atol=1e-5)
