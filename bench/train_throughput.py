"""Training throughput (target tokens per second) of `model.fit` on this machine.

    .venv/bin/python bench/train_throughput.py                 # small + base, fp32 + mixed_bfloat16, 1 + 2 replicas
    .venv/bin/python bench/train_throughput.py --presets small --steps 10
    .venv/bin/python bench/train_throughput.py --configs configs/multi30k.json my-recipe.json \
        --precisions fp32 --replica-counts 1 --rounds 3          # two recipes' models, alternating
    .venv/bin/python bench/train_throughput.py --configs configs/multi30k-best.json --precisions bf16 \
        --replica-counts 1 --r-drop 0 5 --rounds 3                # what R-Drop costs an update

Each configuration runs in its own subprocess (logical CPU devices and the
dtype policy must be set before TensorFlow initializes). The model is built and
compiled by kt-train's own `training.fit.build_and_compile` (paper Adam, label
smoothing 0.1) under `MirroredStrategy` over `--replicas` logical CPU devices
(kt-train itself uses TensorFlow's default strategy on one device; the step
is the same, and the iterator-deletion stall that choice avoids falls between
epochs, outside the timed steps) and trained with `model.fit` on synthetic batches of a fixed
shape: `--tokens-per-batch` tokens per side, sentences of `--length` tokens, no
padding, vocabulary 8000. After `--warmup` steps, each step is timed (the loss
is read back every step, so steps do not overlap) and the median is reported.
Two replicas = two logical CPU devices sharing the same cores.

`--configs` measures the models of kt-train config files instead of presets
(their "preset", "model" overrides, "vocab_size" and "tokens_per_batch"), to
compare what an epoch of one recipe costs against another's; `--rounds N`
alternates all configurations N times, as this machine's speed drifts.

`--r-drop WEIGHT ...` measures each configuration with kt-train's `--r-drop WEIGHT` (0: off): R-Drop's loss,
and every sentence twice in its batch, as `make_batches(copies=2)` makes them. The token budget counts
each pair once (as kt-train's does), so target tokens per second count the sentences learned from, and the
ratio of two median steps is what R-Drop costs an update.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from training import ONEDNN_ENV  # noqa: E402  (imports no TensorFlow)


# What caps PyTorch's own kernels and MKL's at AVX2, beside oneDNN's ONEDNN_MAX_CPU_ISA (worker_env).
AVX2_CAP = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def worker_env() -> dict:
    """The environment of every benchmark worker: TensorFlow's INFO lines off, no TF_CONFIG, and
    TensorFlow's oneDNN kernels on, as kt-train runs (training/train.py), for the peers
    on TensorFlow too; `TF_ENABLE_ONEDNN_OPTS=0` in the caller's environment measures without them.

    `ONEDNN_MAX_CPU_ISA=AVX2` (the stand-in for an AVX2-only CPU) caps every library's kernels, not only
    oneDNN's: PyTorch's own (`ATEN_CPU_CAPABILITY=avx2`) and MKL's, which computes PyTorch's float32
    products on x86 and would otherwise keep using AVX-512 on an Intel CPU (docs/benchmarks-log.md, "On an Intel
    Xeon with AMX")."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    env.setdefault(ONEDNN_ENV, "1")
    if env.get("ONEDNN_MAX_CPU_ISA", "").upper() == "AVX2":
        for name, value in AVX2_CAP.items():
            env.setdefault(name, value)
    return env


def run_worker(cmd, env, label, cwd=REPO):
    """Runs one configuration in its own process (in `cwd`); `(its RESULT line as a dict or None, seconds)`.

    On failure the worker's stderr is printed and the result is None.
    """
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        print(f"{label}: FAILED\n{proc.stderr[-3000:]}", file=sys.stderr, flush=True)
        return None, time.time() - t0
    return json.loads(lines[-1][len("RESULT "):]), time.time() - t0


def timed_fit(model, ds, warmup: int, steps: int) -> list:
    """`model.fit` for `warmup` + `steps` steps; the seconds of each of the last `steps`.

    The loss is read back at the end of every step, so steps do not overlap.
    """
    import keras

    times = []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, step, logs=None):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, step, logs=None):
            float(logs["loss"])  # wait for the step to finish
            times.append(time.perf_counter() - self.t0)

    model.fit(ds, epochs=1, steps_per_epoch=warmup + steps, verbose=0, callbacks=[Timer()])
    return times[warmup:]


