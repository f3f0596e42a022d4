"""The layout's dependency rules: the library and the export never import training/, the library imports
without TensorFlow on the other backends, and nothing but the kt-train CLI imports training/train.py."""

import ast
import subprocess
import sys

from conftest import REPO, SUBPROCESS_ENV, run_on_backend

IMPORT_ALL = r"""
import importlib, json, pkgutil, sys
import keras_transformer, export
for package in (keras_transformer, export):
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(module.name)
print(json.dumps(sorted(m for m in sys.modules if m == "training" or m.startswith("training."))))
"""


def test_library_and_export_import_nothing_from_training():
    """In a fresh interpreter, every module of keras_transformer/ and export/ is imported: no training module
    comes with them."""
    proc = subprocess.run([sys.executable, "-c", IMPORT_ALL], capture_output=True, text=True, env=SUBPROCESS_ENV,
                          cwd=str(REPO), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


IMPORT_LIBRARY = r"""
import importlib, json, pkgutil, sys
import keras, keras_transformer
assert keras.backend.backend() == sys.argv[1], keras.backend.backend()
for module in pkgutil.walk_packages(keras_transformer.__path__, "keras_transformer."):
    importlib.import_module(module.name)
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0].startswith("tensorflow"))))
"""


def test_every_library_module_imports_on_jax_without_tensorflow(tmp_path):
    """In .venv-jax (no TensorFlow installed) under KERAS_BACKEND=jax, every module of keras_transformer/ imports,
    and no tensorflow module is loaded with them."""
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
    sources = [p for folder in ("keras_transformer", "export", "training", "tests", "bench")
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
