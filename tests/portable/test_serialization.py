"""Every class round-trips through get_config and .keras files, inside users' own models."""

import json
import re
import warnings
import zipfile

import keras
import numpy as np
import pytest

import keras_transformer as kt
from conftest import VOCAB, random_ids, user_functional_model
from portable.conftest import to_numpy

D_MODEL, HEADS, D_FF = 16, 2, 32


def test_user_functional_model_saves_and_loads(tmp_path):
    rng = np.random.default_rng(0)
    source, target = random_ids(rng, 2, 6), random_ids(rng, 2, 4)
    source[0, 4:] = 0
    model = user_functional_model(VOCAB, D_MODEL, HEADS, D_FF)
    before = to_numpy(model([source, target]))
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    np.testing.assert_allclose(to_numpy(loaded([source, target])), before, atol=1e-6)


def test_transformer_saves_and_loads(tmp_path, tiny_model):
    rng = np.random.default_rng(1)
    source, target = random_ids(rng, 2, 6), random_ids(rng, 2, 5)
    before = to_numpy(tiny_model((source, target)))
    tiny_model.save(tmp_path / "t.keras")
    loaded = keras.models.load_model(tmp_path / "t.keras")
    assert isinstance(loaded, kt.Transformer)
    np.testing.assert_allclose(to_numpy(loaded((source, target))), before, atol=1e-6)


def test_a_transformer_with_its_own_key_size_saves_and_loads(tmp_path):
    """key_dim=3 (d_k) beside tiny's d_model // num_heads = 8 (d_v): every attention's W^Q and W^K are 3 wide a
    head and W^V 8, and the .keras file rebuilds them so, with the same outputs."""
    rng = np.random.default_rng(4)
    source, target = random_ids(rng, 2, 6), random_ids(rng, 2, 5)
    source[1, 4:] = 0
    model = kt.Transformer.from_preset("tiny", vocab_size=VOCAB, key_dim=3)
    before = to_numpy(model((source, target)))
    attentions = [layer.self_attention for layer in model.encoder.encoder_layers] + [
        attention for layer in model.decoder.decoder_layers
        for attention in (layer.self_attention, layer.cross_attention)]
    assert len(attentions) == 6
    for attention in attentions:
        w = attention.projections
        assert (w.query.kernel.shape, w.key.kernel.shape, w.value.kernel.shape) == ((32, 4, 3), (32, 4, 3), (32, 4, 8))
    model.save(tmp_path / "k.keras")
    loaded = keras.models.load_model(tmp_path / "k.keras")
    assert loaded.key_dim == 3 and loaded.get_config() == model.get_config()
    assert [w.shape for w in loaded.weights] == [w.shape for w in model.weights]
    np.testing.assert_allclose(to_numpy(loaded((source, target))), before, atol=1e-6)
    # A configuration saved before the option (no "key_dim") builds the paper's d_k = d_model // num_heads.
    old = {key: value for key, value in model.get_config().items() if key != "key_dim"}
    assert kt.Transformer.from_config(old).encoder.encoder_layers[0].self_attention.key_dim == 8


