"""Our served translator side by side with CTranslate2, on the same trained weights (not a test).

Runs in the benchmark virtualenv, never the project's: ctranslate2 is no
project dependency (`make bench-venv`, or
`python3 -m venv .venv-bench && .venv-bench/bin/pip install -e . ctranslate2==4.8.5`).

    # 1. Our SavedModel, decoding in float32 (project venv).
    .venv/bin/python -m export.export_model --model-dir runs/en-de --model-file runs/en-de/averaged.keras \\
        --export-dir /tmp/ct2/ours32 --beam-size 4 --length-penalty 1.0 --precision float32
    # 2. The same weights as a float32 CTranslate2 model, then checked token by token against ours.
    .venv-bench/bin/python bench/ctranslate2_side_by_side.py convert --model-dir runs/en-de \\
        --model-file runs/en-de/averaged.keras --output-dir /tmp/ct2/ct2-en-de
    # 3. Greedy identity, sacreBLEU and speed on the 1,000 sentences of test_2016_flickr.
    #    Each system in its own process: ours on the threads kt-export printed, CTranslate2 in every layout.
    .venv-bench/bin/python bench/ctranslate2_side_by_side.py compare \\
        --saved-model /tmp/ct2/ours32/translator/1@2x1 --ct2-model /tmp/ct2/ct2-en-de \\
        --ct2 float32:1x2 --ct2 float32:2x1 --ct2 int8:1x2 --ct2 int8:2x1 \\
        --repeats 3 --json runs/bench/ctranslate2.json --outputs runs/bench/ct2-outputs

convert: builds a `ctranslate2.specs.TransformerSpec` from the Keras model
(post-norm or pre-norm as trained, ReLU, embeddings x sqrt(d_model), the
shared embedding as the output projection when tied, LayerNorm epsilon 1e-6:
CTranslate2's own default with a beta is 1e-5) and writes it in float32 with
the sentencepiece model and `keras_transformer.json` (languages, source
limit). The vocabulary is the sentencepiece pieces in id order, so
CTranslate2's ids are ours: pad 0, unk 1, <s> 2 (the decoder's start), </s> 3,
added after every source (`add_source_eos`), as our sources end. Position
encodings are OUR table (the paper's interleaved sin/cos from position 0), not
CTranslate2's built-in sinusoid (concatenated, from position 1, another
frequency). Linear weights are transposed ([in, out] -> [out, in]);
self-attention gets Q, K, V stacked, cross-attention Q, then K and V stacked.
The conversion is then checked: CTranslate2's `score_batch` and our Keras
model in float32 score the references of `--check-sentences` test sentences
(teacher forcing); the per-token log-probabilities must agree to
`--tolerance`, and the tokens must be ours (target pieces + </s>).

compare: each system runs alone in its own process (bench/translate_worker.py:
our export with its TensorFlow thread pools, or one CTranslate2 setting, with
no other framework loaded), and they take turns: the driver hands the same
batches to one worker at a time and the worker times them itself. The source
sentences are translated by batches of similar length (as
`export.translate.translate_lines`, kt-translate and bench/served_speed.py
batch them), text in, text out:
  - ours: the SavedModel's text signatures `greedy` and `serving_default`
    (beam search, with the beam size and alpha it was exported with),
    tokenization and detokenization in the graph;
  - CTranslate2: `Translator(device="cpu", compute_type, inter_threads,
    intra_threads).translate_batch` on sentencepiece pieces, tokenization and
    detokenization (Python sentencepiece, same model) inside the timed section.
Same batches, beam sizes (1 and 4), source limit (config.json's `max_source_length` tokens, </s>
included) and output limit: ours stops each sentence at its source length +
50 tokens, the end token included; CTranslate2 takes one limit per batch,
without the end token, so it gets (longest source in the batch + 50) - 1: a
sentence that runs on to its limit can come out longer from CTranslate2.
Pad is never output (ours bans it; CTranslate2: `suppress_sequences`), and
the end token may come first (`min_decoding_length=0`).

Thread layouts. Ours: `--saved-model PATH@NxM` serves PATH on N inter-op
threads of M intra-op threads (TF Serving's --tensorflow_inter_op_parallelism
and --tensorflow_intra_op_parallelism); an export with N parallel decoding
loops (`kt-export --parallel-loops N`, what it prints) runs its loops on N
inter-op threads of 1 intra-op thread each. Repeat `--saved-model` for other
exports or layouts (`NAME=PATH@NxM` names a row). CTranslate2: `--ct2
COMPUTE_TYPE:WORKERSxTHREADS`, repeated: `--ct2 float32:1x2 --ct2 float32:2x1
--ct2 int8:1x2 --ct2 int8:2x1` (with 2 workers each batch is split in two
halves that run at once). Each row gives every system's speed and each of
ours over the fastest setting of each compute type (the ratios of
BENCHMARKS.md's "Against CTranslate2").
CTranslate2 picks its matrix-product backend once per process: MKL on a
GenuineIntel CPU, oneDNN elsewhere, or oneDNN everywhere with `CT2_USE_MKL=0`.
Run the comparison both ways on an Intel CPU: the fastest thread layout can
differ between the two (docs/benchmarks-log.md, "On the Intel Xeon with AMX,
int8 and float32").

Length penalty: ours is ((5 + |y|) / 6)^alpha with |y| counting the end
token, CTranslate2's |y|^lp without it. No lp gives ours exactly; by default
lp makes the two agree in slope on a log-log scale at the median reference
length m (in pieces): lp = alpha * m / (m + 6). So beam outputs may differ a
little; greedy ones must be identical (>= 95%). CTranslate2's greedy search
computes no scores (`return_scores=False`; ours reports one).

Batch 64 runs the first `--limit` sentences (all 1,000), batch 1 the first
`--batch1-limit` (200). Every system is warmed up with one pass, then the
repeats take turns (ours, CTranslate2 settings, ours, ...) and the median of
each is reported.
Identity and sacreBLEU are of the largest batch size (64: all sentences;
`--outputs DIR` writes both systems' translations). Keep the CPU line (model
and avx2/avx512*/amx flags) with the figures; CT2_VERBOSE=1 makes CTranslate2
log the ISA and GEMM backend it picked (oneDNN unless the CPU is a
GenuineIntel one, where it takes MKL).

Time on an otherwise idle machine, not under `nice` (the load average at start
and end is printed and saved): CTranslate2's OpenMP threads meet at a barrier
in every op, so when one of them shares a core with another busy process (and
more so at a lower priority) all wait for it; its times then grow 10-60x,
TensorFlow's work-stealing threads' far less, which flatters the ratio.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.native_logs import import_tensorflow_quietly  # noqa: E402

tf = import_tensorflow_quietly()

import numpy as np  # noqa: E402
import sentencepiece as spm  # noqa: E402

from bench.served_speed import cpu_line  # noqa: E402
from bench.translate_worker import REPLY_PREFIX, parse_ct2_setting, parse_layout  # noqa: E402
from export.translate import resolve_saved_model, translate_lines  # noqa: E402
from export.engine_weights import engine_model  # noqa: E402
from export.search import EXTRA_OUTPUT_LENGTH  # noqa: E402
from common import run_dir  # noqa: E402
from common.run_dir import TOKENIZER_FILENAME, tokenizer_path  # noqa: E402
from export.translator import load_model_dir  # noqa: E402
from keras_transformer.embedding import positional_encoding  # noqa: E402
from keras_transformer.text import END_ID, PAD_ID, START_ID, UNK_ID, read_lines  # noqa: E402
from common.tokenizer import encode_source

# ctranslate2 is imported where it is used, so that `--help` runs in the project's virtualenv, which does not have
# it (tests/test_bench_scripts.py runs every bench script's `--help` there).

# Written next to the CTranslate2 model: what `compare` needs to know of the model it came from.
SIDECAR_FILENAME = "keras_transformer.json"
# (beam size, our signature): the SavedModel's serving_default must be exported with --beam-size 4.
DECODINGS = ((1, "greedy"), (4, "serving_default"))
GREEDY_IDENTITY_GOAL = 0.95
LENGTH_PENALTY = 1.0  # compare --length-penalty's default
WORKER = Path(__file__).resolve().with_name("translate_worker.py")
# Between two timed calls: CTranslate2's OpenMP threads spin for a while after their last op (Intel OpenMP's
# KMP_BLOCKTIME), and the next system must not start beside them.
SETTLE_S = 0.5


# ------------------------------------------------------------------ convert


def numpy32(variable):
    """A Keras variable as a float32 numpy array (bfloat16-stored weights included)."""
    return np.asarray(variable.numpy(), dtype=np.float32)


def linear(kernel, bias, input_axes=1):
    """A CTranslate2 linear layer from a Keras kernel whose first `input_axes` axes are the input.

    CTranslate2 weights are [out, in]; Dense kernels are [in, out], an attention's Q/K/V kernels
    [in, heads, head_dim] and its output kernel [heads, head_dim, out] (heads-major on both sides).
    """
    from ctranslate2.specs import common_spec

    kernel = numpy32(kernel)
    spec = common_spec.LinearSpec()
    spec.weight = np.ascontiguousarray(kernel.reshape(int(np.prod(kernel.shape[:input_axes])), -1).T)
    spec.bias = numpy32(bias).reshape(-1)
    return spec


def set_layer_norm(spec, norm):
    spec.gamma, spec.beta = numpy32(norm.gamma), numpy32(norm.beta)


def set_attention(spec, attention, norm, self_attention):
    """Our MultiHeadAttention + the LayerNorm of its residual block -> a CTranslate2 attention spec."""
    from ctranslate2.converters.utils import fuse_linear

    # The layer's public `projections` (keras_transformer.keras_internals.attention_projections reads Keras' own).
    projections = attention.projections
    q, k, v = (linear(dense.kernel, dense.bias) for dense in (projections.query, projections.key, projections.value))
    if self_attention:
        fuse_linear(spec.linear[0], [q, k, v])
    else:  # cross-attention: queries from the decoder, keys and values (stacked) from the encoder output
        fuse_linear(spec.linear[0], [q])
        fuse_linear(spec.linear[1], [k, v])
    spec.linear[-1] = linear(projections.output.kernel, projections.output.bias, input_axes=2)
    set_layer_norm(spec.layer_norm, norm)


def set_feed_forward(spec, layer):
    spec.linear_0 = linear(layer.feed_forward.inner.kernel, layer.feed_forward.inner.bias)
    spec.linear_1 = linear(layer.feed_forward.outer.kernel, layer.feed_forward.outer.bias)
    set_layer_norm(spec.layer_norm, layer.feed_forward_norm)


def set_embeddings(embeddings_spec, positions_spec, embedding, num_positions):
    """Token embedding (CTranslate2 scales it by sqrt(d_model) itself, as we do) and our sinusoid table,
    [num_positions, d_model], position 0 first (CTranslate2 adds row i at position i)."""
    embeddings_spec.weight = numpy32(embedding.token_embedding.embeddings)
    positions_spec.encodings = positional_encoding(tf.range(num_positions), embedding.d_model, "float32",
                                                   embedding.sinusoid_layout).numpy()


def transformer_spec_of(model, pieces, num_positions):
    """A float32-ready `TransformerSpec` holding the Keras Transformer's weights."""
    if model.key_dim not in (None, model.d_model // model.num_heads):
        # CTranslate2's attention has one size per head, d_model / num_heads, for queries, keys and values.
        raise ValueError(f"A model with key_dim={model.key_dim} (d_k apart from d_model // num_heads = "
                         f"{model.d_model // model.num_heads}) is not converted: CTranslate2's heads are d_model / "
                         "num_heads wide for queries, keys and values alike.")
    if model.activation != "relu" or model.output_bias:
        raise ValueError(f"A model with activation={model.activation!r} or output_bias={model.output_bias} is not "
                         "converted: this converter writes the paper's ReLU feed-forward networks and an output "
                         "projection without a bias only.")
    from ctranslate2.specs import transformer_spec

    if model.learned_positions:
        # Our decoding stops outputs at the table's end; CTranslate2 would fail there instead.
        raise ValueError("A model with learned positions is not converted (sinusoids only).")
    encoder_layers, decoder_layers = model.encoder.encoder_layers, model.decoder.decoder_layers
    spec = transformer_spec.TransformerSpec(
        transformer_spec.TransformerEncoderSpec(len(encoder_layers), model.num_heads, pre_norm=model.norm_first),
        transformer_spec.TransformerDecoderSpec(len(decoder_layers), model.num_heads, pre_norm=model.norm_first),
    )
    config = spec.config
    config.layer_norm_epsilon = model.layer_norm_epsilon
    config.unk_token, config.bos_token, config.eos_token = pieces[UNK_ID], pieces[START_ID], pieces[END_ID]
    config.decoder_start_token = pieces[START_ID]
    config.add_source_bos, config.add_source_eos = False, True  # source = pieces + [END_ID]
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)

    # The encoder has a list of embeddings (one per source factor); one here.
    set_embeddings(spec.encoder.embeddings[0], spec.encoder.position_encodings,
                   model.source_embedding or model.target_embedding, num_positions)
    for layer_spec, layer in zip(spec.encoder.layer, encoder_layers):
        set_attention(layer_spec.self_attention, layer.self_attention, layer.self_attention_norm, True)
        set_feed_forward(layer_spec.ffn, layer)

    set_embeddings(spec.decoder.embeddings, spec.decoder.position_encodings, model.target_embedding, num_positions)
    for layer_spec, layer in zip(spec.decoder.layer, decoder_layers):
        set_attention(layer_spec.self_attention, layer.self_attention, layer.self_attention_norm, True)
        set_attention(layer_spec.attention, layer.cross_attention, layer.cross_attention_norm, False)
        set_feed_forward(layer_spec.ffn, layer)

    if model.norm_first:  # a pre-norm stack ends with a LayerNorm
        set_layer_norm(spec.encoder.layer_norm, model.encoder.final_norm)
        set_layer_norm(spec.decoder.layer_norm, model.decoder.final_norm)
    if model.output_projection is None:  # tied: logits = h E^T, and E is already [out, in]
        spec.decoder.projection.weight = spec.decoder.embeddings.weight
    else:
        spec.decoder.projection = linear(model.output_projection.kernel, model.output_projection.bias)
    return spec


