"""kt-train: the command line of a training run (settings: training.config; the fit: training.fit).

    kt-train --config configs/multi30k.json --source-lang en --target-lang de --model-dir runs/en-de
    python -m training.train --preset small --data-dir ../shared/data/multi30k --model-dir runs/en-de

Run it again with the same command to resume a killed run from its last backup.
"""

from __future__ import annotations

import logging
import os
import sys

from common.native_logs import quiet_import_for_commands, wants_logs
from training import ONEDNN_ENV

# TensorFlow (since 2.9) turns its oneDNN kernels on by default only on CPUs with AVX512_VNNI, AVX512_BF16
# or AMX; on an AVX2-only CPU it then trains on its Eigen kernels, much slower (docs/design.md, "Training precision
# and oneDNN, from the CPU").
# It reads the variable once, when it loads. A value the user set wins (0 turns oneDNN off).
os.environ.setdefault(ONEDNN_ENV, "1")
# Before TensorFlow is imported: as a command, its C++ log lines stay out of the terminal (common/native_logs.py).
quiet_import_for_commands(__name__)

from training.config import build_parser, resolve_settings  # noqa: E402,F401  (build_parser: kt-train's parser)
from training.errors import BackupError, ConfigError, DataError  # noqa: E402
from training.fit import train  # noqa: E402


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    verbose = wants_logs(argv)
    # kt-train's progress is its own `[kt-train]` lines; Python logging brings warnings (a byte-order mark
    # removed, another process preparing the dataset), and with --verbose also INFO: the strategy's devices,
    # and TFDS' absl lines ("Load dataset info", ...).
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = resolve_settings(argv)
    try:
        summary = train(settings)
    except (DataError, ConfigError, BackupError) as e:
        print(f"kt-train: error: {e}", file=sys.stderr)
        return 2
    return 1 if summary.get("nan_loss") else 0


if __name__ == "__main__":
    sys.exit(main())
