"""Every read of Keras' private state in the library, in one place.

Written for Keras 3.15 (setup.py pins `keras>=3.15,<3.16`): on a Keras upgrade, check each attribute
below against `keras.layers.MultiHeadAttention`'s source. Keras keeps the attention's four projections
and its options in private attributes; the library's `MultiHeadAttention` computes with those weights
(`keras_transformer.linear`), and so does the TensorFlow serving engine (`export/step.py`), through
the layer's public `projections` and `is_plain()`, which read them here.
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
