"""The masks of the paper, built once and passed explicitly (section 3.2.3).

Padding masks come from the token ids (pad id 0): a Keras mask does not
survive a `tf.function` or a model boundary, so the ids are the source of
truth. `keras_mask` is only the fallback for layers used inside a user's own
functional model, where `PositionalEmbedding` attaches one.
"""

import tensorflow as tf

PAD_ID = 0


def padding_mask(token_ids):
    """`[batch, length]` bool, True at real tokens (pad id is 0)."""
    return tf.not_equal(token_ids, PAD_ID)


def causal_mask(query_length, key_length=None, start=0):
    """`[1, query_length, key_length]` bool: query `start + i` attends to keys `<= start + i`.

    With the defaults, the square mask of a full pass (position i sees 0..i).
    In incremental decoding the queries are the new positions from `start`
    and the keys are the whole cache (`key_length` slots).
    """
    key_length = query_length if key_length is None else key_length
    query_positions = start + tf.range(query_length)[:, None]
    key_positions = tf.range(key_length)[None, :]
    return (key_positions <= query_positions)[None]


def keras_mask(x):
    """The Keras padding mask an upstream layer attached to `x` (e.g. `PositionalEmbedding`), or None."""
    return getattr(x, "_keras_mask", None)
