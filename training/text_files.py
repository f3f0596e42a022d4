"""Plain parallel text: two line-aligned files, read with clear errors for the damage real corpora carry.

`read_parallel_files` is the one reader of training and validation text (the
Multi30k builder uses it too). What it does with each kind of damage:

- gzip-compressed files (`.gz`, or any file starting with gzip's magic bytes): read
  decompressed, every error below naming the decompressed line;
- a missing file, or two files whose line counts differ: an error naming both
  files and both counts (with a hint when one file uses carriage returns alone
  as line ends);
- bytes that are not UTF-8 (a Latin-1 or UTF-16 file, a cut multi-byte
  character), or a NUL byte: an error naming the file, the line and the byte;
- a UTF-8 byte-order mark: removed (repaired), and counted;
- empty or blank lines on either side: the pair is skipped, and counted with
  the first line numbers;
- pairs shifted against each other (a line lost in one file and one added
  elsewhere, so the counts still agree): an error naming where the shift
  starts, found from sentence lengths (`check_alignment`);
- Unicode line and paragraph separators, vertical tabs, form feeds and tabs
  inside a line: kept in the line. Lines end at `\\n` (or `\\r\\n`) only, so
  they can never shift one file against the other.
"""

from __future__ import annotations

import codecs
import gzip
import itertools
import logging
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from keras_transformer.text import split_lines
from training.errors import DataError, DataNotFoundError, LineCountMismatchError

log = logging.getLogger("training.text_files")

# Sentence lengths of translations correlate; a shift by one line destroys that. A window is flagged when
# its lengths correlate clearly better shifted by one line than as given (see `check_alignment`).
ALIGNMENT_WINDOW = 1000
ALIGNMENT_MIN_LINES = 200
ALIGNMENT_MARGIN = 0.25
ALIGNMENT_MIN_CORRELATION = 0.4


@dataclass
class ReadStats:
    """What happened while reading a parallel corpus."""

    lines: int = 0
    kept: int = 0
    empty_skipped: int = 0
    empty_line_numbers: list = field(default_factory=list)
    byte_order_marks_removed: int = 0


def _line_and_column(data: bytes, offset: int) -> tuple[int, int]:
    """1-based line and byte column of `offset` in `data`."""
    return data.count(b"\n", 0, offset) + 1, offset - (data.rfind(b"\n", 0, offset) + 1) + 1


GZIP_MAGIC = b"\x1f\x8b"


def read_text_lines(path) -> tuple[list[str], bool]:
    """The lines of a UTF-8 corpus file, plain or gzip-compressed (told by its first bytes, whatever its name),
    and whether a byte-order mark was removed.

    Raises `DataError` naming the file, the line and the byte when the file is
    UTF-16, is not UTF-8, or holds a NUL byte (lines and bytes of the
    decompressed text), or when a gzip file is cut short or damaged.
    """
    path = Path(path)
    data = path.read_bytes()
    if data.startswith(GZIP_MAGIC):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"{path}: a damaged or incomplete gzip file ({e}); download or compress it again, "
                            f"or check it with gzip -t") from None
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        raise DataError(f"{path} is UTF-16 (it starts with a UTF-16 byte-order mark); convert it to UTF-8, "
                        f"e.g. iconv -f UTF-16 -t UTF-8")
    bom = data.startswith(codecs.BOM_UTF8)
    if bom:
        data = data[len(codecs.BOM_UTF8):]
    return split_lines(_decode_text(data, path)), bom


