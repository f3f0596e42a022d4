"""Concurrent requests share a decoding loop (export/request_batching.py), through `tf.saved_model.load`.

The session's `exported` fixture is kt-export's default export, so it merges concurrent requests (batches of up to
64 sentences, no timeout). Each test sends every request alone first, then all at once from one thread per
request (a barrier releases them together), and asks: did each client get what it got alone (the translation,
`truncated` and every other string or int output exactly; float scores to 1e-5, the export's batch-invariance
promise: tests/test_export_savedmodel.py), and did fewer batches run than requests, holding the requests'
sentences (TensorFlow's profiler tells each batch a BatchFunction op runs, and its size: `conftest.batches_run`)?
The C++ loader's side, concurrent `Session::Run` calls in one session as TF Serving makes them:
tests/test_cpp_loader.py.
"""

import threading

import numpy as np
import pytest
import tensorflow as tf

from conftest import HOSTILE, HUGE_TEXT, batches_run, load_saved_model, multi30k_lines, needs_multi30k
from export.request_batching import DEFAULT_MAX_BATCH_SIZE, RequestBatching, batched, used_width

pytestmark = needs_multi30k


def _call(signatures, request):
    name, inputs = request
    return {k: v.numpy() for k, v in signatures[name](**{k: tf.constant(v) for k, v in inputs.items()}).items()}


def _all_at_once(signatures, requests):
    """Each request from its own thread, released together -> the answers in request order (an exception is the
    answer of a request that failed)."""
    barrier = threading.Barrier(len(requests))
    answers = [None] * len(requests)

    def client(i):
        barrier.wait()
        try:
            answers[i] = _call(signatures, requests[i])
        except Exception as e:  # noqa: BLE001  (a failed request is an answer too)
            answers[i] = e

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def _assert_same(got, alone, context):
    assert not isinstance(got, Exception), (context, got)
    assert set(got) == set(alone), context
    for key, expected in alone.items():
        assert got[key].shape == expected.shape, (context, key)
        if expected.dtype.kind == "f":
            np.testing.assert_allclose(got[key], expected, rtol=1e-5, atol=1e-6, err_msg=f"{context} {key}")
        else:
            assert got[key].tolist() == expected.tolist(), (context, key)


def _rows(request):
    return len(next(iter(request[1].values())))


def _concurrent_against_alone(exported, requests, merged=None):
    """Sends `requests` alone, then all at once; each answer must be its alone one. `merged`: how many of the
    requests go through the batching queues, the first ones (default all; a request of more than 64 sentences
    does not). The batches run must be fewer than the merged requests, and hold their sentences, each once.
    Returns the batches' sizes."""
    signatures = load_saved_model(exported).signatures
    alone = [_call(signatures, r) for r in requests]
    together, sizes = batches_run(lambda: _all_at_once(signatures, requests))
    for i, (got, expected) in enumerate(zip(together, alone)):
        _assert_same(got, expected, (i, requests[i][0]))
    merged = len(requests) if merged is None else merged
    assert 0 < len(sizes) < merged, (sizes, merged)
    assert sum(sizes) == sum(_rows(r) for r in requests[:merged]), sizes
    assert max(sizes) <= DEFAULT_MAX_BATCH_SIZE
    return sizes


def test_concurrent_clients_each_get_their_own_translation_from_fewer_batches(exported):
    """20 clients at once on `greedy`, each with one sentence, three of them hostile (empty, invalid UTF-8, 10,000
    characters), and one more client with 70 sentences, more than a batch holds: every client gets exactly the
    translation and `truncated` flag it gets alone (the score to 1e-5), the hostile ones change nothing for the
    others in their batch, the large request is answered whole (decoded on its own), and the 20 requests that
    could be merged ran in fewer batches than 20."""
    sentences = multi30k_lines("test_2016_flickr.en", 90)
    texts = [[s] for s in sentences[:17]] + [[""], [b"\xff\xfe\xfd"], [HUGE_TEXT]]
    requests = [("greedy", {"text": t}) for t in texts] + [("greedy", {"text": sentences[17:87]})]
    assert len(requests[-1][1]["text"]) > DEFAULT_MAX_BATCH_SIZE
    _concurrent_against_alone(exported, requests, merged=len(texts))
    # The hostile requests' answers, as the export promises alone: "" for nothing to translate, one string each.
    signatures = load_saved_model(exported).signatures
    assert _call(signatures, requests[17])["translation"].tolist() == [b""]
    assert _call(signatures, requests[19])["truncated"].tolist() == [True]