def convert(model, tokenizer_file, config, output_dir, force=False) -> Path:
    """Writes the float32 CTranslate2 model of `model` to `output_dir`, with the tokenizer and the sidecar."""
    from ctranslate2.converters import Converter

    class SpecConverter(Converter):
        """CTranslate2's own conversion steps (validate, alias shared weights, quantize, save) for a built spec."""

        def __init__(self, spec):
            self._spec = spec

        def _load(self):
            return self._spec

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_file))
    pieces = sp.id_to_piece(list(range(sp.get_piece_size())))  # in id order: CTranslate2's ids are ours
    # Positions read: a source of max_source_length tokens; outputs of up to max_source_length + 50 tokens.
    num_positions = run_dir.max_source_length(config) + EXTRA_OUTPUT_LENGTH
    spec = transformer_spec_of(model, pieces, num_positions)
    spec.register_file(str(tokenizer_file), TOKENIZER_FILENAME)
    SpecConverter(spec).convert(str(output_dir), quantization="float32", force=force)
    sidecar = {"source_lang": config["source_lang"], "target_lang": config["target_lang"],
               "max_source_length": run_dir.max_source_length(config), "positions": num_positions}
    (Path(output_dir) / SIDECAR_FILENAME).write_text(json.dumps(sidecar, indent=2) + "\n")
    return Path(output_dir)


