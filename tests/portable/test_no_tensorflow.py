"""On JAX and PyTorch the library runs without TensorFlow: the session-end check (conftest runs this file last)."""

import sys

import pytest

from portable.conftest import BACKEND


def test_no_tensorflow_module_was_imported():
    """After every other test of the session, on a backend other than TensorFlow, no tensorflow module (nor
    tensorflow_text, tensorflow_datasets, ...) is in sys.modules: neither the library nor the tests loaded one."""
    if BACKEND == "tensorflow":
        pytest.skip("TensorFlow is the backend")
    loaded = sorted(name for name in sys.modules if name.split(".")[0].startswith("tensorflow"))
    assert loaded == [], f"TensorFlow modules loaded on the {BACKEND} backend: {loaded[:20]}"
