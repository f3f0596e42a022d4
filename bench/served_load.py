"""Served translators under load: C clients in a closed loop, ours against CTranslate2 (not a test).

Runs in the benchmark virtualenv, never the project's: ctranslate2 is no
project dependency (`make bench-venv`: ctranslate2 4.8.5).

    # 1. Two exports of the same weights (project venv): with request batching (kt-export's default: concurrent
    #    requests merged into batches of up to 64 sentences) and without it (--max-request-batch 0).
    .venv/bin/kt-export --model-dir runs/en-de --model-file runs/en-de/averaged.keras --export-dir /tmp/load/batched
    .venv/bin/kt-export --model-dir runs/en-de --model-file runs/en-de/averaged.keras \\
        --export-dir /tmp/load/unbatched --max-request-batch 0
    # 2. The same weights as a float32 CTranslate2 model, checked token by token against ours.
    .venv-bench/bin/python bench/ctranslate2_side_by_side.py convert --model-dir runs/en-de \\
        --model-file runs/en-de/averaged.keras --output-dir /tmp/load/ct2-en-de
    # 3. 1, 4, 16 and 64 clients, greedy and beam 4, 20 s each (after 3 s of warm-up), every system in its own
    #    process: ours on the threads kt-export printed (2 decoding loops: @2x1), CTranslate2 in every layout.
    .venv-bench/bin/python bench/served_load.py \\
        --saved-model batched=/tmp/load/batched/translator/1@2x1 \\
        --saved-model unbatched=/tmp/load/unbatched/translator/1@2x1 \\
        --ct2-model /tmp/load/ct2-en-de --ct2 float32:1x2 --ct2 float32:2x1 --ct2 int8:1x2 --ct2 int8:2x1 \\
        --clients 1,4,16,64 --seconds 20 --warmup-seconds 3 --length-penalty 0.6 --json runs/bench/served_load.json

The load: C clients (`--clients`), each sending one sentence of the split
(test_2016_flickr) at a time and the next as soon as the answer is back (a
closed loop), for `--seconds` after `--warmup-seconds`; client i starts at
sentence i * N / C and walks on through the file. It reports the sentences
answered per second and the latency of each (p50, p90, p99, from the call to
its answer), for greedy and beam search (`--decodings greedy,beam4`).

Each system runs alone in its own process (bench/translate_worker.py, whose
`load` request runs the clients as threads in it), and the systems take
turns: one loaded system works while the others wait on their pipes, with a
short pause between (CTranslate2's OpenMP threads spin a while after their
last op).
  - ours: the clients call the export's text signature (`greedy`, or
    `serving_default`: the beam search it was exported with, whose beam size
    must be the one `--decodings` names) at once, as TF Serving's request
    threads do, on INTER inter-op threads of INTRA intra-op threads each
    (`--saved-model PATH@INTERxINTRA`: TF Serving's
    --tensorflow_inter_op_parallelism and --tensorflow_intra_op_parallelism;
    default TensorFlow's own, one per core). An export with request batching
    merges the calls that arrive while it decodes into one batch
    (export/request_batching.py); one without decodes each call on its own.
  - CTranslate2: one `ctranslate2.Translator(compute_type, inter_threads=WORKERS,
    intra_threads=THREADS)` shared by the client threads, each calling
    `translate_batch` with its one sentence, as CTranslate2's documentation
    says to serve concurrent requests (each of its WORKERS takes the next
    queued call: CTranslate2's docs/parallel.md); tokenized and detokenized
    with Python sentencepiece in the call. `--ct2 TYPE:WORKERSxTHREADS`,
    repeated: every setting is run, and the table shows each compute type at
    its best setting in each row (the JSON lines have them all). CTranslate2's length penalty is matched to
    ours (`--length-penalty`, the alpha the exports were made with; kt-export
    prints it) as `compare` matches it (bench/ctranslate2_side_by_side.py).

"ideal batch 64" (`--ideal-batch 64`; 0: not run): every system also
translates all the sentences in batches of 64 of similar length, given at
once, as `compare` times its batch 64: what it gets when the batching is done
for it. Its JSON line has each system's seconds of each round.

`--rounds N` runs every measurement N times (the systems alternating:
A B C A B C ...) and reports the median of each figure. One round of the
loads takes decodings x client counts x systems x (seconds + warm-up + 0.5 s):
19 minutes for the command above (2 x 4 x 6 x 23.5 s), plus the ideal batch.

`--trace-batches` runs each of our loads under TensorFlow's profiler and
prints how many sentences the batches of the export's request batching held
(the mean; every batch's size, in order, is in the JSON lines): whether the
clients' requests merge into one batch, or into groups that take turns.

`--limit N` takes the first N sentences only (a smoke run: `--clients 1,4
--seconds 2 --warmup-seconds 1 --ideal-batch 8 --limit 64`).

Prints the CPU line, one JSON line per measurement (a system, a decoding, a
client count, a round), then a markdown table: for each decoding and client
count, each system's sentences/s (p99 latency in ms) and each of ours over
CTranslate2's best setting of each compute type. Time on an otherwise idle
machine, not under `nice` (the load average at start and end is printed and
saved): see bench/ctranslate2_side_by_side.py on CTranslate2's OpenMP
threads beside a busy process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sentencepiece as spm  # noqa: E402

from bench.ctranslate2_side_by_side import (SETTLE_S, SIDECAR_FILENAME, Worker, decoding_name,  # noqa: E402
                                            matched_length_penalty, parse_ours, run_summary,
                                            time_workers)
from bench.served_speed import cpu_line  # noqa: E402
from bench.translate_worker import parse_ct2_setting  # noqa: E402
from common.run_dir import DEFAULT_LENGTH_PENALTY, TOKENIZER_FILENAME  # noqa: E402
from export.search import EXTRA_OUTPUT_LENGTH  # noqa: E402
from keras_transformer.text import PAD_ID, read_lines  # noqa: E402

# ctranslate2 is imported by the workers only, so that `--help` runs in the project's virtualenv.

# Before a decoding's loads, each system translates this many sentences one at a time (untimed): its first
# calls (graph optimization, first allocations) are not in any warm-up window.
WARM_UP_SENTENCES = 8


def parse_counts(text):
    """'1,4,16,64' -> [1, 4, 16, 64]."""
    try:
        counts = [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected client counts, e.g. 1,4,16,64") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: client counts must be >= 1")
    return counts


def parse_decodings(text):
    """'greedy,beam4' -> [(1, "greedy"), (4, "serving_default")]: (beam size, our signature)."""
    decodings = []
    for name in text.split(","):
        if name == "greedy":
            decodings.append((1, "greedy"))
        elif name.startswith("beam") and name[4:].isdigit() and int(name[4:]) > 1:
            decodings.append((int(name[4:]), "serving_default"))
        else:
            raise argparse.ArgumentTypeError(f"{text!r}: expected greedy and/or beamN (N > 1), e.g. greedy,beam4")
    return decodings


class LoadWorker(Worker):
    """A translator in its own process that also answers load requests (bench/translate_worker.py)."""

    def load(self, sentences, clients, seconds, warmup_seconds, decoding, trace_batches=False) -> dict:
        beam, signature = decoding
        request = {"load": {"clients": clients, "seconds": seconds, "warmup_seconds": warmup_seconds,
                            "beam": beam, "signature": signature, "trace_batches": trace_batches},
                   "sentences": sentences}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        answer = self._reply()
        if "error" in answer:
            raise RuntimeError(f"{self.name}: {answer['error']}")
        return answer


def default_ct2_settings():
    """Both compute types, one worker of every core's thread and one worker per core."""
    cores = os.cpu_count() or 1
    layouts = [(1, cores)] + ([(cores, 1)] if cores > 1 else [])
    return [(c, i, t) for c in ("float32", "int8") for i, t in layouts]


