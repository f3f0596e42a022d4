"""The served graph: a trained model directory, loaded, and the `Translator` that exports it.

A model directory (written by `kt-train`) holds `config.json`, `model.keras`
and `tokenizer.model`; `load_model_dir` reads it. `Translator` is a
`tf.Module` with the tokenizer, the model and text-in, text-out functions.
`kt-export` saves it as the SavedModel TF Serving serves, and `kt-evaluate`
scores the same functions, so the BLEU it prints is the BLEU of the export.

Signatures (all batch-first, dense, so TF Serving's REST row format
`{"instances": [...]}` works):

- `serving_default`: `text` string `[batch]` -> `translation` string `[batch]`,
  `score` float32 `[batch]` (beam search; the score is
  log P(translation | text) / ((5 + len) / 6)^alpha), `truncated` bool
  `[batch]` (the source was longer than the model's limit, and only its
  first `max_source_length - 1` pieces were translated).
- `greedy`: same inputs and outputs, greedy decoding (faster).
- `n_best`: `text` -> `translations` string `[batch, n]` and `scores` float32
  `[batch, n]`, the beam's n = beam size different finished hypotheses, best
  first (the first is `serving_default`'s), and `truncated`. Graph decoder only.
- `sample`: `text`, `seed` int64, `temperature` float32 (> 0) and `top_k`
  int32 (0: every token), each `[batch]` -> `translation`, `score`,
  `truncated`: each token drawn from softmax(log P / temperature) over the
  top_k most likely (`keras_transformer.sample_decode`); the same text and
  seed give the same translation alone or in any batch; top_k 1 is greedy
  decoding. A temperature of 0 or less fails the request, naming it.
- `prefix`: `text` and `prefix` string `[batch]` -> `translation`, `score`,
  `truncated`: beam search whose output begins with the prefix's pieces
  (whole pieces: "Ein Hund" forces "▁Ein ▁Hund"); "" is `serving_default`.
- `greedy_prefix`: the same inputs and outputs as `prefix`: greedy decoding
  whose output begins with the prefix's pieces (the library's
  `greedy_decode(..., prefix_ids=...)`); "" is `greedy`.
- `score`: `text` and `target` string `[batch]` -> `score` (as
  `serving_default` scores its own output), `log_prob` (log P(target | text)
  under teacher forcing) and `truncated` (the source or the target was cut to
  the limit), float32 / bool `[batch]` (`keras_transformer.score_targets`).
- `align`: `text` -> `serving_default`'s outputs, plus `alignment` int32
  `[batch, length]` (for each output piece, the source piece it attends to
  most: `keras_transformer.align_targets`; -1 at padding), `source_pieces`
  and `target_pieces` string `[batch, length]` (the pieces those indices
  count, "</s>" included, "" at padding).
- `translate_ids`: `source_ids` int32 `[batch, source_len]` (pieces + end id,
  padded with 0) -> `tokens` int32 `[batch, length]` (end id, then 0),
  `score` float32 `[batch]` (beam search), `truncated`, for clients that
  tokenize themselves.
- `tokenize`: `text` -> `source_ids`, the source ids the text signatures decode
  from, and `truncated`.

With `xla_max_batch` > 0 (`kt-export --xla-max-batch N`), `serving_default`
and `greedy` decode a batch of at most N sentences with the same search
compiled by XLA (`tf.function(jit_compile=True)`) in float32, and larger
batches with the graph decoder. A small batch's step is a few MFLOP spread
over some 300 ops, so it costs the executor's dispatch of each op; XLA runs
the whole loop as one compiled program (much faster than the graph at
batch 1; docs/design.md, "Small batches under XLA, opt-in").
At batch 64 XLA is no faster (greedy) or slower (beam search: every row stays
in its fixed-shape loop until the last sentence ends), hence the threshold.
XLA compiles once per input shape, so the source is padded to a multiple of
`XLA_LENGTH_MULTIPLE` tokens and the batch to a power of two (or N): at most
a few dozen shapes, each compiled on first use (for seconds; same section).
Float32, because in bfloat16 the compiled search gave a sentence a different
translation in a batch of 3 than alone (XLA rounds bfloat16 differently per
shape); float32 is a little slower there at batch 1 (same section). It runs
`engine_model(model, "float32", untie_output_projection=True)`, whose output
projection is stored `[d_model, vocab]`, the layout XLA's CPU matmul reads
fastest. TF Serving runs it only when started with
`--xla_cpu_compilation_enabled`.
The other signatures (`prefix` and `greedy_prefix` among them) decode with
the graph decoder at every batch size.

With `parallel_loops` N > 1 (`kt-export --parallel-loops`; by default the
exporting machine's CPUs, at most 8), the graph decoder splits a batch into N
decoding loops that run at once (`export.search.parallel_decode`): a
step is ~400 small ops run one after another, so one loop keeps about one
core busy. Serve it with N inter-op threads and 1 intra-op thread
(`--tensorflow_inter_op_parallelism=N --tensorflow_intra_op_parallelism=1`).

Inputs are made safe inside the graph: invalid UTF-8 is replaced with U+FFFD
before tokenization, every source (text or ids) is truncated to the model's
maximum source length (`max_source_length - 1` pieces + the end id), and one string
comes back for every input, with `truncated` saying whether its source was cut. Text with nothing to translate (empty,
whitespace-only: the tokenizer gives no piece) gets the empty translation ""
and score 0.0 in the text signatures; the other rows of its batch are
unaffected.

Variables: the functions capture the `tf.Variable`s inside Keras 3 variables.
A `tf.Module` that tracks the Keras model instead can give a SavedModel that
`tf.saved_model.load` reads but the TF1/C++ loader TF Serving uses rejects
("Could not find variable ..."), and with this model `tf.saved_model.save`
tries to trace `Transformer.call` with float inputs and fails. So the module
tracks exactly the variables its concrete functions capture (what
`keras.export.ExportArchive` does), and not the Keras model object.
"""

