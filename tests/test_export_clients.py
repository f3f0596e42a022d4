"""The export's clients, as users call them: `export.client`'s RestClient and GrpcClient, and `kt-translate`
over a file, in process (`--saved-model`) and through a server (`--server`).

TF Serving's binary cannot be installed here: `stand_in_server` answers its REST and gRPC APIs in process
from the quick model's export (conftest's `exported`); tests/test_export_serving.py queries the real model
server where it is installed. What the export itself computes is tests/test_export_savedmodel.py's.
"""

import base64
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from conftest import COMMAND_ENV, LONG_TEXT, REPO, TF_LOG_LINE
from conftest import load_saved_model, needs_multi30k, write_lines
from conftest import multi30k_lines as _lines

pytestmark = needs_multi30k


def _json_value(value):
    """One row of an output as TF Serving's REST API writes it (strings as text, arrays as lists)."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.ndarray):
        return [_json_value(v) for v in value]
    return value.item()


def test_kt_translate_cli(exported, tmp_path):
    """kt-translate over a file (a base directory resolves to its latest version): input order kept,
    blank lines stay blank, invalid UTF-8 translated, same translations as the signature itself (beam search,
    serving_default; --greedy: the mode test below). Run as from a user's shell, it prints the progress bar and
    none of TensorFlow's log lines (oneDNN's graph rewrite logs one at ERROR level as the beam search first runs,
    on CPUs where oneDNN is on)."""
    sentences = _lines("val.en", 40)[20:]
    lines = [s.encode("utf-8") for s in sentences[:3]] + [b"", b"\xff broken"] + [s.encode() for s in sentences[3:]]
    source = tmp_path / "in.en"
    source.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "out.de"
    proc = subprocess.run([sys.executable, "-m", "export.translate", "--saved-model", str(exported.parent),
                           "--input", str(source), "--output", str(out), "--batch-size", "8", "--scores"],
                          capture_output=True, text=True, env=COMMAND_ENV, cwd=str(REPO), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sent" in proc.stderr  # the progress bar: more lines than one batch
    assert not TF_LOG_LINE.search(proc.stderr), proc.stderr[-3000:]
    rows = out.read_text(encoding="utf-8").split("\n")
    assert rows[-1] == "" and len(rows) == len(lines) + 1
    rows = [row.split("\t", 1) for row in rows[:-1]]
    assert rows[3] == ["", ""]  # the blank line
    loaded = load_saved_model(exported)
    nonblank = [line for line in lines if line]
    expected = loaded.signatures["serving_default"](text=tf.constant(nonblank))
    expected_text = [t.decode("utf-8") for t in expected["translation"].numpy().tolist()]
    got = [row for row in rows if row != ["", ""]]
    assert [t for _, t in got] == expected_text
    # kt-translate's scores (batches of 8) against the signature's over one batch of them all.
    np.testing.assert_allclose([float(s) for s, _ in got], expected["score"].numpy(), atol=1e-3)


@pytest.fixture(scope="module")
def stand_in_server(exported):
    """The export behind TF Serving's REST and gRPC APIs, in process (the real model server cannot be
    installed here; tests/test_export_serving.py uses it where it is). It exercises the clients'
    requests: row-format JSON with b64 binary strings and a signature's other inputs beside `text` in each
    instance, and the tensorflow_serving protos, each input's dtype the signature's. A failed signature call
    is answered as TF Serving answers it: HTTP 400 with `{"error": message}`, gRPC INVALID_ARGUMENT."""
    import http.server
    import threading

    from google.protobuf import json_format
    from tensorflow.core.protobuf import saved_model_pb2

    loaded = load_saved_model(exported)
    sm = saved_model_pb2.SavedModel()
    sm.ParseFromString((exported / "saved_model.pb").read_bytes())
    signature_defs = sm.meta_graphs[0].signature_def
    calls, call_inputs = [], []

    def input_dtype(signature, name):
        if signature not in signature_defs:
            raise ValueError(f'Serving signature name: "{signature}" not found in signature def')
        if name not in signature_defs[signature].inputs:
            raise ValueError(f"signature {signature} has no input {name!r}")
        return tf.as_dtype(signature_defs[signature].inputs[name].dtype)

    def outputs(signature, texts, inputs=None):
        """Every output of the signature, as TF Serving returns them. `inputs`: its other inputs, name -> one
        value per text."""
        inputs = inputs or {}
        calls.append((signature, list(texts)))
        call_inputs.append({name: list(values) for name, values in inputs.items()})
        tensors = {name: tf.constant(values, dtype=input_dtype(signature, name)) for name, values in inputs.items()}
        out = loaded.signatures[signature](text=tf.constant(texts, dtype=input_dtype(signature, "text")), **tensors)
        return {k: v.numpy() for k, v in out.items()}

    def run(signature, texts):
        out = outputs(signature, texts)
        return out["translation"].tolist(), out["score"].tolist()

    def rest_column(dtype, name, values):
        """One input's JSON values as TF Serving reads them for `dtype`."""
        if dtype == tf.string:
            return [base64.b64decode(v["b64"]) if isinstance(v, dict) else v.encode("utf-8") for v in values]
        if dtype.is_integer and not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise ValueError(f"input {name!r} is {dtype.name}: JSON integers expected, got {values}")
        if dtype.is_floating and not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise ValueError(f"input {name!r} is {dtype.name}: JSON numbers expected, got {values}")
        return values

    class Rest(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, code, body):
            data = json.dumps(body).encode("utf-8")
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/v1/models/translator":
                self._send(200, {"model_version_status": [{"version": exported.name, "state": "AVAILABLE"}]})
            elif self.path == "/v1/models/translator/metadata":
                sig_map = {k: json_format.MessageToDict(v, preserving_proto_field_name=True)
                           for k, v in signature_defs.items()}
                self._send(200, {"model_spec": {"name": "translator", "version": exported.name},
                                 "metadata": {"signature_def": {"signature_def": sig_map}}})
            else:
                self._send(404, {"error": "Servable not found"})

        def do_POST(self):
            if self.path != "/v1/models/translator:predict":
                return self._send(404, {"error": "Servable not found"})
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            signature = body.get("signature_name", "serving_default")
            # A bare value (or {"b64": ...}) is the `text` input; else the instance names its inputs.
            instances = [t if isinstance(t, dict) and "b64" not in t else {"text": t} for t in body["instances"]]
            try:
                if any(set(instance) != set(instances[0]) for instance in instances):
                    raise ValueError("every instance must have the same named inputs")
                columns = {name: rest_column(input_dtype(signature, name), name, [t[name] for t in instances])
                           for name in instances[0]}
                out = outputs(signature, columns.pop("text"), columns)
            except (tf.errors.OpError, TypeError, ValueError) as e:
                return self._send(400, {"error": getattr(e, "message", None) or str(e)})
            self._send(200, {"predictions": [{k: _json_value(v[i]) for k, v in out.items()}
                                             for i in range(len(instances))]})

    rest = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Rest)
    threading.Thread(target=rest.serve_forever, daemon=True).start()

    grpc_target = None
    try:
        from concurrent import futures

        import grpc
        from tensorflow_serving.apis import get_model_metadata_pb2, predict_pb2, prediction_service_pb2_grpc
    except ImportError:
        grpc = None
    if grpc is not None:
        class Prediction(prediction_service_pb2_grpc.PredictionServiceServicer):
            def Predict(self, request, context):
                assert request.model_spec.name == "translator"
                signature = request.model_spec.signature_name or "serving_default"
                try:
                    for name, tensor in request.inputs.items():
                        if tensor.dtype != input_dtype(signature, name).as_datatype_enum:
                            raise ValueError(f"input {name!r} must be {input_dtype(signature, name).name}, got "
                                             f"{tf.as_dtype(tensor.dtype).name}")
                    inputs = {name: tf.make_ndarray(tensor).tolist() for name, tensor in request.inputs.items()}
                    out = outputs(signature, inputs.pop("text"), inputs)
                except (tf.errors.OpError, TypeError, ValueError) as e:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, getattr(e, "message", None) or str(e))
                response = predict_pb2.PredictResponse()
                for name, value in out.items():
                    response.outputs[name].CopyFrom(tf.make_tensor_proto(value))
                return response

            def GetModelMetadata(self, request, context):
                assert list(request.metadata_field) == ["signature_def"]
                response = get_model_metadata_pb2.GetModelMetadataResponse()
                response.model_spec.name = request.model_spec.name
                sig_map = get_model_metadata_pb2.SignatureDefMap()
                for k, v in signature_defs.items():
                    sig_map.signature_def[k].CopyFrom(v)
                response.metadata["signature_def"].Pack(sig_map)
                return response

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(Prediction(), server)
        grpc_target = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        server.start()
    try:
        yield {"rest": f"http://127.0.0.1:{rest.server_address[1]}", "grpc": grpc_target, "run": run,
               "calls": calls, "inputs": call_inputs, "loaded": loaded}
    finally:
        rest.shutdown()
        rest.server_close()
        if grpc is not None:
            server.stop(0)


