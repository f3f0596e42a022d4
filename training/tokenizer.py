"""Joint (shared source+target) subword vocabulary: trained with the
`sentencepiece` package, applied with tensorflow-text's `SentencepieceTokenizer`
so the same tokenizer runs in tf.data and inside an exported graph.

Id convention of the project: pad 0, unk 1, bos/start 2, eos/end 3.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
TOKENIZER_FILENAME = "tokenizer.model"
DEFAULT_VOCAB_SIZE = 8000

log = logging.getLogger("training.tokenizer")


def train_sentencepiece(sentences, vocab_size: int = DEFAULT_VOCAB_SIZE, *, model_type: str = "unigram",
                        input_sentence_size: int = 2_000_000, seed_sentencepiece_size: int = 1_000_000,
                        hard_vocab_limit: bool = False) -> bytes:
    """Trains a cased, reversible sentencepiece model on an iterable of strings and
    returns the serialized model proto (the bytes of a `.model` file).

    Byte fallback keeps unseen characters reversible; `hard_vocab_limit=False`
    lets small corpora end with fewer pieces than asked for instead of failing.
    """
    import sentencepiece as spm

    model = io.BytesIO()
    try:
        _train(spm, sentences, model, vocab_size, model_type, input_sentence_size, seed_sentencepiece_size,
               hard_vocab_limit)
    except RuntimeError as e:
        from training.errors import ConfigError

        raise ConfigError(f"Could not train a sentencepiece vocabulary of {vocab_size} pieces "
                          f"(--vocab-size): {e}") from e
    return model.getvalue()


def _train(spm, sentences, model, vocab_size, model_type, input_sentence_size, seed_sentencepiece_size,
           hard_vocab_limit):
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(s for s in sentences if s),
        model_writer=model,
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=1.0,
        byte_fallback=True,
        pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
        pad_piece="<pad>", unk_piece="<unk>", bos_piece="<s>", eos_piece="</s>",
        input_sentence_size=input_sentence_size,
        shuffle_input_sentence=True,
        seed_sentencepiece_size=seed_sentencepiece_size,
        hard_vocab_limit=hard_vocab_limit,
        max_sentence_length=16384,
        num_threads=2,
        minloglevel=2,
    )


def save_model_proto(model_proto: bytes, model_dir) -> Path:
    path = Path(model_dir) / TOKENIZER_FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model_proto)
    return path


def load_model_proto(model_dir_or_file) -> bytes:
    p = Path(model_dir_or_file)
    if p.is_dir():
        p = p / TOKENIZER_FILENAME
    if not p.is_file():
        raise FileNotFoundError(f"Tokenizer model not found: {p} (train one with python -m training.train)")
    return p.read_bytes()


def make_tokenizer(model_proto: bytes):
    """The tensorflow-text tokenizer for a serialized sentencepiece model proto.

    Used by the input pipeline, evaluation, and (via the same bytes kept as a
    SavedModel asset) by export/. No bos/eos here: the pipeline adds them.
    """
    import tensorflow_text as tf_text

    return tf_text.SentencepieceTokenizer(model=model_proto, out_type="int32", add_bos=False, add_eos=False)


def vocab_size_of(model_proto: bytes) -> int:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=model_proto)
    return sp.get_piece_size()


def check_special_ids(model_proto: bytes) -> None:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=model_proto)
    got = (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id())
    if got != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
        raise ValueError(f"Tokenizer has pad/unk/bos/eos ids {got}, expected {(PAD_ID, UNK_ID, BOS_ID, EOS_ID)}.")
