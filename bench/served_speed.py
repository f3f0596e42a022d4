"""Served-translator speed: SavedModels side by side, on one machine, in one run (not a test).

    python bench/served_speed.py --export base=/tmp/kt12/base/translator/1 \
        --export new=exports/en-de/translator/1 --data-dir ../shared/data/multi30k \
        --source-lang en --target-lang de --repeats 3 --json runs/bench/served_speed.json

Each SavedModel is loaded in this process with `tf.saved_model.load` and
called through its text signatures, as TF Serving calls them: `greedy` and
`serving_default` (beam search), strings in, strings out (tokenization,
search and detokenization all in the graph). The source sentences of the
split are sorted by length (as `kt-translate` batches them); batch 64 runs
all of them (1,000 for test_2016_flickr), batch 1 the first `--batch1-limit`
of the file (200). Every configuration is warmed up first with one untimed
pass over its sentences (its seconds are reported: they include an XLA
decoder's compilations, once per input shape); then the repeats
alternate between the exports (A B A B ...), so that a noisy neighbour slows
them alike, and the median is reported. The first export is the baseline:
every other row gives its speed-up over it.

`--inter-op-threads N --intra-op-threads M` set the session's thread pools
as TF Serving's `--tensorflow_inter_op_parallelism` and
`--tensorflow_intra_op_parallelism` do (default: TensorFlow's, one thread
per core in each); an export with N parallel decoding loops is meant to be
served with N inter-op threads and 1 intra-op thread.

Also reports sacreBLEU of each export's beam output (batch 64) against the
references, and how many greedy and beam translations equal the baseline's.

Machines differ up to 4x: compare ratios from one run, and keep the CPU line
this prints (model and the flags that matter: avx2, avx512*, amx*) with the figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def cpu_line() -> str:
    """'<model name>; flags: avx2 avx512f ... ' (the flags that decide matmul speed)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or platform.machine()
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    wanted = [f for f in flags if f in ("avx2", "fma") or f.startswith(("avx512", "amx"))]
    return f"{fields.get('Model name', '?').strip()}, {os.cpu_count()} logical CPUs; flags: {' '.join(wanted)}"


def time_alternating(fns, texts, batch_size, repeats, warm_up=None):
    """Warm-up, then `repeats` rounds alternating the translators `fns` ({name: texts -> (translations, scores)})
    over `texts` in length-sorted batches; returns ({name: seconds of each round}, {name: translations}).

    The warm-up (tracing, compilation, first allocations) translates the first two batches, or all of
    `texts` once if `warm_up` is a dict, which then gets each translator's warm-up seconds: an XLA
    decoder compiles once for each input shape, as a server's does before it is in steady state."""
    from export.translate import translate_lines

    for name, fn in fns.items():
        t0 = time.perf_counter()
        translate_lines(fn, texts if warm_up is not None else texts[:batch_size * 2], batch_size)
        if warm_up is not None:
            warm_up[name] = time.perf_counter() - t0
    seconds, outputs = {name: [] for name in fns}, {}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            outputs[name] = translate_lines(fn, texts, batch_size)[0]
            seconds[name].append(time.perf_counter() - t0)
    return seconds, outputs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--export", action="append", required=True, metavar="NAME=PATH",
                   help="a SavedModel version directory; repeat; the first is the baseline")
    p.add_argument("--data-dir", default="../shared/data/multi30k")
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--source-lang", default="en")
    p.add_argument("--target-lang", default="de")
    p.add_argument("--limit", type=int, default=1000, help="sentences at batch 64 (default 1000: all)")
    p.add_argument("--batch1-limit", type=int, default=200, help="sentences at batch 1 (default 200)")
    p.add_argument("--signatures", default="greedy,serving_default")
    p.add_argument("--batch-sizes", default="64,1")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--inter-op-threads", type=int, default=0, metavar="N",
                   help="the session's inter-op threads, as TF Serving's --tensorflow_inter_op_parallelism "
                        "(default 0: TensorFlow's choice, one per core)")
    p.add_argument("--intra-op-threads", type=int, default=0, metavar="N",
                   help="its intra-op threads, as --tensorflow_intra_op_parallelism (default 0: one per core)")
    p.add_argument("--json", help="also write the results here")
    return p


def main(argv=None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    args = build_parser().parse_args(argv)

    import sacrebleu
    import tensorflow as tf
    import tensorflow_text  # noqa: F401  (registers the sentencepiece ops the graphs use)

    # Before any op runs: TensorFlow fixes its thread pools when it first executes.
    tf.config.threading.set_inter_op_parallelism_threads(args.inter_op_threads)
    tf.config.threading.set_intra_op_parallelism_threads(args.intra_op_threads)

    from export.translate import SavedModelTranslator
    from keras_transformer.text import read_lines

    exports = dict(e.split("=", 1) for e in args.export)
    data = Path(args.data_dir)
    sources = read_lines(data / f"{args.split}.{args.source_lang}")[:args.limit]
    references = read_lines(data / f"{args.split}.{args.target_lang}")[:args.limit]
    threads = f"inter-op threads {args.inter_op_threads or 'default'}, intra-op {args.intra_op_threads or 'default'}"
    print(f"CPU: {cpu_line()}\nTensorFlow {tf.__version__}; {len(sources)} sentences of {args.split}; {threads}",
          flush=True)

    results, outputs = [], {}
    for signature in args.signatures.split(","):
        for batch_size in (int(b) for b in args.batch_sizes.split(",")):
            texts = sources[:args.batch1_limit] if batch_size == 1 else sources
            fns = {name: SavedModelTranslator(path, signature) for name, path in exports.items()}
            warm_up = {}
            seconds, last = time_alternating(fns, texts, batch_size, args.repeats, warm_up)
            outputs.update({(name, signature, batch_size): hyps for name, hyps in last.items()})
            base = statistics.median(seconds[next(iter(fns))])
            for name in fns:
                median = statistics.median(seconds[name])
                row = {"export": name, "signature": signature, "batch_size": batch_size, "sentences": len(texts),
                       "seconds": [round(s, 2) for s in seconds[name]], "median_s": round(median, 2),
                       "sentences_per_s": round(len(texts) / median, 1), "speedup": round(base / median, 2),
                       "warm_up_s": round(warm_up[name], 2)}
                results.append(row)
                print(json.dumps(row), flush=True)

    baseline = next(iter(exports))
    quality = {}
    for name in exports:
        entry = {}
        for signature in args.signatures.split(","):
            key = (name, signature, max(int(b) for b in args.batch_sizes.split(",")))
            if key not in outputs:
                continue
            hyps = outputs[key]
            same = sum(a == b for a, b in zip(hyps, outputs[(baseline, *key[1:])]))
            entry[signature] = {"bleu": round(sacrebleu.corpus_bleu(hyps, [references[:len(hyps)]]).score, 2),
                                f"identical_to_{baseline}": f"{same} of {len(hyps)}"}
        quality[name] = entry
    summary = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_line(),
        "tensorflow": tf.__version__,
        "inter_op_threads": args.inter_op_threads,
        "intra_op_threads": args.intra_op_threads,
        "load_average_at_end": os.getloadavg(),
        "command": "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
        "exports": exports,
        "quality": quality,
        "results": results,
    }
    print("\n| export | signature | batch | sentences | median s | sentences/s | speed-up |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['export']} | {r['signature']} | {r['batch_size']} | {r['sentences']} | {r['median_s']} | "
              f"{r['sentences_per_s']} | {r['speedup']}x |")
    print(json.dumps({"quality": quality, "cpu": summary["cpu"]}, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
