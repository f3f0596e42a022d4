"""What every encoder/decoder layer and stack shares: the paper's hyper-parameters, stored and serialized once."""

import keras

from keras_transformer.attention import MultiHeadAttention, head_size
from keras_transformer.feed_forward import activation_function
from keras_transformer.residual import LAYER_NORM_EPSILON, layer_norm


class TransformerLayerBase(keras.layers.Layer):
    """Holds d_model, num_heads, d_ff, dropout (P_drop), norm_first, attention_dropout, activation_dropout,
    key_dim, activation and layer_norm_epsilon (see `EncoderLayer` for their meaning).

    Output shape = the shape of the first input (every sub-layer keeps `[batch, length, d_model]`).
    """

    def __init__(self, d_model, num_heads, d_ff, dropout=0.1, norm_first=False, *, attention_dropout=0.0,
                 activation_dropout=0.0, key_dim=None, activation="relu", layer_norm_epsilon=LAYER_NORM_EPSILON,
                 **kwargs):
        super().__init__(**kwargs)
        activation_function(activation, type(self).__name__)
        if isinstance(layer_norm_epsilon, bool) or not isinstance(layer_norm_epsilon, (int, float)) or not (
                layer_norm_epsilon > 0):
            raise ValueError(f"{type(self).__name__}: layer_norm_epsilon must be a number > 0, got "
                             f"{layer_norm_epsilon!r}.")
        for name, rate in (("dropout", dropout), ("attention_dropout", attention_dropout),
                           ("activation_dropout", activation_dropout)):
            if not 0.0 <= rate < 1.0:
                raise ValueError(f"{type(self).__name__}: {name} must be in [0, 1), got {rate!r}.")
        self.value_dim = head_size(d_model, num_heads)
        if key_dim is not None and (isinstance(key_dim, bool) or not isinstance(key_dim, int) or key_dim < 1):
            raise ValueError(f"{type(self).__name__}: key_dim must be a positive int (the attention's query and "
                             f"key size per head, d_k) or None (d_model // num_heads), got {key_dim!r}.")
        self.key_dim = key_dim
        self.d_model = d_model
        self.num_heads = num_heads
        self.d_ff = d_ff
        self.dropout = dropout
        self.norm_first = norm_first
        self.attention_dropout = attention_dropout
        self.activation_dropout = activation_dropout
        self.activation = activation
        self.layer_norm_epsilon = layer_norm_epsilon
        self.supports_masking = True

    def _attention(self, name):
        """A `MultiHeadAttention` of this layer's heads: query/key size per head `key_dim` (d_k; None:
        d_model // num_heads), value size per head d_model // num_heads (d_v), output d_model."""
        return MultiHeadAttention(
            self.num_heads, self.key_dim or self.value_dim, value_dim=self.value_dim, dropout=self.attention_dropout,
            dtype=self.dtype_policy, name=name,
        )

    def _norm(self, name):
        """A LayerNorm of this layer's epsilon (`layer_norm_epsilon`)."""
        return layer_norm(self.dtype_policy, name, self.layer_norm_epsilon)

    def compute_output_shape(self, x_shape, *args, **kwargs):
        return x_shape

    def get_config(self):
        return {
            **super().get_config(),
            "d_model": self.d_model,
            "num_heads": self.num_heads,
            "d_ff": self.d_ff,
            "dropout": self.dropout,
            "norm_first": self.norm_first,
            "attention_dropout": self.attention_dropout,
            "activation_dropout": self.activation_dropout,
            "key_dim": self.key_dim,
            "activation": self.activation,
            "layer_norm_epsilon": self.layer_norm_epsilon,
        }


class TransformerStackBase(TransformerLayerBase):
    """`TransformerLayerBase` plus N, the number of identical layers (6 in the paper)."""

    def __init__(self, num_layers, d_model, num_heads, d_ff, dropout=0.1, norm_first=False, **kwargs):
        super().__init__(d_model, num_heads, d_ff, dropout, norm_first, **kwargs)
        self.num_layers = num_layers

    def _identical_layers(self, layer_class, **kwargs):
        """N `layer_class` layers with this stack's settings, named layer_0 ... layer_{N-1}."""
        return [
            layer_class(self.d_model, self.num_heads, self.d_ff, self.dropout, self.norm_first,
                        attention_dropout=self.attention_dropout, activation_dropout=self.activation_dropout,
                        key_dim=self.key_dim, activation=self.activation,
                        layer_norm_epsilon=self.layer_norm_epsilon, dtype=self.dtype_policy, name=f"layer_{i}",
                        **kwargs)
            for i in range(self.num_layers)
        ]

    def _final_norm(self):
        """The LayerNorm that ends a pre-norm stack (None for the paper's post-norm)."""
        return self._norm("final_norm") if self.norm_first else None

    def _build_stack(self, layers, x_shape, *other_shapes):
        for layer in layers:
            layer.build(x_shape, *other_shapes)
        if self.final_norm is not None:
            self.final_norm.build(x_shape)
        self.built = True

    def get_config(self):
        return {**super().get_config(), "num_layers": self.num_layers}
