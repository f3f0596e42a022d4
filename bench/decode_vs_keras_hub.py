"""Cached decoding throughput: this project's greedy/beam search vs keras-hub's samplers (not a test).

Run it in the benchmark virtualenv (keras-hub is not a project dependency), on a quiet machine:

    .venv-bench/bin/python bench/decode_vs_keras_hub.py --json /tmp/decode_vs_keras_hub.json

(defaults: --limit 1000 --batch1-limit 200 --batch-sizes 1,64 --beam-size 4 --new-tokens 16
--repeats 3 --jit off,on; about 30 minutes on 2 cores). Smoke run: add
`--limit 8 --batch1-limit 2 --batch-sizes 1,4 --repeats 1 --jit off`.

What runs, all at preset "small" (d_model 256, 4 heads, d_ff 1024, 3+3 layers, vocabulary 8000),
float32 unless --dtype-policy, random weights (seed 1234):

| row | search loop | model and cache |
|---|---|---|
| ours | `keras_transformer.decoding.greedy_decode` / `beam_search` | our `Transformer` (`encode`, `init_decoding_cache`, `decode_step`) |
| hub-loop/our-model | `keras_hub.samplers.GreedySampler` / `BeamSampler(num_beams=4)` | the same model and cache, through a `next(prompt, cache, index)` that calls `decode_step`: only the search loop differs |
| hub-loop/hub-model | the same keras-hub samplers | an encoder-decoder of `keras_hub.layers` (`ReversibleEmbedding` tied, `SinePositionEncoding`, `TransformerEncoder`, `TransformerDecoder`: post-norm, ReLU, epsilon 1e-6 like ours) with keras-hub's own `[batch, layers, 2, length, heads, head_dim]` self-attention cache, wired as keras-hub 0.32's `BartSeq2SeqLM.generate_step` / `call_decoder_with_cache` |

Each row decodes the same batches: the first --limit source sentences of Multi30k
test_2016_flickr.en (--batch1-limit at batch 1), tokenized with the demo model's sentencepiece
model (pieces + end id), sorted by length and padded with 0 to a multiple of --pad-multiple
(8), so only a few shapes are traced and every row sees identical tensors.

Equal work. With random weights the outputs are meaningless and their lengths would differ, so
every row decodes exactly --new-tokens (N) tokens per sentence, for every sentence:
keras-hub's samplers get no stop token (then they run max_length - index = N steps); ours get
max_output_length=N and an end id of -1, which no step can produce, so neither the per-sentence stop
nor beam search's early stop can fire and both loops run N steps (at step N only the end id is
allowed, so ours writes padding there: same work, and the tokens are not the point). Generated
tokens = sentences x N in every row; sentences/s and tokens/s are both reported, plus ms per
decoding step (median pass time / (batches x N)).

What is timed: one Python call per batch of a `tf.function` that takes the padded source ids and
does everything (encoder, cache set-up, the N-step `tf.while_loop`, the result) and returns int32
tokens; the wall time of a pass over all batches, including `.numpy()` of each result. Every
row's function is first called once per distinct batch shape (tracing/compiling, not timed);
then --repeats passes, interleaved across rows (row 1, row 2, ..., row 1, ...) so a busy
machine's drift hits all rows alike; the median pass is reported.

jit_compile. keras-hub's `Seq2SeqLM`/`CausalLM.generate` wraps `generate_step` in
`tf.function(jit_compile=model.jit_compile)`, and `compile(jit_compile="auto")` resolves that to
False on a CPU-only TensorFlow machine (XLA only with a GPU/TPU); this project decodes in a
plain `tf.function` (export/ and training/evaluate: no XLA; the SavedModel must run on stock
TF Serving). So the "off" rows are what each uses by default here; the "on" rows (default
--jit off,on) add XLA for every configuration, and a row that fails is listed with its error:
our model's cache write at the time of that run (`TensorStridedSliceUpdate` at a loop-dependent
position, chosen so stock TF Serving runs the SavedModel; now a growing concat outside XLA and
`dynamic_update_slice` inside) was not XLA-compilable ("must be a compile-time
constant"), so only hub-loop/hub-model has "on" rows; those compare against ours without XLA.

Known differences that remain (they are part of what is compared, not of the set-up):
- ours' beam search carries the greedy hypothesis as a 5th row per sentence (beam 4: 5 decoder
  rows per sentence per step; keras-hub: 4) and keeps the 2k best candidates; it applies the
  length penalty (alpha 0.6) and bans padding; keras-hub's BeamSampler does not.
- keras-hub's BeamSampler reorders every cache tensor each step. In hub-loop/our-model only the
  self-attention cache is in the sampler's cache (the cross-attention keys/values, encoder
  output and padding mask are repeated once per beam outside the loop, as ours does); in
  hub-loop/hub-model the encoder output, padding mask and cross-attention cache ride in the
  sampler's cache, as keras-hub 0.32's BART does, so BeamSampler reorders them every step too.
  The reorder is `keras.ops.take_along_axis`, which on the TensorFlow backend broadcasts the
  beam indices to the cache's full shape and gathers element by element (ours: one `tf.gather`
  of rows); without XLA that dominates keras-hub's beam steps at batch 64.
- hub-loop/hub-model fills its cross-attention cache the way BART's `_build_cache` does, with a
  seed decoder pass (here over the start token only, not the whole padded prompt), and the
  sampler's first step then recomputes position 0: N+1 single-token decoder passes, vs N.
- The self-attention cache holds N positions everywhere; every row attends over all N slots
  (masked) at every step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from keras_transformer.text import END_ID as EOS_ID  # noqa: E402  (ends every source sentence)
from keras_transformer.text import START_ID  # noqa: E402  (the decoder's start token)

NEVER_ID = -1  # ours' end id: no step can produce it, so every row decodes exactly N tokens
PRESET = "small"
VOCAB_SIZE = 8000
SEED = 1234

CONFIGS = {
    "ours": ("keras_transformer.decoding", "ours"),
    "hub-loop/our-model": ("keras_hub.samplers", "ours (decode_step)"),
    "hub-loop/hub-model": ("keras_hub.samplers", "keras_hub.layers"),
}


# --------------------------------------------------------------------------- data


def load_batches(args, batch_size, limit):
    """Padded int32 source-id batches `[b, len]`: the first `limit` sentences, sorted by length."""
    import numpy as np
    import sentencepiece as spm

    with open(Path(args.data_dir) / f"{args.split}.{args.source_lang}", encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f][:limit]
    sp = spm.SentencePieceProcessor(model_file=str(args.tokenizer))
    ids = [pieces[: args.max_source_length - 1] + [EOS_ID] for pieces in sp.encode(lines)]
    ids.sort(key=len)  # as kt-translate batches
    batches = []
    for i in range(0, len(ids), batch_size):
        chunk = ids[i : i + batch_size]
        width = args.pad_multiple * math.ceil(max(map(len, chunk)) / args.pad_multiple)
        batch = np.zeros([len(chunk), width], np.int32)
        for row, sentence in enumerate(chunk):
            batch[row, : len(sentence)] = sentence
        batches.append(batch)
    return batches, sum(map(len, ids)) / max(len(ids), 1)


# --------------------------------------------------------------------------- models


class HubSeq2Seq:
    """An encoder-decoder of keras_hub layers, sized and shaped like our `Transformer`.

    Post-norm, ReLU feed-forward, LayerNorm epsilon 1e-6, sinusoidal positions, embedding scaled
    by sqrt(d_model) and tied to the output projection, no embedding LayerNorm (ours has none).
    The cached decoder follows keras-hub 0.32's `BartSeq2SeqLM.call_decoder_with_cache`: one
    stacked self-attention cache `[batch, layers, 2, length, heads, head_dim]`, sliced per layer
    and re-stacked every step.
    """

    def __init__(self, d_model, num_heads, d_ff, num_encoder_layers, num_decoder_layers, dropout, **_):
        import keras
        import keras_hub

        self.d_model, self.num_heads = d_model, num_heads
        self.embedding = keras_hub.layers.ReversibleEmbedding(
            VOCAB_SIZE, d_model, tie_weights=True,
            embeddings_initializer=keras.initializers.RandomNormal(stddev=d_model**-0.5), name="hub_embedding",
        )
        self.positions = keras_hub.layers.SinePositionEncoding(name="hub_positions")
        layer_args = dict(intermediate_dim=d_ff, num_heads=num_heads, dropout=dropout, activation="relu",
                          layer_norm_epsilon=1e-6, normalize_first=False)
        self.encoder_layers = [keras_hub.layers.TransformerEncoder(**layer_args, name=f"hub_encoder_{i}")
                               for i in range(num_encoder_layers)]
        self.decoder_layers = [keras_hub.layers.TransformerDecoder(**layer_args, name=f"hub_decoder_{i}")
                               for i in range(num_decoder_layers)]
        hidden = (None, None, d_model)
        self.embedding.build((None, None))
        for layer in self.encoder_layers:
            layer.build(hidden)
        for layer in self.decoder_layers:
            layer.build(hidden, hidden)

    def embed(self, token_ids, start_index=0):
        x = self.embedding(token_ids) * math.sqrt(self.d_model)
        return x + self.positions(x, start_index=start_index)

    def encode(self, source_ids):
        mask = source_ids != 0
        x = self.embed(source_ids)
        for layer in self.encoder_layers:
            x = layer(x, padding_mask=mask)
        return x, mask

    def empty_caches(self, batch_size, target_length, source_length):
        shape = [batch_size, len(self.decoder_layers), 2, target_length, self.num_heads, self.d_model // self.num_heads]
        self_cache = self._zeros(shape)
        shape[3] = source_length
        return self_cache, self._zeros(shape)

    def _zeros(self, shape):
        from keras import ops

        return ops.zeros(shape, dtype=self.embedding.compute_dtype)

    def call_decoder_with_cache(self, encoder_output, encoder_mask, token_ids, self_cache, self_index,
                                cross_cache, cross_index):
        """BART's `call_decoder_with_cache`, minus its embedding LayerNorm."""
        from keras import ops

        x = self.embed(token_ids, start_index=self_index)
        self_caches, cross_caches = [], []
        for i, layer in enumerate(self.decoder_layers):
            x, next_self, next_cross = layer(
                decoder_sequence=x,
                encoder_sequence=encoder_output,
                encoder_padding_mask=encoder_mask,
                self_attention_cache=self_cache[:, i, ...],
                self_attention_cache_update_index=self_index,
                cross_attention_cache=cross_cache[:, i, ...],
                cross_attention_cache_update_index=cross_index,
            )
            self_caches.append(next_self)
            cross_caches.append(next_cross)
        self_cache = ops.stack(self_caches, axis=1)
        if cross_index is not None:
            cross_cache = ops.stack(cross_caches, axis=1)
        logits = ops.cast(self.embedding(x, reverse=True), "float32")
        return logits, x, self_cache, cross_cache