def test_every_decoding_signature_keeps_each_requests_own_inputs_and_options(exported):
    """Every decoding signature at once, three requests each, with their own options (sample's seed, temperature
    and top_k; prefix and greedy_prefix's prefixes; score's targets) and widths (align's pieces, translate_ids'
    ids): each gets exactly its answer alone, shapes included (a merged batch's wider rows are trimmed back to the
    request's own), from fewer batches than requests. Signatures never answer each other's requests: with
    `tf.nondifferentiable_batch_function`'s one queue name, `serving_default` and `greedy` share a queue and a
    call can come back with the other's answer."""
    s = multi30k_lines("test_2016_flickr.en", 12)
    de = multi30k_lines("test_2016_flickr.de", 12)
    signatures = load_saved_model(exported).signatures
    ids = [signatures["tokenize"](text=tf.constant(t))["source_ids"].numpy()
           for t in ([s[0]], s[1:3], [s[3], HOSTILE[3]])]
    requests = []
    for i in range(3):
        texts = s[i * 3:i * 3 + 1 + i % 2]  # one sentence, then two, then one
        n = len(texts)
        requests += [
            ("serving_default", {"text": texts}), ("greedy", {"text": texts}), ("n_best", {"text": texts}),
            ("sample", {"text": texts, "seed": np.arange(n, dtype=np.int64) + 7 * i,
                        "temperature": np.full(n, [0.5, 1.0, 1.5][i], np.float32),
                        "top_k": np.full(n, [0, 1, 20][i], np.int32)}),
            ("prefix", {"text": texts, "prefix": [["Ein Hund", "", "Zwei"][i]] * n}),
            ("greedy_prefix", {"text": texts, "prefix": [["Eine Frau", "Ein", ""][i]] * n}),
            ("score", {"text": texts, "target": de[i * 3:i * 3 + n]}),
            ("align", {"text": texts + [HOSTILE[0]] * (i == 2)}),
            ("translate_ids", {"source_ids": ids[i]}),
        ]
    _concurrent_against_alone(exported, requests)


def test_a_bad_temperature_fails_its_own_request_only(exported):
    """`sample` refuses a temperature <= 0 before the request joins a batch: sent at once with good requests,
    it fails alone, naming the temperature, and the others get their answers."""
    s = multi30k_lines("test_2016_flickr.en", 6)

    def sample(text, temperature):
        return ("sample", {"text": [text], "seed": np.array([3], np.int64),
                           "temperature": np.array([temperature], np.float32), "top_k": np.array([0], np.int32)})

    requests = [sample(text, 0.0 if i == 2 else 1.0) for i, text in enumerate(s)]
    signatures = load_saved_model(exported).signatures
    answers = _all_at_once(signatures, requests)
    assert isinstance(answers[2], tf.errors.InvalidArgumentError) and "temperature" in str(answers[2])
    for i in (0, 1, 3, 4, 5):
        _assert_same(answers[i], _call(signatures, requests[i]), i)


def test_request_batching_settings_are_checked():
    with pytest.raises(ValueError, match="max_batch_size must be an integer >= 1, got 0"):
        RequestBatching(max_batch_size=0)
    with pytest.raises(ValueError, match="timeout_micros must be an integer >= 0, got -1"):
        RequestBatching(timeout_micros=-1)
    with pytest.raises(ValueError, match="batch_threads"):
        RequestBatching(batch_threads=1.5)

    def fn(x):
        return {"y": x}

    assert batched(fn, [tf.TensorSpec([None], tf.int32)], None, "f") is fn  # no batching: the function itself


def test_used_width_counts_the_columns_some_row_uses():
    ids = tf.constant([[5, 3, 0, 0], [6, 7, 3, 0]])
    assert int(used_width(ids, 0)) == 3
    assert int(used_width(tf.zeros([2, 3], tf.int32), 0)) == 0
    assert int(used_width(tf.zeros([0, 3], tf.int32), 0)) == 0
    assert int(used_width(tf.constant([["a", ""], ["", ""]]), "")) == 1


def test_kt_export_batches_requests_by_default_and_prints_how(tmp_path, monkeypatch, capsys):
    """kt-export merges concurrent requests by default (batches of 64, no timeout) and says so;
    --max-request-batch and --request-batch-timeout-us set them, --max-request-batch 0 turns merging off, and
    negative values are refused. (`export` itself is replaced: what reaches it is what the SavedModel is built
    with.)"""
    import json

    import export.export_model as export_model

    received = []

    def fake_export(model_dir, export_dir, **kwargs):
        received.append(kwargs["request_batching"])
        return tmp_path / "exports" / "translator" / "1"

    monkeypatch.setattr(export_model, "export", fake_export)
    (tmp_path / "config.json").write_text(json.dumps({"training": {}}))
    common = ["--model-dir", str(tmp_path), "--export-dir", str(tmp_path / "exports"), "--parallel-loops", "1"]
    for flags, expected in [([], RequestBatching(64, 0)),
                            (["--max-request-batch", "8", "--request-batch-timeout-us", "500"], RequestBatching(8, 500)),
                            (["--max-request-batch", "0"], None)]:
        assert export_model.main(common + flags) == 0
        assert received.pop() == expected, flags
        out = capsys.readouterr().out
        line = next(line for line in out.splitlines() if "request batching" in line)
        assert ("off" in line) == (expected is None), line
        if expected:
            assert f"batches of up to {expected.max_batch_size} sentences" in line
            assert f"timeout {expected.timeout_micros} us" in line
        assert "tensorflow_model_server" in out and "--enable_batching" not in out
    for flag in ("--max-request-batch", "--request-batch-timeout-us"):
        with pytest.raises(SystemExit):
            export_model.main(common + [flag, "-1"])
        assert f"{flag} must be >= 0" in capsys.readouterr().err
    assert not received
