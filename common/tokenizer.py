"""The sentencepiece vocabulary as TensorFlow ops (tensorflow-text), and how sentences become model inputs.

The same tokenizer runs in `tf.data` (training), in evaluation and inside the
exported graph. The vocabulary itself, its training and the special ids are in
`keras_transformer/text.py` (no TensorFlow there).

A run's tokenizer is one joint sentencepiece model (what kt-train trains), or a
`SourceTargetTokenizer`: one model per side in the same ids (an imported Marian
model's, `training/marian.py`). `source_side` and `target_side` pick a side of
either; the functions here take either.

Sequences:
  source     = pieces(source_text)[:max_source_length - 1] + [END_ID]
  target_in  = [START_ID] + pieces(target_text)
  target_out = pieces(target_text) + [END_ID]
"""

import tensorflow as tf
import tensorflow_text as tf_text

from keras_transformer.text import END_ID, PAD_ID, START_ID


def make_tokenizer(model_proto: bytes, *, sampling_alpha: float | None = None):
    """The tensorflow-text tokenizer (int32 ids, no bos/eos) for a sentencepiece model proto.

    By default it gives each text its most likely segmentation. With `sampling_alpha` (> 0) it samples a
    segmentation instead, anew at each call, from all of them with probabilities proportional to
    p(segmentation) ** sampling_alpha (sentencepiece's `nbest_size=-1`): subword regularization (Kudo, 2018,
    "Subword Regularization: Improving Neural Network Translation Models with Multiple Subword Candidates").
    Lower alpha samples more varied segmentations. For training only: the pieces still detokenize to the
    same text, but they are not the ones evaluation and the export see.
    """
    if sampling_alpha is not None and sampling_alpha < 0:
        raise ValueError(f"sampling_alpha must be positive, got {sampling_alpha}")
    sampling = dict(nbest_size=-1, alpha=float(sampling_alpha)) if sampling_alpha else {}
    return tf_text.SentencepieceTokenizer(model=model_proto, out_type="int32", add_bos=False, add_eos=False, **sampling)


class SourceTargetTokenizer(tf.Module):
    """Two tokenizers of one vocabulary: `source` reads the source text, `target` reads and writes the target's.
    Both give the model's ids. It has no `tokenize` of its own, so code that would tokenize without naming a
    side fails instead of picking one."""

    def __init__(self, source, target):
        super().__init__(name="source_target_tokenizer")
        self.source, self.target = source, target  # tracked: their resources are captured by the export's graph


def source_side(tokenizer):
    """The tokenizer of the source text: `tokenizer` itself, or a `SourceTargetTokenizer`'s `source`."""
    return tokenizer.source if isinstance(tokenizer, SourceTargetTokenizer) else tokenizer


def target_side(tokenizer):
    """The tokenizer of the target text: `tokenizer` itself, or a `SourceTargetTokenizer`'s `target`."""
    return tokenizer.target if isinstance(tokenizer, SourceTargetTokenizer) else tokenizer


def encode_source(tokenizer, texts, max_source_length: int | None = None):
    """Source ids for strings `[batch]`: pieces + [END_ID], truncated to `max_source_length` (end id kept).

    Returns a `tf.RaggedTensor` `[batch, (len)]`; `.to_tensor(PAD_ID)` pads it.
    """
    return source_from_pieces(source_side(tokenizer).tokenize(texts), max_source_length)


def source_from_pieces(pieces, max_source_length: int | None = None):
    """Ragged piece ids `[batch, (len)]` -> the source: at most `max_source_length - 1` pieces, then END_ID."""
    if max_source_length is not None:
        pieces = pieces[:, : max_source_length - 1]
    end = tf.fill([pieces.nrows(), 1], tf.constant(END_ID, pieces.dtype))
    return tf.concat([pieces, end], axis=1)


def encode_pair(tokenizer, source_text, target_text):
    """One training pair of scalar strings -> (source, target_in, target_out), int32 `[len]` each."""
    source = tf.cast(source_side(tokenizer).tokenize(source_text), tf.int32)
    target = tf.cast(target_side(tokenizer).tokenize(target_text), tf.int32)
    return (tf.concat([source, [END_ID]], 0), tf.concat([[START_ID], target], 0), tf.concat([target, [END_ID]], 0))


def decode_output(tokenizer, tokens):
    """Decoded tokens `[batch, length]` -> strings `[batch]`.

    Everything from the first end id on, and padding, is dropped before
    detokenizing; the text has no whitespace at either end (an output that
    ends on a lone word-boundary piece, "▁", would end with a space), as
    transformers' `MarianTokenizer.decode` gives it.
    """
    before_end = tf.equal(tf.cumsum(tf.cast(tf.equal(tokens, END_ID), tf.int32), axis=1), 0)
    keep = tf.logical_and(before_end, tf.not_equal(tokens, PAD_ID))
    return tf.strings.strip(tf.reshape(target_side(tokenizer).detokenize(tf.ragged.boolean_mask(tokens, keep)), [-1]))