from __future__ import annotations

import functools
import os

import tensorflow as tf

from common.run_dir import load_model_dir, max_source_length, target_tokenizer_path, tokenizer_path
from common.tokenizer import decode_output, source_from_pieces, source_side, target_side
from export.engine_weights import engine_model
from export.request_batching import RequestBatching, batched, used_width
from export.search import engine_beam_search, engine_greedy_decode, graph_function, parallel_decode
from keras_transformer.decoding import EXTRA_OUTPUT_LENGTH, check_extra_output_length
from keras_transformer.strategies import Sampling, check_options
from keras_transformer.hardware import native_bf16_flags
from keras_transformer.renamed import renamed_arguments
from keras_transformer.scoring import align_targets, score_targets
from keras_transformer.text import END_ID, PAD_ID, START_ID

# The export's signatures (a model directory's files: common/run_dir.py).

TEXT_SIGNATURE = "serving_default"
GREEDY_SIGNATURE = "greedy"
N_BEST_SIGNATURE = "n_best"
SAMPLE_SIGNATURE = "sample"
PREFIX_SIGNATURE = "prefix"
GREEDY_PREFIX_SIGNATURE = "greedy_prefix"
SCORE_SIGNATURE = "score"
ALIGN_SIGNATURE = "align"
IDS_SIGNATURE = "translate_ids"
TOKENIZE_SIGNATURE = "tokenize"

# The XLA decoder's source lengths are padded to a multiple of this, so it compiles for few shapes.
XLA_LENGTH_MULTIPLE = 16
# What the XLA decoder computes in, whatever the graph decoder's precision: in bfloat16 the compiled search
# gave a sentence another translation in a batch of 3 than alone (XLA rounds bfloat16 differently per shape).
XLA_DTYPE = "float32"


# ------------------------------------------------------------ decode precision

PRECISIONS = ("auto", "float32", "bfloat16", "model")