def _decode_text(data: bytes, path, lines_before: int = 0) -> str:
    """`data` (lines of `path` after its first `lines_before`) as UTF-8 text; a `DataError` naming the file, the
    line and the byte where it is not UTF-8 or holds a NUL byte (UTF-16 read as bytes)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line, column = _line_and_column(data, e.start)
        raise DataError(f"{path}, line {lines_before + line}: not UTF-8 (byte 0x{data[e.start]:02x} at byte "
                        f"{column} of the line); convert the file to UTF-8, e.g. iconv -f LATIN1 -t UTF-8") from None
    nul = data.find(b"\x00")
    if nul >= 0:
        line, column = _line_and_column(data, nul)
        raise DataError(f"{path}, line {lines_before + line}: a NUL byte at byte {column} of the line; is this a "
                        f"text file (UTF-16 without a byte-order mark is read so)?")
    return text


def _lone_carriage_returns(lines) -> int:
    return sum(line.count("\r") for line in lines)


def _correlation(a, b) -> float:
    if a.std() == 0 or b.std() == 0:
        return 0.0
    return float(np.corrcoef(a, b)[0, 1])


def check_alignment(source: list[str], target: list[str], source_path, target_path) -> None:
    """Raises `DataError` if the pairs look shifted against each other by one line.

    Translations have correlated lengths. In windows of `ALIGNMENT_WINDOW`
    lines, the log-lengths of source line i and target line i are correlated,
    then those of source line i and target line i +/- 1. A window whose lengths
    correlate better shifted (by `ALIGNMENT_MARGIN`, and at least
    `ALIGNMENT_MIN_CORRELATION`) than as given is shifted: the error names the
    first such window. Corpora under `ALIGNMENT_MIN_LINES` lines are not
    checked; nor can a shift be seen in a corpus whose neighbouring lines have
    similar lengths anyway (sorted by length, say).
    """
    check_alignment_of_lengths([len(s) for s in source], [len(t) for t in target], source_path, target_path)


def check_alignment_of_lengths(source_lengths, target_lengths, source_path, target_path) -> None:
    """`check_alignment` on the lines' lengths in characters (what it reads of them)."""
    check = AlignmentCheck(source_path, target_path)
    check.add(source_lengths, target_lengths)
    check.finish()


class AlignmentCheck:
    """`check_alignment` on a stream of lines' lengths in characters, `add`ed a chunk at a time, in memory bounded
    by two windows and a chunk whatever the corpus's size: each window is checked once its lines are all in, the
    last (and the only one of a corpus under `ALIGNMENT_WINDOW` lines) by `finish`, which raises the first
    window's error, as `check_alignment` would on the whole."""

    def __init__(self, source_path, target_path):
        self.paths = (source_path, target_path)
        self.src = self.tgt = np.zeros(0, np.float64)  # log1p of the lengths of lines `base` on
        self.base = 0  # lines before the buffer (the windows before the current one's previous are dropped)
        self.start = 0  # the first line of the next window to check
        self.lines = 0
        self.error: DataError | None = None

    def add(self, source_lengths, target_lengths) -> None:
        self.lines += len(source_lengths)
        if self.error is not None:  # the first shift found is the one raised: nothing more to keep
            return
        self.src = np.concatenate([self.src, np.log1p(np.asarray(source_lengths, np.float64))])
        self.tgt = np.concatenate([self.tgt, np.log1p(np.asarray(target_lengths, np.float64))])
        while self.error is None and self.start + ALIGNMENT_WINDOW <= self.lines:
            self._window(self.start, self.start + ALIGNMENT_WINDOW, ALIGNMENT_WINDOW)
            self.start += ALIGNMENT_WINDOW
            drop = max(0, self.start - ALIGNMENT_WINDOW) - self.base  # keep the window before the next
            self.src, self.tgt, self.base = self.src[drop:], self.tgt[drop:], self.base + drop

    def finish(self) -> None:
        n = self.lines
        if n < ALIGNMENT_MIN_LINES:
            return
        size = min(ALIGNMENT_WINDOW, n)
        if self.error is None and self.start < n - size // 2:
            self._window(self.start, n, size)
        if self.error is not None:
            raise self.error

    def _window(self, start: int, end: int, size: int) -> None:
        """Checks lines [start, end) (a window of `size`), keeping the error if they look shifted."""
        src, tgt = self.src, self.tgt
        s, t = src[start - self.base:end - self.base], tgt[start - self.base:end - self.base]
        given = _correlation(s, t)
        later = _correlation(s[:-1], t[1:])  # source line i against target line i + 1
        earlier = _correlation(s[1:], t[:-1])  # source line i + 1 against target line i
        shifted = max(later, earlier)
        if shifted >= ALIGNMENT_MIN_CORRELATION and shifted > given + ALIGNMENT_MARGIN:
            offset = 1 if later >= earlier else -1
            first = self.base + _shift_start(src, tgt, max(0, start - size) - self.base, end - self.base, offset)
            which = "source line i matches target line i + 1" if offset == 1 else "source line i + 1 matches target line i"
            source_path, target_path = self.paths
            self.error = DataError(
                f"{source_path} / {target_path}: the pairs look shifted by one line from about line {first} on "
                f"(in lines {start + 1}-{end}, {which}: their lengths correlate {shifted:.2f}, against "
                f"{given:.2f} as given); a line was probably lost in one file there. Fix the files, or pass "
                f"--no-alignment-check if they are right.")