def check_scores(model, tokenizer, ct2_dir, sources, targets, max_source_length, threads):
    """Teacher-forced log-probabilities of `targets`, ours (float32) and CTranslate2's, token by token.

    Only the pairs whose target, with </s>, fits in `max_source_length` tokens are scored: CTranslate2's
    `max_input_length` cuts the target there too, where ours would score it whole.

    Returns (max |difference|, mean |difference|, number of tokens, sentences whose tokens differ, pairs skipped).
    """
    import ctranslate2

    sp = spm.SentencePieceProcessor(model_file=str(Path(ct2_dir) / TOKENIZER_FILENAME))
    target_pieces = sp.encode(targets, out_type=str)
    fits = [len(pieces) + 1 <= max_source_length for pieces in target_pieces]
    sources, targets, target_pieces = ([item for item, ok in zip(items, fits, strict=True) if ok]
                                       for items in (sources, targets, target_pieces))
    translator = ctranslate2.Translator(str(ct2_dir), device="cpu", compute_type="float32",
                                        intra_threads=threads, inter_threads=1)
    ct2 = translator.score_batch(sp.encode(sources, out_type=str), target_pieces, max_input_length=max_source_length)

    source_ids = encode_source(tokenizer, tf.constant(sources), max_source_length).to_tensor(PAD_ID)
    pieces = tf.cast(tokenizer.tokenize(tf.constant(targets)), tf.int32)
    start = tf.fill([pieces.nrows(), 1], START_ID)
    end = tf.fill([pieces.nrows(), 1], END_ID)
    target_in = tf.concat([start, pieces], axis=1).to_tensor(PAD_ID)
    target_out = tf.concat([pieces, end], axis=1)
    log_probs = tf.nn.log_softmax(engine_model(model, "float32")((source_ids, target_in), training=False))
    ours = tf.gather(log_probs, target_out.to_tensor(PAD_ID), batch_dims=2).numpy()

    differences, token_mismatches = [], 0
    for i, (result, out_ids) in enumerate(zip(ct2, target_out.to_list())):
        token_mismatches += result.tokens != [sp.id_to_piece(t) for t in out_ids]
        differences.extend(np.abs(np.asarray(result.log_probs) - ours[i, :len(out_ids)]))
    return (float(np.max(differences)), float(np.mean(differences)), len(differences), token_mismatches,
            fits.count(False))


