"""Input pipeline speed: a prepared corpus's shards -> padded, length-bucketed batches (not a test).

    .venv/bin/python bench/synthetic_corpus.py --pairs 4.5M --reverse-second-half --out-dir /tmp/kt-synthetic
    .venv/bin/python -m training.prepare --out /tmp/kt-prepared/4500000-rev --vocab-size 8000 \
        --train-files /tmp/kt-synthetic/synthetic-4500000-rev.en /tmp/kt-synthetic/synthetic-4500000-rev.de
    .venv/bin/python bench/prepared_input.py --prepared /tmp/kt-prepared/4500000-rev \
        --tokens-per-replica 4096,25000 --rounds 3 \
        --compare-text /tmp/kt-synthetic/synthetic-4500000-rev.en /tmp/kt-synthetic/synthetic-4500000-rev.de

Measures kt-train's input pipeline for `--prepared DIR` alone, no model:
`training.prepared_corpus.prepared_dataset` over all of the corpus's shards (one
worker, one replica), in target tokens per second: the non-padding tokens of
`target_out`. They are counted in the graph, `ds.take(n).map(count).reduce(...)`,
so no Python loop over the batches adds its own cost; each run builds a new
dataset (a new seed), so its time includes opening the first shards and every
later pool's loading (shards read, SHA-256 checked, pooled, bucketed) in their
due share. A run is `--pairs-per-run` pairs' worth of batches (by default
1,000,000 pairs, or one whole epoch of a smaller corpus: `steps_per_epoch`).
Every budget of `--tokens-per-replica` is measured, the contenders alternating
(A B A B ...) over `--rounds` rounds, after one short untimed warm-up of each;
the median is reported beside the goal, 2,000,000 target tokens/s on a
2-core machine.

`--compare-text SRC TGT` adds the text pipeline kt-train uses without
--prepared, as a contrast: `training.pipeline.make_batches` over the same text
(read by `training.data.load_text_pairs`, as kt-train does, into memory,
outside the timed part), which tokenizes every pair each epoch with
tensorflow-text in the corpus's own vocabulary (shuffle buffer
`--shuffle-buffer`, kt-train's default 20,000), at the same budgets; its runs
are shorter (`--text-pairs-per-run`, 200,000 pairs' worth), as it is much
slower.

The shuffle check (skip it with `--no-shuffle-check`), for a corpus made by
`bench/synthetic_corpus.py --reverse-second-half` from Multi30k: for each of
`--shuffle-epochs` epochs of `training.prepared_corpus.stream_batches` (the generator
behind `prepared_dataset`; an epoch is one pass over every shard, each in a new
order), the share of the pairs in its first `--shuffle-batches` batches that
come from the second half of the corpus's lines, where every word is reversed.
Goal: 40-60%, in every epoch, i.e. the first batches of an epoch sample the
whole corpus, not its first lines. (Pairs over `--max-sentence-length` are left out,
and reversed words take more pieces: prepare the reversed corpus with a
vocabulary of its own, or the dropped pairs, whose count is printed, skew
the share.) A pair is told apart by its source's words: its ids are decoded
with the corpus's vocabulary, and the share of the words found among the
words of Multi30k's training source side (`--data-dir`) is taken; a forward
line has all of them (bar a piece the vocabulary lacks), a reversed one few
(`a`, and words whose reversal is a word: `dog`, `on`, `was`); below 80%
counts as second half, and rows scoring 65-95% are reported as unclear.
(Checked against exact matching of every pair's ids to its line, on a
100,000-pair corpus and a 1,000-piece vocabulary: forward lines all scored
100%, reversed ones at most 63%; none of 38,274 pairs was misclassified.)
Epochs are told apart by counting the shard loads (every epoch loads every
shard once, a pool of them at a time). It also says whether any two epochs
gave their first batches in the same order. The rest of each epoch's
batches are generated too (to reach the next epoch): a few seconds per
million pairs.

Prints the CPU model and its flags beside the figures; no timed assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.served_speed import cpu_line  # noqa: E402
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

GOAL_TOKENS_PER_S = 2_000_000
# Shuffle check: a pair whose source words are less than this share Multi30k's is from the reversed half.
SECOND_HALF_BELOW = 0.8
DEFAULT_DATA_DIR = REPO.parent / "shared" / "data" / "multi30k"




def int_list(text: str) -> list[int]:
    return [int(t.replace("_", "")) for t in text.split(",") if t.strip()]


def count_batches(ds, n: int):
    """Runs `n` batches of `ds` through the graph; (totals, seconds). Totals: target tokens (non-padding
    target_out), padded target tokens, pairs, batches."""
    import tensorflow as tf

    from keras_transformer.text import PAD_ID

    def count(inputs, target_out):
        return tf.stack([tf.reduce_sum(tf.cast(target_out != PAD_ID, tf.int64)), tf.cast(tf.size(target_out), tf.int64),
                         tf.cast(tf.shape(target_out)[0], tf.int64), tf.constant(1, tf.int64)])

    t0 = time.perf_counter()
    totals = ds.take(n).map(count).reduce(tf.zeros([4], tf.int64), lambda a, b: a + b).numpy()
    seconds = time.perf_counter() - t0
    return {"target_tokens": int(totals[0]), "padded_target_tokens": int(totals[1]), "pairs": int(totals[2]),
            "batches": int(totals[3])}, seconds


def shuffle_check(corpus, *, tokens_per_replica: int, max_sentence_length: int, seed: int, epochs: int,
                  batches: int, data_dir: Path) -> dict:
    """The share of second-half (word-reversed) pairs in the first `batches` batches of each of `epochs` epochs
    of `stream_batches` (the module docstring says how pairs and epochs are told apart)."""
    import numpy as np
    import sentencepiece as spm

    from keras_transformer.text import PAD_ID
    from training.prepared_corpus import PreparedCorpus, stream_batches

    lowercase = bool(corpus.manifest["vocabulary"].get("lowercase"))
    lang = corpus.manifest["source_lang"]
    text = (data_dir / f"train.{lang}").read_text(encoding="utf-8")
    known = set((text.lower() if lowercase else text).split())
    sp = spm.SentencePieceProcessor(model_file=str(corpus.tokenizer_file))

    counting = PreparedCorpus(corpus.directory, corpus.manifest)  # a copy whose shard loads are counted
    loads = [0]

    def load_shard(index, _load=counting.load_shard):
        loads[0] += 1
        return _load(index)

    counting.load_shard = load_shard
    n_shards = len(corpus.shards)
    firsts = [[] for _ in range(epochs)]  # each epoch's first batches: source arrays
    t0 = time.perf_counter()
    generated = 0
    for (source, _), _ in stream_batches(counting, list(range(n_shards)), max_sentence_length=max_sentence_length,
                                         tokens_per_replica=tokens_per_replica, seed=seed, epochs=epochs):
        generated += 1
        epoch = (loads[0] - 1) // n_shards
        if len(firsts[epoch]) < batches:
            firsts[epoch].append(source)
    seconds = time.perf_counter() - t0

    out = {"epochs": [], "batches_generated": generated, "seconds": round(seconds, 1)}
    for epoch, sources in enumerate(firsts):
        rows = [row[: int(np.count_nonzero(row != PAD_ID)) - 1].tolist() for source in sources for row in source]
        scores = []
        for decoded in sp.decode(rows):
            words = decoded.split()
            scores.append(sum(w in known for w in words) / max(len(words), 1))
        scores = np.asarray(scores)
        second = int((scores < SECOND_HALF_BELOW).sum())
        out["epochs"].append({"epoch": epoch + 1, "batches": len(sources), "pairs": len(rows),
                              "second_half_pairs": second, "second_half_share": second / max(len(rows), 1),
                              "unclear_pairs": int(((scores >= 0.65) & (scores < 0.95)).sum())})
    orders = [tuple(hash(s.tobytes()) for s in sources) for sources in firsts]
    out["same_order"] = [[a + 1, b + 1] for a in range(epochs) for b in range(a + 1, epochs) if orders[a] == orders[b]]
    return out


def build_parser() -> argparse.ArgumentParser:
    from training.config import default

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prepared", required=True, metavar="DIR", help="a directory kt-prepare made")
    p.add_argument("--tokens-per-replica", type=int_list, default=[4096, 25000], metavar="N,N",
                   help="token budgets of a batch (per side, padded), comma-separated (default 4096,25000)")
    p.add_argument("--max-sentence-length", type=int, default=default("max_sentence_length"),
                   help=f"kt-train's --max-sentence-length (default {default('max_sentence_length')})")
    p.add_argument("--rounds", type=int, default=3, help="timed runs of every contender and budget, alternating")
    p.add_argument("--pairs-per-run", type=int, default=1_000_000,
                   help="a run's batches: this many pairs' worth, at most one epoch (0: one epoch; default 1,000,000)")
    p.add_argument("--text-pairs-per-run", type=int, default=200_000,
                   help="the same for the text pipeline, ten or more times slower (default 200,000)")
    p.add_argument("--batches", type=int, help="a run's batches, both contenders, instead of --pairs-per-run")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--compare-text", nargs=2, metavar=("SOURCE", "TARGET"),
                   help="also measure training.pipeline.make_batches over these text files (the corpus's text)")
    p.add_argument("--shuffle-buffer", type=int, default=20_000, help="the text pipeline's (kt-train's default)")
    p.add_argument("--no-shuffle-check", dest="shuffle_check", action="store_false",
                   help="skip the shuffle check (for a corpus not made with --reverse-second-half)")
    p.add_argument("--shuffle-epochs", type=int, default=3)
    p.add_argument("--shuffle-batches", type=int, default=200, help="the first batches of each epoch checked")
    p.add_argument("--shuffle-tokens-per-replica", type=int, help="the check's budget (default: the first of "
                   "--tokens-per-replica)")
    p.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR),
                   help=f"Multi30k's raw files, for the shuffle check's word list (default {DEFAULT_DATA_DIR})")
    p.add_argument("--json", help="also write the results here")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    import tensorflow as tf

    from common.tokenizer import make_tokenizer
    from training.prepared_corpus import open_prepared, prepared_dataset, steps_per_epoch

    corpus = open_prepared(args.prepared)
    shards = list(range(len(corpus.shards)))
    print(f"CPU: {cpu_line()}; TensorFlow {tf.__version__}, Python {platform.python_version()}", flush=True)
    print(f"corpus: {corpus.directory}: {corpus.pairs:,} pairs, {corpus.manifest['target_tokens']:,} target tokens, "
          f"{len(shards)} shards, vocabulary {corpus.manifest['vocabulary']['pieces']:,}", flush=True)
    too_long = sum(corpus.manifest["length_histogram"][args.max_sentence_length + 1:])
    print(f"pairs longer than --max-sentence-length {args.max_sentence_length} (left out of every batch): "
          f"{too_long:,} "
          f"({too_long / corpus.pairs:.1%}; the shuffle check's share is of the pairs kept)", flush=True)

    text_pairs = tokenizer = None
    if args.compare_text:
        from training.data import DataSpec, load_text_pairs

        t0 = time.time()
        spec = DataSpec(dataset="files", source_lang=corpus.manifest["source_lang"],
                        target_lang=corpus.manifest["target_lang"], files={"train": tuple(args.compare_text)})
        text_pairs = load_text_pairs(spec, "train")
        tokenizer = make_tokenizer(corpus.tokenizer_file.read_bytes())
        print(f"text: {args.compare_text[0]} / {args.compare_text[1]} read in {time.time() - t0:.1f} s (untimed)",
              flush=True)

    def contenders(budget, seed):
        out = {"prepared": lambda: prepared_dataset(corpus, shards, max_sentence_length=args.max_sentence_length,
                                                    tokens_per_replica=budget, seed=seed)}
        if text_pairs is not None:
            from training.pipeline import make_batches

            out["text"] = lambda: make_batches(text_pairs, tokenizer, max_sentence_length=args.max_sentence_length,
                                               tokens_per_batch=budget, num_replicas=1, shuffle=True,
                                               shuffle_buffer=args.shuffle_buffer, seed=seed, repeat=True)
        return out

    runs = {}  # (budget, contender): batches a run
    for budget in args.tokens_per_replica:
        epoch = steps_per_epoch(corpus, max_sentence_length=args.max_sentence_length, tokens_per_replica=budget,
                                replicas=1)
        for name, make in contenders(budget, args.seed).items():
            pairs = args.text_pairs_per_run if name == "text" else args.pairs_per_run
            share = 1.0 if not pairs else min(1.0, pairs / corpus.pairs)
            runs[budget, name] = args.batches or max(1, round(epoch * share))
            print(f"budget {budget:,}: an epoch is {epoch:,} batches; a run of {name} is {runs[budget, name]:,}",
                  flush=True)
            count_batches(make(), 20)  # warm-up: tracing, first reads

    results = []
    for round_ in range(1, args.rounds + 1):
        for budget in args.tokens_per_replica:
            for name, make in contenders(budget, args.seed + round_).items():
                totals, seconds = count_batches(make(), runs[budget, name])
                r = {"round": round_, "contender": name, "tokens_per_replica": budget, **totals,
                     "seconds": round(seconds, 3), "target_tokens_per_s": totals["target_tokens"] / seconds}
                results.append(r)
                print(f"round {round_}  {name:8s} budget {budget:>6,}  {r['target_tokens_per_s']:>12,.0f} target tok/s  "
                      f"({totals['batches']:,} batches, {totals['pairs']:,} pairs, {totals['target_tokens']:,} target "
                      f"tokens, {totals['target_tokens'] / max(totals['padded_target_tokens'], 1):.0%} of the padded "
                      f"batch, {seconds:.2f} s)", flush=True)

    print(f"\nCPU: {cpu_line()}")
    print(f"| contender | tokens per replica | batches a run | pairs per batch | target tokens/s, median of "
          f"{args.rounds} | rounds | goal >= {GOAL_TOKENS_PER_S:,} (prepared) |")
    print("|---|---:|---:|---:|---:|---|---|")
    summary = []
    for budget in args.tokens_per_replica:
        for name in contenders(budget, 0):
            rs = [r for r in results if r["contender"] == name and r["tokens_per_replica"] == budget]
            if not rs:
                continue
            median = statistics.median(r["target_tokens_per_s"] for r in rs)
            goal = ("met" if median >= GOAL_TOKENS_PER_S else "not met") if name == "prepared" else "-"
            summary.append({"contender": name, "tokens_per_replica": budget, "median_target_tokens_per_s": median,
                            "goal_met": goal == "met" if name == "prepared" else None})
            each = ", ".join(f"{r['target_tokens_per_s']:,.0f}" for r in rs)
            print(f"| {name} | {budget:,} | {rs[0]['batches']:,} | {rs[0]['pairs'] / rs[0]['batches']:.0f} | "
                  f"{median:,.0f} | {each} | {goal} |")
    for budget in args.tokens_per_replica:
        pair = {s["contender"]: s["median_target_tokens_per_s"] for s in summary if s["tokens_per_replica"] == budget}
        if "text" in pair:
            print(f"budget {budget:,}: prepared / text = {pair['prepared'] / pair['text']:.1f}x")

    check = None
    if args.shuffle_check:
        budget = args.shuffle_tokens_per_replica or args.tokens_per_replica[0]
        check = shuffle_check(corpus, tokens_per_replica=budget, max_sentence_length=args.max_sentence_length,
                              seed=args.seed, epochs=args.shuffle_epochs, batches=args.shuffle_batches, data_dir=Path(args.data_dir))
        print(f"\nshuffle check (budget {budget:,}; {check['batches_generated']:,} batches generated in "
              f"{check['seconds']} s): second-half pairs among each epoch's first {args.shuffle_batches} batches "
              f"(goal 40-60%)")
        for e in check["epochs"]:
            ok = "within 40-60%" if 0.4 <= e["second_half_share"] <= 0.6 else "OUTSIDE 40-60%"
            print(f"  epoch {e['epoch']}: {e['second_half_pairs']:,} of {e['pairs']:,} pairs "
                  f"({e['second_half_share']:.1%}, {ok}; {e['unclear_pairs']} unclear) in {e['batches']} batches")
        same = check["same_order"]
        print(f"  epochs with the same batch order: {', '.join(f'{a} and {b}' for a, b in same) if same else 'none'}")
        if all(e["second_half_share"] == 0 for e in check["epochs"]):
            print("  (no second-half pair at all: was the corpus made with synthetic_corpus.py --reverse-second-half?)")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_line(), "corpus": str(corpus.directory), "runs": results,
                                               "summary": summary, "shuffle_check": check}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
