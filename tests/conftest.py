import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import keras_transformer as kt  # noqa: E402

VOCAB = 40


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


def random_ids(rng, batch, length, low=4, high=VOCAB):
    """Token ids with no padding (ids 0-3 are pad/unk/start/end by convention)."""
    return rng.integers(low, high, size=(batch, length)).astype("int32")
