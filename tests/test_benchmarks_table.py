"""BENCHMARKS.md's table rows stay short: the figure, the CPU, the commit and a link.

A row of BENCHMARKS.md (a line starting with `|`, other than a header's separator line such as `| --- | :---: |`)
is at most `MAX_ROW` characters. Commands, per-round figures and explanations belong in the docs/benchmarks-log.md
section the row links to.
"""

import re

from conftest import REPO

BENCHMARKS = REPO / "BENCHMARKS.md"
MAX_ROW = 300
SEPARATOR = re.compile(r"^\|(?:\s*:?-{3,}:?\s*\|)+\s*$")


def long_rows(text, limit=MAX_ROW):
    """(line number, length) of every table row of `text` longer than `limit` characters."""
    return [(number, len(line)) for number, line in enumerate(text.split("\n"), 1)
            if line.startswith("|") and not SEPARATOR.match(line) and len(line) > limit]


def test_every_benchmarks_row_is_at_most_300_characters():
    text = BENCHMARKS.read_text(encoding="utf-8")
    assert sum(line.startswith("|") for line in text.split("\n")) > 20  # the page has its tables: the check reads them
    problems = [f"BENCHMARKS.md:{number}: {length} characters" for number, length in long_rows(text)]
    assert problems == [], (f"table rows over {MAX_ROW} characters (move the detail into the log section the row "
                            "links to):\n" + "\n".join(problems))


def test_the_check_finds_a_long_row_and_passes_separators():
    text = "\n".join([
        "| what | figure |",
        "| --- | :---: |",
        "| short | 1.0× |",
        "| long | " + "x" * 300 + " |",
        "|" + " --- |" * 80,
        "Prose " + "y" * 400,
    ])
    assert long_rows(text) == [(4, 311)]
