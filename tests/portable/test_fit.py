"""model.fit learns: a tiny copy task (also with R-Drop's loss), and mixed precision keeps the right dtypes."""

import keras
import numpy as np
import pytest

import keras_transformer as kt
from conftest import copy_task


def test_fit_learns_to_copy():
    rng = np.random.default_rng(0)
    x, y = copy_task(rng, 2048)
    model = kt.Transformer.from_preset("tiny", vocab_size=16, dropout=0.0)
    model.compile(
        optimizer=kt.paper_adam(model.d_model, warmup_steps=100),
        loss=kt.MaskedSparseCategoricalCrossentropy(label_smoothing=0.1),
        metrics=[kt.MaskedAccuracy()],
    )
    # 64 steps an epoch, 5 epochs: 320 steps.
    history = model.fit(x, y, batch_size=32, epochs=5, verbose=0)
    loss, accuracy = model.evaluate(*copy_task(np.random.default_rng(1), 256), verbose=0)
    # With label smoothing 0.1 over 16 ids the loss cannot go below the
    # smoothed target's entropy, about 0.56; a model that copies is near it.
    assert history.history["loss"][0] > 2.0
    assert loss < 0.8
    assert accuracy > 0.95


def test_mixed_precision_computes_in_bfloat16_with_float32_weights_and_logits():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model = kt.Transformer.from_preset("tiny", vocab_size=16, norm_first=True, tie_output_embedding=False)
    model.build()
    assert {w.dtype for w in model.weights} == {"float32"}
    sublayers = [layer for layer in model._flatten_layers() if layer is not model]
    assert sublayers and {layer.compute_dtype for layer in sublayers} == {"bfloat16"}
    rng = np.random.default_rng(2)
    (source, target_in), target_out = copy_task(rng, 8)
    logits = model((source, target_in))
    assert keras.backend.standardize_dtype(logits.dtype) == "float32"
    model.compile(optimizer=kt.paper_adam(model.d_model, 10), loss=kt.MaskedSparseCategoricalCrossentropy())
    loss = model.train_on_batch((source, target_in), target_out)
    assert np.isfinite(loss)


def test_r_drop_fit_learns_and_its_loss_is_the_plain_loss_without_dropout(seeded):
    # Each sentence twice in a row (np.repeat), as MaskedRDropCrossentropy's docstring says.
    rng = np.random.default_rng(3)
    (source, target_in), target_out = copy_task(rng, 1024)
    twice = lambda a: np.repeat(a, 2, axis=0)  # noqa: E731
    model = kt.Transformer.from_preset("tiny", vocab_size=16, dropout=0.1)
    model.compile(optimizer=kt.paper_adam(model.d_model, warmup_steps=100),
                  loss=kt.MaskedRDropCrossentropy(kl_weight=1.0), metrics=[kt.MaskedAccuracy()])
    # Dropout makes the two rows of a pair disagree in training mode: the KL is there.
    x = (twice(source[:8]), twice(target_in[:8]))
    plain = kt.MaskedSparseCategoricalCrossentropy()
    train_logits = model(x, training=True)
    # convert_to_numpy, not float(): on PyTorch the losses require grad and float() warns.
    r_drop_loss = keras.ops.convert_to_numpy(model.loss(twice(target_out[:8]), train_logits))
    assert r_drop_loss > keras.ops.convert_to_numpy(plain(twice(target_out[:8]), train_logits))
    history = model.fit((twice(source), twice(target_in)), twice(target_out), batch_size=64, epochs=8, verbose=0)
    assert history.history["loss"][-1] < 0.7 * history.history["loss"][0]  # it learns
    # Evaluation runs without dropout, so both rows agree and the loss is the plain one of the single batch.
    (source, target_in), target_out = copy_task(np.random.default_rng(4), 256)
    loss, accuracy = model.evaluate((twice(source), twice(target_in)), twice(target_out), verbose=0)
    model.compile(loss=kt.MaskedSparseCategoricalCrossentropy(), metrics=[kt.MaskedAccuracy()])
    single_loss, single_accuracy = model.evaluate((source, target_in), target_out, verbose=0)
    assert loss == pytest.approx(single_loss, rel=1e-5)
    assert accuracy == pytest.approx(single_accuracy, abs=1e-6)
    assert accuracy > 0.8