def median_of(measurements):
    """The median of each figure of a system's rounds (latencies: of each percentile)."""
    latency = {}
    for key in measurements[0]["latency_ms"]:
        values = [m["latency_ms"][key] for m in measurements if m["latency_ms"][key] is not None]
        latency[key] = round(statistics.median(values), 1) if values else None
    return {"sentences_per_s": round(statistics.median(m["sentences_per_s"] for m in measurements), 2),
            "latency_ms": latency}


def best_settings(row, settings):
    """{compute type: the name of its fastest CTranslate2 setting in `row`}."""
    best = {}
    for name, (compute, _, _) in settings.items():
        if compute not in best or row[name]["sentences_per_s"] > row[best[compute]]["sentences_per_s"]:
            best[compute] = name
    return best


def ratio(a, b):
    return round(a / b, 2) if b else None


def ratio_cell(value):
    return "-" if value is None else f"{value}x"


def cell(figures):
    p99 = figures.get("latency_ms", {}).get("p99")
    return f"{figures['sentences_per_s']:g}" + (f" ({p99:g} ms)" if p99 is not None else "")


def run(args) -> int:
    load_at_start = os.getloadavg()
    ct2_dir = Path(args.ct2_model)
    sidecar = json.loads((ct2_dir / SIDECAR_FILENAME).read_text())
    data = Path(args.data_dir)
    sources = read_lines(data / f"{args.split}.{sidecar['source_lang']}")[:args.limit]
    references = read_lines(data / f"{args.split}.{sidecar['target_lang']}")[:args.limit]
    sources = [s for s in sources if s.strip()]
    sp = spm.SentencePieceProcessor(model_file=str(ct2_dir / TOKENIZER_FILENAME))
    length_penalty, median_length = matched_length_penalty(args.length_penalty, references, sp)
    if args.ct2_length_penalty is not None:
        length_penalty = args.ct2_length_penalty

    ours = []  # (name, path, (inter-op, intra-op); 0: TensorFlow's choice)
    for name, path, threads in args.saved_model:
        threads = threads or (0, 0)
        ours.append((name or ("ours" if len(args.saved_model) == 1 else f"ours {threads[0]}x{threads[1]}"),
                     path, threads))
    settings = {f"ct2 {c} {i}x{t}": (c, i, t) for c, i, t in (args.ct2 or default_ct2_settings())}
    names = [name for name, _, _ in ours] + list(settings)
    if len(set(names)) != len(names):
        raise SystemExit(f"served_load: two systems named alike ({', '.join(names)}): name them, "
                         f"--saved-model NAME=PATH")
    compute_types = sorted({c for c, _, _ in settings.values()})

    workers = []
    measurements = []  # every JSON line
    rows = []  # the table's: {"decoding", "clients" (or "ideal_batch"), system: median figures}
    try:
        for name, path, (inter, intra) in ours:
            workers.append(LoadWorker(name, ["ours", "--saved-model", str(path), "--inter-op-threads", str(inter),
                                             "--intra-op-threads", str(intra)]))
        for name, (compute, inter, intra) in settings.items():
            workers.append(LoadWorker(name, [
                "ct2", "--ct2-model", str(ct2_dir), "--tokenizer", str(ct2_dir / TOKENIZER_FILENAME),
                "--setting", f"{compute}:{inter}x{intra}", "--length-penalty", str(length_penalty),
                "--max-source-length", str(sidecar["max_source_length"]),
                "--extra-output-length", str(EXTRA_OUTPUT_LENGTH), "--pad-id", str(PAD_ID)]))
        print(f"CPU: {cpu_line()}\n{len(sources)} sentences of {args.split}; clients {args.clients}, "
              f"{args.seconds:g} s after {args.warmup_seconds:g} s of warm-up, {args.rounds} round(s); each system "
              f"in its own process: " + "; ".join(f"{w.name}: {json.dumps(w.description)}" for w in workers)
              + f"; CTranslate2 length penalty {length_penalty:.3f} (ours: alpha {args.length_penalty}; median "
              f"reference length {median_length:g} pieces); load average {load_at_start[0]:.2f}", flush=True)

        for decoding in args.decodings:
            decoding_label = decoding_name(decoding[0])
            for w in workers:  # untimed: first calls, one sentence at a time as the clients send them
                w.translate(sources[:WARM_UP_SENTENCES], 1, decoding)
                time.sleep(SETTLE_S)
            if args.ideal_batch:
                seconds, _, warm_up = time_workers(workers, sources, args.ideal_batch, decoding, args.rounds)
                row = {"decoding": decoding_label, "ideal_batch": args.ideal_batch}
                for name in names:
                    row[name] = {"sentences_per_s": round(len(sources) / statistics.median(seconds[name]), 2)}
                line = {"decoding": decoding_label, "ideal_batch": args.ideal_batch, "sentences": len(sources),
                        "seconds": {n: [round(s, 3) for s in seconds[n]] for n in names},
                        "sentences_per_s": {n: row[n]["sentences_per_s"] for n in names},
                        "warm_up_s": {n: round(t, 2) for n, t in warm_up.items()}}
                measurements.append(line)
                print(json.dumps(line), flush=True)
                rows.append(row)
            for clients in args.clients:
                rounds = {w.name: [] for w in workers}
                for round_index in range(args.rounds):
                    for w in workers:
                        answer = w.load(sources, clients, args.seconds, args.warmup_seconds, decoding,
                                        args.trace_batches)
                        line = {"system": w.name, "decoding": decoding_label, "round": round_index + 1, **answer}
                        measurements.append(line)
                        print(json.dumps(line), flush=True)
                        rounds[w.name].append(answer)
                        time.sleep(SETTLE_S)
                rows.append({"decoding": decoding_label, "clients": clients,
                             **{name: median_of(rounds[name]) for name in names}})
                if args.trace_batches:
                    rows[-1]["merged_batches"] = {
                        name: statistics.median(a["merged_batches"]["mean_size"] or 0 for a in rounds[name])
                        for name, _, _ in ours if all("merged_batches" in a for a in rounds[name])}
    finally:
        for w in workers:
            w.close()

    for row in rows:
        best = best_settings(row, settings)
        row["best_ct2"] = best
        row["ratio_over_best"] = {o: {c: ratio(row[o]["sentences_per_s"], row[n]["sentences_per_s"])
                                      for c, n in best.items()} for o, _, _ in ours}

    ours_names = [o for o, _, _ in ours]
    header = ([f"{o} sent/s (p99)" for o in ours_names] + [f"ct2 {c} best sent/s (p99)" for c in compute_types]
              + [f"{o} ÷ ct2 {c}" for o in ours_names for c in compute_types])
    print(f"\n| decoding | clients | {' | '.join(header)} |")
    print("|---|---:|" + "---:|" * len(header))
    for row in rows:
        clients = row.get("clients", f"ideal batch {row.get('ideal_batch')}")
        best = row["best_ct2"]
        cells = ([cell(row[o]) for o in ours_names]
                 + [f"{cell(row[best[c]])} {best[c].rsplit(' ', 1)[-1]}" for c in compute_types]
                 + [ratio_cell(row["ratio_over_best"][o][c]) for o in ours_names for c in compute_types])
        print(f"| {row['decoding']} | {clients} | {' | '.join(cells)} |")
    print("(sentences/s, median of the rounds; p99 latency in ms; CTranslate2: each compute type at its fastest "
          "WORKERSxTHREADS in that row)")
    traced = [row for row in rows if row.get("merged_batches")]
    if traced:
        print("\nSentences per merged batch (mean over the load, median of the rounds; the JSON lines have every "
              "batch's size in order):")
        for row in traced:
            print(f"  {row['decoding']}, {row['clients']} clients: "
                  + ", ".join(f"{name} {size:g}" for name, size in row["merged_batches"].items()))

    if args.json:
        summary = run_summary(workers, ours, ct2_dir, args.length_penalty, length_penalty, load_at_start,
                              split=args.split, sentences=len(sources), seconds=args.seconds,
                              warmup_seconds=args.warmup_seconds, rounds=args.rounds, rows=rows,
                              measurements=measurements)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/served_load.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--saved-model", required=True, action="append", type=parse_ours,
                   metavar="[NAME=]PATH[@INTERxINTRA]",
                   help="our export, EXPORT_DIR/NAME[/VERSION], served on INTER inter-op threads of INTRA intra-op "
                        "threads each (default: TensorFlow's own, one per core); repeat for more exports (with and "
                        "without request batching) or thread layouts, each in its own process")
    p.add_argument("--ct2-model", required=True, help="the directory `ctranslate2_side_by_side.py convert` wrote")
    p.add_argument("--ct2", action="append", type=parse_ct2_setting, metavar="TYPE:WORKERSxTHREADS",
                   help="a CTranslate2 setting, each in its own process, e.g. int8:2x1 (2 workers of 1 thread) or "
                        "float32:1x2; repeat: each compute type is reported at its best (default: float32 and int8, "
                        "each 1xCORES and CORESx1)")
    p.add_argument("--clients", type=parse_counts, default=[1, 4, 16, 64], metavar="C,C,...",
                   help="client counts (default 1,4,16,64)")
    p.add_argument("--seconds", type=float, default=20.0, help="measured window of each load (default 20)")
    p.add_argument("--warmup-seconds", type=float, default=3.0,
                   help="load before the window, its answers not counted (default 3)")
    p.add_argument("--decodings", type=parse_decodings, default=[(1, "greedy"), (4, "serving_default")],
                   metavar="greedy,beamN",
                   help="default greedy,beam4; ours decodes beamN with serving_default, which must have been "
                        "exported with beam size N")
    p.add_argument("--ideal-batch", type=int, default=64, metavar="N",
                   help="also translate all the sentences in batches of N at once, each system (default 64; "
                        "0: not run)")
    p.add_argument("--rounds", type=int, default=1, help="alternate the systems this many rounds; report the median")
    p.add_argument("--length-penalty", type=float, default=DEFAULT_LENGTH_PENALTY, metavar="A",
                   help="the length-penalty alpha the exports were made with (kt-export prints it; default "
                        f"{DEFAULT_LENGTH_PENALTY}, kt-export's when config.json records none): CTranslate2's is "
                        "matched to it")
    p.add_argument("--ct2-length-penalty", type=float, help="CTranslate2's length_penalty "
                   "(default: A * m / (m + 6), m = median reference length in pieces)")
    p.add_argument("--data-dir", default="../shared/data/multi30k")
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--limit", type=int, help="use only the first N sentences of the split (default: all)")
    p.add_argument("--trace-batches", action="store_true",
                   help="run each of our loads under TensorFlow's profiler and report how many sentences each batch "
                        "of the export's request batching held (its cost is small, but time figures without it)")
    p.add_argument("--json", help="also write the results here")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.warmup_seconds < 0:
        parser.error("--seconds must be > 0 and --warmup-seconds >= 0")
    if args.ideal_batch < 0 or args.rounds < 1:
        parser.error("--ideal-batch must be >= 0 and --rounds >= 1")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
