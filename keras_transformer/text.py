"""Text <-> ids: the subword vocabulary, the special ids, and how sentences become model inputs.

One joint (source + target) sentencepiece vocabulary, trained with the
`sentencepiece` package (pure Python: no TensorFlow here). On TensorFlow it is
applied with tensorflow-text's `SentencepieceTokenizer` (`common/tokenizer.py`),
so the same tokenizer runs in `tf.data`, in evaluation and inside the exported
graph; on any backend, `sentencepiece` itself gives the same ids.

Special ids (defined here once; `PAD_ID` comes from `masking`, where the
masks are built from it): pad 0, unk 1, start (bos) 2, end (eos) 3.

Sequences:
  source     = pieces(source_text)[:max_source_length - 1] + [END_ID]
  target_in  = [START_ID] + pieces(target_text)
  target_out = pieces(target_text) + [END_ID]
(max_source_length: the most source tokens a model takes, end id included.)
Model outputs are turned back into text by `common.tokenizer.decode_output`:
everything from the first end id on, and padding, dropped before detokenizing.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import sentencepiece as spm

from keras_transformer.masking import PAD_ID

UNK_ID = 1
START_ID = 2  # sentencepiece's bos: the decoder's first input
END_ID = 3  # sentencepiece's eos: ends every source and every output
DEFAULT_VOCAB_SIZE = 8000

# Every vocabulary of the project: all characters kept (byte fallback), these ids; cased unless asked otherwise.
_SENTENCEPIECE_OPTIONS = {
    "character_coverage": 1.0, "byte_fallback": True, "shuffle_input_sentence": True,
    "pad_id": PAD_ID, "unk_id": UNK_ID, "bos_id": START_ID, "eos_id": END_ID,
    "pad_piece": "<pad>", "unk_piece": "<unk>", "bos_piece": "<s>", "eos_piece": "</s>",
    "max_sentence_length": 16384, "minloglevel": 2,
}


# ----------------------------------------------------------------- vocabulary


# sentencepiece's model types the project trains: its unigram language model (the default), and byte-pair
# encoding, the paper's (Sennrich et al., 2016).
VOCAB_TYPES = ("unigram", "bpe")


def train_sentencepiece(sentences, vocab_size: int = DEFAULT_VOCAB_SIZE, *, model_type: str = VOCAB_TYPES[0],
                        input_sentence_size: int = 2_000_000, seed_sentencepiece_size: int = 1_000_000,
                        hard_vocab_limit: bool = False, lowercase: bool = False,
                        num_threads: int | None = None) -> bytes:
    """Trains a reversible sentencepiece model on an iterable of strings.

    Returns the serialized model proto (the bytes of a `.model` file), with
    this module's special ids. Byte fallback keeps unseen characters
    reversible; `hard_vocab_limit=False` lets a small corpus end with fewer
    pieces than asked for instead of failing. The model is cased (the
    `nmt_nfkc` normaliser) unless `lowercase`: then it case-folds
    (`nmt_nfkc_cf`), so "A Dog" and "a dog" give the same ids and a model
    trained with it writes lowercase text (`lowercases` tells which a
    model proto does). Raises `ValueError` when sentencepiece cannot train
    a vocabulary of that size.

    `input_sentence_size` bounds the sentences it trains on: from more,
    sentencepiece draws a uniform random sample of that many (reservoir
    sampling over everything `sentences` yields; `spm.set_random_generator_seed`
    seeds it). `num_threads`: all the machine's cores by default.
    """
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(s for s in sentences if s), model_writer=model, vocab_size=vocab_size,
            model_type=model_type, input_sentence_size=input_sentence_size,
            seed_sentencepiece_size=seed_sentencepiece_size, hard_vocab_limit=hard_vocab_limit,
            normalization_rule_name="nmt_nfkc_cf" if lowercase else "nmt_nfkc",
            num_threads=num_threads or os.cpu_count() or 1, **_SENTENCEPIECE_OPTIONS)
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


def lowercases(model_proto: bytes) -> bool:
    """Whether a sentencepiece model proto case-folds its input (`train_sentencepiece(..., lowercase=True)`)."""
    sp = spm.SentencePieceProcessor(model_proto=model_proto)
    return sp.decode(sp.encode("A")) == "a"


def check_special_ids(model_proto: bytes) -> None:
    """`ValueError` unless the model's pad/unk/bos/eos ids are this module's."""
    sp = spm.SentencePieceProcessor(model_proto=model_proto)
    got, expected = (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()), (PAD_ID, UNK_ID, START_ID, END_ID)
    if got != expected:
        raise ValueError(f"Tokenizer has pad/unk/bos/eos ids {got}, expected {expected}.")


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
