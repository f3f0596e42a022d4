"""The loss under tf.distribute (TensorFlow only; the loss's formulas on every backend: portable/test_losses.py)."""

import subprocess
import sys

import pytest


def test_loss_is_divided_by_the_replicas_under_tf_distribute():
    """Keras sums the replicas' gradients, so each replica's loss must carry 1/N.

    Logical CPU devices must exist before TensorFlow starts: a subprocess.
    """
    script = """
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import numpy as np, keras_transformer as kt
labels = np.array([[3, 4, 0], [5, 0, 0]])
logits = np.random.default_rng(0).normal(size=(2, 3, 6)).astype("float32")
weights = np.array([0.5, 3.0])
for loss in (kt.MaskedSparseCategoricalCrossentropy(), kt.MaskedSparseCategoricalCrossentropy(reduction="sum")):
    for sample_weight in (None, weights):
        alone = float(loss(labels, logits, sample_weight=sample_weight))
        with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
            per_replica = tf.distribute.get_strategy().run(lambda: loss(labels, logits, sample_weight=sample_weight))
        print(alone, float(per_replica.values[0]), float(per_replica.values[1]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [list(map(float, line.split())) for line in done.stdout.strip().splitlines()[-4:]]
    # The mean, with and without sample weights, carries 1/N; a sum is already the global sum's share.
    for (alone, first, second), replicas in zip(lines, [2, 2, 1, 1], strict=True):
        assert first == pytest.approx(alone / replicas, rel=1e-6)
        assert second == pytest.approx(alone / replicas, rel=1e-6)
