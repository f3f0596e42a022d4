"""Average the weights of the last N epoch checkpoints into one model (the paper
averaged the last 5 checkpoints for its base models).

    python -m training.average_checkpoints --model-dir runs/en-de --last 5

Reads MODEL_DIR/checkpoints/epoch-NNN.weights.h5 (written by training.train),
writes MODEL_DIR/averaged.keras (evaluate it with
`python -m training.evaluate --model-dir runs/en-de --model-file runs/en-de/averaged.keras`).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from export.native_logs import VERBOSE_HELP, quiet_import_for_commands

# Before TensorFlow is imported: a command prints none of its C++ start-up lines (see export/native_logs.py).
quiet_import_for_commands(__name__)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_transformer  # noqa: F401  (registers the serializable classes model.keras needs)
from export.translator import MODEL_FILENAME, read_config  # noqa: E402
from training.config import CHECKPOINT_DIR  # noqa: E402

_EPOCH = re.compile(r"epoch-(\d+)\.weights\.h5$")


def list_checkpoints(model_dir) -> list[Path]:
    """Epoch checkpoints in epoch order."""
    d = Path(model_dir) / CHECKPOINT_DIR
    found = [(int(m.group(1)), p) for p in d.glob("epoch-*.weights.h5") if (m := _EPOCH.search(p.name))]
    return [p for _, p in sorted(found)]


def average_weights(model, checkpoint_paths) -> None:
    """Loads each checkpoint into `model` and leaves the element-wise mean of all
    model weights (float32 accumulation) in it."""
    if not checkpoint_paths:
        raise ValueError("No checkpoints to average")
    total = None
    for path in checkpoint_paths:
        model.load_weights(path)
        values = [np.asarray(w, dtype=np.float64) for w in model.get_weights()]
        total = values if total is None else [t + v for t, v in zip(total, values)]
    model.set_weights([t / len(checkpoint_paths) for t in total])


def main(argv=None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    p = argparse.ArgumentParser(prog="kt-average-checkpoints", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--last", type=int, default=5, help="average the last N epoch checkpoints (default 5)")
    p.add_argument("--output", help="output .keras file (default MODEL_DIR/averaged.keras)")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    args = p.parse_args(argv)

    try:
        cfg = read_config(args.model_dir)
    except FileNotFoundError as e:
        print(f"kt-average-checkpoints: error: {e}", file=sys.stderr)
        return 2
    checkpoints = list_checkpoints(args.model_dir)
    if not checkpoints:
        print(f"kt-average-checkpoints: error: no epoch checkpoints in {Path(args.model_dir) / CHECKPOINT_DIR}",
              file=sys.stderr)
        return 2
    chosen = checkpoints[-args.last:]
    if len(chosen) < args.last:
        print(f"Only {len(chosen)} checkpoint(s) available; averaging those.")
    model = keras.models.load_model(Path(args.model_dir) / cfg.get("model_file", MODEL_FILENAME), compile=False)
    average_weights(model, chosen)
    out = Path(args.output) if args.output else Path(args.model_dir) / "averaged.keras"
    model.save(out)
    print(f"Averaged {len(chosen)} checkpoint(s): {', '.join(p.name for p in chosen)} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
