"""A synthetic parallel corpus of any size, made of Multi30k's training pairs (not a test; input for benchmarks).

    .venv/bin/python bench/synthetic_corpus.py --pairs 30k,1M,4.5M --out-dir /tmp/kt-synthetic
    .venv/bin/python bench/synthetic_corpus.py --pairs 1M --reverse-second-half --out-dir /tmp/kt-synthetic
    .venv/bin/python bench/synthetic_corpus.py --pairs 100k --gzip --out-dir /tmp/kt-synthetic

Each output line joins 1 to 3 Multi30k training pairs drawn at random (with
replacement; how many: uniform by default, `--join-probs`), the source sides
with a space and the target sides the same way, so that every line pair is
still a translation: about 2 x 12 = 24 words a side on average (Multi30k's
lines have 11.9 English, 11.1 German words). The draws are numpy's, from
`--seed`; the same command writes the same bytes.

`--reverse-second-half` reverses every word of both sides character-wise
(`Zwei junge` -> `iewZ egnuj`) in lines `pairs // 2` onwards, so that the two
halves of the file differ (in their subwords and lengths alike): a batch's
share of second-half pairs says how well a pipeline mixes the whole corpus
(bench/prepared_input.py's shuffle check). Whitespace inside a Multi30k line
is normalised to single spaces in both halves.

Written as a stream, `--chunk-lines` lines at a time, each chunk gathered with
numpy from a table of Multi30k's lines: memory stays flat (a few tens of MB)
whatever the size; 4.5M pairs is about 1.2 GB of text. Files are
`OUT_DIR/synthetic-N[-rev].SRC` and `.TGT` (`.gz` with `--gzip`, gzip level
`--gzip-level`, 1 by default: fast), each written under a temporary name and
renamed whole. Prints the lines, words per side, bytes and seconds of each.
"""

from __future__ import annotations

import argparse
import gzip
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA_DIR = REPO.parent / "shared" / "data" / "multi30k"
NEWLINE, SPACE = ord("\n"), ord(" ")


def parse_count(text: str) -> int:
    """'30000', '30k', '1M', '4.5M' -> a whole number."""
    t = text.strip().replace("_", "").replace(",", "")
    scale = {"k": 1_000, "m": 1_000_000}.get(t[-1:].lower(), 1)
    value = float(t[:-1]) * scale if scale > 1 else float(t)
    if value != int(value) or value < 1:
        raise argparse.ArgumentTypeError(f"not a whole number of pairs: {text!r}")
    return int(value)


def parse_counts(text: str) -> list[int]:
    return [parse_count(t) for t in text.split(",") if t.strip()]


def corpus_paths(out_dir, pairs: int, source_lang: str, target_lang: str, *, reverse: bool = False,
                 gzipped: bool = False) -> tuple[Path, Path]:
    """The files this script writes for `pairs` (bench/corpus_scaling.py finds them by this name)."""
    stem = f"synthetic-{pairs}{'-rev' if reverse else ''}"
    ext = ".gz" if gzipped else ""
    return Path(out_dir) / f"{stem}.{source_lang}{ext}", Path(out_dir) / f"{stem}.{target_lang}{ext}"


def reverse_words(line: str) -> str:
    return " ".join(w[::-1] for w in line.split())


class LineTable:
    """Multi30k's lines of one side, forward (rows 0..n-1) and word-reversed (rows n..2n-1), as one byte buffer:
    row r is `buffer[starts[r]: starts[r] + lengths[r]]`, the line's UTF-8 bytes and a trailing space."""

    def __init__(self, lines: list[str]):
        rows = [" ".join(l.split()) for l in lines] + [reverse_words(l) for l in lines]
        encoded = [(r + " ").encode("utf-8") for r in rows]
        self.lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
        self.starts = np.cumsum(self.lengths) - self.lengths
        self.buffer = np.frombuffer(b"".join(encoded), np.uint8)
        self.words = np.fromiter((len(r.split()) for r in rows), np.int64, len(rows))

    def gather(self, rows: np.ndarray, line_ends: np.ndarray) -> np.ndarray:
        """The bytes of table rows `rows` one after another, the space after each row at `line_ends` (indices
        into `rows`: a line's last piece) turned into a newline."""
        lens = self.lengths[rows]
        ends = np.cumsum(lens)
        within = np.arange(int(ends[-1]), dtype=np.int64) - np.repeat(ends - lens, lens)
        out = self.buffer[np.repeat(self.starts[rows], lens) + within]
        out[ends[line_ends] - 1] = NEWLINE
        return out


def read_multi30k(data_dir: Path, source_lang: str, target_lang: str) -> tuple[list[str], list[str]]:
    src = (data_dir / f"train.{source_lang}").read_text(encoding="utf-8").splitlines()
    tgt = (data_dir / f"train.{target_lang}").read_text(encoding="utf-8").splitlines()
    if len(src) != len(tgt):
        sys.exit(f"{data_dir}: train.{source_lang} has {len(src)} lines, train.{target_lang} {len(tgt)}")
    kept = [(s, t) for s, t in zip(src, tgt) if s.split() and t.split()]
    return [s for s, _ in kept], [t for _, t in kept]


def _open(path: Path, gzip_level: int | None):
    """(the stream to write, the file under it)."""
    raw = open(path, "wb", buffering=1 << 22)
    if gzip_level is None:
        return raw, raw
    # mtime=0: the same command writes the same bytes.
    return gzip.GzipFile(filename="", mode="wb", compresslevel=gzip_level, fileobj=raw, mtime=0), raw


