"""Paper definitions: the decoder is causal, and padding changes nothing."""

import keras
import numpy as np

import keras_transformer as kt
from conftest import VOCAB, random_ids
from portable.conftest import to_numpy


def test_decoder_is_causal(tiny_model):
    rng = np.random.default_rng(0)
    source = random_ids(rng, 2, 7)
    target = random_ids(rng, 2, 9)
    logits = to_numpy(tiny_model((source, target)))
    for t in range(target.shape[1] - 1):
        changed = target.copy()
        changed[:, t + 1 :] = random_ids(rng, 2, target.shape[1] - t - 1)
        assert (changed[:, t + 1 :] != target[:, t + 1 :]).any()
        new_logits = to_numpy(tiny_model((source, changed)))
        np.testing.assert_allclose(new_logits[:, : t + 1], logits[:, : t + 1], atol=1e-5)
        # And the change is seen where it may be: the next position moves.
        assert np.abs(new_logits[:, t + 1] - logits[:, t + 1]).max() > 1e-4


def test_source_padding_changes_nothing(tiny_model):
    rng = np.random.default_rng(1)
    source = random_ids(rng, 3, 6)
    source[1, 4:] = 0  # rows of different lengths in one batch
    target = random_ids(rng, 3, 5)
    logits = to_numpy(tiny_model((source, target)))
    padded = np.pad(source, [(0, 0), (0, 5)])
    np.testing.assert_allclose(to_numpy(tiny_model((padded, target))), logits, atol=1e-5)
    # Row 1 alone, with no padding at all, gives the same logits as in the batch.
    alone = to_numpy(tiny_model((source[1:2, :4], target[1:2])))
    np.testing.assert_allclose(alone, logits[1:2], atol=1e-5)


def test_target_padding_changes_nothing_at_real_positions(tiny_model):
    rng = np.random.default_rng(2)
    source = random_ids(rng, 2, 6)
    target = random_ids(rng, 2, 5)
    logits = to_numpy(tiny_model((source, target)))
    padded = np.pad(target, [(0, 0), (0, 4)])
    new_logits = to_numpy(tiny_model((source, padded)))
    np.testing.assert_allclose(new_logits[:, :5], logits, atol=1e-5)


def test_padding_is_never_attended_even_with_extreme_pad_embeddings(tiny_model):
    """If pad keys leaked into attention, a huge pad embedding would show."""
    rng = np.random.default_rng(3)
    source = random_ids(rng, 2, 6)
    source[0, 3:] = 0
    target = random_ids(rng, 2, 4)
    before = to_numpy(tiny_model((source, target)))
    table = tiny_model.target_embedding.token_embedding.embeddings
    table.assign(np.concatenate([np.full((1, table.shape[1]), 50.0, "float32"), table.numpy()[1:]]))
    after = to_numpy(tiny_model((source, target)))
    # Column 0 is the pad logit itself, which the tied projection does change.
    np.testing.assert_allclose(after[..., 1:], before[..., 1:], atol=1e-4)


def _right_padded(ids, extra):
    return np.pad(ids, [(0, 0), (0, extra)])


def test_encoder_classifier_ignores_right_padding_through_the_keras_mask():
    """The README's classifier: nothing passes padding_mask, so the Keras mask that
    PositionalEmbedding attaches is the only thing that keeps padding out."""
    ids = keras.Input(shape=(None,), dtype="int32")
    x = kt.PositionalEmbedding(VOCAB, 16)(ids)
    x = kt.EncoderLayer(16, 2, 32, dropout=0.0)(x)
    hidden = kt.Encoder(2, 16, 2, 32, dropout=0.0, norm_first=True)(x)
    pooled = keras.layers.GlobalAveragePooling1D()(hidden)  # a masked mean
    classifier = keras.Model(ids, [hidden, keras.layers.Dense(3)(pooled)])

    source = random_ids(np.random.default_rng(4), 3, 6)
    source[1, 4:] = 0
    hidden, logits = classifier(source)
    padded_hidden, padded_logits = classifier(_right_padded(source, 5))
    real = source != 0
    np.testing.assert_allclose(to_numpy(padded_hidden)[:, :6][real], to_numpy(hidden)[real], atol=1e-5)
    np.testing.assert_allclose(to_numpy(padded_logits), to_numpy(logits), atol=1e-5)


def test_functional_decoder_ignores_source_padding_through_the_keras_mask():
    source_ids = keras.Input(shape=(None,), dtype="int32")
    target_ids = keras.Input(shape=(None,), dtype="int32")
    embedding = kt.PositionalEmbedding(VOCAB, 16)
    memory = kt.Encoder(1, 16, 2, 32, dropout=0.0)(embedding(source_ids))
    x = kt.DecoderLayer(16, 2, 32, dropout=0.0)(embedding(target_ids), memory)
    x = kt.Decoder(1, 16, 2, 32, dropout=0.0)(x, memory)
    model = keras.Model([source_ids, target_ids], x)

    rng = np.random.default_rng(5)
    source, target = random_ids(rng, 2, 6), random_ids(rng, 2, 4)
    source[0, 3:] = 0
    out = to_numpy(model([source, target]))
    np.testing.assert_allclose(to_numpy(model([_right_padded(source, 4), target])), out, atol=1e-5)