# --------------------------------------------------------------------------- decoders


def start_prompt(batch_size, new_tokens):
    """keras-hub's prompt: the start token, then N slots to fill; only the start is "given"."""
    import tensorflow as tf

    prompt = tf.concat([tf.fill([batch_size, 1], START_ID), tf.zeros([batch_size, new_tokens], tf.int32)], 1)
    given = tf.concat([tf.ones([batch_size, 1], tf.bool), tf.zeros([batch_size, new_tokens], tf.bool)], 1)
    return prompt, given


def make_sampler(decoding, beam_size):
    import keras_hub

    if decoding == "greedy":
        return keras_hub.samplers.GreedySampler()
    return keras_hub.samplers.BeamSampler(num_beams=beam_size)


def build_decode_fn(config, decoding, model, hub_model, args):
    """`source_ids [b, len] int32 -> int32 tokens`, everything inside; not yet a tf.function."""
    import tensorflow as tf

    import keras_transformer as kt  # noqa: F401
    from keras_transformer.decoding import beam_search, greedy_decode
    from keras_transformer.model import padding_mask

    n, k = args.new_tokens, args.beam_size

    if config == "ours":

        def decode(src):
            if decoding == "greedy":
                return greedy_decode(model, src, START_ID, NEVER_ID, max_output_length=n)[0]
            return beam_search(model, src, START_ID, NEVER_ID, beam_size=k, length_penalty=0.6, max_output_length=n)[0]

        return decode

    sampler = make_sampler(decoding, k)
    rows = 1 if decoding == "greedy" else k  # BeamSampler repeats the prompt and cache k times, sentence-major

    if config == "hub-loop/our-model":

        def decode(src):
            encoder_output = model.encode(src, training=False)
            mask = padding_mask(src)
            cache = model.init_decoding_cache(encoder_output, n)
            # Per-hypothesis copies, made once, in BeamSampler's row order (tf.repeat on axis 0).
            encoder_output, mask, cross = (tf.nest.map_structure(lambda x: tf.repeat(x, rows, axis=0), t)
                                           for t in (encoder_output, mask, cache["cross_attention"]))
            prompt, given = start_prompt(tf.shape(src)[0], n)

            def next(prompt, self_cache, index):
                # Logits for position `index` from the token at index - 1, as BART's `next`.
                logits, new = model.decode_step(prompt[:, index - 1], index - 1, encoder_output, mask,
                                                {"self_attention": self_cache, "cross_attention": cross})
                return logits, None, new["self_attention"]

            out = sampler(next=next, prompt=prompt, cache=cache["self_attention"], index=1, mask=given,
                          stop_token_ids=None)
            return out[:, 1:]

        return decode

    def decode(src):  # hub-loop/hub-model, wired as keras-hub 0.32's BartSeq2SeqLM.generate_step
        from keras import ops

        encoder_output, mask = hub_model.encode(src)
        batch_size = tf.shape(src)[0]
        prompt, given = start_prompt(batch_size, n)
        self_cache, cross_cache = hub_model.empty_caches(batch_size, n, tf.shape(src)[1])
        # BART's _build_cache seed pass (here over the start token only): fills the cross-attention cache.
        _, _, self_cache, cross_cache = hub_model.call_decoder_with_cache(
            encoder_output, mask, prompt[:, :1], self_cache, 0, cross_cache, 0)

        def next(prompt, cache, index):
            self_cache, encoder_output, mask, cross_cache = cache
            cache_index = index - 1
            token = ops.slice(prompt, [0, cache_index], [ops.shape(prompt)[0], 1])
            logits, hidden, self_cache, _ = hub_model.call_decoder_with_cache(
                encoder_output, mask, token, self_cache, cache_index, cross_cache, None)
            return (ops.squeeze(logits, axis=1), ops.squeeze(hidden, axis=1),
                    (self_cache, encoder_output, mask, cross_cache))

        out = sampler(next=next, prompt=prompt, cache=(self_cache, encoder_output, mask, cross_cache), index=1,
                      mask=given, stop_token_ids=None)
        return out[:, 1:]

    return decode


