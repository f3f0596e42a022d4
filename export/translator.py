"""`Translator`: a `tf.Module` with the tokenizer, the model and text-in,
text-out signatures, saved as a SavedModel that TF Serving serves.

Signatures (all batch-first, dense, so TF Serving's REST row format
`{"instances": [...]}` works):

- `serving_default`: `text` string `[batch]` -> `translation` string `[batch]`,
  `score` float32 `[batch]` (beam search; the score is
  log P(translation | text) / ((5 + len) / 6)^alpha).
- `greedy`: same inputs and outputs, greedy decoding (faster).
- `translate_ids`: `source_ids` int32 `[batch, source_len]` (pieces + end id,
  padded with 0) -> `tokens` int32 `[batch, length]` (end id, then 0),
  `score` float32 `[batch]` (beam search), for clients that tokenize themselves.

Inputs are made safe inside the graph: invalid UTF-8 is replaced with U+FFFD
before tokenization, the source is truncated to the model's maximum source
length after tokenization (`max_length - 1` pieces + the end id), and empty or
whitespace-only text decodes like an empty sentence (one string comes back
for every input).

Variables: the functions capture the `tf.Variable`s inside Keras 3 variables.
A `tf.Module` that tracks the Keras model instead can give a SavedModel that
`tf.saved_model.load` reads but the TF1/C++ loader TF Serving uses rejects
("Could not find variable ..."), and with this model `tf.saved_model.save`
tries to trace `Transformer.call` with float inputs and fails. So the module
tracks exactly the variables its concrete functions capture (what
`keras.export.ExportArchive` does), and not the Keras model object.
"""

from __future__ import annotations


import tensorflow as tf

import keras_transformer as kt
from training.pipeline import decode_output, encode_source

PAD_ID = 0
TEXT_SIGNATURE = "serving_default"
GREEDY_SIGNATURE = "greedy"
IDS_SIGNATURE = "translate_ids"
SIGNATURES = (TEXT_SIGNATURE, GREEDY_SIGNATURE, IDS_SIGNATURE)