def test_rest_client_and_kt_translate_server_mode(stand_in_server, tmp_path, capsys):
    from export import translate as translate_cli
    from export.client import RestClient, ServingError

    texts = _lines("val.en", 3) + ["", b"\xff\xfe broken"]
    expected, expected_scores = stand_in_server["run"]("serving_default",
                                                       [t if isinstance(t, bytes) else t.encode() for t in texts])
    expected = [t.decode("utf-8") for t in expected]

    rest = RestClient(stand_in_server["rest"], "translator")
    translations, scores = rest.translate_with_scores(texts)
    assert translations == expected
    np.testing.assert_allclose(scores, expected_scores, rtol=1e-6)
    # The invalid UTF-8 went over JSON as {"b64": ...} and arrived byte for byte.
    assert stand_in_server["calls"][-1] == ("serving_default", [t if isinstance(t, bytes) else t.encode()
                                                                for t in texts])
    assert rest.translate([]) == []
    assert rest.translate(texts[:1], signature="greedy") == [
        t.decode() for t in stand_in_server["run"]("greedy", [texts[0].encode()])[0]]
    signature = rest.metadata()["metadata"]["signature_def"]["signature_def"]["serving_default"]
    assert set(signature["inputs"]) == {"text"} and set(signature["outputs"]) == {"translation", "score", "truncated"}
    assert rest.status()["model_version_status"][0]["state"] == "AVAILABLE"
    with pytest.raises(ServingError, match="404"):
        RestClient(stand_in_server["rest"], "no-such-model").translate(["x"])

    # kt-translate --server: through the REST client, batched, order kept.
    source = tmp_path / "in.en"
    source.write_text("\n".join(_lines("val.en", 5)) + "\n", encoding="utf-8")
    out = tmp_path / "out.de"
    assert translate_cli.main(["--server", stand_in_server["rest"], "--input", str(source), "--output", str(out),
                               "--batch-size", "2", "--no-progress"]) == 0
    expected5 = [t.decode() for t in stand_in_server["run"]("serving_default",
                                                            [s.encode() for s in _lines("val.en", 5)])[0]]
    assert out.read_text(encoding="utf-8") == "".join(t + "\n" for t in expected5)

    # A source longer than the model's limit: the client reports it, kt-translate names its line.
    assert rest.translate_batch([texts[0], LONG_TEXT, ""]).truncated == [False, True, False]
    n_best = rest.n_best(texts[:2])
    assert [row[0] for row in n_best.translations] == expected[:2] and len(n_best.scores[0]) == 4
    source.write_text("\n".join(_lines("val.en", 2) + ["", LONG_TEXT]) + "\n", encoding="utf-8")
    assert translate_cli.main(["--server", stand_in_server["rest"], "--input", str(source), "--output", str(out),
                               "--no-progress"]) == 0
    assert translate_cli.truncation_warning([4]) in capsys.readouterr().err