def write_corpus(tables, pairs: int, paths, *, seed: int, reverse_second_half: bool, join_probs,
                 chunk_lines: int, gzip_level: int | None) -> dict:
    """Writes `pairs` lines to each of `paths` (source, target); returns counts."""
    rng = np.random.default_rng([seed, pairs])
    n_multi30k = len(tables[0].lengths) // 2
    reverse_from = pairs // 2 if reverse_second_half else pairs
    tmps = [p.with_name(p.name + ".tmp") for p in paths]
    opened = [_open(t, gzip_level) for t in tmps]
    files = [f for f, _ in opened]
    words, nbytes, done = [0, 0], [0, 0], 0
    try:
        while done < pairs:
            n = min(chunk_lines, pairs - done)
            joins = rng.choice(len(join_probs), size=n, p=join_probs) + 1  # Multi30k pairs per line
            rows = rng.integers(0, n_multi30k, int(joins.sum()))
            reversed_line = np.arange(done, done + n) >= reverse_from
            rows += n_multi30k * np.repeat(reversed_line, joins)
            line_ends = np.cumsum(joins) - 1
            for side, (table, f) in enumerate(zip(tables, files)):
                data = table.gather(rows, line_ends)
                f.write(memoryview(data))
                words[side] += int(table.words[rows].sum())
                nbytes[side] += len(data)
            done += n
    finally:
        for f, raw in opened:
            f.close()
            raw.close()
    for tmp, path in zip(tmps, paths):
        os.replace(tmp, path)
    return {"pairs": pairs, "reverse_from": reverse_from if reverse_second_half else None,
            "words_per_line": [w / pairs for w in words], "text_bytes": nbytes,
            "file_bytes": [p.stat().st_size for p in paths]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=parse_counts, required=True,
                   help="line pairs to write, comma-separated, one corpus each: 30000,1000000 or 30k,1M,4.5M")
    p.add_argument("--out-dir", required=True, help="where to write (created; not inside the repository)")
    p.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR),
                   help=f"Multi30k's raw files, train.SRC and train.TGT (default {DEFAULT_DATA_DIR})")
    p.add_argument("--source-lang", default="en")
    p.add_argument("--target-lang", default="de")
    p.add_argument("--reverse-second-half", action="store_true",
                   help="reverse every word of both sides in the second half of the lines (files named -rev)")
    p.add_argument("--join-probs", default="1,1,1", metavar="P1,P2,P3",
                   help="relative odds of joining 1, 2, 3 (...) Multi30k pairs into a line (default 1,1,1: uniform; "
                   "1,2,2 gives about 26 English words a line)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--gzip", action="store_true", help="write .gz files")
    p.add_argument("--gzip-level", type=int, default=1, help="gzip compression level with --gzip (default 1)")
    p.add_argument("--chunk-lines", type=int, default=32768, help="lines gathered and written at a time")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    out_dir = Path(args.out_dir).resolve()
    if out_dir == REPO or REPO in out_dir.parents:
        sys.exit(f"--out-dir {out_dir} is inside the repository {REPO}: write the corpus elsewhere (e.g. /tmp)")
    out_dir.mkdir(parents=True, exist_ok=True)
    odds = np.asarray([float(x) for x in args.join_probs.split(",")])
    if len(odds) < 1 or (odds < 0).any() or odds.sum() <= 0:
        sys.exit(f"--join-probs {args.join_probs}: non-negative odds, at least one above 0")
    odds = odds / odds.sum()

    t0 = time.time()
    src, tgt = read_multi30k(Path(args.data_dir), args.source_lang, args.target_lang)
    tables = (LineTable(src), LineTable(tgt))
    expected = [float((odds * np.arange(1, len(odds) + 1)).sum() * t.words[: len(src)].mean()) for t in tables]
    print(f"Multi30k: {len(src):,} training pairs from {args.data_dir} ({time.time() - t0:.1f} s); expected "
          f"{expected[0]:.1f} {args.source_lang} / {expected[1]:.1f} {args.target_lang} words a line", flush=True)
    for pairs in args.pairs:
        paths = corpus_paths(out_dir, pairs, args.source_lang, args.target_lang,
                             reverse=args.reverse_second_half, gzipped=args.gzip)
        t1 = time.time()
        r = write_corpus(tables, pairs, paths, seed=args.seed, reverse_second_half=args.reverse_second_half,
                         join_probs=odds, chunk_lines=args.chunk_lines, gzip_level=args.gzip_level if args.gzip else None)
        seconds = time.time() - t1
        rev = f"; words reversed from line {r['reverse_from'] + 1:,}" if r["reverse_from"] is not None else ""
        print(f"{paths[0]} / {paths[1].name}: {pairs:,} pairs, {r['words_per_line'][0]:.1f} / "
              f"{r['words_per_line'][1]:.1f} words a line, {r['text_bytes'][0] / 1e6:,.1f} + "
              f"{r['text_bytes'][1] / 1e6:,.1f} MB of text ({(r['file_bytes'][0] + r['file_bytes'][1]) / 1e6:,.1f} "
              f"MB on disk) in {seconds:.1f} s ({pairs / seconds:,.0f} pairs/s){rev}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
