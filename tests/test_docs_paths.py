"""Every repository path the documentation cites exists.

The pages are README.md, docs/*.md, training/README.md, export/README.md and BENCHMARKS.md. A cited path is a
word that begins with one of the repository's folders (`keras_transformer/`, `common/`, `training/`, `export/`,
`bench/`, `tests/`, `docs/`, `configs/`, `.ci/`): `tests/test_layout.py`, `bench/served_speed.py`,
`docs/design.md#anchor` (the anchor is not checked here), in prose, inline code and code blocks. Not checked:
a web address, a path with a placeholder in capitals (`bench/NAME`), a path of another commit (`45ed63c's
tests/quick_model.py`, `git show COMMIT:bench/NAME`, a command run in another checkout after `cd`), and a
script that docs/benchmarks-log.md lists as removed from bench/ (the commit it names has it). A wildcard
(`tests/test_training_*.py`) must match a file. What runs write (runs/, exports/) is no repository path.

The relative links of the same pages (`[text](../training/README.md#anchor)`) and their anchors are
tests/test_readme.py's `test_relative_links_resolve`.
"""

import re

from conftest import REPO, removed_bench_scripts

PAGES = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")),
         "training/README.md", "export/README.md", "BENCHMARKS.md"]
FOLDERS = ("keras_transformer", "common", "training", "export", "bench", "tests", "docs", "configs", r"\.ci")
# A path: a folder of the repository, then names, not inside a longer path, a web address or a dotted name.
CITED_PATH = re.compile(r"(?<![\w./~$-])((?:" + "|".join(FOLDERS) + r")/[\w.*/-]*)(?:::(\w+))?")
# Another commit's file: "45ed63c's `tests/quick_model.py`", "git show 45ed63c:bench/x.py".
OTHER_COMMIT = re.compile(r"\b[0-9a-f]{7,40}(?:'s\s+`?|:)$")
PLACEHOLDER = re.compile(r"(?:^|/)[A-Z][A-Z0-9_]*(?:/|\.|$)")


def cited_paths(page):
    """(line number, path) of every repository path `page` cites, but for another commit's or checkout's."""
    found = []
    for number, line in enumerate((REPO / page).read_text(encoding="utf-8").split("\n"), 1):
        if re.search(r"(?:^|[\s;&(])cd\s+(?!\.?/?work/main\b)\S", line):
            continue  # a command run in another checkout
        for match in CITED_PATH.finditer(line):
            path = match.group(1).split("#")[0].rstrip(".,:;)")
            before = line[:match.start()]
            if OTHER_COMMIT.search(before) or PLACEHOLDER.search(path) or path.count("/") < 1:
                continue
            if before.endswith("://") or re.search(r"https?://\S*$", before):
                continue
            found.append((number, path + (f"::{match.group(2)}" if match.group(2) else "")))
    return found


def missing(path):
    """Why `path` (relative to the repository; `file.py::name`: a test or class in it) is no file or folder of
    it, or None when it is one."""
    path, _, name = path.partition("::")
    if name and (REPO / path).is_file():
        found = re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b", (REPO / path).read_text(encoding="utf-8"),
                          re.MULTILINE)
        return None if found else f"no test or class {name} in it"
    if "*" in path:
        return None if any(REPO.glob(path)) else "no file matches"
    if (REPO / path).exists():
        return None
    if path.startswith("bench/") and path.split("/", 1)[1] in removed_bench_scripts():
        return None
    return "no such file or folder"


def _problems(pages):
    return [f"{page}:{number}: {path}: {why}" for page in pages for number, path in cited_paths(page)
            for why in [missing(path)] if why]


def test_every_cited_repository_path_exists():
    cited = [path for page in PAGES for _, path in cited_paths(page)]
    assert len(cited) > 100 and "tests/test_layout.py" in cited  # the pages cite many: the check reads them
    problems = _problems(PAGES)
    assert problems == [], "cited paths that do not exist:\n" + "\n".join(problems)


def test_the_check_finds_a_missing_path_and_passes_the_others(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("\n".join([
        "See `tests/no_such_test.py`, then tests/test_layout.py and docs/design.md#why-the-private-apis.",
        "bench/NAME, `bench/ffn_activity.py` (removed), 45ed63c's `tests/quick_model.py`, tests/test_training_*.py.",
        "https://github.com/keras-team/keras/blob/master/keras/src/layers/x.py and runs/bench/x.json",
        "```",
        "python bench/no_such_script.py --json runs/bench/out.json",
        "cd /tmp/wt && python tests/quick_model.py",
        "```",
        "A wildcard that matches nothing: tests/test_nothing_*.py.",
        "`tests/test_layout.py::test_no_measured_figure_in_code`, `tests/test_layout.py::test_gone`.",
    ]))
    problems = _problems([str(page)])
    assert [p.split(": ", 1)[0].rsplit(":", 1)[1] for p in problems] == ["1", "5", "8", "9"], problems
    assert "tests/no_such_test.py: no such file" in problems[0]
    assert "bench/no_such_script.py: no such file" in problems[1]
    assert "tests/test_nothing_*.py: no file matches" in problems[2]
    assert "tests/test_layout.py::test_gone: no test or class test_gone in it" in problems[3]
