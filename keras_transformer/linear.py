"""x W + b as one 2-D matrix multiplication, on the weights of Keras' `Dense` and `EinsumDense` layers.

The layers keep their Keras sub-layers (same weights, same names in a `.keras`
file) but compute with these: a Keras `Dense` on a 3-D input is a tensordot
and an `EinsumDense` an einsum, and a 2-D matmul over `[batch * length, dim]`
trains faster (one weight gradient, not one per sentence summed).
"""

from keras import ops


def is_plain(dense):
    """True when `dense` computes x W + b with a float kernel (not quantized), which `matmul_2d` reproduces."""
    return dense.quantization_mode is None


def weight(variable, dtype):
    """A Keras variable's value in the compute dtype (bfloat16 under mixed precision)."""
    return ops.cast(variable, dtype)


def matmul_2d(x, dense, in_features=None):
    """`x` `[n, in_features]` times `dense`'s kernel reshaped to `[in_features, -1]`, plus its bias.

    `in_features` defaults to the kernel's first axis (`Dense`, or an `EinsumDense`
    "abc,cde->abde" head projection); W^O's kernel `[heads, head_dim, dim]` needs
    `heads * head_dim`. Returns `[n, out_features]` in the layer's compute dtype.
    """
    dtype = dense.compute_dtype
    in_features = dense.kernel.shape[0] if in_features is None else in_features
    y = ops.matmul(ops.cast(x, dtype), ops.reshape(weight(dense.kernel, dtype), (in_features, -1)))
    if dense.bias is not None:
        y = y + ops.reshape(weight(dense.bias, dtype), (-1,))
    return y