def test_grpc_client(stand_in_server):
    pytest.importorskip("tensorflow_serving.apis", reason="GrpcClient needs tensorflow-serving-api "
                        "(pip install tensorflow-serving-api)")
    from export.client import GrpcClient

    texts = _lines("val.en", 3) + ["", b"\xff\xfe broken"]
    expected, expected_scores = stand_in_server["run"]("serving_default",
                                                       [t if isinstance(t, bytes) else t.encode() for t in texts])
    expected = [t.decode("utf-8") for t in expected]

    client = GrpcClient(stand_in_server["grpc"], "translator")
    try:
        translations, scores = client.translate_with_scores(texts)
        assert stand_in_server["calls"][-1] == ("serving_default", [t if isinstance(t, bytes) else t.encode()
                                                                    for t in texts])
        assert translations == expected
        np.testing.assert_allclose(scores, expected_scores, rtol=1e-6)
        assert client.translate([]) == []
        assert set(client.metadata().signature_def["serving_default"].outputs) == {"translation", "score", "truncated"}
        assert client.translate_batch([texts[0], LONG_TEXT]).truncated == [False, True]
        n_best = client.n_best(texts[:2])
        assert [row[0] for row in n_best.translations] == expected[:2] and len(n_best.scores[0]) == 4
    finally:
        client.close()