def run_convert(args) -> int:
    model, tokenizer, config = load_model_dir(args.model_dir, args.model_file)
    output = convert(model, tokenizer_path(args.model_dir, config), config, args.output_dir, force=args.force)
    limit = run_dir.max_source_length(config)
    print(f"Wrote {output} (float32, {limit + EXTRA_OUTPUT_LENGTH} positions)", flush=True)

    data = Path(args.data_dir)
    sources = read_lines(data / f"{args.split}.{config['source_lang']}")[:args.check_sentences]
    targets = read_lines(data / f"{args.split}.{config['target_lang']}")[:args.check_sentences]
    max_diff, mean_diff, tokens, mismatches, skipped = check_scores(
        model, tokenizer, output, sources, targets, limit, args.threads)
    ok = max_diff <= args.tolerance and mismatches == 0
    print(f"Check on {len(sources) - skipped} reference translations ({tokens} tokens; {skipped} longer than "
          f"max_source_length {limit} skipped), teacher forcing: token log-probs "
          f"differ by at most {max_diff:.2e} (mean {mean_diff:.2e}); sentences whose tokens differ: {mismatches}. "
          f"{'OK' if ok else 'MISMATCH'} (tolerance {args.tolerance:g}).")
    return 0 if ok else 1


# ------------------------------------------------------------------ compare