def test_a_transformer_of_marians_shape_saves_and_loads_and_an_older_config_is_the_papers(tmp_path):
    """activation="silu" reaches every feed-forward network of both stacks, sinusoid_layout="halves" both
    embeddings, output_bias=True adds a weight (set nonzero), layer_norm_epsilon=1e-5 reaches every LayerNorm; the
    .keras file keeps them (the same outputs), and a configuration saved before the options (none of the keys)
    builds the paper's ReLU, interleaved sinusoids, no bias, and the library's epsilon of 1e-6."""
    rng = np.random.default_rng(5)
    source, target = random_ids(rng, 2, 6), random_ids(rng, 2, 5)
    model = kt.Transformer.from_preset("tiny", source_vocab_size=VOCAB, target_vocab_size=VOCAB + 3,
                                       activation="silu", sinusoid_layout="halves", output_bias=True,
                                       layer_norm_epsilon=1e-5)
    model.build()
    model.logits_bias.assign(np.random.default_rng(6).normal(size=(VOCAB + 3,)).astype("float32"))
    before = to_numpy(model((source, target)))
    layers = model.encoder.encoder_layers + model.decoder.decoder_layers
    assert [layer.feed_forward.activation for layer in layers] == ["silu"] * len(layers)
    assert model.source_embedding.sinusoid_layout == model.target_embedding.sinusoid_layout == "halves"
    norms = [layer for layer in model._flatten_layers() if isinstance(layer, keras.layers.LayerNormalization)]
    assert len(norms) == 2 * 2 + 2 * 3 and {norm.epsilon for norm in norms} == {1e-5}
    model.save(tmp_path / "a.keras")
    loaded = keras.models.load_model(tmp_path / "a.keras")
    assert (loaded.activation, loaded.sinusoid_layout, loaded.output_bias, loaded.layer_norm_epsilon) == (
        "silu", "halves", True, 1e-5)
    assert loaded.get_config() == model.get_config()
    np.testing.assert_allclose(to_numpy(loaded((source, target))), before, atol=1e-6)
    config = model.get_config()
    del config["activation"], config["sinusoid_layout"], config["output_bias"], config["layer_norm_epsilon"]
    older = kt.Transformer.from_config(config)
    assert (older.activation, older.sinusoid_layout, older.output_bias, older.layer_norm_epsilon) == (
        "relu", "interleaved", False, 1e-6)
    assert older.decoder.decoder_layers[0].feed_forward.activation == "relu"
    assert older.target_embedding.sinusoid_layout == "interleaved"


def test_compiled_transformer_reloads_with_loss_metric_and_schedule(tmp_path, tiny_model):
    tiny_model.compile(
        optimizer=kt.paper_adam(32, warmup_steps=10),
        loss=kt.MaskedSparseCategoricalCrossentropy(label_smoothing=0.2),
        metrics=[kt.MaskedAccuracy()],
    )
    rng = np.random.default_rng(2)
    x = (random_ids(rng, 4, 5), random_ids(rng, 4, 5))
    y = random_ids(rng, 4, 5)
    tiny_model.fit(x, y, epochs=1, verbose=0)
    tiny_model.save(tmp_path / "c.keras")
    loaded = keras.models.load_model(tmp_path / "c.keras")
    assert loaded.loss.label_smoothing == 0.2
    np.testing.assert_allclose(loaded.evaluate(x, y, verbose=0), tiny_model.evaluate(x, y, verbose=0), rtol=1e-5)


LAYERS = [
    (kt.MultiHeadAttention, dict(num_heads=2, key_dim=8)),
    (kt.PositionalEmbedding, dict(vocab_size=VOCAB, d_model=D_MODEL, dropout=0.2)),
    (kt.PositionalEmbedding, dict(vocab_size=VOCAB, d_model=D_MODEL, learned_positions=True, max_positions=9)),
    (kt.FeedForward, dict(d_model=D_MODEL, d_ff=D_FF)),
    (kt.FeedForward, dict(d_model=D_MODEL, d_ff=D_FF, dropout=0.2)),
    (kt.FeedForward, dict(d_model=D_MODEL, d_ff=D_FF, activation="silu")),
    (kt.EncoderLayer, dict(d_model=D_MODEL, num_heads=HEADS, d_ff=D_FF, dropout=0.3, norm_first=True)),
    (kt.EncoderLayer, dict(d_model=D_MODEL, num_heads=HEADS, d_ff=D_FF, attention_dropout=0.1, activation_dropout=0.2)),
    (kt.EncoderLayer, dict(d_model=D_MODEL, num_heads=HEADS, d_ff=D_FF, key_dim=3)),
    (kt.DecoderLayer, dict(d_model=D_MODEL, num_heads=HEADS, d_ff=D_FF, key_dim=5)),
    (kt.DecoderLayer, dict(d_model=D_MODEL, num_heads=HEADS, d_ff=D_FF, activation="gelu")),
    (kt.DecoderLayer, dict(d_model=D_MODEL, num_heads=HEADS, d_ff=D_FF, dropout=0.3)),
    (kt.Encoder, dict(num_layers=2, d_model=D_MODEL, num_heads=HEADS, d_ff=D_FF)),
    (kt.Decoder, dict(num_layers=2, d_model=D_MODEL, num_heads=HEADS, d_ff=D_FF, norm_first=True)),
    (kt.Decoder, dict(num_layers=2, d_model=D_MODEL, num_heads=HEADS, d_ff=D_FF, norm_first=True,
                      layer_norm_epsilon=1e-5)),
    (kt.Decoder, dict(num_layers=2, d_model=D_MODEL, num_heads=HEADS, d_ff=D_FF, attention_dropout=0.1,
                      activation_dropout=0.2, use_cross_attention=False)),
    (kt.Transformer, dict(vocab_size=VOCAB, **kt.PRESETS["tiny"])),
    (kt.Transformer, dict(vocab_size=VOCAB, **kt.PRESETS["tiny"], key_dim=3)),
    (kt.Transformer, dict(vocab_size=VOCAB, **kt.PRESETS["tiny"], activation="swish", sinusoid_layout="halves",
                          output_bias=True)),
    (kt.Transformer, dict(source_vocab_size=11, target_vocab_size=13, d_model=16, num_heads=2, d_ff=8,
                          num_encoder_layers=1, num_decoder_layers=3, tie_output_embedding=False)),
]