# Inputs of the new client methods: a non-UTF-8 text and an empty one among real sentences.
def _method_texts():
    return _lines("val.en", 3) + ["", b"\xff\xfe broken"]


def _as_bytes(texts):
    return [t if isinstance(t, bytes) else t.encode("utf-8") for t in texts]


def _signature_call(loaded, signature, texts, **inputs):
    """The loaded SavedModel's signature on `texts`, its other inputs as given (lists of one value per text, in
    the signature's dtypes): name -> numpy array."""
    fn = loaded.signatures[signature]
    specs = fn.structured_input_signature[1]
    tensors = {name: tf.constant(values, dtype=specs[name].dtype) for name, values in inputs.items()}
    return {k: v.numpy() for k, v in fn(text=tf.constant(_as_bytes(texts), dtype=tf.string), **tensors).items()}


def _expected_translated(out):
    from export.client import TranslatedBatch

    return TranslatedBatch([t.decode("utf-8") for t in out["translation"].tolist()], out["score"].tolist(),
                           out["truncated"].tolist())


def _expected_aligned(out):
    """The align signature's outputs, as AlignedBatch promises them: padding (-1, "") dropped."""
    from export.client import AlignedBatch

    return AlignedBatch(*_expected_translated(out),
                        [[(int(s), j) for j, s in enumerate(row) if s != -1] for row in out["alignment"].tolist()],
                        [[p.decode("utf-8") for p in row if p] for row in out["source_pieces"].tolist()],
                        [[p.decode("utf-8") for p in row if p] for row in out["target_pieces"].tolist()])


def _client(stand_in_server, transport):
    from export.client import RestClient

    if transport == "rest":
        return RestClient(stand_in_server["rest"], "translator")
    pytest.importorskip("tensorflow_serving.apis", reason="GrpcClient needs tensorflow-serving-api "
                        "(pip install tensorflow-serving-api)")
    from export.client import GrpcClient

    return GrpcClient(stand_in_server["grpc"], "translator")


