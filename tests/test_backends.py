"""One library for every Keras backend: a .keras file saved on one backend loads on every other with the same
outputs, and the same weights give the same greedy translations on JAX, PyTorch and TensorFlow.

Each backend runs in a fresh interpreter of its own virtualenv under KERAS_BACKEND: TensorFlow in this suite's,
JAX in .venv-jax and PyTorch in .venv-torch, neither with TensorFlow (`make venv-jax`, `make venv-torch`; a
backend whose virtualenv is missing is skipped, with the target that makes it).
"""

import json

import numpy as np
import pytest
import sentencepiece as spm

from conftest import BACKEND_VENVS, multi30k_lines, random_ids, run_on_backend
from keras_transformer.text import END_ID, START_ID

BACKENDS = list(BACKEND_VENVS)  # tensorflow, jax, torch

SAVE_SCRIPT = r"""
import sys
import keras, numpy as np
import keras_transformer as kt
from conftest import VOCAB, user_functional_model

out_dir, inputs_file = sys.argv[1:]
keras.utils.set_random_seed(0)
inputs = np.load(inputs_file)
source, target = inputs["source"], inputs["target"]
transformer = kt.Transformer.from_preset("tiny", vocab_size=VOCAB)
transformer.compile(optimizer=kt.paper_adam(32, warmup_steps=10),
                    loss=kt.MaskedSparseCategoricalCrossentropy(label_smoothing=0.2), metrics=[kt.MaskedAccuracy()])
user = user_functional_model()
outputs = {"transformer": transformer((source, target)), "user": user([source, target])}
transformer.save(f"{out_dir}/transformer.keras")
user.save(f"{out_dir}/user.keras")
np.savez(f"{out_dir}/outputs.npz", **{name: keras.ops.convert_to_numpy(x) for name, x in outputs.items()})
"""

LOAD_SCRIPT = r"""
import json, sys, traceback
import keras, numpy as np
import keras_transformer as kt

inputs_file, out_dir, *saved = sys.argv[1:]
inputs = np.load(inputs_file)
source, target = inputs["source"], inputs["target"]
outputs, errors = {}, {}
for saved_on, folder in zip(saved[::2], saved[1::2]):
    try:
        transformer = keras.models.load_model(f"{folder}/transformer.keras")
        assert isinstance(transformer, kt.Transformer), type(transformer)
        assert transformer.loss.label_smoothing == 0.2, transformer.loss  # compiled again, with our loss
        outputs[f"{saved_on}/transformer"] = keras.ops.convert_to_numpy(transformer((source, target)))
    except Exception:
        errors[f"{saved_on}/transformer"] = traceback.format_exc()[-3000:]
    try:
        user = keras.models.load_model(f"{folder}/user.keras")
        outputs[f"{saved_on}/user"] = keras.ops.convert_to_numpy(user([source, target]))
    except Exception:
        errors[f"{saved_on}/user"] = traceback.format_exc()[-3000:]
np.savez(f"{out_dir}/outputs.npz", **outputs)
json.dump(errors, open(f"{out_dir}/errors.json", "w"))
"""


def _once_per_backend(function):
    """function(backend), run once per backend: the same result, or the same skip or failure, at every call."""
    results = {}

    def cached(backend):
        if backend not in results:
            try:
                results[backend] = True, function(backend)
            except (pytest.skip.Exception, AssertionError) as error:
                results[backend] = False, error
        ok, value = results[backend]
        if ok:
            return value
        if isinstance(value, pytest.skip.Exception):
            pytest.skip(value.msg)
        pytest.fail(str(value), pytrace=False)

    return cached


@pytest.fixture(scope="module")
def round_trip_inputs(tmp_path_factory):
    """Source and target ids, with padding in both, in an .npz file every backend reads."""
    rng = np.random.default_rng(0)
    source, target = random_ids(rng, 3, 7), random_ids(rng, 3, 5)
    source[0, 4:] = 0
    target[2, 3:] = 0
    path = tmp_path_factory.mktemp("inputs") / "inputs.npz"
    np.savez(path, source=source, target=target)
    return path


@pytest.fixture(scope="module")
def saved(round_trip_inputs, tmp_path_factory):
    """saved(backend): a tiny compiled Transformer and a user's functional model with our layers, saved on
    `backend` in a fresh process -> (folder, {"transformer": outputs, "user": outputs}) on the inputs."""

    def save(backend):
        folder = tmp_path_factory.mktemp(f"saved-on-{backend}")
        run_on_backend(backend, SAVE_SCRIPT, folder, round_trip_inputs, cwd=folder)
        return folder, dict(np.load(folder / "outputs.npz"))

    return _once_per_backend(save)


