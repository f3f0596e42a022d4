"""Fixtures and helpers shared by the tests (test modules never import each other).

Loaded on every backend (tests/portable runs under KERAS_BACKEND=jax and torch without TensorFlow installed):
numpy, keras and keras_transformer only at module level (and on TensorFlow, TensorFlow itself, imported quietly
before keras imports it); TensorFlow's API only inside what the TF suite alone calls (the quick model, the TF1
loader script).
"""

import atexit
import base64
import csv
import fcntl
import json
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# Under CI=true, a skip that is not on tests/ci_skips.py's list of expected skips fails.
pytest_plugins = ["ci_skips"]

if os.environ.get("KERAS_BACKEND", "tensorflow") == "tensorflow":
    # On TensorFlow, `import keras` loads TensorFlow, whose C++ start-up lines ("oneDNN custom operations are
    # on", "Could not find cuda drivers") are written before TF_CPP_MIN_LOG_LEVEL applies, and each xdist
    # worker's came out at the end of the run's log. Import it as the commands do.
    from common.native_logs import import_tensorflow_quietly

    import_tensorflow_quietly()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import keras_transformer as kt  # noqa: E402
from keras_transformer.text import END_ID, START_ID  # noqa: E402

VOCAB = 40
REPO = Path(__file__).resolve().parents[1]
# The one rule for the data: $KT_MULTI30K_DIR, else ../shared/data/multi30k beside the repository.
MULTI30K = Path(os.environ.get("KT_MULTI30K_DIR") or REPO.parent / "shared" / "data" / "multi30k")
needs_multi30k = pytest.mark.skipif(not (MULTI30K / "train.en").is_file(), reason=f"Multi30k not found in {MULTI30K}")
# For subprocesses that import the project from this checkout.
SUBPROCESS_ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(REPO)}
# As a user's shell runs a command: TensorFlow's log level not set, so the command's own setting is what shows.
COMMAND_ENV = {k: v for k, v in SUBPROCESS_ENV.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
# An absl log line of TensorFlow's C++ ("I0000 00:00:1795909414.482418   21382 tf_record_dataset_op.cc:396] ..."),
# at any level; not only at a line's start, as it may follow a progress bar's "\r".
TF_LOG_LINE = re.compile(r"[IWEF]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w.]+:\d+\]")
QUICK_MODEL_MAX_SENTENCE_LENGTH = 64  # the quick model's, config.json's max_source_length
# More pieces than the quick model's source limit (QUICK_MODEL_MAX_SENTENCE_LENGTH), however the vocabulary cuts
# it.
LONG_TEXT = "A dog runs along the beach while two children watch. " * 20
# 10,000 characters: far over any model's length limit, and a large request.
HUGE_TEXT = ("A dog runs along the beach while two children watch. " * 200)[:10_000]
# What a server must answer without failing: blanks, HUGE_TEXT, invalid UTF-8, NUL bytes.
HOSTILE = ["", " ", "\t \n ", HUGE_TEXT, b"\xff\xfe\xfd", b"ok \x80 bytes", "a\x00b", "\x00"]
TEXT_SIGNATURES = ("serving_default", "greedy")  # the export's signatures that take text alone
# The interpreter of each Keras backend's virtualenv (the TF suite runs in its own), and the make target that
# creates it: JAX and PyTorch each have one without TensorFlow.
BACKEND_VENVS = {
    "tensorflow": (Path(sys.executable), "venv"),
    "jax": (REPO / ".venv-jax" / "bin" / "python", "venv-jax"),
    "torch": (REPO / ".venv-torch" / "bin" / "python", "venv-torch"),
}


REMOVED_SCRIPTS_HEADING = "## One-off investigation scripts removed from bench/"


def removed_bench_scripts():
    """The names of the scripts that docs/benchmarks-log.md's table "One-off investigation scripts removed from
    bench/" lists (`ffn_activity.py`, ...): the documentation still cites them, and their commands, from the
    commits the table names, which hold them."""
    log = (REPO / "docs" / "benchmarks-log.md").read_text(encoding="utf-8")
    assert REMOVED_SCRIPTS_HEADING in log, f"docs/benchmarks-log.md has no section {REMOVED_SCRIPTS_HEADING!r}"
    section = log.split(REMOVED_SCRIPTS_HEADING, 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([\w.-]+)` \|", section, re.MULTILINE))


def backend_python(backend):
    """The python of `backend`'s virtualenv, to run with KERAS_BACKEND=backend; skips the test when that
    virtualenv has not been made (`make venv-jax`, `make venv-torch`)."""
    python, target = BACKEND_VENVS[backend]
    if backend != "tensorflow" and not (python.parents[1] / ".installed").is_file():
        pytest.skip(f"no {backend} virtualenv ({python.parents[1].name}): `make {target}` creates it")
    return python


def run_on_backend(backend, script, *args, cwd, timeout=900):
    """Runs the Python `script` with `args` in a fresh interpreter of `backend`'s virtualenv under
    KERAS_BACKEND=backend (tests/ importable, for conftest's helpers); fails the test if it fails."""
    python = backend_python(backend)
    env = {**SUBPROCESS_ENV, "KERAS_BACKEND": backend, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    proc = subprocess.run([str(python), "-c", script, *map(str, args)], capture_output=True, text=True, env=env,
                          cwd=str(cwd), timeout=timeout)
    assert proc.returncode == 0, f"on {backend}:\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.fixture(autouse=True)
def seeded():
    keras.utils.set_random_seed(1234)
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.fixture
def tiny_model():
    """A built tiny model with a shared vocabulary of VOCAB ids."""
    model = kt.Transformer.from_preset("tiny", vocab_size=VOCAB)
    model.build()
    return model


def built_once(tmp_path_factory, name, build):
    """`build(folder) -> path` run once for the whole test run, also when pytest-xdist splits it among worker
    processes (`make test` does): the first worker to ask builds into a folder they all share while the others
    wait on a lock, then every worker gets the same path. For session fixtures the tests only read."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # each worker's base temp is a sibling in one folder of the run
    done = root / f"{name}.built"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_file():
            folder = root / name
            shutil.rmtree(folder, ignore_errors=True)  # what a worker's failed build left
            folder.mkdir()
            done.write_text(str(build(folder)), encoding="utf-8")  # written only once the build succeeded
    return Path(done.read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def quick_model_dir(tmp_path_factory):
    """A model directory as kt-train writes it, trained in about a minute (see bench/quick_model.py)."""
    if not (MULTI30K / "train.en").is_file():
        pytest.skip(f"Multi30k not found in {MULTI30K}")
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))  # bench/ is no installed package
    from bench.quick_model import build_quick_model_dir

    return built_once(tmp_path_factory, "quick-en-de", lambda folder: build_quick_model_dir(
        folder, MULTI30K, lines=2000, vocab_size=400, steps=200,
        max_sentence_length=QUICK_MODEL_MAX_SENTENCE_LENGTH))


def random_ids(rng, batch, length, low=4, high=VOCAB):
    """Token ids with no padding (ids 0-3 are pad/unk/start/end by convention)."""
    return rng.integers(low, high, size=(batch, length)).astype("int32")


def copy_task(rng, n, length=6, vocab=16):
    """Source: random tokens then END_ID; target: START_ID + the same tokens + END_ID."""
    tokens = rng.integers(4, vocab, size=(n, length)).astype("int32")
    end = np.full((n, 1), END_ID, "int32")
    source = np.concatenate([tokens, end], axis=1)
    target_in = np.concatenate([np.full((n, 1), START_ID, "int32"), tokens], axis=1)
    target_out = np.concatenate([tokens, end], axis=1)
    return (source, target_in), target_out


def user_functional_model(vocab=VOCAB, d_model=16, num_heads=2, d_ff=32):
    """A user's own functional model: a classifier and a tagger built from our layers (every kind of layer once,
    post-norm and pre-norm), ((source [b, s], target [b, t]) ids -> [b, t, 3])."""
    source = keras.Input(shape=(None,), dtype="int32", name="source")
    target = keras.Input(shape=(None,), dtype="int32", name="target")
    embedding = kt.PositionalEmbedding(vocab, d_model, dropout=0.1)
    memory = kt.Encoder(2, d_model, num_heads, d_ff)(embedding(source))
    memory = kt.EncoderLayer(d_model, num_heads, d_ff, norm_first=True)(memory)
    x = kt.DecoderLayer(d_model, num_heads, d_ff)(embedding(target), memory)
    x = kt.Decoder(1, d_model, num_heads, d_ff, norm_first=True)(x, memory)
    x = kt.FeedForward(d_model, d_ff)(x)
    x = kt.MultiHeadAttention(num_heads=num_heads, key_dim=d_model // num_heads)(x, memory)
    return keras.Model([source, target], keras.layers.Dense(3)(x))


# A decoder-only (GPT-style) language model from the library's layers, and the pattern it learns in the tests.
PATTERN_VOCAB, PERIOD, PATTERN_LENGTH = 12, 2, 16


def gpt_model(vocab=VOCAB, d_model=16, num_heads=2, d_ff=32, num_layers=2, norm_first=False):
    """A user's functional language model: ids -> PositionalEmbedding -> Decoder without cross-attention -> Dense."""
    ids = keras.Input(shape=(None,), dtype="int32", name="ids")
    embedding = kt.PositionalEmbedding(vocab, d_model, name="embedding")
    decoder = kt.Decoder(num_layers, d_model, num_heads, d_ff, dropout=0.0, norm_first=norm_first,
                         use_cross_attention=False, name="decoder")
    projection = keras.layers.Dense(vocab, name="projection")
    return keras.Model(ids, projection(decoder(embedding(ids))))


def gpt_layers(model):
    """The embedding, decoder and output projection of a `gpt_model`, as kt.greedy_generate takes them."""
    return model.get_layer("embedding"), model.get_layer("decoder"), model.get_layer("projection")


def repeated_patterns(rng, n):
    """Rows `a b a b ...` of PATTERN_LENGTH tokens, a and b drawn uniformly from ids 1..11 (0 is padding)."""
    pattern = rng.integers(1, PATTERN_VOCAB, size=(n, PERIOD))
    return np.tile(pattern, (1, PATTERN_LENGTH // PERIOD)).astype("int32")


@pytest.fixture(scope="module")
def trained_lm():
    """A 2-layer d_model=32 `gpt_model` fitted for 3 epochs (48 steps) on 512 `repeated_patterns` rows: a few
    seconds. (model, last epoch's loss)."""
    keras.utils.set_random_seed(0)
    data = repeated_patterns(np.random.default_rng(0), 512)
    model = gpt_model(vocab=PATTERN_VOCAB, d_model=32, num_heads=4, d_ff=64)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=kt.MaskedSparseCategoricalCrossentropy(0.0))
    history = model.fit(data[:, :-1], data[:, 1:], batch_size=32, epochs=3, verbose=0)
    return model, history.history["loss"][-1]


def multi30k_lines(name, n):
    """The first `n` lines of a Multi30k file, e.g. multi30k_lines("val.en", 100)."""
    return (MULTI30K / name).read_text(encoding="utf-8").split("\n")[:n]


def write_lines(path, lines):
    """`lines` (str, written as UTF-8, or bytes, written as they are: invalid UTF-8 too), one per line, to
    `path` (returned)."""
    path.write_bytes(b"".join((line if isinstance(line, bytes) else line.encode("utf-8")) + b"\n" for line in lines))
    return path


def history_rows(model_dir):
    """Every row of MODEL_DIR/history.csv (Keras' CSVLogger; a resumed run appends, so an epoch may repeat), in
    order, as dicts of strings: `[{"epoch": "0", "loss": ..., ...}, ...]`."""
    with open(Path(model_dir) / "history.csv", newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def two_batch_epochs_args(tmp_path, model_dir):
    """kt-train flags for a `tiny` run into `model_dir` on Multi30k's first 200 training pairs (written under
    `tmp_path`): a 400-piece vocabulary, epochs of 2 batches of 400 tokens, warm-up 10, no validation, quiet."""
    src, tgt = (write_lines(tmp_path / f"s.{lang}", multi30k_lines(f"train.{lang}", 200)) for lang in ("en", "de"))
    return ["--preset", "tiny", "--train-files", str(src), str(tgt), "--vocab-size", "400", "--model-dir",
            str(model_dir), "--tokens-per-batch", "400", "--steps-per-epoch", "2", "--warmup-steps", "10",
            "--no-validation", "--verbose", "0"]


def as_recorded_before_the_renames(model_dir, dest):
    """`dest` (returned): a model directory with `model_dir`'s config.json as kt-train recorded it before the
    renames of common.run_dir.RENAMED_SETTINGS (the "training" keys "alpha" and "max_length" for "length_penalty"
    and "max_sentence_length", and the source limit as "max_length", not "max_source_length"), and `model_dir`'s
    tokenizer if it has one; not its model (pass the commands `--model-file MODEL_DIR/model.keras`)."""
    from common.run_dir import RENAMED_SETTINGS

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    old_name = {renamed.new: old for old, renamed in RENAMED_SETTINGS.items()}
    config["training"] = {old_name.get(k, k): v for k, v in config["training"].items()}
    if "max_source_length" in config:
        config["max_length"] = config.pop("max_source_length")
    assert "alpha" in config["training"], "model_dir recorded no length_penalty"
    (dest / "config.json").write_text(json.dumps(config), encoding="utf-8")
    if (Path(model_dir) / "tokenizer.model").is_file():
        shutil.copy(Path(model_dir) / "tokenizer.model", dest / "tokenizer.model")
    return dest


# Runs in an interpreter of its own that imports only tensorflow and tensorflow_text, like the model server
# (which links TensorFlow's and tensorflow-text's kernels and nothing of Python). It loads one export into one
# session, as TF Serving does, then answers request files, one path per line on stdin, one JSON line each on stdout.
TF1_SCRIPT = r"""
import base64, json, sys, traceback
import tensorflow as tf
import tensorflow_text  # noqa: F401  (registers the sentencepiece ops, as TF Serving links them)


def answer(sess, meta_graph, signatures, requests):
    # (tensorflow imports keras itself for tf.keras; none of the project's Python is imported)
    modules = sorted({m.split(".")[0] for m in sys.modules} & {"keras_transformer", "common", "training", "export", "tf_keras"})
    results = {"loaded_python_modules": modules, "signatures": signatures, "runs": []}
    for signature_name, texts, extra in requests:
        if signature_name not in signatures:  # (indexing the protobuf map would add it, empty)
            raise KeyError(f"no signature {signature_name!r}: the export has {signatures}")
        sig = meta_graph.signature_def[signature_name]
        fetches = {k: v.name for k, v in sig.outputs.items()}
        feed = {sig.inputs["text"].name: [base64.b64decode(t) for t in texts]}
        for name, (kind, values) in extra.items():  # more inputs: strings base64-encoded, numbers as they are
            feed[sig.inputs[name].name] = [base64.b64decode(v) for v in values] if kind == "strings" else values
        out = sess.run(fetches, feed)
        run = {}
        for k, v in out.items():
            if v.dtype == object:  # strings, flattened ([batch] or [batch, n]); the shape is beside them
                run[k] = [base64.b64encode(x).decode("ascii") for x in v.ravel().tolist()]
            else:
                run[k] = v.tolist()
            run[k + "_shape"] = list(v.shape)
        results["runs"].append(run)
    return results


with tf.compat.v1.Session(graph=tf.Graph()) as sess:
    meta_graph = tf.compat.v1.saved_model.loader.load(sess, ["serve"], sys.argv[1])
    signatures = sorted(meta_graph.signature_def)
    for line in sys.stdin:
        try:
            results = answer(sess, meta_graph, signatures, json.load(open(line.strip())))
        except Exception:  # the failing request's test fails with this; the session goes on serving the others
            results = {"error": traceback.format_exc()[-4000:]}
        print(json.dumps(results), flush=True)
"""

# The TF1 sessions of this test process, by (saved_model.pb path, its mtime): (process, its stderr file).
_TF1_SESSIONS = {}


@atexit.register
def _close_tf1_sessions():
    for proc, stderr in _TF1_SESSIONS.values():
        try:
            proc.stdin.close()
        except OSError:  # it had died
            pass
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(stderr.parent, ignore_errors=True)


def _b64(text):
    return base64.b64encode(text if isinstance(text, bytes) else text.encode("utf-8")).decode("ascii")


def _extra_inputs(extra):
    """{input name: [values]} -> {name: ("strings", [base64]) or ("numbers", [values])}, as TF1_SCRIPT reads them."""
    return {name: ("strings", [_b64(v) for v in values]) if values and isinstance(values[0], (str, bytes))
            else ("numbers", [v.item() if hasattr(v, "item") else v for v in values])
            for name, values in extra.items()}


def split_runs(runs, sizes):
    """The runs of requests that were sent in one go, cut back into each part's: `sizes` is {part: its number of
    requests}, in the order they were sent (one run per request) -> {part: its runs}; every run belongs to a part."""
    parts, start = {}, 0
    for name, size in sizes.items():
        parts[name] = runs[start:start + size]
        start += size
    assert start == len(runs), f"{len(runs)} runs for {start} requests"
    return parts


def run_tf1(saved_model, requests, tmp_path):
    """[(signature, [texts (str or bytes)])] -> the outputs of each run (strings base64-encoded), through the TF1
    session loader TF Serving uses, in an interpreter that imports nothing but TensorFlow and tensorflow-text. A
    request may have a third item, its other inputs: {input name: [one value per text]} (strings, or numbers).
    One session per export for the whole test process, as TF Serving keeps one: its start and the export's load
    take longer than most tests' requests (a rewritten export loads afresh)."""
    pb = Path(saved_model).resolve() / "saved_model.pb"
    key = (pb, pb.stat().st_mtime_ns)
    if key not in _TF1_SESSIONS:
        folder = Path(tempfile.mkdtemp(prefix="tf1-session-"))  # its working directory: no project module there
        stderr = folder / "stderr.txt"
        env = {k: v for k, v in SUBPROCESS_ENV.items() if k != "PYTHONPATH"}
        with stderr.open("w") as err:
            proc = subprocess.Popen([sys.executable, "-c", TF1_SCRIPT, str(pb.parent)], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=folder)
        _TF1_SESSIONS[key] = proc, stderr
    proc, stderr = _TF1_SESSIONS[key]
    req = tmp_path / "requests.json"
    req.write_text(json.dumps([(request[0], [_b64(t) for t in request[1]],
                                _extra_inputs(request[2] if len(request) > 2 else {})) for request in requests]))
    try:
        proc.stdin.write(f"{req.resolve()}\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], 600)
    except BrokenPipeError:
        ready = [proc.stdout]
    line = proc.stdout.readline() if ready else ""
    if not line:  # it died, or hangs: its error, and a fresh session for the next test
        proc.kill()
        del _TF1_SESSIONS[key]
        error = stderr.read_text(encoding="utf-8", errors="replace")[-4000:]
        shutil.rmtree(stderr.parent, ignore_errors=True)
        pytest.fail(f"The TF1 session of {pb.parent} {'died' if ready else 'did not answer in 600 s'}:\n{error}",
                    pytrace=False)
    results = json.loads(line)
    assert "error" not in results, results["error"]
    return results


# Loaded SavedModels of this test process, by (saved_model.pb path, its mtime): see load_saved_model.
_LOADED_SAVED_MODELS = {}


def load_saved_model(path, load=None):
    """`tf.saved_model.load(path)`, once per export for the whole test process (a rewritten export loads afresh).
    Loading rebuilds every signature's functions in Python, and a signature's first call optimizes its graph:
    the tests that only call signatures share one loaded object, and the tests of loading itself (the TF1 and
    C++ loaders, `kt-translate` in a subprocess) load their own. `load`: the loader to use when the export is
    not loaded yet (`one_load_per_export` passes the real one)."""
    import tensorflow as tf
    import tensorflow_text  # noqa: F401  (registers the sentencepiece ops an export's graph holds)

    pb = Path(path).resolve() / "saved_model.pb"
    key = (pb, pb.stat().st_mtime_ns)
    if key not in _LOADED_SAVED_MODELS:
        _LOADED_SAVED_MODELS[key] = (load or tf.saved_model.load)(str(pb.parent))
    return _LOADED_SAVED_MODELS[key]


def batches_run(call):
    """(`call()`, the size of each batch BatchFunction ops ran in this process meanwhile, in order): TensorFlow's
    profiler, read by `export.tf_internals.merged_batch_sizes`. The C++ loader's test reads TensorFlow's batching
    metric instead (tests/cpp/serving_check.cc)."""
    from export.tf_internals import merged_batch_sizes

    return merged_batch_sizes(call)


@pytest.fixture
def one_load_per_export(monkeypatch):
    """For this test, `tf.saved_model.load(path)` (what `kt-translate --saved-model` calls in process) is
    `load_saved_model(path)`."""
    import tensorflow as tf

    load = tf.saved_model.load
    monkeypatch.setattr(tf.saved_model, "load", lambda path, *args, **kwargs: (
        load(path, *args, **kwargs) if args or kwargs else load_saved_model(path, load)))


def full_pass_decoder(start_id):
    """A decoder for `keras_transformer.decoding`'s searches that runs the model's whole decoder every step:
    decoding by its definition, the reference the cache is tested against.

    Like `decoding.cached_decoder`, `(model, encoder_output, source_mask, steps, rows) -> (cache, next_logits)`;
    `next_logits` reads the rows' outputs so far. The whole fixed-size prefix goes through the decoder each step
    and position `index` is read: causality keeps the later (not yet written) positions out of it.
    """
    from keras import ops

    def decoder(model, encoder_output, source_mask, steps, rows=1):
        if rows > 1:
            encoder_output, source_mask = (ops.repeat(x, rows, axis=0) for x in (encoder_output, source_mask))

        def next_logits(last, index, outputs, cache):
            start = ops.full((ops.shape(outputs)[0], 1), start_id, "int32")
            prefix = ops.concatenate([start, outputs[:, :-1]], axis=1)
            return ops.take(model.decode(prefix, encoder_output, source_mask), index, axis=1), cache

        return {}, next_logits

    return decoder


@pytest.fixture(scope="session")
def exported(quick_model_dir, tmp_path_factory):
    """EXPORT_DIR/translator/1 of the quick model: beam 4, cached decoding (what kt-export writes by default), in 2
    loops (kt-export's default on 2 CPUs; fixed here, so the tests decode in parallel loops on any machine).
    One export for the test run: the export, signature and C++ loader tests all read it."""
    from export.export_model import export

    return built_once(tmp_path_factory, "exports",
                      lambda folder: export(quick_model_dir, folder, check_ops=False, parallel_loops=2))


# The largest batch the XLA decoder of `xla_exported` takes.
XLA_MAX_BATCH = 4


@pytest.fixture(scope="session")
def xla_exported(quick_model_dir, tmp_path_factory):
    """The quick model's export with an XLA decoder for batches of up to XLA_MAX_BATCH sentences (`kt-export
    --xla-max-batch`), the graph decoder above: one for the test run, read by the export and C++ loader tests."""
    from export.export_model import export

    return built_once(tmp_path_factory, "xla-exports",
                      lambda folder: export(quick_model_dir, folder, xla_max_batch=XLA_MAX_BATCH, check_ops=False))


def xla_requests():
    """{test: its requests to `xla_exported`}, for `xla_tf1_runs`: batches on both sides of XLA_MAX_BATCH."""
    sentences = multi30k_lines("test_2016_flickr.en", 12)
    hostile = [HOSTILE[:XLA_MAX_BATCH], HOSTILE[XLA_MAX_BATCH:]]  # each part under XLA, the whole without
    return {"small_batches": [(sig, batch) for sig in ("greedy", "serving_default")
                              for batch in (sentences[:1], sentences[:3], sentences[:6])],
            "cpp_loader": [(sig, texts) for sig in TEXT_SIGNATURES for texts in
                           (sentences[:1], sentences[:XLA_MAX_BATCH + 1], *hostile, HOSTILE, sentences, [])]}


@pytest.fixture(scope="session")
def xla_tf1_runs(xla_exported, tmp_path_factory):
    """{test: (its xla_requests(), their runs)}: one TF1 session run (TF Serving's loader) of `xla_exported` for the
    whole test run, shared by the export and C++ loader tests. Why shared: a process that runs the export compiles
    its XLA decoder anew for each batch size, and that compiling is most of such a run's time."""
    parts = xla_requests()

    def build(folder):
        runs = run_tf1(xla_exported, [r for requests in parts.values() for r in requests], folder)["runs"]
        (folder / "runs.json").write_text(json.dumps(runs), encoding="utf-8")
        return folder / "runs.json"

    runs = json.loads(built_once(tmp_path_factory, "xla-tf1-runs", build).read_text(encoding="utf-8"))
    split = split_runs(runs, {name: len(requests) for name, requests in parts.items()})
    return {name: (requests, split[name]) for name, requests in parts.items()}


@pytest.fixture(scope="session")
def copy_model():
    """Trained one epoch on the copy task: it has learned END but is still unsure,
    so beams really differ (a random model never says END). Seeded: otherwise its weights, and so the near-ties
    its beams meet, would depend on which tests ran before it in the same worker."""
    keras.utils.set_random_seed(0)
    model = kt.Transformer.from_preset("tiny", vocab_size=16, dropout=0.0)
    model.compile(optimizer=kt.paper_adam(model.d_model, 100), loss=kt.MaskedSparseCategoricalCrossentropy())
    x, y = copy_task(np.random.default_rng(0), 2048)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    return model


def copy_sources(seed, n):
    """`n` sources of the copy task (random tokens, then END_ID)."""
    return copy_task(np.random.default_rng(seed), n)[0][0]


def copy_prefixes(seed, batch, width=3):
    """Target prefixes `[batch, width]` of 0 to `width` copy-task tokens each (never 0), 0-padded."""
    rng = np.random.default_rng(seed)
    prefix = np.zeros((batch, width), "int32")
    for row, n in enumerate(rng.integers(0, width + 1, batch)):
        prefix[row, :n] = rng.integers(4, 16, n)
    return prefix


def random_model(seed, vocab=24, **kwargs):
    """A tiny model with random weights of scale 0.5: it spreads its probability, so beams really differ."""
    model = kt.Transformer.from_preset("tiny", vocab_size=vocab, dropout=0.0, **kwargs)
    model.build()
    rng = np.random.default_rng(seed)
    for weight in model.weights:
        weight.assign(rng.normal(scale=0.5, size=weight.shape).astype("float32"))
    return model


def trimmed(tokens):
    """Tokens `[batch, length]` (any backend's tensor) without their all-padding columns at the end."""
    tokens = keras.ops.convert_to_numpy(tokens)
    used = np.flatnonzero((tokens != 0).any(axis=0))
    return tokens[:, : used[-1] + 1 if len(used) else 0]


def uncached_greedy(model, source, max_output_length):
    """Greedy decoding by the definition: a full forward pass for every new token.

    The pass reads the whole target buffer `[batch, max_output_length + 1]`, padded after the tokens chosen so far,
    so every pass has one shape: JAX's eager ops then compile once, not once per length. The padding sits at
    future positions, which the causal mask hides (and padding keys are masked besides)."""
    target = np.zeros((len(source), max_output_length + 1), "int32")
    target[:, 0] = START_ID
    finished = np.zeros(len(source), bool)
    for t in range(max_output_length):
        log_probs = keras.ops.convert_to_numpy(keras.ops.log_softmax(model((source, target))[:, t]))
        log_probs[:, 0] = -np.inf  # padding is never produced
        if t + 1 == max_output_length:
            log_probs[:, np.arange(log_probs.shape[1]) != END_ID] = -np.inf
        token = np.where(finished, 0, log_probs.argmax(-1))
        target[:, t + 1] = token
        finished |= token == END_ID
        if finished.all():
            break
    return target[:, 1 : t + 2]


def never_ending_model(**kwargs):
    """A random model whose end token always loses: only the length limit stops decoding."""
    model = kt.Transformer.from_preset("tiny", vocab_size=24, tie_output_embedding=False, **kwargs)
    model.build()
    bias = model.output_projection.bias
    bias.assign(np.where(np.arange(24) == END_ID, -1e4, keras.ops.convert_to_numpy(bias)).astype("float32"))
    return model


def sources_of_2_and_6_tokens():
    source = np.zeros((2, 6), "int32")
    source[0, :2] = [5, 6]
    source[1, :6] = [5, 6, 7, 8, 9, 10]
    return source


def assert_length_penalised_log_probs(model, source, tokens, scores, alpha):
    """Each `scores[i]` is log P(output | source) / ((5 + |output|) / 6)^alpha (paper section 7; Wu et al.,
    2016), the log-probability recomputed by a full forward pass; every output ends with the end token."""
    tokens, scores = keras.ops.convert_to_numpy(tokens), keras.ops.convert_to_numpy(scores)
    for i, row in enumerate(tokens):
        output = row[row != 0]
        assert output[-1] == END_ID
        target_in = np.concatenate([[START_ID], output[:-1]])[None].astype("int32")
        log_probs = keras.ops.convert_to_numpy(keras.ops.log_softmax(model((source[i : i + 1], target_in))[0]))
        log_prob = log_probs[np.arange(len(output)), output].sum()
        assert scores[i] == pytest.approx(log_prob / ((5 + len(output)) / 6) ** alpha, rel=1e-4)


def a_sentence_and_a_batch_holding_it():
    """A copy-task sentence `[1, 6]`, and a batch `[4, 9]` holding it in row 1, among a longer sentence and
    two shorter ones."""
    rng = np.random.default_rng(7)
    sentence = np.array([[5, 9, 12, 4, 7, END_ID]], "int32")
    batch = np.zeros((4, 9), "int32")
    batch[0] = np.append(rng.integers(4, 16, 8), END_ID)  # longer
    batch[1, :6] = sentence[0]
    batch[2, :2] = [6, END_ID]  # shorter
    batch[3, :4] = [11, 5, 8, END_ID]
    return sentence, batch


# Subprocesses under tf.distribute: logical CPU devices and multi-worker strategies must be set up before
# TensorFlow starts, so these tests run programs.

def distributed_env(**extra):
    """The environment of a subprocess that imports the repo, quiet, without a TF_CONFIG of ours."""
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def free_ports(n):
    """`n` free TCP ports on 127.0.0.1."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def start_workers(cmd, log_paths):
    """Two workers running `cmd` (kt-train, or any program; or a list of one command per worker) in one
    MultiWorkerMirroredStrategy cluster on 127.0.0.1: [(process, log file)]."""
    workers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    cmds = cmd if isinstance(cmd[0], (list, tuple)) else [cmd] * len(log_paths)
    procs = []
    for i, log_path in enumerate(log_paths):
        tf_config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}
        log = open(log_path, "w")
        procs.append((subprocess.Popen(cmds[i], cwd=REPO, env=distributed_env(TF_CONFIG=json.dumps(tf_config)),
                                       stdout=log, stderr=subprocess.STDOUT), log))
    return procs


def wait_all(procs, timeout):
    """Waits for every worker; kills what is left and closes the logs."""
    try:
        for p, _ in procs:
            p.wait(timeout=timeout)
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
            log.close()


# A Python for `make` (PY=...) that runs `-m MODULE ARGS...` under TFDS' own mock data
# (`tfds.testing.mock_data`): TFDS' reading code on generated examples, no download. Its arguments after the
# script: the examples per split, then `-m MODULE ARGS...` as make passes them.
MOCK_TFDS_PYTHON = r"""
import runpy, sys
import tensorflow_datasets as tfds

examples, flag, module, *args = sys.argv[1:]
assert flag == "-m", sys.argv
sys.argv = [module, *args]
code = 0
with tfds.testing.mock_data(num_examples=int(examples)):
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
sys.exit(code)
"""


def mock_tfds_python(tmp_path, examples: int = 120) -> str:
    """`PY=...` for `make`: this interpreter running `MOCK_TFDS_PYTHON` with `examples` per split."""
    script = tmp_path / "mock_tfds_python.py"
    script.write_text(MOCK_TFDS_PYTHON, encoding="utf-8")
    return f"{sys.executable} {script} {examples}"


# A small grammar for the parsing recipe's end-to-end test: each word has one tag and one role (a verb's class
# says what follows it; "of" attaches to the noun phrase before it, the other prepositions to the verb phrase),
# so each sentence has one parse, which a model can learn from the words alone. Trees as the Penn Treebank writes
# them: in an unlabelled outer bracket, with a function tag (NP-SBJ) and a final period (a tag EVALB deletes).
GRAMMAR_LEXICON = {
    "DT": "the a every this".split(),
    "JJ": "big small red old happy".split(),
    "NN": "dog cat man woman ball park house car boy girl".split(),
    "NNP": "Anna Bob Paris Oslo".split(),
    "VBD": "saw liked took found".split(),  # takes an object
    "VBD-I": "slept ran smiled".split(),  # takes none
    "VBD-S": "said thought".split(),  # takes a clause
    "IN": "with in near".split(),  # the verb phrase's
    "IN-N": ["of"],  # the noun phrase's
}


def grammar_tree(rng, depth=0) -> str:
    """A random sentence of the grammar above as a bracketed tree (`rng`: a `random.Random`): a clause is a
    subject, a verb phrase and, at the top, a period; a verb phrase may hold one clause (after "that")."""
    def word(tag):
        return f"({tag.split('-')[0]} {rng.choice(GRAMMAR_LEXICON[tag])})"

    def noun_phrase(nested=True):
        kind = rng.random()
        inside = (f"{word('DT')} {word('NN')}" if kind < 0.4 else f"{word('DT')} {word('JJ')} {word('NN')}"
                  if kind < 0.7 else word("NNP"))
        if nested and rng.random() < 0.25:
            return f"(NP (NP {inside}) (PP {word('IN-N')} {noun_phrase(False)}))"
        return f"(NP {inside})"

    def verb_phrase():
        kind = rng.random()
        if kind < 0.2:
            return f"(VP {word('VBD-I')})"
        if kind < 0.55:
            return f"(VP {word('VBD')} {noun_phrase()})"
        if kind < 0.8 or depth > 0:
            return f"(VP {word('VBD')} {noun_phrase()} (PP {word('IN')} {noun_phrase()}))"
        return f"(VP {word('VBD-S')} (SBAR (IN that) {grammar_tree(rng, depth + 1)}))"

    clause = f"(S (NP-SBJ{noun_phrase()[3:]} {verb_phrase()}" + (" (. .))" if depth == 0 else ")")
    return f"( {clause} )" if depth == 0 else clause
