"""The losses under tf.distribute (TensorFlow only; their formulas on every backend: portable/test_losses.py)."""

import subprocess
import sys

import pytest

from conftest import MULTI30K, REPO, SUBPROCESS_ENV, needs_multi30k


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


@needs_multi30k
def test_r_drop_pairs_stay_whole_on_each_replica():
    """kt-train --r-drop --cpu-replicas 2: tf.distribute splits each batch of make_batches(copies=2) into
    contiguous shares; each share must hold whole pairs (rows 2i, 2i + 1 the same sentence), or
    MaskedRDropCrossentropy would pair two different sentences."""
    script = f"""
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import numpy as np
from common.tokenizer import make_tokenizer
from keras_transformer.text import train_sentencepiece
from training.pipeline import make_batches
lines = [open("{MULTI30K}/train." + lang, encoding="utf-8").read().split("\\n")[:400] for lang in ("en", "de")]
tok = make_tokenizer(train_sentencepiece(lines[0] + lines[1], vocab_size=500))
pairs = tf.data.Dataset.from_tensor_slices((lines[0], lines[1]))
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
batches = make_batches(pairs, tok, max_sentence_length=40, tokens_per_batch=500, num_replicas=2, copies=2, shuffle=False)
shares = 0
for (source, target_in), target_out in strategy.experimental_distribute_dataset(batches):
    for part in (source, target_in, target_out):
        for rows in part.values:
            rows = rows.numpy()
            assert len(rows) % 2 == 0 and (rows[0::2] == rows[1::2]).all(), rows
            shares += 1
print("shares", shares)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env=SUBPROCESS_ENV, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) > 3 * 2 * 3  # several batches, 2 replicas, 3 tensors