def matched_length_penalty(alpha, references, sp) -> tuple[float, float]:
    """(CTranslate2 lp, m): lp with |y|^lp as steep as ((|y| + 6) / 6)^alpha in log-log at |y| = m,
    the median reference length in pieces (|y| without the end token)."""
    m = float(statistics.median(len(p) for p in sp.encode(references)))
    return alpha * m / (m + 6.0), m


def source_ids_identical(saved_model, sources, sp, max_source_length) -> int:
    """How many sources our SavedModel's `tokenize` frames exactly as CTranslate2 is given them
    (pieces, truncated to max_source_length - 1, then </s>)."""
    tokenize = tf.saved_model.load(str(resolve_saved_model(saved_model))).signatures["tokenize"]
    ours = tokenize(text=tf.constant(sources))["source_ids"].numpy()
    theirs = [ids[:max_source_length - 1] + [END_ID] for ids in sp.encode(sources)]
    return sum(list(row[row != PAD_ID]) == ids for row, ids in zip(ours, theirs))


def decoding_name(beam) -> str:
    return "greedy" if beam == 1 else f"beam{beam}"


def write_outputs(directory, outputs):
    """OUTPUTS/{ours,ctranslate2}.{greedy,beam4}.txt, one translation per line, in input order."""
    directory.mkdir(parents=True, exist_ok=True)
    for beam, hyps in outputs.items():
        for name, lines in hyps.items():
            (directory / f"{name}.{decoding_name(beam)}.txt").write_text(
                "".join(line + "\n" for line in lines), encoding="utf-8")


def parse_ours(text):
    """'[NAME=]PATH[@INTERxINTRA]' -> (name or None, path, (inter-op, intra-op) threads or None)."""
    name, _, rest = text.rpartition("=") if "=" in text.split("@")[0] else (None, "", text)
    path, _, layout = rest.partition("@")
    try:
        threads = parse_layout(layout) if layout else None
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"--saved-model {text!r}: {e}") from None
    return name or None, path, threads


def kt_translate_batches(texts, batch_size):
    """The batches kt-translate makes of `texts` (sorted by length), in its order: `translate_lines`' own."""
    batches = []

    def record(batch):
        batches.append(list(batch))
        return [""] * len(batch), [None] * len(batch)

    translate_lines(record, texts, batch_size)
    return batches


