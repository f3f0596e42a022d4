"""Token embedding plus positional encoding (paper sections 3.4 and 3.5)."""

import math

import keras
from keras import ops

from keras_transformer.masking import PAD_ID
from keras_transformer.renamed import renamed_arguments


# How the sinusoids are laid out along d_model: "interleaved", the paper's (sin in the even columns, cos in the
# odd ones), or "halves", Marian's and OPUS-MT's (the sin of every frequency, then the cos of every frequency).
SINUSOID_LAYOUTS = ("interleaved", "halves")


def positional_encoding(positions, d_model, dtype="float32", layout="interleaved"):
    """The paper's sinusoidal encoding (section 3.5) at the given positions.

    PE(pos, 2i)   = sin(pos / 10000^(2i / d_model))
    PE(pos, 2i+1) = cos(pos / 10000^(2i / d_model))

    With `layout="halves"` the same values sit in another order, Marian's: column i holds the sin of
    frequency i and column d_model/2 + i its cos, for i < d_model/2.

    Args:
        positions: int tensor `[length]`.
        d_model: even model width.
        dtype: dtype of the result.
        layout: "interleaved" (default, the paper's) or "halves" (`SINUSOID_LAYOUTS`).

    Returns:
        `[length, d_model]` tensor.
    """
    if d_model % 2:
        raise ValueError(f"positional_encoding needs an even d_model, got d_model={d_model}.")
    check_sinusoid_layout(layout, "positional_encoding")
    positions = ops.cast(positions, "float32")[:, None]
    two_i = ops.arange(0, d_model, 2, dtype="float32")[None, :]
    angles = positions / ops.power(10000.0, two_i / d_model)
    if layout == "halves":
        encoding = ops.concatenate([ops.sin(angles), ops.cos(angles)], axis=-1)
    else:  # interleave, so that even columns hold sin and odd columns cos
        encoding = ops.reshape(ops.stack([ops.sin(angles), ops.cos(angles)], axis=-1), (-1, d_model))
    return ops.cast(encoding, dtype)


def check_sinusoid_layout(layout, owner):
    """A ValueError naming `owner` unless `layout` is one of `SINUSOID_LAYOUTS`."""
    if layout not in SINUSOID_LAYOUTS:
        raise ValueError(f"{owner}: sinusoid_layout must be one of {', '.join(map(repr, SINUSOID_LAYOUTS))}, "
                         f"got {layout!r}.")