def worker(args) -> dict:
    from training.distribute import split_cpu

    if args.replicas > 1:
        split_cpu(args.replicas)
    import keras
    import numpy as np
    import tensorflow as tf

    from training.config import TrainSettings, default
    from training.fit import build_and_compile

    policy = "mixed_bfloat16" if args.precision == "bf16" else "float32"
    keras.mixed_precision.set_global_policy(policy)
    cpus = [d.name for d in tf.config.list_logical_devices("CPU")][: args.replicas]
    strategy = tf.distribute.MirroredStrategy(cpus)
    recipe = recipe_settings(args.config_file) if args.config_file else {}
    settings = TrainSettings(**{"preset": args.preset or default("preset"), **recipe,
                                "r_drop": args.r_drop_weight or None})
    with strategy.scope():
        model = build_and_compile(settings, args.vocab_size)
    batch = args.tokens_per_batch // args.length
    batch -= batch % args.replicas
    rng = np.random.default_rng(0)
    src = rng.integers(4, args.vocab_size, size=(batch, args.length), dtype=np.int32)
    tgt = rng.integers(4, args.vocab_size, size=(batch, args.length + 1), dtype=np.int32)
    if settings.r_drop:
        src, tgt = np.repeat(src, 2, axis=0), np.repeat(tgt, 2, axis=0)  # rows 2i, 2i + 1: one pair
    ds = tf.data.Dataset.from_tensors(((src, tgt[:, :-1]), tgt[:, 1:])).repeat()

    timed = timed_fit(model, ds, args.warmup, args.steps)
    median = statistics.median(timed)
    target_tokens = batch * args.length
    return {
        "preset": args.config_file or args.preset, "precision": policy, "replicas": args.replicas,
        "r_drop": args.r_drop_weight,
        "batch": f"{len(src)}x{args.length}", "target_tokens_per_step": target_tokens,
        "median_step_s": round(median, 4), "target_tokens_per_s": round(target_tokens / median, 1),
        "steps_timed": len(timed), "params": model.count_params(),
    }


def recipe_settings(path) -> dict:
    """The settings of a kt-train config file that shape a training step: preset, model overrides, vocabulary,
    batch, clipping, accumulation and Adam's epsilon."""
    cfg = json.loads(Path(path).read_text())
    return {k: cfg[k] for k in ("preset", "model", "vocab_size", "tokens_per_batch", "global_clipnorm", "grad_accum",
                                "adam_epsilon") if k in cfg}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["small", "base"])
    p.add_argument("--configs", nargs="+", metavar="JSON",
                   help="kt-train config files to measure instead of --presets (their model, vocabulary and batch)")
    p.add_argument("--rounds", type=int, default=1, help="run every configuration this many times, alternating")
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--replica-counts", nargs="+", type=int, default=[1, 2])
    p.add_argument("--tokens-per-batch", type=int, default=4096)
    p.add_argument("--length", type=int, default=32, help="tokens per sentence (source and target)")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (default 3 small, 2 base/big)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10 small, 4 base/big)")
    p.add_argument("--r-drop", nargs="+", type=float, default=[0.0], metavar="WEIGHT",
                   help="measure with kt-train's --r-drop WEIGHT too (0: off; default: 0 only)")
    p.add_argument("--json", help="also write the results here")
    # internal: one configuration
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--preset", help=argparse.SUPPRESS)
    p.add_argument("--precision", help=argparse.SUPPRESS)
    p.add_argument("--replicas", type=int, help=argparse.SUPPRESS)
    p.add_argument("--config-file", help=argparse.SUPPRESS)
    p.add_argument("--r-drop-weight", type=float, default=0.0, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0

    env = worker_env()
    results = []
    t_start = time.time()
    # (the worker's flag naming the model, its value, the settings it brings)
    models = [("--config-file", path, recipe_settings(path)) for path in args.configs or []] or \
        [("--preset", preset, {"preset": preset}) for preset in args.presets]
    for round_ in range(1, args.rounds + 1):
        for model_flag, name, settings in models:
            heavy = settings.get("preset") in ("base", "big")
            warmup = args.warmup if args.warmup is not None else (2 if heavy else 3)
            steps = args.steps if args.steps is not None else (4 if heavy else 10)
            vocab_size = settings.get("vocab_size", args.vocab_size)
            tokens_per_batch = settings.get("tokens_per_batch", args.tokens_per_batch)
            for precision, replicas, weight in itertools.product(args.precisions, args.replica_counts, args.r_drop):
                cmd = [sys.executable, __file__, "--worker", model_flag, name, "--precision", precision,
                       "--replicas", str(replicas), "--warmup", str(warmup), "--steps", str(steps),
                       "--tokens-per-batch", str(tokens_per_batch), "--length", str(args.length),
                       "--vocab-size", str(vocab_size), "--r-drop-weight", str(weight)]
                r, seconds = run_worker(cmd, env, f"{name} {precision} x{replicas} r-drop {weight:g}")
                if r is None:
                    continue
                r.update(wall_s=round(seconds, 1), round=round_)
                results.append(r)
                print(f"round {round_}  {name:5s} {r['precision']:14s} replicas={replicas} r-drop={weight:g}  "
                      f"{r['target_tokens_per_s']:9.1f} target tok/s  (median step {r['median_step_s']:.3f}s, "
                      f"batch {r['batch']}, {r['wall_s']}s wall)", flush=True)

    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}; "
          f"total {time.time() - t_start:.0f}s\n")
    print("| round | model | precision | replicas | R-Drop weight | parameters | batch (sentences x tokens) "
          "| median step (s) | target tokens/s |")
    print("|---|---|---|---|---|---:|---|---|---|")
    for r in results:
        print(f"| {r['round']} | {r['preset']} | {r['precision']} | {r['replicas']} | {r['r_drop']:g} "
              f"| {r['params']:,} | {r['batch']} | {r['median_step_s']:.3f} | {r['target_tokens_per_s']:,.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
