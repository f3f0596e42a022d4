"""Idle gaps in a `kt-train` run: seconds per epoch, and how long the process sat at zero CPU (not a test).

Runs `python -m training.train ARGS...` in a subprocess, samples its CPU time
every `--interval` seconds from /proc (Linux), and reports each epoch's time
(from Keras' one-line-per-epoch log) and every stretch of at least `--min-gap`
seconds in which the process used no CPU at all. A training process on a busy
input pipeline never sits idle; such gaps are waits.

What it found: Keras makes a new tf.data iterator every epoch and at every
validation and deletes the old one, and deleting an iterator waited for the
next wake-up of a tf.data autotuning thread, up to a minute once the iterator
was old: 40-100 s in most 100-second Multi30k epochs. `kt-train` now turns
tf.data autotuning off for its batches (training/pipeline.py) and runs on one
device under TensorFlow's default strategy, not `MirroredStrategy`, whose
`MultiDeviceIterator` keeps autotuning threads of its own
(training/distribute.py).

    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python bench/epoch_stalls.py -- \\
        --config configs/multi30k.json --epochs 4 --model-dir runs/bench/stalls
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process, in seconds; None once it has gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--interval", type=float, default=1.0, help="seconds between CPU samples")
    p.add_argument("--min-gap", type=float, default=5.0, help="report idle stretches at least this long")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then kt-train's arguments")
    args = p.parse_args(argv)
    train_args = [a for a in args.train_args if a != "--"]

    cmd = [sys.executable, "-m", "training.train", "--verbose", "2", *train_args]
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"epoch_stalls_{os.getpid()}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        gaps, idle_since, last = [], None, cpu_seconds(proc.pid)
        t_start = time.time()
        while proc.poll() is None:
            time.sleep(args.interval)
            now, cpu = time.time(), cpu_seconds(proc.pid)
            if cpu is None or last is None:
                break
            if cpu - last == 0.0:
                idle_since = idle_since or now - args.interval
            elif idle_since is not None:
                if now - args.interval - idle_since >= args.min_gap:
                    gaps.append({"at_s": round(idle_since - t_start), "seconds": round(now - args.interval - idle_since)})
                idle_since = None
            last = cpu
        proc.wait()
    text = log_path.read_text()
    epochs = [int(s) for s in re.findall(r"^\d+/\d+ - (\d+)s - ", text, flags=re.M)]
    result = {"command": " ".join(cmd), "returncode": proc.returncode, "epoch_seconds": epochs,
              "idle_gaps": gaps, "idle_seconds": sum(g["seconds"] for g in gaps), "log": str(log_path)}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