def decode_policy(precision="auto", flags=None) -> tuple[str | None, str]:
    """(Keras dtype policy to decode in, or None for the model's own; the reason in a few words).

    "auto": float32 on every CPU. bfloat16 decodes faster where the CPU computes it natively (`flags`:
    this machine's by default), but there a sentence's score, and now and then its translation, depends on
    the other sentences of its batch (a batch of another size rounds differently; docs/design.md, "The engine
    decodes in float32 by default"), so it is only used when asked for ("bfloat16"). "model": the model's own
    policy (e.g. mixed_bfloat16 if it was trained so).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "model":
        return None, "the model's own policy was asked for"
    if precision != "auto":
        return precision, f"{precision} was asked for"
    native = native_bf16_flags(flags)
    if native:
        return "float32", (f"the same translation alone or in any batch; this CPU computes bfloat16 natively "
                           f"({', '.join(native)}): --precision bfloat16 decodes faster, but a translation may "
                           f"then depend on its batch")
    return "float32", "this CPU has no native bfloat16 (no avx512_bf16 or amx_bf16), where float32 is faster"


# ------------------------------------------------------------ decoding loops

# "auto" loops: one per CPU of the exporting machine, at most this many (a batch of 64 then has 8 rows a loop).
MAX_AUTO_LOOPS = 8


def decode_loops(parallel_loops="auto", cpus=None) -> tuple[int, str]:
    """(decoding loops per batch, the reason in a few words); "auto": one per CPU, at most `MAX_AUTO_LOOPS`.

    `cpus`: the CPUs this process may use by default.
    """
    if parallel_loops != "auto":
        loops = int(parallel_loops)
        if loops < 1:
            raise ValueError(f"parallel_loops must be >= 1 or 'auto', got {parallel_loops!r}")
        return loops, f"{loops} asked for"
    if cpus is None:  # the CPUs this process may run on (no affinity call outside Linux: all of them)
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    loops = max(1, min(cpus, MAX_AUTO_LOOPS))
    return loops, f"this machine has {cpus} CPU{'s' if cpus != 1 else ''}" + (
        f" (at most {MAX_AUTO_LOOPS} loops)" if cpus > MAX_AUTO_LOOPS else "")


# ----------------------------------------------------------------- translator


class Translator(tf.Module):
    """Tokenizer + Transformer + decoding, exportable with `save()`.

    Args:
        model: a built `keras_transformer.Transformer`.
        tokenizer: a `tensorflow_text.SentencepieceTokenizer` from
            `common.tokenizer.make_tokenizer` (its special ids are the
            start and end ids decoding uses), or a
            `common.tokenizer.SourceTargetTokenizer` of one per side (an
            imported Marian model's): the source's reads the text, the
            target's the prefixes and score's targets, and writes the output.
        max_source_length: most source tokens, end id included (config.json
            `max_source_length`); longer inputs are truncated. None: no limit.
        beam_size: beam size of `serving_default` and `translate_ids`.
        length_penalty: the length penalty's exponent alpha (Wu et al., 2016):
            a hypothesis scores log P / ((5 + length) / 6)^alpha (kt-export's
            --length-penalty). `alpha=` is its old name, still accepted (a
            `DeprecationWarning`).
        use_cache: decode over the key/value cache (False: recompute the
            whole prefix each step; same outputs, slower; for benchmarks).
        tokenizer_file: path of the sentencepiece `.model`, shipped in the
            SavedModel's `assets/` for clients (the tokenizer op itself takes
            the model proto as an attribute, so it is also in the graph).
        target_tokenizer_file: the target side's, with a tokenizer of one per
            side; shipped in `assets/` too.
        xla_max_batch: batches of at most this many sentences decode in an
            XLA-compiled function (see the module docstring); 0: never.
        xla_model: the model that function runs (`from_model_dir` gives
            `engine_model(model, "float32", untie_output_projection=True)`); default `model`.
        parallel_loops: a batch decodes in this many loops at once, outside
            XLA (see the module docstring); 1: one loop; "auto": see
            `decode_loops`.
        no_repeat_ngram_size: n > 0: no output of any signature gets an
            n-gram (n consecutive pieces) twice, as the library's searches'
            `no_repeat_ngram_size`; 0 (default): no ban.
        extra_output_length: an output of any signature has at most its
            source's length (in pieces, the end id included) + this many
            pieces, as the library's searches' `extra_output_length`
            (`EXTRA_OUTPUT_LENGTH`, 50, by default; 300 for the paper's
            parsing).
        request_batching: a `RequestBatching`: every decoding signature merges
            concurrent calls into one batch (export/request_batching.py;
            kt-export's default); None: each call decodes on its own.

    Functions (each a `tf.function`; `signatures()` names them):
        translate(text `[batch]`) -> {"translation": `[batch]` string, "score": `[batch]`} (beam search)
        translate_greedy(text) -> the same, greedy decoding
        translate_n_best(text) -> {"translations": `[batch, beam_size]`, "scores": `[batch, beam_size]`}
        translate_sampled(text, seed, temperature, top_k), translate_prefixed(text, prefix),
        translate_greedy_prefixed(text, prefix), score(text, target), translate_aligned(text): the
            signatures sample, prefix, greedy_prefix, score and align (module docstring)
        translate_ids(source_ids `[batch, len]`) -> {"tokens": `[batch, length]`, "score": `[batch]`}
        tokenize(text) -> {"source_ids": `[batch, len]`}

    Example:

    ```python
    translator = Translator.from_model_dir("runs/en-de", beam_size=4, length_penalty=1.0)
    translator.translate(tf.constant(["Two dogs play in the snow."]))["translation"]
    translator.save("exports/en-de/translator/1")
    ```
    """

    @renamed_arguments(alpha="length_penalty")
    def __init__(self, model, tokenizer, *, max_source_length, beam_size=4, length_penalty=0.6, use_cache=True,
                 tokenizer_file=None, target_tokenizer_file=None, xla_max_batch=0, xla_model=None, parallel_loops=1, no_repeat_ngram_size=0,
                 extra_output_length=EXTRA_OUTPUT_LENGTH, request_batching=None, name="translator"):
        super().__init__(name=name)
        if beam_size < 1:
            raise ValueError(f"beam_size must be >= 1, got {beam_size}")
        if xla_max_batch < 0:
            raise ValueError(f"xla_max_batch must be >= 0 (0: no XLA), got {xla_max_batch}")
        check_options(no_repeat_ngram_size=no_repeat_ngram_size)
        self.no_repeat_ngram_size = no_repeat_ngram_size
        check_extra_output_length(extra_output_length)
        self.extra_output_length = extra_output_length
        parallel_loops, _ = decode_loops(parallel_loops)  # names a bad count before anything is traced
        if max_source_length is not None and max_source_length < 2:
            raise ValueError(f"max_source_length must be >= 2 (one piece and the end id), got {max_source_length}")
        self.tokenizer = tokenizer  # tracked: its sentencepiece resource is captured by the functions
        if tokenizer_file is not None:
            self.tokenizer_file = tf.saved_model.Asset(str(tokenizer_file))
        if target_tokenizer_file is not None:
            self.target_tokenizer_file = tf.saved_model.Asset(str(target_tokenizer_file))
        self.max_source_length = None if max_source_length is None else int(max_source_length)
        self.beam_size, self.length_penalty, self.use_cache = int(beam_size), float(length_penalty), bool(use_cache)
        # Not an attribute: tracking the Keras model would track Keras variables, not the tf.Variables
        # the functions capture (see the module docstring). The closures keep it alive.
        self._model = lambda: model
        self.parallel_loops = parallel_loops
        self.xla_max_batch = int(xla_max_batch)
        if self.xla_max_batch:
            xla_model = model if xla_model is None else xla_model
            # XLA is decided here, so here the searches are told to keep every shape fixed.
            self._xla_beam = graph_function(lambda source: self._search(source, xla_model, fixed_shapes=True),
                                         jit_compile=True)
            self._xla_greedy = graph_function(
                lambda source: self._search(source, xla_model, greedy=True, fixed_shapes=True), jit_compile=True)

        # One traced beam search of source ids, called by serving_default, align and translate_ids: the
        # SavedModel holds its graph once, not once per signature (n_best, prefix and the XLA program differ).
        self._beam = graph_function(lambda source: self._search(source),
                                 input_signature=[tf.TensorSpec([None, None], tf.int32)])

        # Every decoding signature's work, `fn(*inputs) -> outputs` row by row, merged with concurrent calls
        # when `request_batching` is set (export/request_batching.py). Checks that fail a request (a
        # temperature <= 0) and trims to the request's own rows stay outside, in the signature itself.
        self.request_batching = request_batching
        self._batched_functions = []

        def merged(fn, spec, signature, batching=request_batching):
            call = batched(fn, spec, batching, signature)
            if batching is not None:
                self._batched_functions.append(call.concrete_function)
            return call

        text_spec = [tf.TensorSpec([None], tf.string, name="text")]
        sample_spec = text_spec + [tf.TensorSpec([None], tf.int64, name="seed"),
                                   tf.TensorSpec([None], tf.float32, name="temperature"),
                                   tf.TensorSpec([None], tf.int32, name="top_k")]
        prefix_spec = text_spec + [tf.TensorSpec([None], tf.string, name="prefix")]
        score_spec = text_spec + [tf.TensorSpec([None], tf.string, name="target")]
        # translate_ids merges sources padded to the source limit (the batch concatenates fixed widths); with no
        # limit it cannot, and decodes each call on its own.
        ids_batching = request_batching if self.max_source_length is not None else None
        self._merged_sampled = merged(self._translate_sampled_rows, sample_spec, SAMPLE_SIGNATURE)
        self._merged_aligned = merged(self._translate_aligned_rows, text_spec, ALIGN_SIGNATURE)
        self._merged_ids = merged(self._translate_source_rows, [tf.TensorSpec([None, self.max_source_length],
                                                                              tf.int32)], IDS_SIGNATURE, ids_batching)
        self.translate = graph_function(merged(self._translate_beam, text_spec, TEXT_SIGNATURE),
                                     input_signature=text_spec)
        self.translate_greedy = graph_function(merged(self._translate_greedy, text_spec, GREEDY_SIGNATURE),
                                            input_signature=text_spec)
        self.translate_n_best = graph_function(merged(self._translate_n_best, text_spec, N_BEST_SIGNATURE),
                                            input_signature=text_spec)
        self.translate_sampled = graph_function(self._translate_sampled, input_signature=sample_spec)
        self.translate_prefixed = graph_function(merged(self._translate_prefixed, prefix_spec, PREFIX_SIGNATURE),
                                              input_signature=prefix_spec)
        self.translate_greedy_prefixed = graph_function(
            merged(self._translate_greedy_prefixed, prefix_spec, GREEDY_PREFIX_SIGNATURE), input_signature=prefix_spec)
        self.score = graph_function(merged(self._score, score_spec, SCORE_SIGNATURE), input_signature=score_spec)
        self.translate_aligned = graph_function(self._translate_aligned, input_signature=text_spec)
        self.translate_ids = graph_function(
            self._translate_ids, input_signature=[tf.TensorSpec([None, None], tf.int32, name="source_ids")])
        # No batching: tokenizing decodes nothing, and costs little alone.
        self.tokenize = graph_function(self._tokenize, input_signature=text_spec)
        # Nothing is traced here: a function is traced when it is first called (kt-evaluate calls one or
        # two), or by `save`, which traces every signature.

    @classmethod
    @renamed_arguments(alpha="length_penalty")
    def from_model_dir(cls, model_dir, *, model_file=None, weights=None, beam_size=4, length_penalty=0.6, use_cache=True,
                       precision="auto", xla_max_batch=0, parallel_loops=1, no_repeat_ngram_size=0,
                       extra_output_length=EXTRA_OUTPUT_LENGTH, request_batching=None):
        """A `Translator` for a directory written by kt-train, with its config's `max_source_length`, decoding
        in `precision` (see `decode_policy`; the weights are mapped by `engine_model`, the output
        projection stored `[d_model, vocab]`, as the matmul reads it fastest, in one column block per
        decoding loop); with `xla_max_batch`, small
        batches under XLA in float32; `parallel_loops`: a number, or "auto" (see `decode_loops`);
        `request_batching`: a `RequestBatching`, or None (each call decodes on its own)."""
        loaded, tokenizer, config = load_model_dir(model_dir, model_file, weights)
        parallel_loops, _ = decode_loops(parallel_loops)  # "auto" becomes the number the loops and blocks share
        # One column block of the output projection per decoding loop, for the threads a lone loop leaves idle.
        model = engine_model(loaded, decode_policy(precision)[0], untie_output_projection=True,
                             output_blocks=parallel_loops)
        xla_model = engine_model(loaded, XLA_DTYPE, untie_output_projection=True) if xla_max_batch else None
        return cls(model, tokenizer, max_source_length=max_source_length(config), beam_size=beam_size, length_penalty=length_penalty,
                   use_cache=use_cache, tokenizer_file=tokenizer_path(model_dir, config),
                   target_tokenizer_file=target_tokenizer_path(model_dir, config),
                   xla_max_batch=xla_max_batch, xla_model=xla_model,
                   parallel_loops=parallel_loops, no_repeat_ngram_size=no_repeat_ngram_size,
                   extra_output_length=extra_output_length, request_batching=request_batching)

    # -- graph pieces: text -> source ids -> search -> text ----------------

    def _tokenize(self, text):
        """Strings `[batch]` -> {"source_ids": int32 `[batch, len]`, pieces (truncated) + end id, 0-padded;
        "truncated": bool `[batch]`, whether a source had more pieces than that}."""
        pieces = self._pieces(text)
        source = source_from_pieces(pieces, self.max_source_length).to_tensor(PAD_ID)
        return {"source_ids": tf.ensure_shape(tf.cast(source, tf.int32), [None, None]),
                "truncated": self._truncated(pieces)}

    def _pieces(self, text, side=source_side):
        """Strings `[batch]` -> their piece ids, ragged `[batch, (pieces)]`, invalid UTF-8 replaced by U+FFFD;
        `side`: `common.tokenizer`'s `source_side` (the source text's pieces) or `target_side`."""
        return side(self.tokenizer).tokenize(tf.strings.unicode_transcode(
            text, input_encoding="UTF-8", output_encoding="UTF-8", errors="replace", replacement_char=0xFFFD))

    def _truncated(self, pieces):
        """Ragged source pieces `[batch, (len)]` -> bool `[batch]`: more pieces than the source limit keeps."""
        if self.max_source_length is None:
            return tf.zeros([pieces.nrows()], tf.bool)
        return pieces.row_lengths() > self.max_source_length - 1

    def _search(self, source_ids, model=None, *, greedy=False, n_best=None, fixed_shapes=False, **row_options):
        """Beam search of `source_ids` `[batch, len]` with the export's beam size, alpha and cache (`greedy`:
        greedy decoding), in `parallel_loops` loops (one loop with `fixed_shapes`, the XLA program's);
        `n_best` as `engine_beam_search`'s. `row_options`:
        `prefix_ids` `[batch, prefix_len]` or `sampling` (a `Sampling` of `[batch]` tensors), split into
        the loops with their rows. Returns tokens and scores as `parallel_decode`."""
        model = self._model() if model is None else model
        if greedy:
            search = functools.partial(engine_greedy_decode, model, start_id=START_ID, end_id=END_ID)
        else:
            search = functools.partial(engine_beam_search, model, start_id=START_ID, end_id=END_ID,
                                       beam_size=self.beam_size, n_best=n_best)

        def decode(ids, *rows):
            options = tf.nest.pack_sequence_as(row_options, list(rows))
            return search(ids, length_penalty=self.length_penalty, use_cache=self.use_cache, fixed_shapes=fixed_shapes,
                          no_repeat_ngram_size=self.no_repeat_ngram_size,
                          extra_output_length=self.extra_output_length, **options)

        loops = 1 if fixed_shapes else self.parallel_loops
        return parallel_decode(decode, source_ids, loops, *tf.nest.flatten(row_options))

    def _decode(self, source, decode, xla_decode):
        """`decode(source)`, or for a batch of 1 to `xla_max_batch` sentences `xla_decode` on the source
        padded to an XLA shape: the batch to the next power of two (or `xla_max_batch`) with copies of its
        last row, the length to a multiple of `XLA_LENGTH_MULTIPLE` with padding."""
        if not self.xla_max_batch or xla_decode is None:
            return decode(source)
        batch, length = tf.shape(source)[0], tf.shape(source)[1]

        def compiled():
            sizes = tf.constant(sorted({*(2 ** i for i in range(self.xla_max_batch.bit_length())),
                                        self.xla_max_batch}))
            rows = tf.reduce_min(tf.boolean_mask(sizes, sizes >= batch))
            padded = tf.gather(source, tf.minimum(tf.range(rows), batch - 1))
            padded = tf.pad(padded, [[0, 0], [0, -length % XLA_LENGTH_MULTIPLE]])
            tokens, scores = xla_decode(padded)
            return tokens[:batch], scores[:batch]  # the copies end where their original does: nothing to trim

        return tf.cond((batch > 0) & (batch <= self.xla_max_batch), compiled, lambda: decode(source))

    def _translate_text(self, text, decode, xla_decode=None, extra=None):
        """The text signatures' outputs for `text` `[batch]` decoded by `decode(source_ids)` (or, for small
        batches, `xla_decode`); `extra(source_ids, tokens, empty)` -> more outputs."""
        tokenized = self._tokenize(text)
        source = tokenized["source_ids"]
        tokens, scores = self._decode(source, decode, xla_decode)
        # Nothing to translate: "" and score 0, row by row, so the other rows and the batch size are as before.
        empty = _nothing_to_translate(source)
        return {"translation": tf.where(empty, "", decode_output(self.tokenizer, tokens)),
                "score": tf.where(empty, 0.0, tf.reshape(scores, [-1])), "truncated": tokenized["truncated"],
                **(extra(source, tokens, empty) if extra else {})}

    def _translate_n_best(self, text):
        tokenized = self._tokenize(text)
        source = tokenized["source_ids"]
        tokens, scores = self._search(source, n_best=self.beam_size)  # [batch, n, length], [batch, n]
        batch, n, length = tf.shape(tokens)[0], self.beam_size, tf.shape(tokens)[2]  # no -1: batch may be 0
        texts = tf.reshape(decode_output(self.tokenizer, tf.reshape(tokens, [batch * n, length])), [batch, n])
        empty = _nothing_to_translate(source)[:, None]
        return {"translations": tf.where(empty, "", texts), "scores": tf.where(empty, 0.0, scores),
                "truncated": tokenized["truncated"]}

    def _translate_sampled(self, text, seed, temperature, top_k):
        # Checked before the request joins a batch, so a bad temperature fails its own request only.
        check = tf.debugging.assert_greater(temperature, 0.0, message="sample: every temperature must be > 0 "
                                            "(top_k 1 is greedy decoding)")
        with tf.control_dependencies([check]):
            temperature = tf.identity(temperature)
        return self._merged_sampled(text, seed, temperature, top_k)

    def _translate_sampled_rows(self, text, seed, temperature, top_k):
        # A seed is any int64; the hash reads its low 32 bits.
        sampling = Sampling(tf.cast(seed, tf.int32), temperature, top_k)
        return self._translate_text(text, lambda source: self._search(source, greedy=True, sampling=sampling))

    def _translate_prefixed(self, text, prefix, greedy=False):
        """Text and prefix strings `[batch]` -> the text signatures' outputs of the beam search (`greedy`:
        greedy decoding) whose output begins with each row's prefix pieces `[batch, prefix_len]`, 0-padded
        (a blank prefix: no piece, the plain search)."""
        prefix_ids = tf.cast(self._pieces(prefix, target_side).to_tensor(PAD_ID), tf.int32)
        # No `xla_decode`: the XLA programs (`_xla_beam`, `_xla_greedy`) take no prefix, so a prefixed request
        # runs the graph decoder at any batch size, beam and greedy alike.
        return self._translate_text(text, lambda source: self._search(source, greedy=greedy, prefix_ids=prefix_ids))

    def _translate_greedy_prefixed(self, text, prefix):
        return self._translate_prefixed(text, prefix, greedy=True)

    def _translate_aligned(self, text):
        outputs = dict(self._merged_aligned(text))
        # The request's own width: a merged batch pads every row to its longest (alone: the same width).
        targets = used_width(outputs["target_pieces"], "")
        outputs["alignment"] = outputs["alignment"][:, :targets]
        outputs["target_pieces"] = outputs["target_pieces"][:, :targets]
        outputs["source_pieces"] = outputs["source_pieces"][:, :used_width(outputs["source_pieces"], "")]
        return outputs

    def _translate_aligned_rows(self, text):
        def alignment(source, tokens, empty):
            aligned = align_targets(self._model(), source, tokens, START_ID, END_ID)
            return {"alignment": tf.where(empty[:, None], -1, aligned),
                    "source_pieces": self._piece_strings(source, tf.zeros_like(empty), source_side),
                    "target_pieces": self._piece_strings(tokens, empty, target_side)}

        return self._translate_text(text, self._beam, extra=alignment)

    def _piece_strings(self, ids, empty, side):
        """Ids `[batch, length]` -> their pieces in `side`'s tokenizer (`source_side`, `target_side`), "" at
        padding and in the rows `empty` `[batch]`."""
        ids = tf.ensure_shape(ids, [None, None])
        return tf.where((ids != PAD_ID) & ~empty[:, None], side(self.tokenizer).id_to_string(ids), "")

    def _score(self, text, target):
        tokenized = self._tokenize(text)
        target_pieces = self._pieces(target, target_side)
        target_ids = tf.cast(source_from_pieces(target_pieces, self.max_source_length).to_tensor(PAD_ID), tf.int32)
        scores, log_prob, _ = score_targets(self._model(), tokenized["source_ids"], target_ids, START_ID,
                                            length_penalty=self.length_penalty)
        return {"score": scores, "log_prob": log_prob,
                "truncated": tokenized["truncated"] | self._truncated(target_pieces)}

    def _translate_beam(self, text):
        return self._translate_text(text, self._beam, self._xla_beam if self.xla_max_batch else None)

    def _translate_greedy(self, text):
        return self._translate_text(text, functools.partial(self._search, greedy=True),
                                    self._xla_greedy if self.xla_max_batch else None)

    def _translate_ids(self, source_ids):
        # The same source the text signatures decode: pieces truncated to the limit, then one end id, padded to
        # the limit's width (a merged batch concatenates its calls' sources).
        pieces = tf.ragged.boolean_mask(source_ids, (source_ids != PAD_ID) & (source_ids != END_ID))
        source = source_from_pieces(pieces, self.max_source_length).to_tensor(
            PAD_ID, shape=[None, self.max_source_length])
        outputs = self._merged_ids(source)
        tokens = outputs["tokens"]
        return {"tokens": tokens[:, :used_width(tokens, PAD_ID)], "score": outputs["score"],
                "truncated": self._truncated(pieces)}

    def _translate_source_rows(self, source):
        """Source ids `[batch, width]` (pieces + end id, 0-padded) -> beam search's {"tokens", "score"}, the
        source first cut to its longest row."""
        tokens, scores = self._beam(source[:, :used_width(source, PAD_ID)])
        return {"tokens": tf.ensure_shape(tf.cast(tokens, tf.int32), [None, None]), "score": tf.reshape(scores, [-1])}

    # -- saving -------------------------------------------------------------

    def signatures(self):
        return {
            TEXT_SIGNATURE: self.translate.get_concrete_function(),
            GREEDY_SIGNATURE: self.translate_greedy.get_concrete_function(),
            N_BEST_SIGNATURE: self.translate_n_best.get_concrete_function(),
            SAMPLE_SIGNATURE: self.translate_sampled.get_concrete_function(),
            PREFIX_SIGNATURE: self.translate_prefixed.get_concrete_function(),
            GREEDY_PREFIX_SIGNATURE: self.translate_greedy_prefixed.get_concrete_function(),
            SCORE_SIGNATURE: self.score.get_concrete_function(),
            ALIGN_SIGNATURE: self.translate_aligned.get_concrete_function(),
            IDS_SIGNATURE: self.translate_ids.get_concrete_function(),
            TOKENIZE_SIGNATURE: self.tokenize.get_concrete_function(),
        }

    def save(self, path):
        """Writes the SavedModel of every signature to `path`; returns `path`."""
        signatures = self.signatures()
        captured = {}
        for fn in [*signatures.values(), *self._batched_functions]:
            for v in fn.variables:
                captured.setdefault(id(v), v)
        # Tracked: the variables the functions capture, and only these (see the module docstring).
        self.model_variables = list(captured.values())
        tf.saved_model.save(self, str(path), signatures=signatures)
        return path


def _nothing_to_translate(source_ids):
    """`[batch]` bool: the tokenizer gave no piece (empty or whitespace-only text): the source is only the end id."""
    return tf.equal(tf.math.count_nonzero(source_ids, axis=1), 1)
