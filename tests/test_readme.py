"""The documentation works as written: the README's Python examples run, every relative link of the docs leads
somewhere, and docs/layout.md names every module of the code.

- Every ```python block of README.md runs in a fresh interpreter of the TensorFlow virtualenv (`KERAS_BACKEND=
  tensorflow`, the repository on `PYTHONPATH`, a temporary directory as cwd), as a user would paste it. A block
  that cannot run here (it needs a trained model or a server) is marked on the line before it with
  `<!-- not run: the reason -->`, and is skipped with that reason; at least `MIN_RUN_BLOCKS` must run.
- Every relative link (`[text](path)`, `![alt](path)`, `[ref]: path`, `href=`/`src=`) of README.md, docs/*.md,
  training/README.md, export/README.md and BENCHMARKS.md resolves to an existing file or folder, and a `#anchor`
  into a markdown file to one of its headings, slugged as GitHub does. Links inside code are not links.
"""

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO

README = REPO / "README.md"
LINKED_PAGES = [README, *sorted((REPO / "docs").glob("*.md")), REPO / "training" / "README.md",
                REPO / "export" / "README.md", REPO / "BENCHMARKS.md"]
# The README's runnable examples: the library on a Keras backend, training on several GPUs, decoder-only
# generation.
MIN_RUN_BLOCKS = 3
NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(?P<reason>.*?)\s*-->\s*$")
# A block marked so runs with the CPU split into 2 logical devices first (as kt-train --cpu-replicas 2 splits it),
# and must print "replicas: 2": the README's multi-GPU script, on the two replicas a machine without GPUs has.
TWO_DEVICES = re.compile(r"^\s*<!--\s*run on 2 logical CPU devices\s*-->\s*$")
SPLIT_CPU = """import tensorflow as tf
tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * 2)
"""
FENCE = re.compile(r"^\s*(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")
# A block's own time; the whole file stays under 2 minutes on 2 busy cores.
BLOCK_TIMEOUT = 600


def _fenced_blocks(text):
    """(first line number of the code, info string, code, the line before the opening fence) of every fenced
    code block of a markdown text, and the text's lines with every block's lines blanked."""
    lines = text.split("\n")
    blocks, outside = [], list(lines)
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence = opening["fence"]
        close = re.compile(r"^\s*" + re.escape(fence[0]) + "{" + str(len(fence)) + r",}\s*$")
        end = next((j for j in range(i + 1, len(lines)) if close.match(lines[j])), len(lines))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        blocks.append((i + 2, opening["info"].lower(), "\n".join(lines[i + 1:end]) + "\n", before))
        for j in range(i, min(end + 1, len(lines))):
            outside[j] = ""
        i = end + 1
    return blocks, outside


def python_blocks(path=README):
    """(line, code, reason it is not run or None, on 2 logical devices) of every ```python block of `path`."""
    blocks, _ = _fenced_blocks(path.read_text(encoding="utf-8"))
    found = []
    for line, info, code, before in blocks:
        if info in ("python", "py", "python3"):
            marker = NOT_RUN.match(before)
            found.append((line, code, marker["reason"] if marker else None, bool(TWO_DEVICES.match(before))))
    return found


@pytest.mark.parametrize("line, code, not_run, two_devices",
                         [pytest.param(*block, id=f"README.md:{block[0]}") for block in python_blocks()])
def test_readme_python_block_runs(line, code, not_run, two_devices, tmp_path):
    """The block at README.md:line, pasted into a fresh interpreter, exits 0 (a block marked to run on 2 logical
    CPU devices, on them, printing "replicas: 2")."""
    if not_run is not None:
        pytest.skip(f"README.md:{line}: not run: {not_run}")
    script = tmp_path / f"readme_line_{line}.py"
    script.write_text((SPLIT_CPU if two_devices else "") + code, encoding="utf-8")
    venv_python = REPO / ".venv" / "bin" / "python"
    python = venv_python if venv_python.is_file() else sys.executable
    env = {**os.environ, "PYTHONPATH": str(REPO), "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run([str(python), str(script)], capture_output=True, text=True, env=env, cwd=str(tmp_path),
                          timeout=BLOCK_TIMEOUT)
    assert proc.returncode == 0, (f"README.md:{line}: the python block failed (exit {proc.returncode}):\n"
                                  f"{proc.stderr[-4000:]}")
    if two_devices:
        assert "replicas: 2" in proc.stdout, proc.stdout[-2000:]


def test_readme_runs_enough_python_blocks():
    """At least MIN_RUN_BLOCKS of the README's python blocks run, every `not run` marker gives a reason, and every
    marker stands right before a python block (a marker before anything else would mark nothing)."""
    blocks = python_blocks()
    assert sum(reason is None for _, _, reason, _ in blocks) >= MIN_RUN_BLOCKS, blocks
    assert all(reason for _, _, reason, _ in blocks if reason is not None), "a `not run` marker needs its reason"
    lines = README.read_text(encoding="utf-8").split("\n")
    for pattern, marked in ((NOT_RUN, {line for line, _, reason, _ in blocks if reason is not None}),
                            (TWO_DEVICES, {line for line, _, _, two in blocks if two})):
        for number, text in enumerate(lines, 1):
            if pattern.match(text):
                # The block's code begins two lines after its marker (marker, fence, code), blank lines aside.
                fence = next(n for n in range(number + 1, len(lines) + 1) if lines[n - 1].strip())
                assert fence + 1 in marked, f"README.md:{number}: a marker not followed by a python block"