@pytest.mark.parametrize("cls,kwargs", LAYERS, ids=lambda v: getattr(v, "__name__", ""))
def test_from_config_of_get_config(cls, kwargs):
    obj = cls(**kwargs)
    config = obj.get_config()
    for key, value in kwargs.items():
        assert config[key] == value
    again = cls.from_config(config)
    assert again.get_config() == config
    # Serialized by registered name, so a .keras file finds the class again.
    assert keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(obj)).get_config() == config


@pytest.mark.parametrize(
    "obj",
    [kt.TransformerSchedule(256, 100), kt.MaskedSparseCategoricalCrossentropy(0.3),
     kt.MaskedRDropCrossentropy(kl_weight=2.5, label_smoothing=0.2), kt.MaskedAccuracy(name="acc")],
    ids=lambda o: type(o).__name__,
)
def test_schedule_loss_metric_round_trip(obj):
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(obj))
    assert type(again) is type(obj)
    assert again.get_config() == obj.get_config()


def test_build_creates_every_weight_before_the_first_call():
    model = kt.Transformer.from_preset("tiny", vocab_size=VOCAB)
    model.build()
    count = len(model.weights)
    model((np.ones((1, 3), "int32"), np.ones((1, 2), "int32")))
    assert len(model.weights) == count


def test_transformer_takes_its_old_max_length_argument_as_max_positions_with_a_deprecation_warning():
    tiny = dict(vocab_size=VOCAB, **kt.PRESETS["tiny"], learned_positions=True)
    message = (r"^Transformer\(max_length=\.\.\.\) is now Transformer\(max_positions=\.\.\.\) \(read as such; "
               r"the old name will be removed in keras-transformer 0\.3\.0\)$")
    with pytest.warns(DeprecationWarning, match=message) as caught:
        old = kt.Transformer(**tiny, max_length=8)
    # The warning points at the call that used the old name.
    assert [w.filename for w in caught if "max_length" in str(w.message)] == [__file__]
    assert old.max_positions == old.target_embedding.max_positions == 8
    assert old.get_config()["max_positions"] == 8 and "max_length" not in old.get_config()
    with pytest.raises(ValueError, match="got max_positions=8 and max_length=8: max_length is max_positions's old"):
        kt.Transformer(**tiny, max_positions=8, max_length=8)
    message = r"^PositionalEmbedding\(max_length=\.\.\.\) is now PositionalEmbedding\(max_positions=\.\.\.\)"
    with pytest.warns(DeprecationWarning, match=message):
        layer = kt.PositionalEmbedding(VOCAB, D_MODEL, learned_positions=True, max_length=9)
    assert layer.max_positions == 9 and "max_length" not in layer.get_config()
    with pytest.raises(ValueError, match="max_length is max_positions's old name, give max_positions only"):
        kt.PositionalEmbedding(VOCAB, D_MODEL, learned_positions=True, max_positions=9, max_length=9)
    # Both names given is refused whatever the values: the new one at its default too.
    with pytest.raises(ValueError, match="got max_positions=None and max_length=9"):
        kt.PositionalEmbedding(VOCAB, D_MODEL, learned_positions=True, max_positions=None, max_length=9)
    with pytest.raises(ValueError, match="got max_positions=None and max_length=8"):
        kt.Transformer(VOCAB, learned_positions=True, max_positions=None, max_length=8)