@pytest.mark.parametrize("transport", ["rest", "grpc"])
def test_sample_prefix_score_and_align_clients_return_the_signatures_outputs(stand_in_server, transport):
    """RestClient's and GrpcClient's sample, translate_with_prefix, score and align return exactly the loaded
    SavedModel's signature outputs for the same inputs (a non-UTF-8 text and an empty one among them; the extra
    inputs per text or one for all; invalid UTF-8 in a prefix too), in their NamedTuples with the padding
    dropped; an empty batch gives empty results without a request."""
    from export.client import AlignedBatch, ScoredBatch, TranslatedBatch

    loaded = stand_in_server["loaded"]
    texts = _method_texts()
    client = _client(stand_in_server, transport)
    try:
        # sample: one seed, temperature and top_k per text, then one for all.
        settings = {"seed": [11, 12, 13, 14, 2 ** 40 + 15], "temperature": [0.7, 1.0, 1.5, 1.0, 0.9],
                    "top_k": [0, 5, 1, 0, 3]}
        got = client.sample(texts, **settings)
        assert got == _expected_translated(_signature_call(loaded, "sample", texts, **settings))
        assert stand_in_server["calls"][-1] == ("sample", _as_bytes(texts))
        sent = stand_in_server["inputs"][-1]  # as the server read them, in the signature's dtypes
        assert sent["seed"] == settings["seed"] and sent["top_k"] == settings["top_k"]
        np.testing.assert_array_equal(np.float32(sent["temperature"]), np.float32(settings["temperature"]))
        assert got.translations[3] == "" and got.scores[3] == 0.0  # the empty text
        assert client.sample(texts, seed=4) == _expected_translated(_signature_call(
            loaded, "sample", texts, seed=[4] * 5, temperature=[1.0] * 5, top_k=[0] * 5))

        # translate_with_prefix: str and bytes prefixes, "" (plain beam search) and invalid UTF-8.
        prefixes = ["Ein", "", "Zwei Männer", "Ein", b"\xff"]
        got = client.translate_with_prefix(texts, prefixes)
        assert got == _expected_translated(_signature_call(loaded, "prefix", texts, prefix=_as_bytes(prefixes)))
        assert stand_in_server["inputs"][-1] == {"prefix": _as_bytes(prefixes)}
        assert got.translations[0].startswith("Ein") and got.translations[2].startswith("Zwei Männer")

        # score: the translations serving_default gives, an empty target and an invalid UTF-8 one.
        targets = [t.decode("utf-8") for t in stand_in_server["run"]("serving_default", _as_bytes(texts[:3]))[0]]
        targets += ["Ein Hund.", b"\xfe kaputt"]
        got = client.score(texts, targets)
        out = _signature_call(loaded, "score", texts, target=_as_bytes(targets))
        assert got == ScoredBatch(out["score"].tolist(), out["log_prob"].tolist(), out["truncated"].tolist())
        assert stand_in_server["inputs"][-1] == {"target": _as_bytes(targets)}

        # align
        got = client.align(texts)
        expected = _expected_aligned(_signature_call(loaded, "align", texts))
        assert got == expected
        assert [len(a) for a in got.alignments] == [len(p) for p in got.target_pieces]  # one pair per piece
        assert got.source_pieces[3] == ["</s>"] and got.target_pieces[3] == [] and got.alignments[3] == []
        assert all(pieces[-1] == "</s>" for pieces in got.target_pieces[:3] + got.source_pieces)
        assert got.translations == _expected_translated(_signature_call(loaded, "serving_default", texts)).translations

        # An empty batch: empty results, what the signature gives, without a request.
        n_calls = len(stand_in_server["calls"])
        assert client.sample([]) == TranslatedBatch([], [], []) == _expected_translated(_signature_call(
            loaded, "sample", [], seed=[], temperature=[], top_k=[]))
        assert client.translate_with_prefix([], []) == TranslatedBatch([], [], []) == _expected_translated(
            _signature_call(loaded, "prefix", [], prefix=[]))
        out = _signature_call(loaded, "score", [], target=[])
        assert client.score([], []) == ScoredBatch([], [], []) == ScoredBatch(
            out["score"].tolist(), out["log_prob"].tolist(), out["truncated"].tolist())
        assert client.align([]) == AlignedBatch([], [], [], [], [], []) == _expected_aligned(
            _signature_call(loaded, "align", []))
        assert len(stand_in_server["calls"]) == n_calls
    finally:
        if transport == "grpc":
            client.close()
    with pytest.raises(ValueError, match="seed: 2 values for 5 texts"):
        client.sample(texts, seed=[1, 2])
    with pytest.raises(ValueError, match="prefixes: 4 values for 5 texts"):
        client.translate_with_prefix(texts, prefixes[:4])


