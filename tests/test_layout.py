"""The layout's dependency rules: the library and the export never import training/, the library imports
without TensorFlow on the other backends, and nothing but the kt-train CLI imports training/train.py. And no
measured figure in the code: BENCHMARKS.md holds them, and docs/design.md the reasons."""

import ast
import json
import re
import subprocess
import sys
import tokenize

from conftest import REPO, SUBPROCESS_ENV, run_on_backend

IMPORT_ALL = r"""
import importlib, json, pkgutil, sys
import common, keras_transformer, export
for package in (common, keras_transformer, export):
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(module.name)
print(json.dumps(sorted(m for m in sys.modules if m == "training" or m.startswith("training."))))
"""


def test_library_and_export_import_nothing_from_training():
    """In a fresh interpreter, every module of common/, keras_transformer/ and export/ is imported: no training
    module comes with them."""
    proc = subprocess.run([sys.executable, "-c", IMPORT_ALL], capture_output=True, text=True, env=SUBPROCESS_ENV,
                          cwd=str(REPO), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


# The modules kt-train runs (the command, the fit, the pipeline, the data, the settings, the preparation), and
# what else the interpreter loaded with them; then kt-evaluate's, which decodes through the serving engine.
IMPORT_KT_TRAIN = r"""
import importlib, json, sys
def loaded(prefix):
    return sorted(m for m in sys.modules if m == prefix or m.startswith(prefix + "."))
importlib.import_module("common")
for name in ("run_dir", "tokenizer", "native_logs"):
    importlib.import_module("common." + name)
common = loaded("export") + loaded("training")
for name in ("train", "fit", "pipeline", "data", "config", "prepare", "prepared_corpus", "callbacks"):
    importlib.import_module("training." + name)
kt_train = loaded("export")
importlib.import_module("training.evaluate")
print(json.dumps([common, kt_train, loaded("export")]))
"""


def test_kt_train_does_not_load_the_serving_engine():
    """What training and serving share lives in common/, below both: it imports neither, and the modules
    kt-train runs import nothing from export/ (kt-evaluate does: it scores the served graph's output)."""
    proc = subprocess.run([sys.executable, "-c", IMPORT_KT_TRAIN], capture_output=True, text=True,
                          env=SUBPROCESS_ENV, cwd=str(REPO), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    common, kt_train, with_evaluate = json.loads(proc.stdout.strip().splitlines()[-1])
    assert common == [] and kt_train == []
    assert "export.translator" in with_evaluate  # the check sees export/ when it is loaded


# The library's one TensorFlow-only module: the training step for tf.distribute (`kt.UpdateStep`, loaded when used).
TENSORFLOW_ONLY = ["keras_transformer.distributed"]
IMPORT_LIBRARY = r"""
import importlib, json, pkgutil, sys
import keras, keras_transformer
assert keras.backend.backend() == sys.argv[1], keras.backend.backend()
for module in pkgutil.walk_packages(keras_transformer.__path__, "keras_transformer."):
    if module.name not in %r:
        importlib.import_module(module.name)
try:
    keras_transformer.UpdateStep
except ImportError as e:
    assert "TensorFlow backend" in str(e), e
else:
    raise AssertionError("kt.UpdateStep without TensorFlow")
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0].startswith("tensorflow"))))
""" % (TENSORFLOW_ONLY,)


def test_every_library_module_imports_on_jax_without_tensorflow(tmp_path):
    """In .venv-jax (no TensorFlow installed) under KERAS_BACKEND=jax, every module of keras_transformer/ but the
    TensorFlow-only one imports, no tensorflow module is loaded with them, and `kt.UpdateStep` says it is
    TensorFlow's."""
    stdout = run_on_backend("jax", IMPORT_LIBRARY, "jax", cwd=tmp_path, timeout=300)
    assert stdout.strip().splitlines()[-1] == "[]"


def _imported_modules(path):
    """Every module a Python file imports, as dotted names (`from a import b` gives a and a.b)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_only_the_cli_imports_training_train():
    """training/train.py is the kt-train CLI: code takes settings, callbacks and the fit from the modules that
    own them. (Tests may call the CLI's `main`, nothing else of it.)"""
    sources = [p for folder in ("keras_transformer", "common", "export", "training", "tests", "bench")
               for p in (REPO / folder).rglob("*.py") if p != REPO / "training" / "train.py"]
    assert len(sources) > 30
    importers = {}
    for path in sources:
        names = {n for n in _imported_modules(path) if n == "training.train" or n.startswith("training.train.")}
        if path.parent.name == "tests":
            names -= {"training.train", "training.train.main"}
        if names:
            importers[str(path.relative_to(REPO))] = sorted(names)
    assert importers == {}


def test_training_imports_export_only_to_decode_as_served():
    """training/ reaches export/ in two places only, both to decode as the export does: kt-evaluate
    (training/evaluate.py scores the served graph's output) and the validation BLEU of kt-train --val-bleu
    (training/callbacks.py, inside the callback). What else training and serving share lives in common/ (the
    run directory, `load_model_dir`, the tokenizer), as docs/layout.md says."""
    importers = sorted(str(path.relative_to(REPO)) for path in (REPO / "training").rglob("*.py")
                       if any(name.split(".")[0] == "export" for name in _imported_modules(path)))
    assert importers == ["training/callbacks.py", "training/evaluate.py"]


def test_the_benchmarks_import_nothing_from_the_tests():
    """bench/ stands on the project alone: no bench script imports a module of tests/ or puts tests/ on its
    path (what a benchmark and the tests share lives in bench/, e.g. bench/quick_model.py, or in the packages)."""
    test_modules = {path.stem for path in (REPO / "tests").rglob("*.py")} | {"tests"}
    found = []
    for path in sorted((REPO / "bench").glob("*.py")):
        found += [f"{path.relative_to(REPO)}: imports {name}" for name in sorted(_imported_modules(path))
                  if name.split(".")[0] in test_modules]
        found += [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
                  for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                  if "sys.path" in line and re.search(r"[\"']tests[\"'/]", line)]
    assert found == []


# A measured figure: a ratio (`2.5x`, `1.7×`, `0.84x`, `2.1-2.6x`, `5x faster`, `3-5x cheaper`, `2 times
# slower`), a duration written as a number (`40-100 s`, `2-5 s`, `8.5 ms`, `~40 us`, `100-second`), or a
# percentage that is a speed or a share of the time (`9% slower`, `8% of a step's time`).
_COMPARATIVE = r"(?:faster|slower|cheaper|dearer|quicker|longer|shorter|the\s+speed|as\s+fast)"
_RANGE = r"(?<![\w.%:#])\d+(?:\.\d+)?(?:\s*[-–]\s*\d+(?:\.\d+)?)?"  # not in a word, a hex literal or a format spec
MEASURED_FIGURE = re.compile(
    r"\d\s*×"  # any N×: the sign is a ratio (shapes here are written with x)
    r"|(?<![\w.%:#])\d+\.\d+(?:\s*[-–]\s*\d+(?:\.\d+)?)?\s?x(?!\w)"  # N.Nx, N.N-M.Mx
    r"|" + _RANGE + r"\s?x\s+" + _COMPARATIVE +  # Nx faster, N-Mx cheaper (a bare integer `4x` may be a shape)
    r"|" + _RANGE + r"\s+times\s+" + _COMPARATIVE +
    r"|" + _RANGE + r"[\s-]?(?:s|secs?|seconds?|ms|µs|us|ns|min|minutes?|hours?)\b"  # 2-5 s, 8.5 ms, 100-second
    r"|" + _RANGE + r"\s?%\s+(?:" + _COMPARATIVE + r"|of\s+(?:a|an|the|each)\s+[\w' -]*?time)")


def _prose(path):
    """(line number, text) of every comment and string literal of a Python file: docstrings and --help texts
    are string literals. The replacement fields of f-strings are blanked (newlines kept): they are code."""
    with tokenize.open(path) as f:
        tokens = list(tokenize.generate_tokens(f.readline))
    prose = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    for tok in tokens:
        if tok.type in prose:
            text = tok.string
            if tok.type == tokenize.STRING and re.match(r"(?i)[rbu]*f", text):
                text = re.sub(r"\{[^{}]*\}", lambda m: "{" + "\n" * m.group().count("\n") + "}", text)
            yield tok.start[0], text


def test_no_measured_figure_in_code():
    """No timing in code. Docstrings, comments and --help texts give the reason (what is faster or slower,
    and why) and point to docs/design.md or the BENCHMARKS.md section that holds the figure: a figure in the
    code goes stale with the next benchmark, and BENCHMARKS.md is the one place that dates it and says how it
    was run.

    The rule: in every .py file of keras_transformer/, training/ and export/, only comments and string
    literals are read, so code (`timeout=600`, `time.sleep(0.5)`) is never flagged: a number in code is a
    setting, not a claim. The replacement fields of f-strings are blanked (`f"{elapsed:.1f}s"` and
    `f"in {t:.0f} s"` print a time, they do not state one). In what is left, `MEASURED_FIGURE` flags a ratio
    (`N×`, `N.Nx`, `N.N-M.Mx`, `Nx` or `N-Mx` followed by faster/slower/cheaper..., `N times slower`), a
    duration written as a number (`N s`, `N-M s`, `N.N ms`, `N us`, `N ns`, `N-second`, minutes, hours) and a
    percentage of speed or time (`N% slower`, `N% of a step's time`). Not flagged: a bare integer `Nx`
    (`[batch, 4x...]` is a shape), `NxM`, hex (`0x1f`), format specs (`%02x`, `:.1f`), a bare `x`.
    A failure lists file:line and the line."""
    findings = []
    for folder in ("keras_transformer", "common", "training", "export"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for first_line, text in _prose(path):
                lines = text.split("\n")
                flagged = {text.count("\n", 0, m.start()) for m in MEASURED_FIGURE.finditer(text)}
                findings += [f"{path.relative_to(REPO)}:{first_line + i}: {lines[i].strip()}" for i in sorted(flagged)]
    assert findings == [], "measured figures (give the reason, point to BENCHMARKS.md):\n" + "\n".join(findings)


# Every private Keras name the project uses (keras_transformer/keras_internals.py), and `keras.src`.
KERAS_PRIVATE_API = re.compile(
    r"\._(?:query|key|value|output)_dense\b|_use_gate\b|_sliding_window\b|"  # the attention layer
    r"\._attention_axes\b|\._dropout_layer\b|\._compute_attention_mask\b|\b_compute_attention\b|"
    r"\._inverse_sqrt_key_dim\b|self\._dropout\b|"
    r"_symbolic_build\b|\._loss_tracker\b|\._initial_epoch\b|_all_reduce_sum_gradients\b|"  # the trainer
    r"\b_save_model\b|\b_load_model\b|\._(?:prev_)?(?:weights|training_metadata)_path\b|"  # BackupAndRestore
    r"\._current_epoch\b|\._last_batch_seen\b|_should_save_on_batch\b|"
    r"\bkeras\.src\b|\bkeras\s+import\s+src\b")
# One module per package that needs any: the library's (the attention, kt.UpdateStep) and kt-train's.
KERAS_INTERNALS = [REPO / "keras_transformer" / "keras_internals.py", REPO / "training" / "keras_internals.py"]


def _keras_private_api_users(paths):
    return sorted(f"{path.relative_to(REPO)}:{number}" for path in paths if path not in KERAS_INTERNALS
                  for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                  if KERAS_PRIVATE_API.search(line))


# The project's code: the packages, and the benchmarks (tests/ may reach into anything to test it).
CODE_FOLDERS = ("keras_transformer", "common", "export", "training", "bench")


def test_private_keras_api_is_used_in_one_module():
    """Private Keras API (the attention's weights, options and methods, the trainer's, the optimizer's and
    the backup callback's private state, `keras.src`) is used only in keras_transformer/keras_internals.py (the
    library's uses) and training/keras_internals.py (kt-train's), each labelled with the Keras version and
    tested use by use in tests/test_keras_internals.py; the library's
    layer, the serving engine and the benchmarks use its public `projections` and `is_plain()`, kt-train its
    functions."""
    assert _keras_private_api_users(path for folder in CODE_FOLDERS for path in (REPO / folder).rglob("*.py")) == []
    # The check sees each use where the two modules make it: the library's, then kt-train's.
    library, trainer = (path.read_text(encoding="utf-8").splitlines() for path in KERAS_INTERNALS)
    for lines, symbols in ((library, ("layer._query_dense", "_use_gate", "layer._dropout_layer",
                                      "layer._compute_attention_mask", "def _compute_attention",
                                      "model._maybe_symbolic_build", "optimizer._all_reduce_sum_gradients",
                                      "model._loss_tracker")),
                           (trainer, ("model._initial_epoch", "self._weights_path", "self._prev_weights_path",
                                      "self._training_metadata_path", "self._current_epoch",
                                      "self._last_batch_seen", "def _save_model"))):
        for symbol in symbols:
            assert any(symbol in line and KERAS_PRIVATE_API.search(line) for line in lines), symbol


def _private_imports_from_the_library(path, packages=("keras_transformer",)):
    """`module.name` for each `_`-prefixed name that the file at `path` imports from `packages` (by default the
    library, `keras_transformer`), or reads as an attribute of a module of theirs it imports."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found, library_modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in packages:
            found += [f"{node.module}.{alias.name}" for alias in node.names if alias.name.startswith("_")]
            library_modules |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            library_modules |= {(alias.asname or alias.name).split(".")[0] for alias in node.names
                                if alias.name.split(".")[0] in packages}
    found += [f"{node.value.id}.{node.attr}" for node in ast.walk(tree)
              if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id in library_modules and node.attr.startswith("_") and not node.attr.startswith("__")]
    return found


def test_the_serving_engine_and_the_benchmarks_import_no_private_name(tmp_path):
    """`export/` reaches the library through its public names only (the strategies, `SearchOps`,
    the layers' `projections`), as CTranslate2 never imports its trainer's internals; `bench/` reaches the
    library, training/, export/ and common/ through theirs, as a user's script would."""
    private = {f"{path.relative_to(REPO)}: {name}" for path in sorted((REPO / "export").rglob("*.py"))
               for name in _private_imports_from_the_library(path)}
    private |= {f"{path.relative_to(REPO)}: {name}" for path in sorted((REPO / "bench").rglob("*.py"))
                for name in _private_imports_from_the_library(path, ("keras_transformer", "training", "export",
                                                                     "common", "bench"))}
    assert private == set()
    # The check itself sees such an import.
    probe = tmp_path / "probe.py"
    probe.write_text("from keras_transformer.decoding import _no_gradient\nfrom keras_transformer import decoding\n"
                     "decoding._prepare\n")
    assert _private_imports_from_the_library(probe) == ["keras_transformer.decoding._no_gradient", "decoding._prepare"]
    probe.write_text("from export.search import _run\nfrom keras_transformer import decoding\n")
    assert _private_imports_from_the_library(probe, ("keras_transformer", "export")) == ["export.search._run"]


# TensorFlow's private API: its `tensorflow.python` package, however it is imported or reached.
TF_PRIVATE_API = re.compile(r"\btensorflow\.python\b|\bfrom\s+tensorflow\s+import\s+python\b|\btf\.python\b")
TF_INTERNALS = REPO / "export" / "tf_internals.py"


def test_private_tensorflow_api_is_used_in_one_module():
    """TensorFlow's private API (`tensorflow.python`) is used only in export/tf_internals.py, which says what
    each use is for and to check them when TensorFlow is upgraded; everything else, the benchmarks too, calls
    its functions. A failure lists file:line."""
    users = sorted(f"{path.relative_to(REPO)}:{number}" for folder in CODE_FOLDERS
                   for path in (REPO / folder).rglob("*.py") if path != TF_INTERNALS
                   for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                   if TF_PRIVATE_API.search(line))
    assert users == []
    # The check sees each use where tf_internals.py makes it.
    assert sum(bool(TF_PRIVATE_API.search(line)) for line in TF_INTERNALS.read_text(encoding="utf-8").splitlines()
               if line.lstrip().startswith(("import ", "from "))) == 2