@keras.saving.register_keras_serializable(package="keras_transformer")
class PositionalEmbedding(keras.layers.Layer):
    """Embedding(tokens) * sqrt(d_model) + positional encoding, then dropout.

    Token id 0 is padding: `compute_mask` returns `token_ids != 0`, so Keras
    layers downstream (and this library's encoder/decoder layers) see it.

    Args:
        vocab_size: number of token ids.
        d_model: embedding width.
        dropout: dropout rate on the sum (paper section 5.4, P_drop).
        learned_positions: learn a `[max_positions, d_model]` position table
            instead of the sinusoids (the paper's variant in table 3, row E).
        max_positions: number of learned positions (required then): inputs
            may cover positions 0 to max_positions - 1 only, and longer ones
            raise an error that names max_positions. `max_length=` is its old
            name, still accepted (with a `DeprecationWarning`; a saved
            configuration with "max_length" loads without one).
        sinusoid_layout: the sinusoids' order along d_model: "interleaved"
            (default, the paper's) or "halves" (Marian's: every sin, then
            every cos; see `positional_encoding`). Learned positions have none.

    Shapes:
        call(token_ids `[batch, length]`, start_index=0) -> `[batch, length, d_model]`.
        `start_index` offsets the positions, for decoding one step at a time.

    Example:

    ```python
    ids = keras.Input(shape=(None,), dtype="int32")
    x = PositionalEmbedding(vocab_size=8000, d_model=512)(ids)  # masked where ids == 0
    ```

    The embedding is initialised with stddev d_model^-0.5, so after the
    sqrt(d_model) scale the vectors have unit scale, and the matrix also
    works as the tied output projection (`embedding.token_embedding.embeddings`).
    """

    @renamed_arguments(max_length="max_positions")
    def __init__(
        self,
        vocab_size,
        d_model,
        dropout=0.0,
        learned_positions=False,
        max_positions=None,
        sinusoid_layout="interleaved",
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_sinusoid_layout(sinusoid_layout, type(self).__name__)
        if learned_positions and not max_positions:
            raise ValueError("PositionalEmbedding(learned_positions=True) needs max_positions.")
        if not learned_positions and d_model % 2:
            raise ValueError(f"The sinusoidal encoding needs an even d_model, got d_model={d_model}.")
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.dropout = dropout
        self.learned_positions = learned_positions
        self.max_positions = max_positions
        self.sinusoid_layout = sinusoid_layout
        self.token_embedding = keras.layers.Embedding(
            vocab_size,
            d_model,
            embeddings_initializer=keras.initializers.RandomNormal(stddev=d_model**-0.5),
            dtype=self.dtype_policy,
            name="token_embedding",
        )
        self.position_embedding = (
            keras.layers.Embedding(max_positions, d_model, dtype=self.dtype_policy, name="position_embedding")
            if learned_positions
            else None
        )
        self.dropout_layer = keras.layers.Dropout(dropout, dtype=self.dtype_policy)
        self.supports_masking = True

    def build(self, input_shape=None):
        self.token_embedding.build((None, None))
        if self.position_embedding is not None:
            self.position_embedding.build((None,))
        self.built = True

    def call(self, token_ids, start_index=0, training=None):
        if len(token_ids.shape) != 2:
            raise ValueError(
                "PositionalEmbedding expects token ids of shape [batch, length] (rank 2), "
                f"got shape {token_ids.shape}."
            )
        length = ops.shape(token_ids)[1]
        positions = ops.cast(start_index, "int32") + ops.arange(length, dtype="int32")
        x = self.token_embedding(token_ids) * ops.cast(math.sqrt(self.d_model), self.compute_dtype)
        if self.position_embedding is not None:
            self._check_within_table(start_index, length)
            x = x + self.position_embedding(positions)[None]
        else:
            x = x + positional_encoding(positions, self.d_model, self.compute_dtype, self.sinusoid_layout)[None]
        return self.dropout_layer(x, training=training)

    def _check_within_table(self, start_index, length):
        """A ValueError naming max_positions when the positions run past the learned table.

        Past its end a gather fails with an obscure message deep in the graph
        on CPU, and silently returns zeros on GPU. Checked wherever the
        positions are known when the call runs or is traced (eager calls, and
        static shapes with a Python start index); the searches never pass the
        table (their output bound stops there).
        """
        end = _concrete_int(start_index), _concrete_int(length)
        if None in end or sum(end) <= self.max_positions:
            return
        raise ValueError(
            f"PositionalEmbedding(learned_positions=True, max_positions={self.max_positions}) has no position past "
            f"{self.max_positions - 1}; this input needs max_positions >= start_index + length = {sum(end)}."
        )

    def compute_mask(self, token_ids, mask=None):
        return ops.not_equal(token_ids, PAD_ID)

    def compute_output_shape(self, input_shape):
        return (*input_shape, self.d_model)

    def get_config(self):
        return {
            **super().get_config(),
            "vocab_size": self.vocab_size,
            "d_model": self.d_model,
            "dropout": self.dropout,
            "learned_positions": self.learned_positions,
            "max_positions": self.max_positions,
            "sinusoid_layout": self.sinusoid_layout,
        }

    @classmethod
    def from_config(cls, config):
        return super().from_config(saved_max_positions(config))


def saved_max_positions(config):
    """`config` (a `PositionalEmbedding`'s or `Transformer`'s) with a "max_length" saved before it was renamed
    "max_positions" (a .keras file, config.json's "model_config") read as "max_positions", without a warning:
    a saved file is not the caller's to fix. A None of either name gives way to the other's value (an old
    configuration merged with new overrides); two different numbers stay, and the constructor refuses them."""
    config = dict(config)
    if "max_length" in config:
        if config.get("max_positions") is None:
            config["max_positions"] = config.pop("max_length")
        elif config["max_length"] in (None, config["max_positions"]):
            del config["max_length"]
    return config


def _concrete_int(value):
    """`value` as a Python int where it is known now (a number, or an eager tensor), else None (traced)."""
    if value is None:
        return None
    try:
        return int(value)
    except Exception:  # a symbolic TF tensor, a JAX tracer: not known until it runs
        return None