def test_an_old_keyword_beside_its_new_name_is_refused_whatever_the_values():
    """`renamed_arguments` sees whether the new name was passed, not whether its value differs from the
    default: `kl_weight=5.0, alpha=2` (5.0 the default) is refused, as is the new name given by position."""
    from keras_transformer.renamed import REMOVED_IN, renamed_arguments

    @renamed_arguments(alpha="kl_weight")
    def loss(kl_weight=5.0, label_smoothing=0.1):
        return kl_weight, label_smoothing

    for call in (lambda: loss(kl_weight=5.0, alpha=2), lambda: loss(5.0, alpha=2)):
        with pytest.raises(ValueError, match=r"^loss got kl_weight=5\.0 and alpha=2: alpha is kl_weight's old name, "
                                             r"give kl_weight only$"):
            call()
    with pytest.warns(DeprecationWarning, match=rf"^loss\(alpha=\.\.\.\) is now loss\(kl_weight=\.\.\.\) \(read as "
                                                rf"such; the old name will be removed in keras-transformer "
                                                rf"{re.escape(REMOVED_IN)}\)$"):
        assert loss(alpha=2, label_smoothing=0.0) == (2, 0.0)
    assert loss() == (5.0, 0.1) and loss(kl_weight=1.0) == (1.0, 0.1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'beta'"):
        loss(beta=1)


def _no_max_length_warning(load):
    """`load()`, asserting it warned of no max_length (a saved file is not the caller's to fix)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load()
    assert [str(w.message) for w in caught if "max_length" in str(w.message)] == []
    return loaded


def test_a_config_saved_with_max_length_loads_as_max_positions():
    # What a configuration written before the rename holds (config.json's "model_config" too): "max_length".
    new = kt.Transformer(vocab_size=VOCAB, **kt.PRESETS["tiny"], learned_positions=True, max_positions=8).get_config()
    old = {**{k: v for k, v in new.items() if k != "max_positions"}, "max_length": 8}
    loaded = _no_max_length_warning(lambda: kt.Transformer.from_config(old))
    assert loaded.max_positions == loaded.target_embedding.max_positions == 8
    assert loaded.get_config() == new  # saved again, it writes max_positions
    # An old configuration merged with new overrides: a None of either name gives way to the other.
    for merged in ({**old, "max_positions": None}, {**old, "max_length": None, "max_positions": 8}):
        assert _no_max_length_warning(lambda: kt.Transformer.from_config(merged)).max_positions == 8
    with pytest.raises(ValueError, match="got max_positions=16 and max_length=8"):
        kt.Transformer.from_config({**old, "max_positions": 16})
    layer = kt.PositionalEmbedding(VOCAB, D_MODEL, learned_positions=True, max_positions=9).get_config()
    old_layer = {**{k: v for k, v in layer.items() if k != "max_positions"}, "max_length": 9}
    serialized = keras.saving.serialize_keras_object(kt.PositionalEmbedding(VOCAB, D_MODEL))
    loaded = _no_max_length_warning(lambda: keras.saving.deserialize_keras_object({**serialized,
                                                                                    "config": old_layer}))
    assert loaded.max_positions == 9 and loaded.get_config() == layer


def test_a_keras_file_saved_with_max_length_loads_as_max_positions(tmp_path):
    model = kt.Transformer.from_preset("tiny", vocab_size=VOCAB, learned_positions=True, max_positions=8)
    rng = np.random.default_rng(3)
    inputs = (random_ids(rng, 2, 6), random_ids(rng, 2, 5))
    expected = to_numpy(model(inputs))
    path = tmp_path / "old.keras"
    model.save(path)
    with zipfile.ZipFile(path) as z:  # rewritten as the file was before the rename
        members = {name: z.read(name) for name in z.namelist()}
    config = json.loads(members["config.json"])
    config["config"]["max_length"] = config["config"].pop("max_positions")
    members["config.json"] = json.dumps(config).encode()
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    loaded = _no_max_length_warning(lambda: keras.models.load_model(path))
    assert loaded.max_positions == 8
    np.testing.assert_allclose(to_numpy(loaded(inputs)), expected, atol=1e-6)