def _shift_start(src, tgt, start, end, offset) -> int:
    """The 1-based line in [start, end) after which lines fit best shifted by `offset`, before it as given."""
    s = (src[start:end] - src[start:end].mean()) / (src[start:end].std() or 1.0)
    t = (tgt[start:end] - tgt[start:end].mean()) / (tgt[start:end].std() or 1.0)
    given = s * t
    shifted = np.zeros_like(given)
    if offset == 1:
        shifted[:-1] = s[:-1] * t[1:]
    else:
        shifted[:-1] = s[1:] * t[:-1]
    # Break k: lines before k as given, from k on shifted; the best k has the largest total agreement.
    totals = np.concatenate([[0.0], np.cumsum(given)]) + np.concatenate([np.cumsum(shifted[::-1])[::-1], [0.0]])
    return start + int(np.argmax(totals)) + 1


def read_parallel_files(source_path, target_path, *, check_shift: bool = True
                        ) -> tuple[list[str], list[str], ReadStats]:
    """Reads two line-aligned UTF-8 files, with the checks and repairs of this module's docstring.

    Returns `(source_lines, target_lines, stats)`, the lines kept verbatim
    (inner tabs included) without their terminators. Raises
    `DataNotFoundError`, `LineCountMismatchError` or `DataError`, each naming
    the file, and the line where there is one. `check_shift=False` skips
    `check_alignment`.
    """
    source_path, target_path = Path(source_path), Path(target_path)
    for p in (source_path, target_path):
        if not p.is_file():
            raise DataNotFoundError(f"Parallel text file not found: {p}")
    (src, src_bom), (tgt, tgt_bom) = read_text_lines(source_path), read_text_lines(target_path)
    if len(src) != len(tgt):
        hint = "".join(
            f" {path} has {cr} carriage return(s) inside lines: are its lines ended by carriage returns alone?"
            for path, cr in ((source_path, _lone_carriage_returns(src)), (target_path, _lone_carriage_returns(tgt)))
            if cr)
        raise LineCountMismatchError(
            f"Line counts differ: {source_path} has {len(src)} lines but {target_path} has "
            f"{len(tgt)} lines. The two files must be line-aligned translations.{hint}"
        )
    if check_shift:
        check_alignment(src, tgt, source_path, target_path)
    stats = ReadStats(lines=len(src), byte_order_marks_removed=int(src_bom) + int(tgt_bom))
    if stats.byte_order_marks_removed:
        log.warning("Removed the UTF-8 byte-order mark at the start of %s.",
                    " and of ".join(str(p) for p, bom in ((source_path, src_bom), (target_path, tgt_bom)) if bom))
    out_src, out_tgt = _drop_empty_pairs(src, tgt, stats, first_line=1)
    stats.kept = len(out_src)
    _report_empty_pairs(stats, source_path, target_path)
    return out_src, out_tgt, stats


def _drop_empty_pairs(src, tgt, stats: ReadStats, first_line: int) -> tuple[list[str], list[str]]:
    """The pairs of `src` and `tgt` (lines `first_line`, ... of their files) with text on both sides; each pair
    dropped is counted in `stats` (its line number among the first 20)."""
    out_src, out_tgt = [], []
    for i, (s, t) in enumerate(zip(src, tgt), start=first_line):
        if not s.strip() or not t.strip():
            stats.empty_skipped += 1
            if len(stats.empty_line_numbers) < 20:
                stats.empty_line_numbers.append(i)
            continue
        out_src.append(s)
        out_tgt.append(t)
    return out_src, out_tgt


def _report_empty_pairs(stats: ReadStats, source_path, target_path) -> None:
    """Warns of the empty pairs skipped, with their first line numbers; a `DataError` when no pair is left."""
    if stats.empty_skipped:
        log.warning("Skipped %d empty line pair(s) in %s / %s (line numbers, first 20: %s); kept %d of %d.",
                    stats.empty_skipped, source_path, target_path, stats.empty_line_numbers, stats.kept, stats.lines)
    if stats.kept == 0:
        raise DataError(f"No non-empty line pairs in {source_path} / {target_path}.")