def test_a_temperature_of_zero_is_a_serving_error_naming_it(stand_in_server):
    """The sample signature refuses a temperature of 0 (InvalidArgument); over REST the server answers HTTP 400
    with its message, which RestClient raises as a ServingError; over gRPC the RpcError is INVALID_ARGUMENT."""
    from export.client import RestClient, ServingError

    texts = _lines("val.en", 2)
    with pytest.raises(ServingError, match="temperature") as error:
        RestClient(stand_in_server["rest"], "translator").sample(texts, temperature=[1.0, 0.0])
    assert "HTTP 400" in str(error.value)
    if stand_in_server["grpc"] is not None:
        import grpc

        client = _client(stand_in_server, "grpc")
        try:
            with pytest.raises(grpc.RpcError) as error:
                client.sample(texts, temperature=0.0)
        finally:
            client.close()
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in error.value.details()


def test_kt_translate_modes_in_process_and_through_the_server_write_the_same_files(exported, stand_in_server,
                                                                                    tmp_path, one_load_per_export):
    """kt-translate --sample, --prefix, --greedy --prefix, --score and --align write the same file in process
    (--saved-model) and through --server (RestClient), blank lines blank; --score writes the signature's score
    and log_prob, --prefix translations begin with their prefix (with --greedy: the greedy_prefix signature's
    translations, a blank prefix's the greedy signature's), --align 'translation ||| i-j ...' with
    serving_default's translation."""
    from export import translate as translate_cli

    lines = _lines("val.en", 4)[:2] + [""] + _lines("val.en", 4)[2:] + [b"\xff broken"]
    source = write_lines(tmp_path / "in.en", lines)
    prefixes = write_lines(tmp_path / "prefix.de", ["Ein", "Zwei", "", "", "Eine Frau", "Ein"])
    targets = _lines("val.de", 4)[:2] + [""] + _lines("val.de", 4)[2:] + ["Kaputt."]
    targets_file = write_lines(tmp_path / "targets.de", targets)
    modes = {"sample": ["--sample", "--temperature", "0.8", "--top-k", "10", "--seed", "5"],
             "prefix": ["--prefix", str(prefixes)], "greedy_prefix": ["--greedy", "--prefix", str(prefixes)],
             "score": ["--score", str(targets_file)], "align": ["--align"]}
    written = {}
    for mode, flags in modes.items():
        for where in (["--saved-model", str(exported)], ["--server", stand_in_server["rest"]]):
            out = tmp_path / f"{mode}-{where[0][2:]}.txt"
            assert translate_cli.main(where + ["--input", str(source), "--output", str(out), "--batch-size", "3",
                                               "--no-progress"] + flags) == 0
            written.setdefault(mode, []).append(out.read_text(encoding="utf-8"))
        assert stand_in_server["calls"][-1][0] == mode  # through --server: the mode's own signature
        in_process, served = written[mode]
        assert in_process == served, mode
        rows = in_process.split("\n")
        assert len(rows) == len(lines) + 1 and rows[2] == "" and rows[-1] == "", mode
    nonblank = [i for i, line in enumerate(lines) if line]
    rows = {mode: texts[0].split("\n")[:-1] for mode, texts in written.items()}

    scored = _signature_call(stand_in_server["loaded"], "score", [lines[i] for i in nonblank],
                             target=[targets[i].encode() for i in nonblank])
    # The file holds 4 decimals of sums computed in batches of 3, the reference in one batch of 5: float32 sums of
    # other batch shapes may differ in their last bits, and so flip a 4th decimal (seen on an AMX Xeon).
    assert all(re.fullmatch(r"-?\d+\.\d{4}\t-?\d+\.\d{4}", rows["score"][i]) for i in nonblank)
    np.testing.assert_allclose([[float(x) for x in rows["score"][i].split("\t")] for i in nonblank],
                               np.stack([scored["score"], scored["log_prob"]], axis=1), rtol=0, atol=2e-4)
    assert rows["prefix"][0].startswith("Ein") and rows["prefix"][1].startswith("Zwei")
    assert rows["prefix"][4].startswith("Eine Frau")
    prefixed = [i for i in nonblank if i != 3]  # line 3's prefix is blank
    greedy_prefix = _expected_translated(_signature_call(
        stand_in_server["loaded"], "greedy_prefix", [lines[i] for i in prefixed],
        prefix=[_as_bytes(["Ein", "Zwei", "", "", "Eine Frau", "Ein"])[i] for i in prefixed])).translations
    assert [rows["greedy_prefix"][i] for i in prefixed] == greedy_prefix
    assert rows["greedy_prefix"][0].startswith("Ein") and rows["greedy_prefix"][4].startswith("Eine Frau")
    greedy = _expected_translated(_signature_call(stand_in_server["loaded"], "greedy", [lines[3]])).translations
    assert rows["greedy_prefix"][3] == greedy[0]
    beam = _expected_translated(_signature_call(stand_in_server["loaded"], "serving_default",
                                                [lines[i] for i in nonblank])).translations
    assert [rows["align"][i].split(" ||| ")[0] for i in nonblank] == beam
    for i in nonblank:
        pairs = rows["align"][i].split(" ||| ")[1].split()
        assert pairs and all(re.fullmatch(r"\d+-\d+", pair) for pair in pairs)


