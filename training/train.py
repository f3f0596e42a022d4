"""kt-train: the command line of a training run (settings: training.config; the fit: training.fit).

    kt-train --config configs/multi30k.json --source-lang en --target-lang de --model-dir runs/en-de
    python -m training.train --preset small --data-dir ../shared/data/multi30k --model-dir runs/en-de

Run it again with the same command to resume a killed run from its last backup.
"""

from __future__ import annotations

import logging
import os
import sys

# Before TensorFlow is imported (by training.fit): keep its C++ INFO lines out of the terminal.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from training.config import resolve_config  # noqa: E402
from training.errors import ConfigError, DataError  # noqa: E402
from training.fit import train  # noqa: E402


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = resolve_config(argv)
    try:
        summary = train(cfg)
    except (DataError, ConfigError) as e:
        print(f"kt-train: error: {e}", file=sys.stderr)
        return 2
    return 1 if summary.get("nan_loss") else 0


if __name__ == "__main__":
    sys.exit(main())