class Worker:
    """A translator in its own process (bench/translate_worker.py), answering timed requests."""

    def __init__(self, name, argv):
        self.name = name
        self.process = subprocess.Popen([sys.executable, str(WORKER), *argv], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, encoding="utf-8")
        self.description = self._reply()

    def _reply(self):
        for line in self.process.stdout:
            if line.startswith(REPLY_PREFIX):
                return json.loads(line[len(REPLY_PREFIX):])
        raise RuntimeError(f"{self.name}: the worker ended (exit status {self.process.wait()}); see its stderr above")

    def translate(self, texts, batch_size, decoding):
        """(seconds the worker took, translations in input order) for `texts` in kt-translate's batches;
        `decoding`: (beam size, our signature), one of DECODINGS."""
        beam, signature = decoding
        request = {"batches": kt_translate_batches(texts, batch_size), "beam": beam, "signature": signature}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        answer = self._reply()
        translations = iter(answer["translations"])
        texts_out = translate_lines(lambda batch: (next(translations), [None] * len(batch)), texts, batch_size).texts
        return answer["seconds"], texts_out

    def close(self):
        if self.process.poll() is None:
            self.process.stdin.write("\n")
            self.process.stdin.close()
            self.process.wait()


def time_workers(workers, texts, batch_size, decoding, repeats):
    """One untimed pass each (its seconds are returned: tracing, first allocations, an XLA decoder's
    compilations), then `repeats` rounds alternating the workers, each alone on the machine while it runs
    (the others wait on their pipes; SETTLE_S between calls lets the last one's threads go idle).
    Returns ({name: seconds of each round}, {name: translations of the last round}, {name: warm-up seconds})."""
    warm_up = {}
    for w in workers:
        warm_up[w.name] = w.translate(texts, batch_size, decoding)[0]
        time.sleep(SETTLE_S)
    seconds, outputs = {w.name: [] for w in workers}, {}
    for _ in range(repeats):
        for w in workers:
            elapsed, outputs[w.name] = w.translate(texts, batch_size, decoding)
            seconds[w.name].append(elapsed)
            time.sleep(SETTLE_S)
    return seconds, outputs, warm_up


