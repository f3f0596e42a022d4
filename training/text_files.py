"""Plain parallel text: two line-aligned files, read with clear errors and empty pairs skipped."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from keras_transformer.text import read_lines
from training.errors import DataError, DataNotFoundError, LineCountMismatchError

log = logging.getLogger("training.text_files")


@dataclass
class ReadStats:
    """What happened while reading a parallel corpus."""

    lines: int = 0
    kept: int = 0
    empty_skipped: int = 0
    empty_line_numbers: list = field(default_factory=list)


def read_parallel_files(source_path, target_path) -> tuple[list[str], list[str], ReadStats]:
    """Reads two line-aligned files. Empty lines (either side) are skipped and counted.

    Raises `DataNotFoundError` if a file is missing and `LineCountMismatchError`
    (naming both files and both counts) if the line counts differ. Lines are kept
    verbatim (inner tabs included), only the line terminator is removed.
    """
    source_path, target_path = Path(source_path), Path(target_path)
    for p in (source_path, target_path):
        if not p.is_file():
            raise DataNotFoundError(f"Parallel text file not found: {p}")
    src, tgt = read_lines(source_path), read_lines(target_path)
    if len(src) != len(tgt):
        raise LineCountMismatchError(
            f"Line counts differ: {source_path} has {len(src)} lines but {target_path} has "
            f"{len(tgt)} lines. The two files must be line-aligned translations."
        )
    stats = ReadStats(lines=len(src))
    out_src, out_tgt = [], []
    for i, (s, t) in enumerate(zip(src, tgt), start=1):
        if not s.strip() or not t.strip():
            stats.empty_skipped += 1
            if len(stats.empty_line_numbers) < 20:
                stats.empty_line_numbers.append(i)
            continue
        out_src.append(s)
        out_tgt.append(t)
    stats.kept = len(out_src)
    if stats.empty_skipped:
        log.warning(
            "Skipped %d empty line pair(s) in %s / %s (line numbers, first 20: %s); kept %d of %d.",
            stats.empty_skipped, source_path, target_path, stats.empty_line_numbers,
            stats.kept, stats.lines,
        )
    if stats.kept == 0:
        raise DataError(f"No non-empty line pairs in {source_path} / {target_path}.")
    return out_src, out_tgt, stats
