"""The residual connection around every sub-layer (paper sections 3.1 and 5.4)."""


def residual(x, sublayer, norm, dropout, norm_first, training):
    """Post-norm (the paper): LayerNorm(x + Dropout(Sublayer(x))).

    Pre-norm (`norm_first=True`): x + Dropout(Sublayer(LayerNorm(x))); the
    stack then needs a final LayerNorm, which `Encoder`/`Decoder` add.
    """
    if norm_first:
        return x + dropout(sublayer(norm(x)), training=training)
    return norm(x + dropout(sublayer(x), training=training))
