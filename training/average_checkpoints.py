"""Average the weights of the last N checkpoints into one model (the paper
averaged the last 5 checkpoints for its base models, the last 20 for its big
ones), or of the N best epoch checkpoints by a validation score that kt-train
recorded in history.csv.

    python -m training.average_checkpoints --model-dir runs/en-de --last 5
    python -m training.average_checkpoints --model-dir runs/en-de --best 5              # lowest val_loss
    python -m training.average_checkpoints --model-dir runs/en-de --best 5 --by val_bleu  # kt-train --val-bleu

Reads MODEL_DIR/checkpoints/epoch-NNN.weights.h5 (written by training.train),
or, from a run by updates (kt-train --checkpoint-every), its
update-NNNNNNN.weights.h5 in update order; --best ranks epoch checkpoints only,
writes MODEL_DIR/averaged.keras (evaluate it with
`python -m training.evaluate --model-dir runs/en-de --model-file runs/en-de/averaged.keras`).
It also works while kt-train is still running, or after a run was stopped before it wrote model.keras: the
model is then built from the architecture that config.json records.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from common.native_logs import VERBOSE_HELP, quiet_import_for_commands

# Before TensorFlow is imported: a command prints none of its C++ start-up lines (see common/native_logs.py).
quiet_import_for_commands(__name__)

import numpy as np  # noqa: E402

import keras_transformer  # noqa: E402  (also registers the serializable classes model.keras needs)
from common.run_dir import (CHECKPOINT_DIR, DEFAULT_AVERAGE_LAST, epoch_checkpoints, load_or_build_model,  # noqa: E402
                            read_config_or_exit, recorded_setting, update_checkpoints)
def list_checkpoints(model_dir) -> list[Path]:
    """A run by updates' checkpoints in update order, else the epoch checkpoints in epoch order."""
    return [path for _, path in update_checkpoints(model_dir) or epoch_checkpoints(model_dir)]


# For each score, whether a higher value is better.
SCORES = {"val_loss": False, "val_bleu": True}
HISTORY_FILENAME = "history.csv"


def epoch_scores(model_dir, by: str = "val_loss") -> dict[int, float]:
    """{epoch (1-based, as the checkpoint names count): score} from MODEL_DIR/history.csv.

    A resumed run appends to the file; where an epoch has several rows, the last
    one counts. Raises `ValueError` when the file or the column is missing.
    """
    path = Path(model_dir) / HISTORY_FILENAME
    if not path.is_file():
        raise ValueError(f"{path} not found: kt-train writes it; --best needs it")
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if not rows or by not in rows[0] or not any(row.get(by) for row in rows):
        hint = " (train with kt-train --val-bleu to record it)" if by == "val_bleu" else " (train with validation data)"
        raise ValueError(f"{path} has no {by} column{hint}")
    return {int(row["epoch"]) + 1: float(row[by]) for row in rows if row.get(by)}


def best_checkpoints(model_dir, n: int, by: str = "val_loss") -> list[tuple[Path, float]]:
    """The `n` epoch checkpoints with the best `by` score (`SCORES`), best first, with their scores."""
    if by not in SCORES:
        raise ValueError(f"unknown score {by!r}; one of {sorted(SCORES)}")
    scores = epoch_scores(model_dir, by)
    scored = [(path, scores[epoch]) for epoch, path in epoch_checkpoints(model_dir) if epoch in scores]
    scored.sort(key=lambda item: -item[1] if SCORES[by] else item[1])
    return scored[:n]


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kt-average-checkpoints", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    choice = p.add_mutually_exclusive_group()
    choice.add_argument("--last", type=int, help="average the last N checkpoints (default: the N that "
                        f"kt-train --average-last recorded in config.json, else {DEFAULT_AVERAGE_LAST})")
    choice.add_argument("--best", type=int, metavar="N",
                        help="average the N epoch checkpoints with the best validation score instead (see --by)")
    p.add_argument("--by", choices=sorted(SCORES), default="val_loss",
                   help="the score --best ranks by, from history.csv: val_loss (lowest; default) or val_bleu "
                   "(highest; recorded by kt-train --val-bleu)")
    p.add_argument("--output", help="output .keras file (default MODEL_DIR/averaged.keras)")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    cfg = read_config_or_exit(args.model_dir, "kt-average-checkpoints")
    args.last = recorded_setting(cfg, "average_last", args.last, DEFAULT_AVERAGE_LAST)
    checkpoints = list_checkpoints(args.model_dir)
    if not checkpoints:
        print(f"kt-average-checkpoints: error: no checkpoints in {Path(args.model_dir) / CHECKPOINT_DIR}",
              file=sys.stderr)
        return 2
    if args.best is not None and update_checkpoints(args.model_dir):
        print("kt-average-checkpoints: error: --best ranks epoch checkpoints by history.csv's rows; this run wrote "
              "checkpoints by updates (kt-train --checkpoint-every): average the last N with --last N",
              file=sys.stderr)
        return 2
    wanted = args.best if args.best is not None else args.last
    if wanted < 1:
        print(f"kt-average-checkpoints: error: {'--best' if args.best is not None else '--last'} must be at least 1",
              file=sys.stderr)
        return 2
    if args.best is not None:
        try:
            ranked = best_checkpoints(args.model_dir, args.best, args.by)
        except ValueError as e:
            print(f"kt-average-checkpoints: error: {e}", file=sys.stderr)
            return 2
        chosen = [path for path, _ in ranked]
        if not chosen:
            print(f"kt-average-checkpoints: error: no epoch checkpoint has a {args.by} in history.csv",
                  file=sys.stderr)
            return 2
        print(f"The {len(chosen)} best by {args.by}: "
              + ", ".join(f"{path.name} ({score:.4g})" for path, score in ranked))
    else:
        chosen = checkpoints[-args.last:]
    if len(chosen) < wanted:
        print(f"Only {len(chosen)} checkpoint(s) available; averaging those.")
    try:
        model = load_or_build_model(args.model_dir, cfg)
    except FileNotFoundError as e:
        print(f"kt-average-checkpoints: error: {e}", file=sys.stderr)
        return 2
    average_weights(model, chosen)
    out = Path(args.output) if args.output else Path(args.model_dir) / "averaged.keras"
    model.save(out)
    print(f"Averaged {len(chosen)} checkpoint(s): {', '.join(p.name for p in chosen)} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
