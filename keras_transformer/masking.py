"""The masks of the paper, built once and passed explicitly (section 3.2.3).

Padding masks come from the token ids (pad id 0): a Keras mask does not
survive a `tf.function` or a model boundary, so the ids are the source of
truth. Inside a user's own functional model the layers also accept the Keras
mask that `PositionalEmbedding` attaches, through the `mask` arguments Keras
fills in itself (on every backend, `jax.jit` included).
"""

from keras import ops

PAD_ID = 0
# The score of what must not be chosen: a masked attention position before its softmax (as Keras' own
# Softmax does), and a banned token, an empty hypothesis or a missing beam in the searches.
MASKED_SCORE = -1e9


def padding_mask(token_ids):
    """`[batch, length]` bool, True at real tokens (pad id is 0)."""
    return ops.not_equal(token_ids, PAD_ID)


def causal_mask(query_length, key_length=None, start=0):
    """`[1, query_length, key_length]` bool: query `start + i` attends to keys `<= start + i`.

    With the defaults, the square mask of a full pass (position i sees 0..i).
    In incremental decoding the queries are the new positions from `start`
    and the keys are the whole cache (`key_length` slots).
    """
    key_length = query_length if key_length is None else key_length
    query_positions = ops.cast(start, "int32") + ops.arange(query_length, dtype="int32")[:, None]
    key_positions = ops.arange(key_length, dtype="int32")[None, :]
    return ops.less_equal(key_positions, query_positions)[None]


def first_mask(*masks):
    """The first of `masks` that is not None (an explicit padding mask before a Keras mask), or None."""
    return next((mask for mask in masks if mask is not None), None)