def run_summary(workers, ours, ct2_model, length_penalty, ct2_length_penalty, load_at_start, **results) -> dict:
    """The JSON summary's fields common to `compare` and bench/served_load.py (when, where, what ran, with
    which length penalties, the load around it), then `results`."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_line(),
        "command": " ".join([sys.executable, *sys.argv]),
        "systems": {w.name: w.description for w in workers},
        "saved_models": {name: str(path) for name, path, _ in ours},
        "ct2_model": str(ct2_model),
        "length_penalty": length_penalty,
        "ct2_length_penalty": round(ct2_length_penalty, 4),
        **results,
        "load_average_at_start": load_at_start,
        "load_average_at_end": os.getloadavg(),
    }


def run_compare(args) -> int:
    import sacrebleu

    load_at_start = os.getloadavg()
    sidecar = json.loads((Path(args.ct2_model) / SIDECAR_FILENAME).read_text())
    data = Path(args.data_dir)
    sources = read_lines(data / f"{args.split}.{sidecar['source_lang']}")[:args.limit]
    references = read_lines(data / f"{args.split}.{sidecar['target_lang']}")[:args.limit]
    max_source_length = sidecar["max_source_length"]

    sp = spm.SentencePieceProcessor(model_file=str(Path(args.ct2_model) / TOKENIZER_FILENAME))
    length_penalty, median_length = matched_length_penalty(args.length_penalty, references, sp)
    if args.ct2_length_penalty is not None:
        length_penalty = args.ct2_length_penalty
    default_threads = (args.tf_inter_op_threads, args.tf_intra_op_threads or args.threads)
    ours = []  # (name, path, (inter-op, intra-op))
    for name, path, threads in args.saved_model:
        threads = threads or default_threads
        ours.append((name or ("ours" if len(args.saved_model) == 1 else f"ours {threads[0]}x{threads[1]}"),
                     path, threads))
    settings = {f"ct2 {c} {i}x{t}": (c, i, t) for c, i, t in (args.ct2 or [("float32", 1, args.threads)])}
    names = [name for name, _, _ in ours] + list(settings)
    if len(set(names)) != len(names):
        raise SystemExit(f"compare: two systems named alike ({', '.join(names)}): name them, --saved-model NAME=PATH")
    same_sources = source_ids_identical(ours[0][1], sources, sp, max_source_length)

    workers = []
    try:
        for name, path, (inter, intra) in ours:
            workers.append(Worker(name, ["ours", "--saved-model", str(path), "--inter-op-threads", str(inter),
                                         "--intra-op-threads", str(intra)]))
        for name, (compute, inter, intra) in settings.items():
            workers.append(Worker(name, ["ct2", "--ct2-model", str(args.ct2_model),
                                         "--tokenizer", str(Path(args.ct2_model) / TOKENIZER_FILENAME),
                                         "--setting", f"{compute}:{inter}x{intra}",
                                         "--length-penalty", str(length_penalty),
                                         "--max-source-length", str(max_source_length),
                                         "--extra-output-length", str(EXTRA_OUTPUT_LENGTH), "--pad-id", str(PAD_ID)]))
        print(f"CPU: {cpu_line()}\n{len(sources)} sentences of {args.split}; each system in its own process: "
              + "; ".join(f"{w.name}: {json.dumps(w.description)}" for w in workers)
              + f"; CTranslate2 length penalty {length_penalty:.3f} (ours: alpha {args.length_penalty}; median "
              f"reference length {median_length:g} pieces); source ids identical: {same_sources} of {len(sources)}; "
              f"load average {load_at_start[0]:.2f}", flush=True)

        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
        results, outputs = [], {}
        for beam, signature in DECODINGS:
            for batch_size in batch_sizes:
                texts = sources[:args.batch1_limit] if batch_size == 1 else sources
                seconds, outputs[(beam, batch_size)], warm_up = time_workers(
                    workers, texts, batch_size, (beam, signature), args.repeats)
                speed = {n: len(texts) / statistics.median(s) for n, s in seconds.items()}
                row = {"beam": beam, "batch_size": batch_size, "sentences": len(texts),
                       **{f"{n}_seconds": [round(s, 2) for s in seconds[n]] for n in names},
                       **{f"{n}_sentences_per_s": round(speed[n], 1) for n in names},
                       "ratios": {o: {c: round(speed[o] / speed[c], 2) for c in settings} for o, _, _ in ours},
                       "warm_up_s": {n: round(t, 2) for n, t in warm_up.items()}}
                results.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for w in workers:
            w.close()

    first = ours[0][0]
    quality = {}
    for beam, _ in DECODINGS:
        hyps = outputs[(beam, max(batch_sizes))]
        quality[decoding_name(beam)] = {
            "sentences": len(hyps[first]),
            **{f"identical_{name}": sum(a == b for a, b in zip(hyps[first], hyps[name])) for name in names[1:]},
            **{f"{name}_bleu": round(sacrebleu.corpus_bleu(h, [references[:len(h)]]).score, 2)
               for name, h in hyps.items()}}
    # Identity is a property of the conversion, so it is asked of the float32 settings only.
    exact = [name for name, setting in settings.items() if setting[0] == "float32"]
    greedy = quality["greedy"]
    greedy_ok = all(greedy[f"identical_{name}"] >= GREEDY_IDENTITY_GOAL * greedy["sentences"] for name in exact)
    if args.outputs:
        write_outputs(Path(args.outputs), {beam: outputs[(beam, max(batch_sizes))] for beam, _ in DECODINGS})

    print(f"\n| decoding | batch | sentences | {' | '.join(f'{n} sent/s' for n in names)} |")
    print("|---|---:|---:|" + "---:|" * len(names))
    for r in results:
        print(f"| {decoding_name(r['beam'])} | {r['batch_size']} | {r['sentences']} | "
              + " | ".join(str(r[f"{n}_sentences_per_s"]) for n in names) + " |")
    compute_types = sorted({setting[0] for setting in settings.values()})
    print("\nOurs against each CTranslate2 compute type at its fastest setting (per row):")
    for r in results:
        best = {c: max((n for n in settings if settings[n][0] == c), key=lambda n: r[f"{n}_sentences_per_s"])
                for c in compute_types}
        r["ratio_over_best"] = {o: {c: r["ratios"][o][n] for c, n in best.items()} for o, _, _ in ours}
        for o, _, _ in ours:
            print(f"  {decoding_name(r['beam'])}, batch {r['batch_size']}, {o}: "
                  + ", ".join(f"/ {c} = {r['ratios'][o][n]}x ({n})" for c, n in best.items()))
    for decoding, q in quality.items():
        print(f"{decoding}: sacreBLEU " + ", ".join(f"{n} {q[f'{n}_bleu']}" for n in names)
              + "; identical to " + first + ": "
              + ", ".join(f"{n} {q[f'identical_{n}']} of {q['sentences']}" for n in names[1:]))
    if exact:
        print(f"Greedy identity goal (>= {GREEDY_IDENTITY_GOAL:.0%}, float32): {'met' if greedy_ok else 'NOT met'}")

    if args.json:
        summary = run_summary(workers, ours, args.ct2_model, args.length_penalty, length_penalty, load_at_start,
                              source_ids_identical=same_sources, quality=quality, results=results)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if greedy_ok else 1


# ------------------------------------------------------------------ command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--data-dir", default="../shared/data/multi30k")
    common.add_argument("--split", default="test_2016_flickr")
    common.add_argument("--threads", type=int, default=2, help="CTranslate2 intra_threads and TF intra-op threads")

    c = commands.add_parser("convert", parents=[common], help="write the CTranslate2 model and check it")
    c.add_argument("--model-dir", required=True, help="directory written by kt-train")
    c.add_argument("--model-file", help="a .keras file in place of MODEL_DIR/model.keras (e.g. averaged.keras)")
    c.add_argument("--output-dir", required=True, help="the CTranslate2 model directory to write")
    c.add_argument("--force", action="store_true", help="replace OUTPUT_DIR if it exists")
    c.add_argument("--check-sentences", type=int, default=100, help="references scored by both (default 100)")
    c.add_argument("--tolerance", type=float, default=1e-4, help="largest token log-prob difference allowed")

    m = commands.add_parser("compare", parents=[common], help="identity, BLEU and speed, ours vs CTranslate2")
    m.add_argument("--saved-model", required=True, action="append", type=parse_ours,
                   metavar="[NAME=]PATH[@INTERxINTRA]",
                   help="our float32 export, EXPORT_DIR/NAME[/VERSION], served on INTER inter-op threads of INTRA "
                        "intra-op threads each (default: --tf-inter-op-threads x --tf-intra-op-threads); repeat "
                        "for more exports or thread layouts, each in its own process. The first is the one the "
                        "translations are compared with")
    m.add_argument("--ct2-model", required=True, help="the directory `convert` wrote")
    m.add_argument("--length-penalty", type=float, metavar="A",
                   help=f"the length penalty the SavedModel was exported with (default {LENGTH_PENALTY})")
    run_dir.add_renamed_flags(m, "alpha")  # --alpha, still read (with a note): see main
    m.add_argument("--ct2-length-penalty", type=float, help="CTranslate2's length_penalty "
                   "(default: alpha * m / (m + 6), m = median reference length in pieces)")
    m.add_argument("--limit", type=int, default=1000, help="sentences at batch 64 (default 1000: all)")
    m.add_argument("--batch1-limit", type=int, default=200, help="sentences at batch 1 (default 200)")
    m.add_argument("--batch-sizes", default="64,1")
    m.add_argument("--repeats", type=int, default=3)
    m.add_argument("--tf-inter-op-threads", type=int, default=0, metavar="N",
                   help="TensorFlow's inter-op threads (default 0: its own choice, one per core)")
    m.add_argument("--tf-intra-op-threads", type=int, default=0, metavar="N",
                   help="TensorFlow's intra-op threads (default 0: --threads)")
    m.add_argument("--ct2", action="append", type=parse_ct2_setting, metavar="TYPE:WORKERSxTHREADS",
                   help="a CTranslate2 setting to time beside ours, each in its own process, e.g. int8:2x1 (2 workers "
                        "of 1 thread, each batch split in two) or float32:1x2; repeat to alternate several in one "
                        "run (default: float32:1xTHREADS)")
    m.add_argument("--json", help="also write the results here")
    m.add_argument("--outputs", help="also write both systems' translations (largest batch size) to this directory")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run_dir.take_renamed_flags(parser, args, f"{parser.prog}:")
    if args.command == "compare" and args.length_penalty is None:  # no parser default: --alpha may give it
        args.length_penalty = LENGTH_PENALTY
    return run_convert(args) if args.command == "convert" else run_compare(args)


if __name__ == "__main__":
    sys.exit(main())
