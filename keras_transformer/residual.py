"""The residual connection around every sub-layer (paper sections 3.1 and 5.4).

Post-norm (the paper): LayerNorm(x + Dropout(Sublayer(x))).
Pre-norm (`norm_first=True`): x + Dropout(Sublayer(LayerNorm(x))); the stack
then needs a final LayerNorm, which `Encoder`/`Decoder` add.

A layer writes each block in the open, so that what the sub-layer returns
besides its output (attention weights, a cache) stays an ordinary value:

```python
residual = x
x = norm_before(x, norm, norm_first)
x = sublayer(x)
x = add_and_norm_after(residual, x, norm, dropout, norm_first, training)
```
"""

import keras

LAYER_NORM_EPSILON = 1e-6


def layer_norm(dtype, name, epsilon=LAYER_NORM_EPSILON):
    """The LayerNorm of a residual block (or of a pre-norm stack's end)."""
    return keras.layers.LayerNormalization(epsilon=epsilon, dtype=dtype, name=name)


def norm_before(x, norm, norm_first):
    """The sub-layer's input: `norm(x)` in a pre-norm block, `x` itself in a post-norm one."""
    return norm(x) if norm_first else x


def add_and_norm_after(residual, sublayer_output, norm, dropout, norm_first, training):
    """`residual + Dropout(sublayer_output)`, then `norm` in a post-norm block."""
    x = residual + dropout(sublayer_output, training=training)
    return x if norm_first else norm(x)