class Translator(tf.Module):
    """Tokenizer + Transformer + decoding, exportable with `save()`.

    Args:
        model: a built `keras_transformer.Transformer`.
        tokenizer: a `tensorflow_text.SentencepieceTokenizer` (int32 ids, no
            bos/eos: see `training.tokenizer.make_tokenizer`).
        start_id, end_id: target start and end ids.
        max_source_length: most source tokens, end id included (config.json
            `max_length`); longer inputs are truncated.
        beam_size: beam size of `serving_default` and `translate_ids`.
        alpha: length-penalty exponent.
        use_cache: decode over the key/value cache (False: recompute the
            whole prefix each step; same outputs, slower; for benchmarks).
        tokenizer_file: path of the sentencepiece `.model`, shipped in the
            SavedModel's `assets/` for clients (the tokenizer op itself takes
            the model proto as an attribute, so it is also in the graph).
    """

    def __init__(self, model, tokenizer, *, start_id, end_id, max_source_length, beam_size=4, alpha=0.6,
                 use_cache=True, tokenizer_file=None, name="translator"):
        super().__init__(name=name)
        if beam_size < 1:
            raise ValueError(f"beam_size must be >= 1, got {beam_size}")
        if max_source_length is not None and max_source_length < 2:
            raise ValueError(f"max_source_length must be >= 2 (one piece and the end id), got {max_source_length}")
        self.tokenizer = tokenizer  # tracked: its sentencepiece resource is captured by the functions
        if tokenizer_file is not None:
            self.tokenizer_file = tf.saved_model.Asset(str(tokenizer_file))
        self.start_id, self.end_id = int(start_id), int(end_id)
        self.max_source_length = None if max_source_length is None else int(max_source_length)
        self.beam_size, self.alpha, self.use_cache = int(beam_size), float(alpha), bool(use_cache)
        # Not an attribute: tracking the Keras model would track Keras variables, not the tf.Variables
        # the functions capture (see the module docstring). The closures keep it alive.

        def beam(source_ids):
            return kt.beam_search(model, source_ids, self.start_id, self.end_id, beam_size=self.beam_size,
                                  alpha=self.alpha, use_cache=self.use_cache)

        def greedy(source_ids):
            return kt.greedy_decode(model, source_ids, self.start_id, self.end_id, alpha=self.alpha,
                                    use_cache=self.use_cache)

        self._beam, self._greedy = beam, greedy

        text_spec = [tf.TensorSpec([None], tf.string, name="text")]
        self.translate = tf.function(self._translate_text, input_signature=text_spec)
        self.translate_greedy = tf.function(self._translate_text_greedy, input_signature=text_spec)
        self.translate_ids = tf.function(
            self._translate_ids, input_signature=[tf.TensorSpec([None, None], tf.int32, name="source_ids")])
        self.tokenize = tf.function(self._tokenize, input_signature=text_spec)
        functions = [self.translate, self.translate_greedy, self.translate_ids, self.tokenize]
        captured = {}
        for fn in functions:
            for v in fn.get_concrete_function().variables:
                captured.setdefault(id(v), v)
        self.model_variables = list(captured.values())

    # -- graph pieces -----------------------------------------------------

    def _tokenize(self, text):
        """Strings `[batch]` -> source ids int32 `[batch, len]`: pieces (truncated) + end id, 0-padded."""
        text = tf.strings.unicode_transcode(text, input_encoding="UTF-8", output_encoding="UTF-8",
                                            errors="replace", replacement_char=0xFFFD)
        source = encode_source(self.tokenizer, text, self.max_source_length).to_tensor(PAD_ID)
        return {"source_ids": tf.ensure_shape(tf.cast(source, tf.int32), [None, None])}

    def _text_outputs(self, text, decode):
        source = self._tokenize(text)["source_ids"]
        tokens, scores = decode(source)
        return {"translation": decode_output(self.tokenizer, tokens, self.end_id), "score": tf.reshape(scores, [-1])}

    def _translate_text(self, text):
        return self._text_outputs(text, self._beam)

    def _translate_text_greedy(self, text):
        return self._text_outputs(text, self._greedy)

    def _translate_ids(self, source_ids):
        tokens, scores = self._beam(source_ids)
        return {"tokens": tf.ensure_shape(tf.cast(tokens, tf.int32), [None, None]), "score": tf.reshape(scores, [-1])}

    # -- saving -------------------------------------------------------------

    def signatures(self):
        return {
            TEXT_SIGNATURE: self.translate.get_concrete_function(),
            GREEDY_SIGNATURE: self.translate_greedy.get_concrete_function(),
            IDS_SIGNATURE: self.translate_ids.get_concrete_function(),
            "tokenize": self.tokenize.get_concrete_function(),
        }

    def save(self, path):
        tf.saved_model.save(self, str(path), signatures=self.signatures())
        return path


def from_model_dir(model_dir, *, model_file=None, beam_size=4, alpha=0.6, use_cache=True, max_source_length="config"):
    """A `Translator` for a directory written by `training.train` (model.keras, tokenizer.model, config.json).

    `max_source_length="config"` takes config.json's `max_length`.
    """
    from pathlib import Path

    from training.evaluate import load_trained

    model, tokenizer, cfg = load_trained(model_dir, model_file)
    if max_source_length == "config":
        max_source_length = cfg.get("max_length")
    translator = Translator(
        model, tokenizer, start_id=cfg["start_id"], end_id=cfg["end_id"], max_source_length=max_source_length,
        beam_size=beam_size, alpha=alpha, use_cache=use_cache,
        tokenizer_file=Path(model_dir) / cfg.get("tokenizer_file", "tokenizer.model"))
    return translator, cfg
