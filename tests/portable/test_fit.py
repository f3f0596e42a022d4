"""model.fit learns: a tiny copy task, and mixed precision keeps the right dtypes."""

import keras
import numpy as np

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