# Lines a streamed corpus is read in at a time (`iter_parallel_chunks`).
STREAM_CHUNK_LINES = 20_000


def _open_corpus(path: Path):
    """A binary stream of a corpus file's text, decompressed when it starts with gzip's magic bytes."""
    with open(path, "rb") as f:
        magic = f.read(2)
    return gzip.open(path, "rb") if magic == GZIP_MAGIC else open(path, "rb")


def iter_text_chunks(path, chunk_lines: int = STREAM_CHUNK_LINES):
    """The lines of a corpus file (plain or gzip), `chunk_lines` at a time, read as a stream: lists of `str`.

    The errors and repairs of `read_text_lines`, naming the same file, line and
    byte, with memory bounded by a chunk. A removed UTF-8 byte-order mark is
    logged.
    """
    path = Path(path)
    first, offset = True, 0  # offset: lines before this chunk
    try:
        with _open_corpus(path) as f:
            while True:
                raw = list(itertools.islice(f, chunk_lines))
                if not raw:
                    return
                data = b"".join(raw)
                if first:
                    first = False
                    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
                        raise DataError(f"{path} is UTF-16 (it starts with a UTF-16 byte-order mark); convert it "
                                        f"to UTF-8, e.g. iconv -f UTF-16 -t UTF-8")
                    if data.startswith(codecs.BOM_UTF8):
                        data = data[len(codecs.BOM_UTF8):]
                        log.warning("Removed the UTF-8 byte-order mark at the start of %s.", path)
                lines = split_lines(_decode_text(data, path, lines_before=offset))
                offset += len(lines)
                yield lines
    except (OSError, EOFError, zlib.error) as e:
        if isinstance(e, FileNotFoundError):
            raise DataNotFoundError(f"Parallel text file not found: {path}") from None
        raise DataError(f"{path}: a damaged or incomplete gzip file ({e}); download or compress it again, "
                        f"or check it with gzip -t") from None


def iter_parallel_chunks(source_path, target_path, *, check_shift: bool = True,
                         chunk_lines: int = STREAM_CHUNK_LINES, stats: ReadStats | None = None):
    """`read_parallel_files` as a stream: yields `(source_lines, target_lines)` chunks of the non-empty pairs.

    The same errors (a line-count mismatch once the shorter file ends, with both
    counts; the shift check of `check_alignment`, raised once both have ended,
    on the lines' lengths, checked a window at a time as they are read,
    `AlignmentCheck`: its memory does not grow with the files). `stats`, if
    given, is filled in as the files are read.
    """
    source_path, target_path = Path(source_path), Path(target_path)
    for p in (source_path, target_path):
        if not p.is_file():
            raise DataNotFoundError(f"Parallel text file not found: {p}")
    stats = stats if stats is not None else ReadStats()
    alignment = AlignmentCheck(source_path, target_path) if check_shift else None
    sources, targets = iter_text_chunks(source_path, chunk_lines), iter_text_chunks(target_path, chunk_lines)
    for src in sources:
        tgt = next(targets, [])
        if len(src) != len(tgt):
            n_src = stats.lines + len(src) + sum(len(c) for c in sources)
            n_tgt = stats.lines + len(tgt) + sum(len(c) for c in targets)
            raise LineCountMismatchError(
                f"Line counts differ: {source_path} has {n_src} lines but {target_path} has {n_tgt} lines. The "
                f"two files must be line-aligned translations.")
        if alignment is not None:
            alignment.add(np.fromiter((len(s) for s in src), np.int32, len(src)),
                          np.fromiter((len(t) for t in tgt), np.int32, len(tgt)))
        out_src, out_tgt = _drop_empty_pairs(src, tgt, stats, first_line=stats.lines + 1)
        stats.lines += len(src)
        stats.kept += len(out_src)
        if out_src:
            yield out_src, out_tgt
    rest = sum(len(c) for c in targets)
    if rest:
        raise LineCountMismatchError(
            f"Line counts differ: {source_path} has {stats.lines} lines but {target_path} has {stats.lines + rest} "
            f"lines. The two files must be line-aligned translations.")
    if alignment is not None:
        alignment.finish()
    _report_empty_pairs(stats, source_path, target_path)
