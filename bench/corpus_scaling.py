"""Memory and time against corpus size: kt-prepare, its vocabulary, and kt-train's start on a prepared corpus.

    .venv/bin/python bench/synthetic_corpus.py --pairs 30k,1M,4.5M --out-dir /tmp/kt-synthetic
    .venv/bin/python bench/corpus_scaling.py --corpus-dir /tmp/kt-synthetic --pairs 30k,1M,4.5M \\
        --work-dir /tmp/kt-corpus-scaling                      # + --tokenizer runs/en-de/tokenizer.model

Every measured command runs as a subprocess under `/usr/bin/time -v`, which
gives its peak resident memory ("Maximum resident set size": the largest of
the process and any child it waited for) and its wall-clock time; its output
lines are timestamped as they arrive, for the seconds to a given line. The
corpora are the files `bench/synthetic_corpus.py` writes into `--corpus-dir`
(`synthetic-N.SRC/TGT`; `--reversed` takes the `-rev` ones, `--gzip` the
`.gz` ones). For each size, in this order:

(a) kt-prepare with an existing vocabulary, `--tokenizer` (the corpus's
    vocabulary is not trained: what preparing costs once the vocabulary
    exists), `--shards` shards, into `WORK_DIR/prepared-N` (deleted first:
    a finished directory would be left as it is). Without `--tokenizer`, one
    vocabulary of `--vocab-size` pieces is trained first, on the smallest
    corpus, unmeasured, and used for every size. Reported: the whole
    process (Python and TensorFlow's import, about 6 s and 0.6 GB of it, are
    included) and the seconds from the "vocabulary:" line to the end
    (tokenizing and dealing the pairs, then shuffling the shards).
(b) the vocabulary's own cost (skip it with `--no-vocab`): kt-prepare
    training a vocabulary of `--vocab-size` pieces on the largest corpus
    (`--vocab-corpus` for another) with `--vocab-sample` 1,000,000 and
    4,000,000 lines (a uniform sample of both sides' lines), stopped (SIGTERM
    to the Python process this script started) once it prints its
    "vocabulary:" line, so that the figures are the vocabulary's: peak RSS
    and the seconds from the start to that line.
(c) kt-train on the prepared corpus of (a) (skip it with `--no-train`):
    `--prepared DIR --preset tiny --max-updates 1 --no-validation` (plus
    `--train-args`), peak RSS, and its seconds to the first update: from the
    process's start to the line kt-train prints when the update that reaches
    --max-updates ends ("reached 1 of 1 updates"; the end of the process if
    it never comes). That covers importing TensorFlow, opening the corpus
    (its manifest; every shard's size), counting the first 100 batches, the
    model's build and the first step's tracing, and the first batch; only the
    data parts grow with the corpus, and those are timed too (the "data:" and
    "batches:" lines).

Then a table with the ratios the goals need, for the largest size L against
the second largest M (4.5M against 1M) and the smallest S (30k):
kt-prepare's time per pair at L over M's (t_L / t_M / (N_L / N_M), goal
<= 1.2), kt-prepare's peak RSS at L (goal <= 2 GB, 10^9 bytes), kt-train's
peak RSS and seconds to the first update at L over S's (goals <= 1.2x).
`--rounds N` runs (a) and (c) N times, alternating the sizes, and reports
the medians. The work directory must not be inside the repository.

Prints the CPU model and flags beside the figures; no timed assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO))
from bench.served_speed import cpu_line  # noqa: E402
from synthetic_corpus import corpus_paths, parse_count, parse_counts  # noqa: E402

TIME = "/usr/bin/time"
GOALS = {"prepare_time_per_pair": 1.2, "prepare_rss_gb": 2.0, "train_rss": 1.2, "train_first_update": 1.2}




def _elapsed_seconds(text: str) -> float:
    """'1:02:03.5' or '2:03.5' -> seconds."""
    seconds = 0.0
    for part in text.strip().split(":"):
        seconds = seconds * 60 + float(part)
    return seconds


def parse_time_report(text: str) -> dict:
    """The figures of a `/usr/bin/time -v` report this script uses."""
    out = {}
    for line in text.splitlines():
        key, _, value = line.strip().rpartition(": ")
        if key == "Maximum resident set size (kbytes)":
            out["max_rss_kb"] = int(value)
        elif key.startswith("Elapsed (wall clock) time"):
            out["wall_s"] = _elapsed_seconds(value)
        elif key == "User time (seconds)":
            out["user_s"] = float(value)
        elif key == "System time (seconds)":
            out["system_s"] = float(value)
        elif key == "Exit status":
            out["exit_status"] = int(value)
    return out


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def measured(cmd: list[str], report: Path, *, stop_at: str | None = None, label: str = "") -> dict:
    """Runs `cmd` under `/usr/bin/time -v`; its report's figures, its output lines as (seconds since the start,
    line), and whether it was stopped. With `stop_at` (a regex), the command is sent SIGTERM once a line of
    its output matches."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    env.pop("TF_CONFIG", None)
    report.unlink(missing_ok=True)
    t0 = time.monotonic()
    proc = subprocess.Popen([TIME, "-v", "-o", str(report), *cmd], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines, stopped = [], False
    for line in proc.stdout:
        lines.append((time.monotonic() - t0, line.rstrip("\n")))
        if stop_at and not stopped and re.search(stop_at, line):
            for child in _children(proc.pid):  # the command /usr/bin/time started for us
                os.kill(child, signal.SIGTERM)
            stopped = True
    proc.wait()
    figures = parse_time_report(report.read_text()) if report.is_file() else {}
    failed = proc.returncode != 0 and not stopped
    if failed or "max_rss_kb" not in figures:
        tail = "\n".join(l for _, l in lines[-30:])
        print(f"{label}: FAILED (exit {proc.returncode})\n{tail}", file=sys.stderr, flush=True)
    return {**figures, "lines": lines, "stopped": stopped, "failed": failed or "max_rss_kb" not in figures}


def seconds_to(run: dict, pattern: str) -> float | None:
    """Seconds from the start to the first output line matching `pattern`, or None."""
    for t, line in run["lines"]:
        if re.search(pattern, line):
            return t
    return None


def prepare_cmd(out: Path, files, args, *, tokenizer=None, vocab_sample=None, shards=None) -> list[str]:
    cmd = [sys.executable, "-m", "training.prepare", "--out", str(out), "--train-files", str(files[0]), str(files[1]),
           "--source-lang", args.source_lang, "--target-lang", args.target_lang,
           "--shards", str(shards or args.shards), "--seed", str(args.seed)]
    if tokenizer:
        return cmd + ["--tokenizer", str(tokenizer)]
    return cmd + ["--vocab-size", str(args.vocab_size), "--vocab-sample", str(vocab_sample)]


def gb(kb: int) -> float:
    return kb * 1024 / 1e9


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus-dir", required=True, help="where bench/synthetic_corpus.py wrote the corpora")
    p.add_argument("--pairs", type=parse_counts, required=True, help="corpus sizes, e.g. 30k,1M,4.5M")
    p.add_argument("--reversed", action="store_true", help="the corpora made with --reverse-second-half")
    p.add_argument("--gzip", action="store_true", help="the corpora made with --gzip")
    p.add_argument("--source-lang", default="en")
    p.add_argument("--target-lang", default="de")
    p.add_argument("--work-dir", default="/tmp/kt-corpus-scaling",
                   help="prepared corpora, model directories and reports (default /tmp/kt-corpus-scaling; not in "
                   "the repository); its prepared-N directories are left for bench/prepared_input.py")
    p.add_argument("--tokenizer", help="an existing sentencepiece model for (a) (default: one trained first, "
                   "unmeasured, on the smallest corpus, with --vocab-size)")
    p.add_argument("--vocab-size", type=int, default=8000, help="pieces of the vocabularies trained (default 8000)")
    p.add_argument("--shards", type=int, default=64, help="kt-prepare --shards (default 64, kt-prepare's)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--rounds", type=int, default=1, help="times to run (a) and (c), alternating the sizes")
    p.add_argument("--no-vocab", dest="vocab", action="store_false", help="skip (b), the vocabulary's cost")
    p.add_argument("--vocab-samples", type=parse_counts, default=[1_000_000, 4_000_000],
                   help="(b): the --vocab-sample values measured (default 1M,4M)")
    p.add_argument("--vocab-corpus", type=parse_count, help="(b): the corpus size to train them on (default: the "
                   "largest of --pairs)")
    p.add_argument("--no-train", dest="train", action="store_false", help="skip (c), kt-train's start")
    p.add_argument("--preset", default="tiny", help="(c): kt-train's --preset (default tiny)")
    p.add_argument("--max-updates", type=int, default=1, help="(c): kt-train's --max-updates (default 1)")
    p.add_argument("--train-args", default="", help="(c): more kt-train flags, one string")
    p.add_argument("--json", help="also write the results here")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    work = Path(args.work_dir).resolve()
    if work == REPO or REPO in work.parents:
        sys.exit(f"--work-dir {work} is inside the repository {REPO}: choose one outside it (e.g. under /tmp)")
    if not os.access(TIME, os.X_OK):
        sys.exit(f"{TIME} is missing (Debian/Ubuntu: apt-get install time)")
    sizes = sorted(set(args.pairs))
    corpora = {n: corpus_paths(args.corpus_dir, n, args.source_lang, args.target_lang, reverse=args.reversed,
                               gzipped=args.gzip) for n in sizes}
    vocab_on = args.vocab_corpus or sizes[-1]
    if args.vocab and vocab_on not in corpora:
        corpora[vocab_on] = corpus_paths(args.corpus_dir, vocab_on, args.source_lang, args.target_lang,
                                         reverse=args.reversed, gzipped=args.gzip)
    missing = [str(f) for files in corpora.values() for f in files if not f.is_file()]
    if missing:
        counts = ",".join(str(n) for n in sorted(corpora))
        sys.exit(f"missing corpora: {', '.join(missing)}; make them with\n  {sys.executable} "
                 f"bench/synthetic_corpus.py --pairs {counts} --out-dir {args.corpus_dir}"
                 f"{' --reverse-second-half' if args.reversed else ''}{' --gzip' if args.gzip else ''}")
    work.mkdir(parents=True, exist_ok=True)
    reports = work / "reports"
    reports.mkdir(exist_ok=True)
    print(f"CPU: {cpu_line()}; Python {platform.python_version()}", flush=True)
    t_start = time.time()

    tokenizer = args.tokenizer
    if not tokenizer:
        out = work / "vocabulary"
        shutil.rmtree(out, ignore_errors=True)
        print(f"vocabulary for (a): {args.vocab_size:,} pieces trained on {corpora[sizes[0]][0].name} (unmeasured)",
              flush=True)
        run = measured(prepare_cmd(out, corpora[sizes[0]], args, vocab_sample=2_000_000, shards=1),
                       reports / "vocabulary.txt", label="vocabulary")
        if run["failed"]:
            return 1
        tokenizer = out / "tokenizer.model"

    prepares, trains, vocabs = [], [], []
    for round_ in range(1, args.rounds + 1):
        for n in sizes:  # (a)
            out = work / f"prepared-{n}"
            shutil.rmtree(out, ignore_errors=True)
            run = measured(prepare_cmd(out, corpora[n], args, tokenizer=tokenizer), reports / f"prepare-{n}.txt",
                           label=f"kt-prepare {n:,}")
            if run["failed"]:
                return 1
            ready = seconds_to(run, r"^\[kt-prepare\] vocabulary:")
            dealt = seconds_to(run, r"^\[kt-prepare\] tokenized [\d,]+ pairs in")
            r = {"round": round_, "pairs": n, "wall_s": run["wall_s"], "max_rss_kb": run["max_rss_kb"],
                 "cpu_s": run.get("user_s", 0) + run.get("system_s", 0),
                 "after_vocabulary_s": None if ready is None else run["wall_s"] - ready,
                 "tokenize_s": None if ready is None or dealt is None else dealt - ready,
                 "shuffle_s": None if dealt is None else run["wall_s"] - dealt}
            prepares.append(r)
            print(f"round {round_}  (a) kt-prepare {n:>10,} pairs: {r['wall_s']:7.1f} s ({r['after_vocabulary_s'] or 0:.1f} "
                  f"after the vocabulary: tokenize and deal {r['tokenize_s'] or 0:.1f}, shuffle the shards "
                  f"{r['shuffle_s'] or 0:.1f}; CPU {r['cpu_s']:.0f} s), peak RSS {r['max_rss_kb'] / 1024:,.0f} MiB",
                  flush=True)
        if not args.train:
            continue
        for n in sizes:  # (c)
            model_dir = work / f"train-{n}"
            shutil.rmtree(model_dir, ignore_errors=True)
            cmd = [sys.executable, "-m", "training.train", "--prepared", str(work / f"prepared-{n}"),
                   "--preset", args.preset, "--max-updates", str(args.max_updates), "--no-validation",
                   "--model-dir", str(model_dir), "--source-lang", args.source_lang, "--target-lang", args.target_lang,
                   "--verbose", "2", *shlex.split(args.train_args)]
            run = measured(cmd, reports / f"train-{n}.txt", label=f"kt-train {n:,}")
            if run["failed"]:
                return 1
            first = seconds_to(run, r"\[kt-train\] reached [\d,]+ of [\d,]+ updates")
            data = seconds_to(run, r"^\[kt-train\] data:")
            counted = seconds_to(run, r"^\[kt-train\] batches:")
            r = {"round": round_, "pairs": n, "wall_s": run["wall_s"], "max_rss_kb": run["max_rss_kb"],
                 "first_update_s": first if first is not None else run["wall_s"], "data_line_s": data,
                 "batches_line_s": counted}
            trains.append(r)
            print(f"round {round_}  (c) kt-train   {n:>10,} pairs: first update at {r['first_update_s']:6.1f} s (data "
                  f"line {data or 0:.1f} s, batches line {counted or 0:.1f} s), process {r['wall_s']:.1f} s, peak RSS "
                  f"{r['max_rss_kb'] / 1024:,.0f} MiB", flush=True)
            shutil.rmtree(model_dir, ignore_errors=True)

    if args.vocab:  # (b)
        for sample in args.vocab_samples:
            out = work / f"vocabulary-{sample}"
            shutil.rmtree(out, ignore_errors=True)
            run = measured(prepare_cmd(out, corpora[vocab_on], args, vocab_sample=sample),
                           reports / f"vocabulary-{sample}.txt", stop_at=r"^\[kt-prepare\] vocabulary:",
                           label=f"vocabulary {sample:,}")
            shutil.rmtree(out, ignore_errors=True)
            if "max_rss_kb" not in run:
                return 1
            ready = seconds_to(run, r"^\[kt-prepare\] vocabulary:")
            said = next((m.group(1) for _, l in run["lines"] for m in [re.search(r"lines, both sides, in (\d+) s", l)]
                         if m), None)
            r = {"vocab_sample": sample, "corpus_pairs": vocab_on, "max_rss_kb": run["max_rss_kb"],
                 "seconds_to_vocabulary": ready, "sentencepiece_s": None if said is None else int(said)}
            vocabs.append(r)
            print(f"(b) vocabulary, {args.vocab_size:,} pieces, sample {sample:>10,} lines of {vocab_on:,} pairs: "
                  f"ready at {ready or 0:.1f} s (kt-prepare says {said} s), peak RSS {r['max_rss_kb'] / 1024:,.0f} MiB",
                  flush=True)

    # The summary: medians over the rounds.
    def med(rows, n, key):
        return median(r[key] for r in rows if r["pairs"] == n)

    print(f"\nCPU: {cpu_line()}; total {time.time() - t_start:.0f} s; shards {args.shards}; tokenizer {tokenizer}")
    print("| pairs | kt-prepare s | after the vocabulary s | kt-prepare peak RSS MiB | kt-train first update s "
          "| kt-train peak RSS MiB |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in sizes:
        tr = [r for r in trains if r["pairs"] == n]
        first = f"{med(trains, n, 'first_update_s'):.1f}" if tr else "-"
        rss = f"{med(trains, n, 'max_rss_kb') / 1024:,.0f}" if tr else "-"
        print(f"| {n:,} | {med(prepares, n, 'wall_s'):.1f} | {med(prepares, n, 'after_vocabulary_s') or 0:.1f} | "
              f"{med(prepares, n, 'max_rss_kb') / 1024:,.0f} | {first} | {rss} |")
    if vocabs:
        print("\n| vocabulary sample (lines) | of a corpus of (pairs) | seconds to the vocabulary | peak RSS MiB |")
        print("|---:|---:|---:|---:|")
        for r in vocabs:
            print(f"| {r['vocab_sample']:,} | {r['corpus_pairs']:,} | {r['seconds_to_vocabulary'] or 0:.1f} | "
                  f"{r['max_rss_kb'] / 1024:,.0f} |")

    ratios = {}
    big, small = sizes[-1], sizes[0]
    mid = sizes[-2] if len(sizes) > 1 else None
    print("\ngoals:")
    if mid is not None:
        scale = big / mid
        whole = med(prepares, big, "wall_s") / med(prepares, mid, "wall_s") / scale
        ratios["prepare_time_per_pair"] = whole
        after_big, after_mid = med(prepares, big, "after_vocabulary_s"), med(prepares, mid, "after_vocabulary_s")
        after = after_big / after_mid / scale if after_big and after_mid else None
        print(f"  kt-prepare time per pair, {big:,} over {mid:,}: {whole:.2f} (goal <= "
              f"{GOALS['prepare_time_per_pair']}: {'met' if whole <= GOALS['prepare_time_per_pair'] else 'NOT met'})"
              + (f"; after the vocabulary alone {after:.2f}" if after else ""))
    rss = gb(med(prepares, big, "max_rss_kb"))
    ratios["prepare_rss_gb"] = rss
    print(f"  kt-prepare peak RSS at {big:,}: {rss:.2f} GB (goal <= {GOALS['prepare_rss_gb']}: "
          f"{'met' if rss <= GOALS['prepare_rss_gb'] else 'NOT met'})")
    if trains and big != small:
        for key, what, goal in (("max_rss_kb", "peak RSS", "train_rss"),
                                ("first_update_s", "seconds to the first update", "train_first_update")):
            ratio = med(trains, big, key) / med(trains, small, key)
            ratios[goal] = ratio
            print(f"  kt-train {what}, {big:,} over {small:,}: {ratio:.2f}x (goal <= {GOALS[goal]}x: "
                  f"{'met' if ratio <= GOALS[goal] else 'NOT met'})")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_line(), "sizes": sizes, "shards": args.shards,
                                               "tokenizer": str(tokenizer), "prepare": prepares, "train": trains,
                                               "vocabulary": vocabs, "ratios": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