def test_kt_translate_sample_is_the_same_in_any_batch_and_changes_with_the_seed(exported, stand_in_server,
                                                                                tmp_path, one_load_per_export):
    """kt-translate --sample: line i is sampled with seed SEED + i, so a line gets the same sample with
    --batch-size 1 as with 32 (other lines, other order around it), and the sample signature's for that seed
    alone; another --seed changes at least one line."""
    from export import translate as translate_cli

    lines = _lines("val.en", 12)[:6] + [""] + _lines("val.en", 12)[6:]
    source = write_lines(tmp_path / "in.en", lines)

    def sampled(*flags):
        out = tmp_path / "out.de"
        assert translate_cli.main(["--saved-model", str(exported), "--input", str(source), "--output", str(out),
                                   "--no-progress", "--sample", *flags]) == 0
        return out.read_text(encoding="utf-8").split("\n")[:-1]

    one_by_one, batched = sampled("--batch-size", "1", "--seed", "7"), sampled("--batch-size", "32", "--seed", "7")
    assert one_by_one == batched and len(batched) == len(lines) and batched[6] == ""
    alone = _signature_call(stand_in_server["loaded"], "sample", [lines[9]], seed=[7 + 9], temperature=[1.0],
                            top_k=[0])
    assert batched[9] == alone["translation"][0].decode("utf-8")
    other_seed = sampled("--seed", "8")
    assert other_seed[6] == "" and other_seed != batched


def test_word_alignment_joins_pieces_into_words():
    """--align's conversion: a piece starting with "\u2581" begins a word (and the first piece does, marker or
    not), the other pieces belong to the word before; pairs with "</s>" on either side are left out; the pairs
    are distinct and sorted, written as Pharaoh 'i-j'."""
    from export.client import AlignedBatch
    from export.translate import _aligned_lines, pharaoh, piece_words, word_alignment

    source = ["\u2581T", "wo", "\u2581", "dog", "s", "\u2581run", ".", "</s>"]  # Two dogs run.
    target = ["Zw", "ei", "\u2581Hund", "e", "\u2581rennen", ".", "</s>"]  # Zwei Hunde rennen.
    assert piece_words(source) == [0, 0, 1, 1, 1, 2, 2, None]
    assert piece_words(target) == [0, 0, 1, 1, 2, 2, None]
    alignment = [(1, 0), (0, 1), (3, 2), (4, 3), (5, 4), (7, 5), (6, 6)]
    assert word_alignment(alignment, source, target) == [(0, 0), (1, 1), (2, 2)]
    assert word_alignment([(2, 4), (0, 0)], source, target) == [(0, 0), (1, 2)]
    assert pharaoh([(0, 0), (1, 1), (2, 2)]) == "0-0 1-1 2-2" and pharaoh([]) == ""
    batch = AlignedBatch(["Zwei Hunde rennen.", ""], [-1.5, 0.0], [False, False], [alignment, []],
                         [source, ["</s>"]], [target, []])
    assert _aligned_lines(batch) == (["Zwei Hunde rennen. ||| 0-0 1-1 2-2", " ||| "], [-1.5, 0.0], [False, False])


