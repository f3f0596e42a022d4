"""Every read of Keras' private state in the library, in one place.

Written for Keras 3.15 (setup.py pins `keras>=3.15,<3.16`): on a Keras upgrade, check each attribute
below against `keras.layers.MultiHeadAttention`'s source. Keras keeps the attention's four projections,
its options, its dropout layer and its mask rules in private attributes and methods; the library's
`MultiHeadAttention` computes with those weights (`keras_transformer.linear`) through its public
`projections` and `is_plain()`, which read them here, as do the functions below.
"""

from typing import Any, NamedTuple

from keras_transformer.linear import is_plain


class AttentionProjections(NamedTuple):
    """The four `EinsumDense` projections of a `keras.layers.MultiHeadAttention`: W^Q, W^K, W^V (kernels
    `[dim, num_heads, head_dim]`) and W^O (kernel `[num_heads, head_dim, dim]`)."""

    query: Any
    key: Any
    value: Any
    output: Any


def attention_projections(layer) -> AttentionProjections:
    """`layer`'s projections (Keras 3.15: `_query_dense`, `_key_dense`, `_value_dense`, `_output_dense`)."""
    return AttentionProjections(layer._query_dense, layer._key_dense, layer._value_dense, layer._output_dense)


def attention_is_plain(layer) -> bool:
    """True when `layer` computes the paper's attention: no gate or sliding window (options newer than
    Keras 3.12, hence `getattr`), attention over the sequence axis only, float (not quantized) kernels."""
    return (
        not getattr(layer, "_use_gate", False)
        and getattr(layer, "_sliding_window", None) is None
        and tuple(layer._attention_axes) == (1,)
        and all(is_plain(dense) for dense in attention_projections(layer))
    )


def attention_dropout_layer(layer):
    """The `Dropout` that `layer` applies to its attention weights (Keras 3.15: `_dropout_layer`)."""
    return layer._dropout_layer


def attention_mask_of_call(layer, query, value, **masks):
    """The `[batch, query_len, key_len]` mask (or None) that Keras' `MultiHeadAttention.call` builds from
    `attention_mask`, `query_mask`, `value_mask`, `key_mask`, `use_causal_mask` and the inputs' Keras masks
    (Keras 3.15: `_compute_attention_mask`)."""
    return layer._compute_attention_mask(query, value, **masks)