@pytest.fixture(scope="module")
def loaded(saved, round_trip_inputs, tmp_path_factory):
    """loaded(backend): every file that saved, loaded on `backend` in one fresh process -> ({"<saved on>/<name>":
    outputs}, {"<saved on>/<name>": the error that loading or calling it raised})."""

    def load(backend):
        folders = []
        for saved_on in BACKENDS:
            try:
                folders += [saved_on, saved(saved_on)[0]]
            except (pytest.skip.Exception, pytest.fail.Exception):
                pass  # that pair's own test says why
        folder = tmp_path_factory.mktemp(f"loaded-on-{backend}")
        run_on_backend(backend, LOAD_SCRIPT, round_trip_inputs, folder, *folders, cwd=folder)
        return dict(np.load(folder / "outputs.npz")), json.loads((folder / "errors.json").read_text())

    return _once_per_backend(load)


@pytest.mark.parametrize("loaded_on", BACKENDS)
@pytest.mark.parametrize("saved_on", BACKENDS)
def test_a_keras_file_saved_on_one_backend_loads_on_another_with_the_same_outputs(saved_on, loaded_on, saved, loaded):
    """Saved on `saved_on` and loaded in a fresh process on `loaded_on` (the same backend too), the Transformer and
    the user's model give the outputs they gave where they were saved, to 1e-5; the loss comes back compiled."""
    _, expected = saved(saved_on)
    outputs, errors = loaded(loaded_on)
    failed = {name: errors[f"{saved_on}/{name}"] for name in expected if f"{saved_on}/{name}" in errors}
    for name, before in expected.items():
        if name not in failed:
            np.testing.assert_allclose(outputs[f"{saved_on}/{name}"], before, atol=1e-5, rtol=1e-5,
                                       err_msg=f"{name} saved on {saved_on}, loaded on {loaded_on}")
    if failed:
        pytest.fail("\n".join(f"{name}.keras saved on {saved_on}, loaded on {loaded_on}:\n{error}"
                              for name, error in failed.items()), pytrace=False)


GREEDY_SCRIPT = r"""
import sys
import keras, numpy as np
import keras_transformer as kt

model_file, ids_file, out_file, start_id, end_id = sys.argv[1:]
assert keras.config.floatx() == "float32" and keras.config.dtype_policy().name == "float32"
model = keras.models.load_model(model_file, compile=False)
tokens, _ = kt.greedy_decode(model, np.load(ids_file), int(start_id), int(end_id))
np.save(out_file, keras.ops.convert_to_numpy(tokens))
"""

SENTENCES = 100


@pytest.fixture(scope="module")
def greedy_tokens(quick_model_dir, tmp_path_factory):
    """greedy_tokens(backend): the quick model's (trained on Multi30k) greedy tokens for the first 100
    test_2016_flickr sentences, decoded in float32 in a fresh process on `backend` -> int array [100, length]."""
    folder = tmp_path_factory.mktemp("greedy")
    sentences = multi30k_lines("test_2016_flickr.en", SENTENCES)
    tokenizer = spm.SentencePieceProcessor(model_file=str(quick_model_dir / "tokenizer.model"))
    pieces = [ids + [END_ID] for ids in tokenizer.encode(sentences)]  # source = pieces + end id, as encode_source
    source_ids = np.zeros((len(pieces), max(map(len, pieces))), "int32")  # padded with 0
    for row, ids in zip(source_ids, pieces, strict=True):
        row[: len(ids)] = ids
    np.save(folder / "ids.npy", source_ids)

    def decode(backend):
        out = folder / f"{backend}.npy"
        run_on_backend(backend, GREEDY_SCRIPT, quick_model_dir / "model.keras", folder / "ids.npy", out, START_ID,
                       END_ID, cwd=folder)
        return np.load(out)

    return _once_per_backend(decode)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "tensorflow"])
def test_the_same_weights_give_the_same_greedy_tokens_as_on_tensorflow(backend, greedy_tokens):
    """The same model file decodes the 100 sentences to the same tokens on `backend` as on TensorFlow (up to
    padding after the end: an output may be wider on one backend than on another)."""
    theirs, reference = greedy_tokens(backend), greedy_tokens("tensorflow")
    # A trained model: every sentence gets a first token and most of them end before the length limit.
    assert reference.shape[0] == SENTENCES and (reference[:, 0] != 0).all()
    assert (reference == END_ID).any(axis=1).mean() > 0.5
    differ = [i for i in range(SENTENCES)
              if not np.array_equal(np.trim_zeros(theirs[i], "b"), np.trim_zeros(reference[i], "b"))]
    assert not differ, f"{backend} and tensorflow decode {len(differ)} of {SENTENCES} sentences differently: {differ}"
