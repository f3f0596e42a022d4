"""Text <-> ids: the subword vocabulary, the special ids, and how sentences become model inputs.

One joint (source + target) sentencepiece vocabulary, trained with the
`sentencepiece` package and applied with tensorflow-text's
`SentencepieceTokenizer`, so the same tokenizer runs in `tf.data`, in
evaluation and inside the exported graph.

Special ids (defined here once; `PAD_ID` comes from `masking`, where the
masks are built from it): pad 0, unk 1, start (bos) 2, end (eos) 3.

Sequences:
  source     = pieces(source_text)[:max_length - 1] + [END_ID]
  target_in  = [START_ID] + pieces(target_text)
  target_out = pieces(target_text) + [END_ID]
Model outputs are turned back into text by `decode_output`: everything from
the first end id on, and padding, dropped before detokenizing.
"""

from __future__ import annotations

import io
from pathlib import Path

import sentencepiece as spm
import tensorflow as tf
import tensorflow_text as tf_text

from keras_transformer.masking import PAD_ID

UNK_ID = 1
START_ID = 2  # sentencepiece's bos: the decoder's first input
END_ID = 3  # sentencepiece's eos: ends every source and every output
DEFAULT_VOCAB_SIZE = 8000

# Every vocabulary of the project: cased, all characters kept (byte fallback), these ids.
_SENTENCEPIECE_OPTIONS = {
    "character_coverage": 1.0, "byte_fallback": True, "shuffle_input_sentence": True,
    "pad_id": PAD_ID, "unk_id": UNK_ID, "bos_id": START_ID, "eos_id": END_ID,
    "pad_piece": "<pad>", "unk_piece": "<unk>", "bos_piece": "<s>", "eos_piece": "</s>",
    "max_sentence_length": 16384, "num_threads": 2, "minloglevel": 2,
}


# ----------------------------------------------------------------- vocabulary


def train_sentencepiece(sentences, vocab_size: int = DEFAULT_VOCAB_SIZE, *, model_type: str = "unigram",
                        input_sentence_size: int = 2_000_000, seed_sentencepiece_size: int = 1_000_000,
                        hard_vocab_limit: bool = False) -> bytes:
    """Trains a cased, reversible sentencepiece model on an iterable of strings.

    Returns the serialized model proto (the bytes of a `.model` file), with
    this module's special ids. Byte fallback keeps unseen characters
    reversible; `hard_vocab_limit=False` lets a small corpus end with fewer
    pieces than asked for instead of failing. Raises `ValueError` when
    sentencepiece cannot train a vocabulary of that size.
    """
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(s for s in sentences if s), model_writer=model, vocab_size=vocab_size,
            model_type=model_type, input_sentence_size=input_sentence_size,
            seed_sentencepiece_size=seed_sentencepiece_size, hard_vocab_limit=hard_vocab_limit, **_SENTENCEPIECE_OPTIONS)
    except RuntimeError as e:
        raise ValueError(f"Could not train a sentencepiece vocabulary of {vocab_size} pieces: {e}") from e
    return model.getvalue()


def read_tokenizer_proto(path) -> bytes:
    """The bytes of a sentencepiece `.model` file; a clear error if it is missing."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Tokenizer model not found: {path} (train one with kt-train)")
    return path.read_bytes()


def vocab_size_of(model_proto: bytes) -> int:
    """Number of pieces (ids) of a sentencepiece model proto."""
    return spm.SentencePieceProcessor(model_proto=model_proto).get_piece_size()


def check_special_ids(model_proto: bytes) -> None:
    """`ValueError` unless the model's pad/unk/bos/eos ids are this module's."""
    sp = spm.SentencePieceProcessor(model_proto=model_proto)
    got, expected = (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()), (PAD_ID, UNK_ID, START_ID, END_ID)
    if got != expected:
        raise ValueError(f"Tokenizer has pad/unk/bos/eos ids {got}, expected {expected}.")


def make_tokenizer(model_proto: bytes):
    """The tensorflow-text tokenizer (int32 ids, no bos/eos) for a sentencepiece model proto."""
    return tf_text.SentencepieceTokenizer(model=model_proto, out_type="int32", add_bos=False, add_eos=False)


# ------------------------------------------------------------------ sequences


def encode_source(tokenizer, texts, max_length: int | None = None):
    """Source ids for strings `[batch]`: pieces + [END_ID], truncated to `max_length` (end id kept).

    Returns a `tf.RaggedTensor` `[batch, (len)]`; `.to_tensor(PAD_ID)` pads it.
    """
    return source_from_pieces(tokenizer.tokenize(texts), max_length)


def source_from_pieces(pieces, max_length: int | None = None):
    """Ragged piece ids `[batch, (len)]` -> the source: at most `max_length - 1` pieces, then END_ID."""
    if max_length is not None:
        pieces = pieces[:, : max_length - 1]
    end = tf.fill([pieces.nrows(), 1], tf.constant(END_ID, pieces.dtype))
    return tf.concat([pieces, end], axis=1)


def encode_pair(tokenizer, source_text, target_text):
    """One training pair of scalar strings -> (source, target_in, target_out), int32 `[len]` each."""
    source = tf.cast(tokenizer.tokenize(source_text), tf.int32)
    target = tf.cast(tokenizer.tokenize(target_text), tf.int32)
    return (tf.concat([source, [END_ID]], 0), tf.concat([[START_ID], target], 0), tf.concat([target, [END_ID]], 0))


def decode_output(tokenizer, tokens):
    """Decoded tokens `[batch, length]` -> strings `[batch]`.

    Everything from the first end id on, and padding, is dropped before
    detokenizing.
    """
    before_end = tf.equal(tf.cumsum(tf.cast(tf.equal(tokens, END_ID), tf.int32), axis=1), 0)
    keep = tf.logical_and(before_end, tf.not_equal(tokens, PAD_ID))
    return tf.reshape(tokenizer.detokenize(tf.ragged.boolean_mask(tokens, keep)), [-1])


def read_lines(path) -> list[str]:
    """The lines of a UTF-8 text file, without their terminators (`\\n` or `\\r\\n`)."""
    with open(path, encoding="utf-8", newline="") as f:
        return split_lines(f.read())


def split_lines(text):
    """`str` or `bytes` split into lines, without terminators (`\\n` or `\\r\\n`) or a last empty line."""
    newline, carriage_return = ("\n", "\r") if isinstance(text, str) else (b"\n", b"\r")
    lines = text.split(newline)
    if lines and not lines[-1]:  # the final newline
        lines.pop()
    return [line[:-1] if line.endswith(carriage_return) else line for line in lines]
