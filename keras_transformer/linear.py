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


def project_heads(x, denses):
    """`x` `[batch, length, dim]` through head projections at once: one 2-D matmul with their kernels side by side.

    Each `dense` is an `EinsumDense` "abc,cde->abde" with kernel
    `[dim, heads, head_dim]` and bias `[heads, head_dim]`; returns one
    `[batch, length, heads, head_dim]` per dense.
    """
    dtype = denses[0].compute_dtype
    x = ops.cast(x, dtype)
    dim = x.shape[-1]
    kernels = [ops.reshape(weight(dense.kernel, dtype), (dim, -1)) for dense in denses]
    y = ops.matmul(ops.reshape(x, (-1, dim)), kernels[0] if len(kernels) == 1 else ops.concatenate(kernels, axis=1))
    if denses[0].bias is not None:
        biases = [ops.reshape(weight(dense.bias, dtype), (-1,)) for dense in denses]
        y = y + (biases[0] if len(biases) == 1 else ops.concatenate(biases, axis=0))
    widths = [dense.kernel.shape[1] * dense.kernel.shape[2] for dense in denses]
    if len(set(widths)) == 1:  # equal parts (the paper's d_k = d_v): one split op, no size arithmetic
        outputs = ops.split(y, len(widths), axis=1) if len(widths) > 1 else [y]
    else:
        outputs = ops.split(y, [sum(widths[:i + 1]) for i in range(len(widths) - 1)], axis=1)
    return [ops.reshape(out, batch_and_length(x) + tuple(dense.kernel.shape[1:])) for out, dense in zip(outputs, denses)]


def project_output(heads, dense):
    """Heads `[batch, length, heads, head_dim]` through W^O (`EinsumDense` "abcd,cde->abe") as one 2-D matmul:
    `[batch, length, dim]`."""
    num_heads, head_dim, dim = dense.kernel.shape
    y = matmul_2d(ops.reshape(heads, (-1, num_heads * head_dim)), dense, num_heads * head_dim)
    return ops.reshape(y, batch_and_length(heads) + (dim,))


def batch_and_length(x):
    """The first two axes of `x` as a shape prefix: `(-1, length)` when the length is static (a decoding step
    in a compiled graph: no shape ops to run at every step), else both read from `ops.shape(x)`."""
    if x.shape[1]:  # static and not 0 (-1 cannot stand beside a 0)
        return (-1, x.shape[1])
    shape = ops.shape(x)
    return (shape[0], shape[1])
