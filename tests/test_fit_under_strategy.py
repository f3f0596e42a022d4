"""`model.fit` in your own script under MirroredStrategy, on 2 logical CPU replicas against one device: your own model
of the library's layers, and what `kt.Transformer` refuses rather than train wrongly. (`kt.Transformer` through
`model.fit` on 1 and 2 replicas and 2 workers: tests/test_training_updates.py, the own-script cases; the README's
multi-GPU script: tests/test_readme.py.)"""

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, distributed_env

PROGRAM = REPO / "tests" / "strategy_fit.py"
LEARNING_RATE, CLIP = 0.5, 0.02  # as in strategy_fit.py


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("strategy-fit") / "results.json"
    env = distributed_env(PYTHONPATH=f"{REPO}:{REPO / 'tests'}")
    done = subprocess.run([sys.executable, str(PROGRAM), str(out)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def assert_same(one, two):
    """float32: the replicas sum in another order. (Some biases stay within 1e-9 of 0: hence the absolute term.)"""
    for a, b in zip(one["weights"], two["weights"], strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("step", ["keras", "installed"])
def test_your_own_language_model_trains_on_2_replicas_as_on_one(results, step):
    """A functional language model of `PositionalEmbedding`, `Decoder` and `Dense`, with the library's loss: plain
    `model.fit` (Keras' own step; the loss divides each replica's sum by every replica's tokens) and with
    `kt.UpdateStep.install` and a clipping optimizer, 2 replicas end with the weights of one device. The two
    halves of each batch hold different numbers of real tokens, so a mean of per-replica means would differ."""
    one, two = results[f"lm-{step}-1"], results[f"lm-{step}-2"]
    assert (one["replicas"], two["replicas"]) == (1, 2)
    assert one["moved"] > 1e-3
    assert_same(one, two)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)


def test_the_installed_step_clips_the_summed_gradient(results):
    """SGD's update is the learning rate times the clipped gradient: the same on 1 and 2 replicas, and different
    from the unclipped one."""
    keras_one, installed = results["lm-keras-1"], results["lm-installed-1"]
    gap = max(np.max(np.abs(np.asarray(a) - np.asarray(b))) for a, b in zip(keras_one["weights"], installed["weights"]))
    assert gap > 1e-3


def test_kt_transformer_refuses_what_keras_own_step_would_do_per_replica(results):
    """Another loss with a clipping optimizer on 2 replicas: refused at compile, with the line that fixes it."""
    message = results["refused-other-loss"]
    assert message is not None and "global_clipnorm=1.0" in message and "2 replicas" in message
    assert "loss=kt.MaskedSparseCategoricalCrossentropy()" in message


def test_a_model_built_outside_the_strategy_scope_is_refused_with_the_fix(results):
    """Keras 3.15 fails in its distributed update with a bare AssertionError; the library names the cause."""
    message = results["refused-outside-scope"]
    assert message is not None and "outside the MirroredStrategy" in message and "with strategy.scope():" in message