# ------------------------------------------------------------------------------------------------------ links

INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?(?P<target>[^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(?P<target>\S+?)>?(?:\s+.*)?$")
HTML_LINK = re.compile(r"\b(?:href|src)\s*=\s*[\"'](?P<target>[^\"']*)[\"']")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(?P<text>.*?)(?:\s+#+)?\s*$")


def _links(path):
    """(line number, target) of every link of a markdown file, code blocks and code spans left out."""
    _, lines = _fenced_blocks(path.read_text(encoding="utf-8"))
    found = []
    for number, line in enumerate(lines, 1):
        line = INLINE_CODE.sub("", line)
        targets = [m["target"] for m in INLINE_LINK.finditer(line)] + [m["target"] for m in HTML_LINK.finditer(line)]
        definition = REFERENCE_DEFINITION.match(line)
        if definition:
            targets.append(definition["target"])
        found += [(number, target) for target in targets]
    return found


def github_slug(heading):
    """The anchor GitHub gives a heading: its text as rendered (code, emphasis and link markup dropped), lowercased,
    every character that is not a letter, digit, space, hyphen or underscore removed, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](url) -> text
    text = re.sub(r"<[^>]+>", "", text)  # HTML tags
    text = text.replace("`", "")
    text = re.sub(r"(\*{1,3}|(?<!\w)_{1,3}|_{1,3}(?!\w))", "", text)  # emphasis markers, not snake_case's _
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path):
    """The anchors of a markdown file's headings, with GitHub's -1, -2, ... for repeated ones."""
    _, lines = _fenced_blocks(path.read_text(encoding="utf-8"))
    seen, found = {}, set()
    for line in lines:
        heading = HEADING.match(line)
        if heading:
            slug = github_slug(heading["text"])
            found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return found


def test_github_slug():
    """The slug rule on headings of these pages."""
    assert github_slug("English→German") == "englishgerman"
    assert github_slug("Training (`python -m training.train`, `kt-train`)") == "training-python--m-trainingtrain-kt-train"
    assert github_slug("The figures behind `eigen_batch_matmul` (commits 77537e5, 728c4b9)") == \
        "the-figures-behind-eigen_batch_matmul-commits-77537e5-728c4b9"
    assert github_slug("On the AVX2-only EPYC with oneDNN on: ahead of both, short of 1.5× (2026-11-25)") == \
        "on-the-avx2-only-epyc-with-onednn-on-ahead-of-both-short-of-15-2026-11-25"
    assert github_slug("**Bold** and [a link](x.md)") == "bold-and-a-link"


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    """Every relative link of the page names an existing file or folder, and its #anchor a heading there."""
    assert page.is_file(), page
    broken = []
    for number, target in _links(page):
        if not target or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
            continue  # an absolute URL (https:, mailto:, ...)
        path_part, _, anchor = target.partition("#")
        destination = (page.parent / path_part).resolve() if path_part else page
        where = f"{page.relative_to(REPO)}:{number}: ({target})"
        if not destination.exists():
            broken.append(f"{where}: no file {destination}")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{where}: no heading #{anchor} in {destination.relative_to(REPO)}")
    assert broken == [], "broken links:\n" + "\n".join(broken)


# ----------------------------------------------------------------------------------------------------- layout

LAYOUT = REPO / "docs" / "layout.md"
PACKAGES = ("keras_transformer", "common", "training", "export")
# What the repository's top level holds that is not the project's: hidden folders, and what git ignores.
NOT_PROJECT_FOLDERS = {"runs", "exports", "build", "dist", "models", "logs", "data", "__pycache__"}


def _named_modules():
    """Every `package/module.py` the module column of docs/layout.md's module table names: in full, or as
    `module.py` after a `package/...` in the same cell."""
    named, in_table = set(), False
    for line in LAYOUT.read_text(encoding="utf-8").split("\n"):
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if cells[:2] == ["step", "module"]:
            in_table = True
        if not cells or not in_table:
            in_table = in_table and bool(cells)
            continue
        package = None
        for span in re.findall(r"`([^`]+)`", cells[1]):
            full = re.fullmatch(r"(\w+)/([\w/]+\.py)", span)
            if full:
                package = full[1]
                named.add(span)
            elif package and re.fullmatch(r"\w+\.py", span):
                named.add(f"{package}/{span}")
    return named


def test_layout_names_every_module_and_folder():
    """docs/layout.md's module table names every module of the library, the training pipeline and the export
    (each package's empty __init__.py aside), and only files that exist; its folder table names every folder of
    the project."""
    named = _named_modules()
    modules = {str(p.relative_to(REPO)) for package in PACKAGES for p in (REPO / package).rglob("*.py")
               if "__pycache__" not in p.parts}
    package_markers = {f"{package}/__init__.py" for package in PACKAGES}
    assert sorted(modules - package_markers - named) == [], "modules docs/layout.md does not name"
    assert sorted(named - modules) == [], "docs/layout.md names modules that do not exist"
    text = LAYOUT.read_text(encoding="utf-8")
    folders = {p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".")
               and p.name not in NOT_PROJECT_FOLDERS and not p.name.endswith(".egg-info")}
    assert sorted(f for f in folders if f"| `{f}/` |" not in text) == [], "folders docs/layout.md does not name"