# --------------------------------------------------------------------------- main


def short_error(exc):
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    for line in lines[1:]:  # TF's interesting line is often further down
        if any(w in line for w in ("Detected unsupported", "not supported", "must be a compile-time constant",
                                   "Unsupported", "No registered")):
            text += f" | {line.strip()}"
            break
    return text[:400]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=str(REPO.parent / "shared/data/multi30k"))
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--source-lang", default="en")
    p.add_argument("--tokenizer", default=str(REPO / "runs/en-de-demo/tokenizer.model"),
                   help="sentencepiece model for the source sentences (vocabulary 8000)")
    p.add_argument("--limit", type=int, default=1000, help="sentences per row (default 1000)")
    p.add_argument("--batch1-limit", type=int, default=200, help="sentences per row at batch 1 (default 200)")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--decodings", default="greedy,beam", help="greedy and/or beam")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"any of {', '.join(CONFIGS)}")
    p.add_argument("--beam-size", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=16,
                   help="tokens decoded per sentence, N, the same for every row (default 16: Multi30k's mean "
                        "German reference length in this vocabulary, end token included)")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per row; the median is reported")
    p.add_argument("--jit", default="off,on", help="off, on, or off,on: tf.function(jit_compile=...) of every row")
    p.add_argument("--dtype-policy", default="float32", help="Keras dtype policy of both models")
    p.add_argument("--pad-multiple", type=int, default=8)
    p.add_argument("--max-source-length", type=int, default=128)
    p.add_argument("--json", help="also write the results here")
    return p


