"""Reproducible random numbers for sampling: a hash of (seed, step, token id), one seed per row.

Sampling draws each output token from the model's distribution by the
Gumbel-max trick: the most likely token after adding Gumbel noise
-log(-log(u)), u uniform in (0, 1), to each log-probability (Gumbel, 1954;
Maddison et al., 2014, "A* Sampling"). The uniforms come from an integer hash
of the row's seed, the output position and the token id, not from a random
generator's state:

- a sentence is sampled the same alone or in any batch (each row has its own
  seed; `keras.random` takes one seed for the whole tensor);
- the same seed gives the same sample on JAX, PyTorch and TensorFlow, and in
  the TensorFlow serving engine (the hash is exact integer arithmetic);
- nothing is stateful, so the searches stay pure functions under `jax.jit`
  and in a SavedModel.

The hash is "lowbias32" (C. Wellons, hash-prospector): xor-shifts and two
multiplications, on int32 whose multiplication wraps around (it does on every
backend; `tests/portable/test_search_options.py` checks it against numpy's uint32).
"""

from keras import ops

# 0x7FEB352D and 0x846CA68B, lowbias32's multipliers, as int32 (the second is above 2^31).
_MULTIPLIERS = (0x7FEB352D, 0x846CA68B - (1 << 32))
# The hash's top 23 bits: (bits + 0.5) / 2^23 is then below 1.0 in float32 (with 24, the largest rounds up to 1.0).
_UNIFORM_BITS = 23


def _shift_right(x, bits):
    """Logical right shift of int32 `x` (`right_shift` of a negative int32 is arithmetic on some backends)."""
    return ops.bitwise_and(ops.right_shift(x, bits), (1 << (32 - bits)) - 1)


def hash32(x):
    """lowbias32 of int32 `x`, elementwise: a 32-bit hash whose output bits each depend on every input bit."""
    x = ops.cast(x, "int32")
    x = ops.bitwise_xor(x, _shift_right(x, 16)) * _MULTIPLIERS[0]
    x = ops.bitwise_xor(x, _shift_right(x, 15)) * _MULTIPLIERS[1]
    return ops.bitwise_xor(x, _shift_right(x, 16))


def uniform_noise(seeds, step, vocab_size):
    """float32 `[rows, vocab_size]`, each in (0, 1): the uniforms of each row's seed (`seeds` int `[rows]`)
    at output position `step` (a scalar), one per token id. The same inputs give the same numbers everywhere."""
    row_keys = hash32(ops.bitwise_xor(hash32(seeds), ops.cast(step, "int32")))
    token_keys = hash32(ops.bitwise_xor(ops.arange(vocab_size, dtype="int32"), _MULTIPLIERS[0]))
    bits = _shift_right(hash32(ops.bitwise_xor(row_keys[:, None], token_keys[None])), 32 - _UNIFORM_BITS)
    return (ops.cast(bits, "float32") + 0.5) / float(1 << _UNIFORM_BITS)


def gumbel_noise(seeds, step, vocab_size):
    """float32 `[rows, vocab_size]` standard Gumbel noise, -log(-log(u)), of `uniform_noise`."""
    return -ops.log(-ops.log(uniform_noise(seeds, step, vocab_size)))
