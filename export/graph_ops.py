"""The ops of a SavedModel, and a check that TF Serving's model server has them.

The stock `tensorflow_model_server` links TensorFlow's core ops and
tensorflow-text's ops (`@org_tensorflow_text//tensorflow_text:ops_lib`).
Anything else (ops from other pip packages, Python callbacks) makes TF Serving
fail to load the model with "Op type not registered"; Python callbacks
(`tf.py_function`) cannot run there, and XLA ops (`Xla*`, e.g. the
`XlaDynamicUpdateSlice` of Keras 3's `slice_update`) fail at run time unless
the server was started with `--xla_cpu_compilation_enabled`.

    python -m export.graph_ops SAVED_MODEL_DIR     # prints the ops, exit 1 if any is not servable
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

# Registered in core TensorFlow, but they call back into Python: no model server can run them.
PYTHON_OPS = frozenset({"PyFunc", "PyFuncStateless", "EagerPyFunc"})


def needs_xla(op: str) -> bool:
    """XLA ops (tf2xla's `Xla*`): outside XLA TensorFlow compiles them on demand, which
    `tensorflow_model_server` refuses unless started with `--xla_cpu_compilation_enabled`."""
    return op.startswith(("Xla", "_Xla"))

# Run in a fresh process: tensorflow alone (with export.tf_internals, which imports nothing else), then
# tensorflow_text.
_REGISTERED_OPS_SCRIPT = r"""
import json, sys
from export.tf_internals import registered_op_names

core = registered_op_names()
import tensorflow_text  # noqa: F401  (registers its ops)
text = sorted(set(registered_op_names()) - set(core))
json.dump({"core": core, "tensorflow_text": text}, sys.stdout)
"""
# The directory that holds export/, for that process.
_PROJECT = str(Path(__file__).resolve().parents[1])


def saved_model_ops(path) -> dict:
    """{op type: count} over every graph node and every function of the SavedModel's function library.

    Calls to library functions (a node whose op is a function name) are not ops and are left out.
    """
    from tensorflow.core.protobuf import saved_model_pb2

    sm = saved_model_pb2.SavedModel()
    sm.ParseFromString((Path(path) / "saved_model.pb").read_bytes())
    counts: dict[str, int] = {}
    for meta_graph in sm.meta_graphs:
        graph = meta_graph.graph_def
        functions = {f.signature.name for f in graph.library.function}
        nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
        for node in nodes:
            if node.op not in functions:
                counts[node.op] = counts.get(node.op, 0) + 1
    return counts


def registered_ops(python=sys.executable) -> dict:
    """Op names registered by core TensorFlow and by tensorflow-text, from a fresh process that
    imports only tensorflow, then tensorflow_text: {"core": [...], "tensorflow_text": [...]}. That process
    runs once per `python` in a process (the packages a given interpreter imports do not change while it runs);
    each call gets its own lists."""
    return json.loads(_registered_ops_json(python))


@functools.lru_cache(maxsize=None)
def _registered_ops_json(python: str) -> str:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
           "PYTHONPATH": os.pathsep.join(filter(None, [_PROJECT, os.environ.get("PYTHONPATH")]))}
    return subprocess.run([python, "-c", _REGISTERED_OPS_SCRIPT], capture_output=True, text=True, env=env,
                          check=True, cwd="/").stdout


def unservable_ops(ops, registered, allow_xla=False) -> list[str]:
    """Ops of `ops` that are neither core TensorFlow nor tensorflow-text, or that need Python, or XLA
    unless `allow_xla` (an export with an XLA decoder, served with `--xla_cpu_compilation_enabled`)."""
    allowed = set(registered["core"]) | set(registered["tensorflow_text"])
    return sorted(op for op in ops
                  if op not in allowed or op in PYTHON_OPS or (needs_xla(op) and not allow_xla))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m export.graph_ops", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("saved_model", help="a SavedModel directory (EXPORT_DIR/NAME/VERSION)")
    p.add_argument("--allow-xla", action="store_true", help="XLA ops are fine: the model server runs with "
                   "--xla_cpu_compilation_enabled (an export made with kt-export --xla-max-batch)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    ops = saved_model_ops(args.saved_model)
    registered = registered_ops()
    text_ops = set(registered["tensorflow_text"])
    for op in sorted(ops):
        origin = "tensorflow_text" if op in text_ops else ("core" if op in registered["core"] else "UNKNOWN")
        if needs_xla(op) or op in PYTHON_OPS:
            origin += ", NOT SERVABLE (" + ("XLA" if needs_xla(op) else "Python") + ")"
        print(f"{op:40s} {ops[op]:6d}  {origin}")
    bad = unservable_ops(ops, registered, allow_xla=args.allow_xla)
    if bad:
        print(f"Not servable by tensorflow_model_server: {', '.join(bad)}", file=sys.stderr)
        return 1
    xla = sorted(op for op in ops if needs_xla(op))
    print(f"{len(ops)} op types, all core TensorFlow or tensorflow-text (no Python" +
          (f"; XLA: {', '.join(xla)}, run with --xla_cpu_compilation_enabled)." if xla else ", no XLA)."))
    return 0


if __name__ == "__main__":
    sys.exit(main())