def test_kt_translate_refuses_mismatched_line_counts_and_flags_that_do_not_go_together(exported, tmp_path,
                                                                                        capsys):
    """--prefix and --score files must have one line per input line (the error names both counts); the modes
    exclude each other and --signature, and --greedy but for --prefix (refused, naming both flags, not ignored),
    --temperature/--top-k/--seed need --sample, a temperature must be > 0: argparse errors (exit 2), before any
    model is loaded."""
    from export import translate as translate_cli

    source = write_lines(tmp_path / "in.en", ["A dog.", "", "Two cats."])
    short = write_lines(tmp_path / "short.de", ["Ein Hund.", ""])
    base = ["--saved-model", str(tmp_path / "no-model-here"), "--input", str(source)]
    for flag, word in (("--prefix", "prefix"), ("--score", "target")):
        with pytest.raises(SystemExit) as exit_:
            translate_cli.main(base + [flag, str(short)])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"{flag} {short} has 2 line(s), the input 3" in err and f"one {word} per input line" in err
    refused = {("--sample", "--n-best"): "not allowed with argument",
               ("--align", "--score", str(short)): "not allowed with argument",
               ("--sample", "--greedy"): "--greedy does not go with --sample: --sample calls the sample signature",
               ("--greedy", "--score", str(short)): "--greedy does not go with --score",
               ("--align", "--greedy"): "--greedy does not go with --align",
               ("--align", "--signature", "greedy"): "--signature does not go with --align: --align calls the align "
                                                     "signature",
               ("--prefix", str(short), "--signature", "greedy"): "--signature does not go with --prefix",
               ("--score", str(short), "--scores"): "--score writes lines of its own: drop --scores",
               ("--temperature", "0.5"): "--temperature goes with --sample",
               ("--top-k", "3", "--align"): "--top-k goes with --sample",
               ("--sample", "--temperature", "0"): "--temperature must be > 0",
               ("--sample", "--top-k", "-1"): "--top-k must be >= 0",
               ("--prefix", str(tmp_path / "missing.de")): "--prefix " + str(tmp_path / "missing.de")}
    for flags, message in refused.items():
        with pytest.raises(SystemExit) as exit_:
            translate_cli.main(base + list(flags))
        assert exit_.value.code == 2, flags
        err = capsys.readouterr().err
        assert "kt-translate: error:" in err and message in err, (flags, err)


def test_kt_translate_n_best_writes_the_moses_format(exported, tmp_path, capsys, one_load_per_export):
    from export import translate as translate_cli

    lines = _lines("val.en", 3) + [""] + _lines("val.en", 5)[3:]
    out = tmp_path / "out.de"
    assert translate_cli.main(["--saved-model", str(exported), "--input", str(write_lines(tmp_path / "in.en", lines)),
                               "--output", str(out), "--no-progress", "--n-best"]) == 0
    rows = [line.split(" ||| ") for line in out.read_text(encoding="utf-8").splitlines()]
    assert [int(r[0]) for r in rows] == [i for i in (0, 1, 2, 4, 5) for _ in range(4)]  # the blank line: none
    loaded = load_saved_model(exported)
    expected = loaded.signatures["n_best"](text=tf.constant([line for line in lines if line]))
    assert [r[1] for r in rows] == [t.decode() for t in expected["translations"].numpy().ravel().tolist()]
    np.testing.assert_allclose([float(r[2]) for r in rows], expected["scores"].numpy().ravel(), atol=1e-4)
    assert translate_cli.main(["--saved-model", str(exported), "--n-best", "--greedy"]) == 2
    assert "--n-best writes every hypothesis" in capsys.readouterr().err


def test_kt_translate_warns_naming_the_truncated_lines(exported, tmp_path, capsys, one_load_per_export):
    from export import translate as translate_cli

    lines = [LONG_TEXT] + _lines("val.en", 3) + ["", LONG_TEXT]
    source = write_lines(tmp_path / "in.en", lines)
    assert translate_cli.main(["--saved-model", str(exported), "--input", str(source), "--output",
                               str(tmp_path / "out.de"), "--no-progress", "--greedy"]) == 0
    err = capsys.readouterr().err
    assert translate_cli.truncation_warning([1, 6]) in err
    assert "2 line(s) longer than the model's limit" in err and "line(s) 1, 6" in err