def main(argv=None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    args = build_parser().parse_args(argv)

    import keras
    import keras_hub
    import tensorflow as tf

    from keras_transformer.model import PRESETS, Transformer

    keras.config.set_dtype_policy(args.dtype_policy)
    keras.utils.set_random_seed(SEED)
    preset = PRESETS[PRESET]
    model = Transformer.from_preset(PRESET, vocab_size=VOCAB_SIZE)
    model.build()
    configs = args.configs.split(",")
    hub_model = HubSeq2Seq(**preset) if "hub-loop/hub-model" in configs else None
    params = {"ours": model.count_params()}
    if hub_model is not None:
        layers = [hub_model.embedding, *hub_model.encoder_layers, *hub_model.decoder_layers]
        params["keras_hub.layers"] = sum(layer.count_params() for layer in layers)
    print(f"parameters: {params}", flush=True)

    load_before = os.getloadavg()
    results, errors, agreement = [], {}, {}
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        limit = args.batch1_limit if batch_size == 1 and args.batch1_limit else args.limit
        batches, mean_source = load_batches(args, batch_size, limit)
        sentences = sum(len(b) for b in batches)
        shapes = sorted({b.shape for b in batches})
        print(f"batch {batch_size}: {sentences} sentences, {len(batches)} batches, {len(shapes)} shapes, "
              f"mean source length {mean_source:.1f}", flush=True)
        rows = []  # (key, fn)
        first_outputs = {}
        for jit in args.jit.split(","):
            for decoding in args.decodings.split(","):
                for config in configs:
                    key = (config, decoding, jit)
                    fn = tf.function(build_decode_fn(config, decoding, model, hub_model, args),
                                     input_signature=[tf.TensorSpec([None, None], tf.int32)],
                                     jit_compile=(jit == "on"))
                    t0 = time.perf_counter()
                    try:
                        for shape in shapes:  # trace / compile every shape before timing
                            out = fn(next(b for b in batches if b.shape == shape)).numpy()
                            if shape == batches[0].shape:
                                first_outputs[key] = out
                        if out.shape[1] > args.new_tokens:
                            raise AssertionError(f"decoded {out.shape[1]} > {args.new_tokens} tokens")
                    except Exception as exc:  # a row that cannot run is reported, not fatal
                        errors[f"{config} {decoding} jit {jit} batch {batch_size}"] = short_error(exc)
                        print(f"ERROR {config} {decoding} jit {jit}: {short_error(exc)}", flush=True)
                        if os.environ.get("BENCH_TRACEBACK"):
                            traceback.print_exc()
                        continue
                    print(f"  warmed up {config} {decoding} jit {jit} in {time.perf_counter() - t0:.1f}s", flush=True)
                    rows.append((key, fn))

        # Same model, same argmax: keras-hub's GreedySampler must reproduce our greedy tokens (positions
        # 1..N-1; at step N ours may only write the end id, here padding).
        for jit in args.jit.split(","):
            a, b = first_outputs.get(("ours", "greedy", jit)), first_outputs.get(("hub-loop/our-model", "greedy", jit))
            if a is not None and b is not None:
                m = args.new_tokens - 1
                same = (a[:, :m] == b[:, :m]).all(axis=1)
                agreement[f"greedy batch {batch_size} jit {jit}"] = f"{int(same.sum())}/{len(same)} sentences"

        times = {key: [] for key, _ in rows}
        for _ in range(args.repeats):
            for key, fn in rows:  # interleaved: drift on a busy machine hits every row
                t0 = time.perf_counter()
                for batch in batches:
                    fn(batch).numpy()
                times[key].append(time.perf_counter() - t0)
        for (config, decoding, jit), passes in times.items():
            seconds = statistics.median(passes)
            tokens = sentences * args.new_tokens
            row = {"config": config, "search_loop": CONFIGS[config][0], "model": CONFIGS[config][1],
                   "decoding": decoding if decoding == "greedy" else f"beam{args.beam_size}",
                   "batch_size": batch_size, "jit_compile": jit == "on", "sentences": sentences,
                   "batches": len(batches), "new_tokens_per_sentence": args.new_tokens,
                   "seconds_median": round(seconds, 3), "seconds_all": [round(s, 3) for s in passes],
                   "sentences_per_s": round(sentences / seconds, 2), "tokens_per_s": round(tokens / seconds, 1),
                   "ms_per_step": round(1000 * seconds / (len(batches) * args.new_tokens), 3)}
            results.append(row)
            print(json.dumps(row), flush=True)

    # Relative to ours, same decoding / batch / jit (ours without XLA where ours did not run with it).
    base = {(r["decoding"], r["batch_size"], r["jit_compile"]): r["tokens_per_s"] for r in results
            if r["config"] == "ours"}
    for r in results:
        ref = base.get((r["decoding"], r["batch_size"], r["jit_compile"]))
        r["vs_ours_jit"] = r["jit_compile"]
        if ref is None and r["jit_compile"]:
            ref, r["vs_ours_jit"] = base.get((r["decoding"], r["batch_size"], False)), False
        r["vs_ours"] = round(r["tokens_per_s"] / ref, 2) if ref else None

    summary = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} CPU cores, no GPU, {platform.processor() or platform.machine()}",
        "versions": {"tensorflow": tf.__version__, "keras": keras.__version__, "keras_hub": keras_hub.__version__},
        "load_average_before_after": [load_before, os.getloadavg()],
        "command": "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
        "model": {"preset": PRESET, **{k: preset[k] for k in ("d_model", "num_heads", "d_ff", "num_encoder_layers",
                                                              "num_decoder_layers")},
                  "vocab_size": VOCAB_SIZE, "weights": f"random (seed {SEED})", "dtype_policy": args.dtype_policy,
                  "parameters": params},
        "data": f"{args.split}.{args.source_lang}, sorted by length, padded to a multiple of {args.pad_multiple}",
        "new_tokens_per_sentence": args.new_tokens,
        "beam_size": args.beam_size,
        "timing": f"median of {args.repeats} interleaved passes over all batches, after one untimed call per shape",
        "greedy_same_tokens_hub_sampler_vs_ours": agreement,
        "errors": errors,
        "results": results,
    }
    print("\n| search loop | model | decoding | batch | jit | sentences | s (median) | sentences/s | tokens/s "
          "| ms/step | tokens/s vs ours |")
    print("|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['search_loop']} | {r['model']} | {r['decoding']} | {r['batch_size']} | "
              f"{'on' if r['jit_compile'] else 'off'} | {r['sentences']} | {r['seconds_median']} | "
              f"{r['sentences_per_s']} | {r['tokens_per_s']} | {r['ms_per_step']} | "
              f"{'-' if r['vs_ours'] is None else r['vs_ours']}"
              f"{' (vs ours jit off)' if r['jit_compile'] and not r['vs_ours_jit'] and r['vs_ours'] else ''} |")
    if errors:
        print("\nDid not run:")
        for name, error in errors.items():
            print(f"- {name}: {error}")
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
