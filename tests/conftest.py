"""Fixtures and helpers shared by the tests (test modules never import each other)."""

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

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
QUICK_MODEL_MAX_LENGTH = 64  # config.json max_length of the quick model


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


@pytest.fixture(scope="session")
def quick_model_dir(tmp_path_factory):
    """A model directory as kt-train writes it, trained in about a minute (see tests/quick_model.py)."""
    if not (MULTI30K / "train.en").is_file():
        pytest.skip(f"Multi30k not found in {MULTI30K}")
    from quick_model import build_quick_model_dir

    return build_quick_model_dir(tmp_path_factory.mktemp("quick-en-de"), MULTI30K, lines=2000, vocab_size=400,
                                 steps=200, max_length=QUICK_MODEL_MAX_LENGTH)


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


def multi30k_lines(name, n):
    """The first `n` lines of a Multi30k file, e.g. multi30k_lines("val.en", 100)."""
    return (MULTI30K / name).read_text(encoding="utf-8").split("\n")[:n]


def write_lines(path, lines):
    """`lines`, one per line, to `path` (returned)."""
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# Runs in a fresh interpreter: only tensorflow and tensorflow_text, like the model server
# (which links TensorFlow's and tensorflow-text's kernels and nothing of Python).
TF1_SCRIPT = r"""
import base64, json, sys
import tensorflow as tf
import tensorflow_text  # noqa: F401  (registers the sentencepiece ops, as TF Serving links them)

path, requests_file = sys.argv[1], sys.argv[2]
requests = json.load(open(requests_file))
# (tensorflow imports keras itself for tf.keras; none of the project's Python is imported)
loaded_python_modules = sorted({m.split(".")[0] for m in sys.modules} & {"keras_transformer", "training", "export", "tf_keras"})
results = {"loaded_python_modules": loaded_python_modules, "runs": []}
with tf.compat.v1.Session(graph=tf.Graph()) as sess:
    meta_graph = tf.compat.v1.saved_model.loader.load(sess, ["serve"], path)
    results["signatures"] = sorted(meta_graph.signature_def)
    for signature_name, texts in requests:
        sig = meta_graph.signature_def[signature_name]
        fetches = {k: v.name for k, v in sig.outputs.items()}
        feed = {sig.inputs["text"].name: [base64.b64decode(t) for t in texts]}
        out = sess.run(fetches, feed)
        run = {}
        for k, v in out.items():
            if v.dtype == object:
                run[k] = [base64.b64encode(x).decode("ascii") for x in v.tolist()]
            else:
                run[k] = v.tolist()
            run[k + "_shape"] = list(v.shape)
        results["runs"].append(run)
json.dump(results, sys.stdout)
"""


def _b64(text):
    return base64.b64encode(text if isinstance(text, bytes) else text.encode("utf-8")).decode("ascii")


def run_tf1(saved_model, requests, tmp_path):
    """[(signature, [texts (str or bytes)])] -> the outputs of each run (strings base64-encoded), through the TF1
    session loader TF Serving uses, in a fresh process."""
    req = tmp_path / "requests.json"
    req.write_text(json.dumps([(sig, [_b64(t) for t in texts]) for sig, texts in requests]))
    env = {k: v for k, v in SUBPROCESS_ENV.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", TF1_SCRIPT, str(saved_model), str(req)], capture_output=True,
                          text=True, env=env, cwd=str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)
