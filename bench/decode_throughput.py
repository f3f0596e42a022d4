"""Decoding throughput through the exported SavedModel (not a test).

    python bench/decode_throughput.py --model-dir runs/en-de --data-dir ../shared/data/multi30k \
        --limit 1000 --batch1-limit 200

Exports the model twice (key/value-cached and uncached decoding; kt-export's
code), loads each SavedModel in process and translates Multi30k's
test_2016_flickr source sentences through its text signatures
(`serving_default` = beam 4, `greedy`), at batch 1 and batch 64 (sentences
sorted by length, as kt-translate does). Reports sentences/s and target
tokens/s, where target tokens = sentencepiece pieces of each translation + 1
(the end token): the length of the decoded output. Each configuration is
warmed up on one batch first. Also checks that cached and uncached decoding
give the same translations.

Without --model-dir it trains a quick model first (bench/quick_model.py,
preset small, 600 steps on 10,000 pairs: ~20 minutes on 2 busy cores; it is
kept in --work-dir and reused) and names it in the output: an untrained
model's outputs run to the length limit and would not be representative.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

sys.path.insert(0, str(REPO))  # the project's packages, and bench.quick_model


def _read(path, limit):
    with open(path, encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f]
    return lines[:limit] if limit else lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", help="a directory written by kt-train (default: train a quick model)")
    p.add_argument("--data-dir", default="../shared/data/multi30k")
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--limit", type=int, default=1000, help="sentences per configuration (default 1000)")
    p.add_argument("--batch1-limit", type=int, help="sentences for the batch-1 configurations (default --limit)")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--decodings", default="greedy,beam4", help="greedy and/or beam4")
    p.add_argument("--caches", default="cached,uncached")
    p.add_argument("--work-dir", help="where the exports (and a quick model) go (default: a temporary directory)")
    p.add_argument("--quick-preset", default="small", help="preset of the quick model (default small)")
    p.add_argument("--quick-steps", type=int, default=600)
    p.add_argument("--quick-lines", type=int, default=10000)
    p.add_argument("--json", help="also write the results here")
    return p


def main(argv=None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    args = build_parser().parse_args(argv)

    import sentencepiece as spm
    import tensorflow as tf
    import tensorflow_text  # noqa: F401

    from export.export_model import export
    from export.translate import translate_lines
    from common.run_dir import read_config

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="kt-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    model_note = None
    if args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        from bench.quick_model import build_quick_model_dir

        model_dir = work / "quick-model"
        t0 = time.time()
        if not (model_dir / "model.keras").is_file():
            build_quick_model_dir(model_dir, args.data_dir, preset=args.quick_preset, steps=args.quick_steps,
                                  lines=args.quick_lines, vocab_size=4000, max_sentence_length=128,
                                  tokens_per_batch=4096,
                                  learning_rate=1e-3)
        model_note = (f"quick model: preset {args.quick_preset}, {args.quick_steps} steps on the first "
                      f"{args.quick_lines} Multi30k training pairs, vocab 4000 ({time.time() - t0:.0f}s)")
        print(model_note, flush=True)
    cfg = read_config(model_dir)
    sources = _read(Path(args.data_dir) / f"{args.split}.{cfg['source_lang']}", args.limit)
    references = _read(Path(args.data_dir) / f"{args.split}.{cfg['target_lang']}", args.limit)
    sp = spm.SentencePieceProcessor(model_file=str(model_dir / cfg["tokenizer_file"]))

    caches = args.caches.split(",")
    exports = {}
    for cache in caches:
        t0 = time.time()
        exports[cache] = export(model_dir, work / "exports", name=cache, use_cache=(cache == "cached"),
                                check_ops=False)
        print(f"exported {exports[cache]} in {time.time() - t0:.1f}s", flush=True)

    results, outputs = [], {}
    for cache in caches:
        loaded = tf.saved_model.load(str(exports[cache]))
        for decoding in args.decodings.split(","):
            fn = loaded.signatures["greedy" if decoding == "greedy" else "serving_default"]

            def translate(texts, fn=fn):
                out = fn(text=tf.constant(list(texts)))
                return ([t.decode("utf-8") for t in out["translation"].numpy().tolist()],
                        out["score"].numpy().tolist())

            for batch_size in (int(b) for b in args.batch_sizes.split(",")):
                n = args.batch1_limit if (batch_size == 1 and args.batch1_limit) else len(sources)
                texts = sources[:n]
                translate(texts[:batch_size])  # warm-up
                t0 = time.perf_counter()
                hyps = translate_lines(translate, texts, batch_size).texts
                seconds = time.perf_counter() - t0
                tokens = sum(len(ids) + 1 for ids in sp.encode(hyps))
                outputs[(cache, decoding, batch_size)] = hyps
                row = {"cache": cache, "decoding": decoding, "batch_size": batch_size, "sentences": n,
                       "seconds": round(seconds, 2), "sentences_per_s": round(n / seconds, 2),
                       "target_tokens": tokens, "tokens_per_s": round(tokens / seconds, 1)}
                results.append(row)
                print(json.dumps(row), flush=True)

    # Cached and uncached decoding agree up to rounding: in bfloat16 a near-tie can flip.
    agree = {}
    for (cache, decoding, batch_size), hyps in outputs.items():
        if cache == "cached" and ("uncached", decoding, batch_size) in outputs:
            other = outputs[("uncached", decoding, batch_size)]
            pairs = list(zip(hyps, other))
            differ = sum(a != b for a, b in pairs)
            agree[f"{decoding} batch {batch_size}"] = f"{len(pairs) - differ} of {len(pairs)} identical"
    ref_tokens = sum(len(ids) + 1 for ids in sp.encode(references))
    hyp_tokens = {k: sum(len(ids) + 1 for ids in sp.encode(v)) / len(v) for k, v in outputs.items()}
    summary = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} CPU cores, no GPU, {platform.processor() or platform.machine()}, "
                   f"TensorFlow {tf.__version__}",
        "load_average": os.getloadavg(),
        "command": "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
        "model": model_note or str(model_dir),
        "model_config": {k: cfg["model_config"].get(k) for k in ("d_model", "num_heads", "d_ff",
                                                                  "num_encoder_layers", "num_decoder_layers")},
        "vocab_size": cfg["vocab_size"],
        "split": args.split,
        "reference_tokens_per_sentence": round(ref_tokens / len(references), 2),
        "output_tokens_per_sentence": {f"{c} {d} batch {b}": round(v, 2) for (c, d, b), v in hyp_tokens.items()},
        "cached_equals_uncached": agree,
        "results": results,
    }
    print("\n| decoding | cache | batch | sentences | s | sentences/s | target tokens/s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['decoding']} | {r['cache']} | {r['batch_size']} | {r['sentences']} | {r['seconds']} | "
              f"{r['sentences_per_s']} | {r['tokens_per_s']} |")
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
