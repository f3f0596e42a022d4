"""The export loaded and run by TensorFlow's C++ API, the way TF Serving runs it.

tensorflow_model_server is C++: it links tensorflow-text's ops, loads a version with
`tensorflow::LoadSavedModel`, replays `assets.extra/tf_serving_warmup_requests`, then calls
`Session::Run` from many threads on one session. tests/cpp/serving_check.cc does the same with the
C++ library of the installed TensorFlow wheel. It is compiled here with g++ (tests skip without it)
into build/cpp/, once per source and TensorFlow version, and its answers are compared byte for byte
with the Python TF1 session loader's (conftest's `run_tf1`).
"""

import base64
import hashlib
import json
import os
import random
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_text

from conftest import HOSTILE, REPO, SUBPROCESS_ENV, TEXT_SIGNATURES, load_saved_model, multi30k_lines, needs_multi30k
from conftest import run_tf1, split_runs
from export.export_model import WARMUP_BATCHES, WARMUP_FILE

pytestmark = needs_multi30k

SOURCE = REPO / "tests" / "cpp" / "serving_check.cc"
BUILD_DIR = REPO / "build" / "cpp"
OPS_DIR = Path(tensorflow_text.__file__).parent / "python" / "ops"  # tensorflow-text's op libraries


def build_serving_check(build_dir=BUILD_DIR) -> Path:
    """serving_check compiled against the installed TensorFlow wheel; built once, named by a hash of its
    source, the TensorFlow version and the command. Skips the calling test when g++ is missing."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("No C++ compiler: g++ is not on PATH (install the g++ package, e.g. apt-get install g++)")
    tf_dir = Path(tf.__file__).parent
    # The wheel's compile flags (headers, C++ ABI, Eigen alignment). Linking: tensorflow_framework alone
    # (what tf.sysconfig suggests) lacks the session factory ("No session factory registered"), so
    # libtensorflow_cc too; the wheel has only the versioned names, hence -l:.
    flags = [*tf.sysconfig.get_compile_flags(), "-O1", "-w"]
    libs = [f"-L{tf_dir}", "-Wl,--no-as-needed", "-l:libtensorflow_cc.so.2", "-l:libtensorflow_framework.so.2",
            f"-Wl,-rpath,{tf_dir}"]
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([tf.__version__, *flags, *libs]).encode()).hexdigest()
    binary = Path(build_dir) / f"serving_check-{key[:16]}"
    if not binary.exists():
        binary.parent.mkdir(parents=True, exist_ok=True)
        tmp = binary.with_name(f"{binary.name}.tmp-{os.getpid()}")  # renamed when complete
        proc = subprocess.run([compiler, *flags, str(SOURCE), "-o", str(tmp), *libs], capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        os.replace(tmp, binary)
    return binary


@pytest.fixture(scope="session")
def serving_check():
    return build_serving_check()


def _hex(text):
    return (text if isinstance(text, bytes) else text.encode("utf-8")).hex()


def _input_value(value):
    """One value of a request's other input as serving_check reads it: strings in hex; floats as float.hex(),
    which strtod reads back to the same double (serving_check then rounds it to float32 as numpy does for
    run_tf1's feed); ints in decimal."""
    value = value.item() if hasattr(value, "item") else value
    if isinstance(value, (str, bytes)):
        return _hex(value)
    return value.hex() if isinstance(value, float) else str(int(value))


def run_serving_check(binary, saved_model, tmp_path, requests=(), *, warmup=False, threads=0):
    """[(signature, [texts])] through serving_check -> (its runs, in order, and its "concurrent" summary, whose
    "answers" are the concurrent runs, in request order). As with conftest's run_tf1, a request may have a third
    item, its other inputs: {input name: [values]}."""
    lines = []
    for i, (signature, texts, *extra) in enumerate(requests):
        lines.append(f"{i} {signature} {len(texts)}")
        lines += [_hex(t) for t in texts]
        inputs = extra[0] if extra else {}
        if inputs:  # a request with text only keeps the format without the "inputs" section
            lines.append(f"inputs {len(inputs)}")
            for name, values in inputs.items():
                lines += [f"{name} {len(values)}", *map(_input_value, values)]
    (tmp_path / "requests.txt").write_text("".join(line + "\n" for line in lines))
    args = [str(binary), str(saved_model), str(OPS_DIR), "--requests", str(tmp_path / "requests.txt")]
    args += ["--warmup"] * warmup + ["--threads", str(threads)] * bool(threads)
    proc = subprocess.run(args, capture_output=True, env=SUBPROCESS_ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-4000:]
    results = [json.loads(line) for line in proc.stdout.decode().splitlines()]
    concurrent = [r["concurrent"] for r in results if "concurrent" in r]
    answers = [r for r in results if r.get("label", "").startswith("concurrent:")]
    runs = [r for r in results if "concurrent" not in r and not r.get("label", "").startswith("concurrent:")]
    if concurrent:
        concurrent[0]["answers"] = answers
    return runs, (concurrent[0] if concurrent else None)


# The outputs that are float32 scores: under request batching a sentence's score in another batch may differ in
# its last bits (a product of another batch size sums in another order), so they compare to 1e-5, as the export
# promises (tests/test_export_savedmodel.py); every other output compares byte for byte.
FLOAT_OUTPUTS = ("score", "scores", "log_prob")


def floats(values):
    return [struct.unpack(">f", bytes.fromhex(v))[0] for v in values]


def assert_concurrent_answers_are_sequential_ones(runs, concurrent):
    """Every concurrent answer is the same request's sequential one: no error, the same outputs and shapes,
    every string, int and bool byte for byte, float scores to 1e-5."""
    assert concurrent["errors"] == []
    assert [a["label"] for a in concurrent["answers"]] == [f"concurrent:{r['label']}" for r in runs]
    for run, answer in zip(runs, concurrent["answers"]):
        got, expected = outputs(answer), outputs(run)
        assert set(got) == set(expected), run["label"]
        for key, values in expected.items():
            if key in FLOAT_OUTPUTS:
                assert floats(got[key]) == pytest.approx(floats(values), rel=1e-5, abs=1e-6), (run["label"], key)
            else:
                assert got[key] == values, (run["label"], key)


def outputs(run):
    """The outputs of one run as serving_check writes them: strings in hex, float32 bits in hex."""
    return {k: v for k, v in run.items() if k not in ("label", "signature")}


def tf1_outputs(run):
    """A conftest.run_tf1 run (base64 strings, floats, ints, bools; nested for 2-D outputs) in serving_check's
    form: flat values, strings in hex, floats as their bits in hex, ints and bools as they are. Every output is
    converted by its values' type, so any signature's outputs compare whole (log_prob, alignment, pieces...)."""

    def value(v):
        if isinstance(v, str):  # run_tf1 gives strings, and only strings, as base64 text
            return base64.b64decode(v).hex()
        if isinstance(v, float):  # a float32 output: its float64 from tolist() is exact, so are its 32 bits
            return struct.pack(">f", v).hex()
        return v

    out = {}
    for key, values in run.items():
        if key.endswith("_shape"):
            out[key] = values
        else:  # dtype=object: ravel without turning ints into floats or bools into ints
            out[key] = [value(v) for v in np.ravel(np.array(values, dtype=object)).tolist()]
    return out


def translations(run):
    return [bytes.fromhex(t) for t in run["translation"]]


def scores(run):
    return [struct.unpack(">f", bytes.fromhex(s))[0] for s in run["score"]]


def warmup_records(saved_model):
    """The export's warm-up file as [(signature, [texts])], in order, read as PredictionLogs (TF Serving's format)."""
    from tensorflow_serving.apis import prediction_log_pb2

    records = []
    for raw in tf.data.TFRecordDataset(str(Path(saved_model) / WARMUP_FILE)).as_numpy_iterator():
        request = prediction_log_pb2.PredictionLog.FromString(raw).predict_log.request
        assert request.model_spec.name == "translator" and list(request.inputs) == ["text"]
        records.append((request.model_spec.signature_name,
                        [t.decode() for t in tf.make_ndarray(request.inputs["text"])]))
    return records


def _signature_texts():
    """The texts of the sample/prefix/score/align test: 10 Multi30k sentences and the hostile inputs."""
    return multi30k_lines("test_2016_flickr.en", 10) + HOSTILE


def _shared_parts():
    """{test: (its requests to the C++ loader, those of them the TF1 session answers too)}, for `shared_runs`."""
    sentences = multi30k_lines("test_2016_flickr.en", 50)
    serve = [(sig, texts) for sig in TEXT_SIGNATURES for texts in (sentences, HOSTILE, [])]
    serve += [("greedy", multi30k_lines("val.en", 512)), ("n_best", sentences[:20] + HOSTILE), ("n_best", [])]
    empty = [("score", [], {"target": []}), ("align", [])]
    texts, good = sentences[:3], sampling_inputs(3)
    refused = [("sample", texts, {**good, "temperature": [1.0, 0.0, 1.5]}),
               ("sample", texts, {**good, "beam_size": [4, 4, 4]}),  # not an input of the signature
               ("sample", texts, {**good, "top_k": [0.5, 1.0, 5.0]}),  # floats for an int32 input
               ("sample", texts)]  # no seed, temperature, top_k
    served = [("sample", texts, good), ("greedy", texts), ("prefix", texts, {"prefix": ["Ein"] * 3})]
    s0, s1 = sentences[:2]
    blank = ["", " ", "\t\n", "\u00a0\u3000"]  # the tokenizer's normalization turns Unicode spaces to spaces
    blanks = [(sig, batch) for sig in TEXT_SIGNATURES for batch in ([blank[0], s0, *blank[1:], s1], [s0], [s1], blank)]
    # The sample/prefix test's score targets: serving_default's translations of its texts (TF1 session only).
    targets = [("serving_default", _signature_texts())]
    return {"serve": (serve, serve), "empty": (empty, empty),
            "refused": (refused[:1] + served + refused[1:] + served, served), "blank": (blanks, []),
            "targets": ([], targets)}


@pytest.fixture(scope="module")
def shared_runs(serving_check, exported, tmp_path_factory):
    """One serving_check run and one TF1 session run that answer the requests of the tests below that need no
    request threads (and, in the TF1 run alone, the sample/prefix test's score targets), as {test: (requests,
    C++ runs, TF1 runs of its Python requests)}, and "warmup": (records, their C++ replays, their TF1 runs).
    The C++ loader replays the warm-up records, then runs every test's requests in turn in one session, as TF
    Serving's one session answers whatever arrives. Why shared: each loader's start and load of the export takes
    longer than most of these tests' requests."""
    tmp = tmp_path_factory.mktemp("cpp-shared")
    parts, records = _shared_parts(), warmup_records(exported)
    named = {"warmup": (records, records), **parts}  # the C++ loader replays the records first; the TF1 run sends them
    requests = [r for cpp_requests, _ in parts.values() for r in cpp_requests]
    python_requests = [r for _, python_part in named.values() for r in python_part]
    cpp, _ = run_serving_check(serving_check, exported, tmp, requests, warmup=True)
    python = run_tf1(exported, python_requests, tmp)["runs"]
    cpp_runs = split_runs(cpp, {name: len(cpp_requests) for name, (cpp_requests, _) in named.items()})
    python_runs = split_runs(python, {name: len(python_part) for name, (_, python_part) in named.items()})
    return {name: (cpp_requests, cpp_runs[name], python_runs[name]) for name, (cpp_requests, _) in named.items()}


def test_serving_check_builds_once_and_skips_without_a_compiler(serving_check, monkeypatch, tmp_path):
    """Must-show 3: the binary is reused while its source and TensorFlow are unchanged; without g++ the
    tests skip, saying which package to install (README.md's Install section names it too)."""
    mtime = serving_check.stat().st_mtime_ns
    assert build_serving_check() == serving_check and serving_check.stat().st_mtime_ns == mtime
    assert serving_check.parent == BUILD_DIR
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++ on it
    with pytest.raises(pytest.skip.Exception, match=r"No C\+\+ compiler: g\+\+ .*install the g\+\+ package"):
        build_serving_check(tmp_path)
    assert "apt-get install g++" in (REPO / "README.md").read_text(encoding="utf-8")


def test_cpp_loader_serves_what_the_python_session_serves(shared_runs):
    """Must-show 1: LoadSavedModel + Session::Run in C++ give byte for byte the TF1 Python session's
    translations and scores, on 50 Multi30k sentences and hostile input, both text signatures."""
    requests, cpp, python = shared_runs["serve"]
    assert [r["signature"] for r in cpp] == [sig for sig, _ in requests]
    for (signature, texts), got, expected in zip(requests, cpp, python):
        assert "error" not in got, got["error"]
        assert outputs(got) == tf1_outputs(expected), (signature, len(texts))
        if signature == "n_best":
            assert got["translations_shape"] == got["scores_shape"] == [len(texts), 4]
        else:
            assert got["translation_shape"] == got["score_shape"] == [len(texts)]
    assert all(translations(cpp[0])) and len(set(translations(cpp[0]))) > 10  # real, varied translations


def sampling_inputs(n):
    """The sample signature's other inputs for `n` texts: per-row seeds (negative and beyond 32 bits too: any
    int64 is a seed), temperatures 0.7, 1.0 and 1.5 and top-k 0 (every token), 1 and 5, in all 9 pairs."""
    return {"seed": [(-1) ** i * (i * 2**33 + 17 * i + 5) for i in range(n)],
            "temperature": [(0.7, 1.0, 1.5)[i % 3] for i in range(n)],
            "top_k": [(0, 1, 5)[i // 3 % 3] for i in range(n)]}


def test_cpp_loader_serves_the_sample_prefix_score_and_align_signatures(serving_check, exported, shared_runs,
                                                                        tmp_path):
    """The signatures with more inputs than text (sample: seed int64, temperature float32, top_k int32; prefix,
    greedy_prefix and score: a second string) and with 2-D int32 and string outputs (align): the C++ loader, fed
    every input with the dtype its signature declares, answers byte for byte as the TF1 Python session does, every
    output compared, on 10 Multi30k sentences with the hostile inputs (and on an empty batch: sample and prefix
    here, score and align in the next test); none fails; each output has its documented shape; and run again from
    2 threads at once, every answer is the same."""
    texts = _signature_texts()
    n = len(texts)
    german = multi30k_lines("test_2016_flickr.de", 10)
    prefixes = ["", "Ein Hund", "Eine Frau", "", "Zwei Männer", "Ein", "", "Ein kleines Mädchen", "Ein Mann", ""]
    prefixes += ["Ein Hund", "", "Eine", b"Ein \xff", "", "Zwei", "Ein", ""]  # one with invalid UTF-8 (replaced)
    _, _, (best,) = shared_runs["targets"]  # serving_default on `texts`, in the shared TF1 session run
    best_translations = [base64.b64decode(t) for t in best["translation"]]  # bytes: hostile rows too
    requests = [
        ("sample", texts, sampling_inputs(n)),
        ("sample", [], sampling_inputs(0)),
        ("prefix", texts, {"prefix": prefixes}),
        ("prefix", [], {"prefix": []}),
        ("greedy_prefix", texts, {"prefix": prefixes}),
        # Scoring serving_default's own translations, and arbitrary German (the hostile texts as targets too:
        # empty, invalid UTF-8, longer than the model's limit).
        ("score", texts, {"target": best_translations}),
        ("score", texts, {"target": german + HOSTILE[::-1]}),
        ("align", texts),
    ]
    cpp, concurrent = run_serving_check(serving_check, exported, tmp_path, requests, threads=2)
    python = run_tf1(exported, requests, tmp_path)["runs"]
    assert [r["signature"] for r in cpp] == [r[0] for r in requests]
    for (signature, sent, *_), got, expected in zip(requests, cpp, python):
        assert "error" not in got, (signature, got["error"])
        assert outputs(got) == tf1_outputs(expected), (signature, len(sent))
        batch = len(sent)
        if signature == "score":
            assert set(outputs(got)) == {"score", "score_shape", "log_prob", "log_prob_shape", "truncated",
                                         "truncated_shape"}
            assert got["score_shape"] == got["log_prob_shape"] == got["truncated_shape"] == [batch]
        else:
            assert got["translation_shape"] == got["score_shape"] == got["truncated_shape"] == [batch]
    assert_concurrent_answers_are_sequential_ones(cpp, concurrent)

    sampled, _, prefixed, _, greedy_prefixed, _, _, aligned = cpp
    assert all(translations(sampled)[:10]) and all(translations(prefixed)[:10])  # real translations, not ""
    assert all(translations(greedy_prefixed)[:10])
    # align: one source piece index per output piece, -1 exactly at the output's padding, and its translation
    # is serving_default's (the same beam search).
    batch, length = aligned["alignment_shape"]
    assert aligned["target_pieces_shape"] == [batch, length] and batch == n
    assert aligned["source_pieces_shape"][0] == n
    source_length = aligned["source_pieces_shape"][1]
    pieces = [bytes.fromhex(p) for p in aligned["target_pieces"]]
    assert all((i == -1) == (p == b"") and -1 <= i < source_length for i, p in zip(aligned["alignment"], pieces))
    assert translations(aligned) == best_translations


def test_cpp_loader_answers_an_empty_batch_of_score_and_align(shared_runs):
    """A batch of 0 texts, which TF Serving passes on as any other: score and align answer it with outputs of
    batch 0, without error, and as the Python session does. (They failed before `score_targets` and
    `align_targets` took sources and targets of length 0, the shapes of an empty batch.)"""
    _, cpp, python = shared_runs["empty"]
    assert [r.get("error") for r in cpp] == [None, None]
    assert [outputs(r) for r in cpp] == [tf1_outputs(r) for r in python]
    assert cpp[0]["score_shape"] == cpp[0]["log_prob_shape"] == [0]
    assert cpp[1]["alignment_shape"][0] == cpp[1]["target_pieces_shape"][0] == cpp[1]["source_pieces_shape"][0] == 0


def test_a_refused_request_gets_an_error_answer_and_the_loader_serves_on(shared_runs):
    """A sample request with a temperature of 0 is refused by the graph's own check: the C++ loader answers it
    with an error that names the temperature, as TF Serving would answer the client, without crashing, and the
    same session then answers the next requests as the Python session does. A request that feeds an input the
    signature does not have, a value not of the input's dtype, or no value for an input fails alone too."""
    requests, cpp, python = shared_runs["refused"]
    served = requests[1:1 + len(python)]
    temperature, errors = cpp[0], cpp[1 + len(served):1 + len(served) + 3]
    assert "temperature must be > 0" in temperature.get("error", "")
    assert "beam_size" in errors[0].get("error", "") and "top_k" in errors[1].get("error", "")
    assert "error" in errors[2]
    for got in cpp[1:1 + len(served)], cpp[-len(served):]:  # before and after the other refused requests
        assert [outputs(r) for r in got] == [tf1_outputs(r) for r in python]


def test_cpp_loader_runs_the_xla_decoder(serving_check, xla_exported, xla_tf1_runs, tmp_path):
    """An export with an XLA decoder for small batches (`kt-export --xla-max-batch`; TF Serving runs it with
    --xla_cpu_compilation_enabled): the C++ loader compiles and runs it, and answers byte for byte as the
    Python session does, hostile input included, at batches on both sides of the threshold."""
    requests, python = xla_tf1_runs["cpp_loader"]
    cpp, _ = run_serving_check(serving_check, xla_exported, tmp_path, requests)
    for (signature, texts), got, expected in zip(requests, cpp, python, strict=True):
        assert "error" not in got, got["error"]
        assert outputs(got) == tf1_outputs(expected), (signature, len(texts))
    assert all(translations(cpp[1])) and translations(cpp[2])[:3] == [b""] * 3


def test_empty_and_whitespace_inputs_translate_to_empty(shared_runs, exported):
    """Must-show 2: nothing to translate gives "" and score 0, in C++ and in Python, and the other rows
    of the batch translate as they do alone."""
    requests, cpp, _ = shared_runs["blank"]
    loaded = load_saved_model(exported)
    for (signature, texts), got in zip(requests, cpp):
        python = loaded.signatures[signature](text=tf.constant(texts))
        assert translations(got) == python["translation"].numpy().tolist()
        assert scores(got) == pytest.approx(python["score"].numpy().tolist(), abs=1e-6)
    for mixed, alone0, alone1, blanks in (cpp[:4], cpp[4:]):
        assert translations(blanks) == [b""] * 4 and scores(blanks) == [0.0] * 4
        got = translations(mixed)
        assert [got[i] for i in (0, 2, 3, 4)] == [b""] * 4 and [scores(mixed)[i] for i in (0, 2, 3, 4)] == [0.0] * 4
        assert got[1] == translations(alone0)[0] != b"" and got[5] == translations(alone1)[0] != b""
        assert [scores(mixed)[i] for i in (1, 5)] == pytest.approx([scores(alone0)[0], scores(alone1)[0]], abs=1e-4)


def test_concurrent_session_runs_answer_like_sequential_ones(serving_check, exported, tmp_path):
    """8 threads send 24 requests each (both text signatures, batches of 1 to 64 sentences, and one of 70, more
    than a merged batch holds) at once to one session, as TF Serving's request threads do; every answer equals
    the same request's answer when run alone (the translation and `truncated` byte for byte, the score to 1e-5)
    and none fails; and the export merged the concurrent requests (kt-export's default): TensorFlow's batching
    metric counts fewer batches than requests, holding every sentence of the requests it merged."""
    pool = multi30k_lines("test_2016_flickr.en", 50)
    rng = random.Random(4)
    threads, per_thread = 8, 24
    # Mostly small batches, as online traffic is (log-uniform in 1..8), plus batches of 16, 32 and 64:
    # 192 requests, ~750 sentences, each run alone and then concurrently: every thread's requests run
    # beside the other seven threads'; more requests of the same mix only repeat such overlaps.
    sizes = [1, 64, 32, 16, 70] + [round(2 ** rng.uniform(0, 3)) for _ in range(threads * per_thread - 5)]
    rng.shuffle(sizes)
    requests = [(TEXT_SIGNATURES[i % 2], rng.sample(pool * 2, n)) for i, n in enumerate(sizes)]
    runs, concurrent = run_serving_check(serving_check, exported, tmp_path, requests, threads=threads)
    assert not [r for r in runs if "error" in r]
    assert concurrent["requests"] == len(requests) and concurrent["threads"] == threads
    assert_concurrent_answers_are_sequential_ones(runs, concurrent)
    batches = {int(size): count for size, count in concurrent["batches"].items()}
    merged = len(requests) - 1  # the request of 70 decodes on its own
    assert 0 < sum(batches.values()) < merged, batches
    assert sum(size * count for size, count in batches.items()) == sum(sizes) - 70, batches


def test_warmup_requests_are_written_and_replay(shared_runs):
    """Must-show 5: the export's TF Serving warm-up file holds PredictionLogs for both text signatures
    (batches of 1 and 8); serving_check reads them as the model server does, and each replays without
    error and with the Python session's answers."""
    from tensorflow_serving.apis import model_pb2, predict_pb2, prediction_log_pb2

    records, replayed, python = shared_runs["warmup"]
    assert records == WARMUP_BATCHES
    assert {sig for sig, _ in records} == set(TEXT_SIGNATURES) and {len(t) for _, t in records} == {1, 8}

    # The field numbers serving_check reads the records with.
    def number(message, field):
        return message.DESCRIPTOR.fields_by_name[field].number

    entry = predict_pb2.PredictRequest.DESCRIPTOR.fields_by_name["inputs"].message_type
    assert (number(prediction_log_pb2.PredictionLog, "predict_log"), number(prediction_log_pb2.PredictLog, "request"),
            number(predict_pb2.PredictRequest, "model_spec"), number(model_pb2.ModelSpec, "signature_name"),
            number(predict_pb2.PredictRequest, "inputs"), entry.fields_by_name["key"].number,
            entry.fields_by_name["value"].number) == (6, 1, 1, 3, 2, 1, 2)

    assert [r["label"] for r in replayed] == [f"warmup:{i}" for i in range(len(records))]
    assert [r["signature"] for r in replayed] == [sig for sig, _ in records]
    for got, expected in zip(replayed, python):
        assert "error" not in got, got["error"]
        assert outputs(got) == tf1_outputs(expected)
