"""Must-show 5: the export served by the real TF Serving model server.

Runs only where `tensorflow_model_server` is on PATH (apt package
`tensorflow-model-server`, or inside the `tensorflow/serving` image); it is
skipped elsewhere. The server is started on free ports and queried on
127.0.0.1 over REST (`:predict` with `instances`, `/metadata`) and gRPC
(`Predict`, with the `tensorflow-serving-api` package).
"""

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from conftest import needs_multi30k

SERVER = shutil.which("tensorflow_model_server")
MODEL_NAME = "translator"

pytestmark = [
    pytest.mark.skipif(SERVER is None, reason="tensorflow_model_server is not on PATH: TF Serving's model server "
                       "binary (apt package tensorflow-model-server, or the tensorflow/serving Docker image) "
                       "is needed to serve the export for real"),
    needs_multi30k,
]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(quick_model_dir, tmp_path_factory):
    """(export base dir, version dir, REST url, gRPC target) of a running model server."""
    from export.export_model import export

    version_dir = export(quick_model_dir, tmp_path_factory.mktemp("exports"), name=MODEL_NAME)
    grpc_port, rest_port = _free_port(), _free_port()
    log = open(tmp_path_factory.mktemp("server") / "server.log", "wb")
    server = subprocess.Popen(
        [SERVER, f"--port={grpc_port}", f"--rest_api_port={rest_port}", f"--model_name={MODEL_NAME}",
         f"--model_base_path={version_dir.parent.resolve()}"],
        stdout=log, stderr=subprocess.STDOUT)
    rest = f"http://127.0.0.1:{rest_port}"
    try:
        deadline = time.time() + 180
        while True:
            if server.poll() is not None:
                pytest.fail(f"tensorflow_model_server exited with {server.returncode}; log: {log.name}")
            try:
                with urllib.request.urlopen(f"{rest}/v1/models/{MODEL_NAME}", timeout=5) as resp:
                    if b'"AVAILABLE"' in resp.read():
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.time() > deadline:
                pytest.fail(f"model not AVAILABLE after 180 s; log: {log.name}")
            time.sleep(1)
        yield version_dir, rest, f"127.0.0.1:{grpc_port}"
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def _in_process(version_dir, texts, signature="serving_default"):
    import tensorflow as tf
    import tensorflow_text  # noqa: F401

    out = tf.saved_model.load(str(version_dir)).signatures[signature](text=tf.constant(texts))
    return [t.decode("utf-8") for t in out["translation"].numpy().tolist()], out["score"].numpy()


SENTENCES = ["A man is riding a bike down the street.", "Two dogs play in the snow.", "A girl in a red dress."]


def test_rest_predict_instances(served):
    from export.client import RestClient

    version_dir, rest, _ = served
    client = RestClient(rest, MODEL_NAME)
    translations, scores = client.translate_with_scores(SENTENCES)
    expected, expected_scores = _in_process(version_dir, SENTENCES)
    assert translations == expected
    np.testing.assert_allclose(scores, expected_scores, rtol=1e-4, atol=1e-4)
    # The plain row format of the docs' curl example: {"instances": ["...", ...]}.
    request = urllib.request.Request(f"{rest}/v1/models/{MODEL_NAME}:predict",
                                     data=json.dumps({"instances": SENTENCES}).encode("utf-8"))
    with urllib.request.urlopen(request, timeout=60) as resp:
        predictions = json.loads(resp.read())["predictions"]
    assert [p["translation"] for p in predictions] == expected
    greedy, _ = client.translate_with_scores(SENTENCES, signature="greedy")
    assert greedy == _in_process(version_dir, SENTENCES, "greedy")[0]
    # Bad input over the wire: one string each, no error.
    long_text = "A dog runs on the beach. " * 400
    bad = ["", "   ", long_text, b"\xff\xfe invalid utf-8"]
    assert len(client.translate(bad)) == len(bad)


def test_rest_metadata_shows_the_signature(served):
    from export.client import RestClient

    _, rest, _ = served
    meta = RestClient(rest, MODEL_NAME).metadata()
    assert meta["model_spec"]["name"] == MODEL_NAME
    signature = meta["metadata"]["signature_def"]["signature_def"]["serving_default"]
    assert set(signature["inputs"]) == {"text"}
    assert set(signature["outputs"]) == {"translation", "score", "truncated"}
    assert signature["inputs"]["text"]["dtype"] == "DT_STRING"
    assert signature["outputs"]["translation"]["dtype"] == "DT_STRING"
    assert signature["outputs"]["score"]["dtype"] == "DT_FLOAT"


def test_grpc_predict(served):
    pytest.importorskip("tensorflow_serving.apis", reason="the gRPC client needs tensorflow-serving-api")
    from export.client import GrpcClient

    version_dir, _, target = served
    client = GrpcClient(target, MODEL_NAME)
    try:
        translations, scores = client.translate_with_scores(SENTENCES)
        signatures = client.metadata()
    finally:
        client.close()
    expected, expected_scores = _in_process(version_dir, SENTENCES)
    assert translations == expected
    np.testing.assert_allclose(scores, expected_scores, rtol=1e-4, atol=1e-4)
    assert set(signatures.signature_def["serving_default"].outputs) == {"translation", "score", "truncated"}
