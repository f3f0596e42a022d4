"""Where the time of one training step goes: TensorFlow-profiler op breakdown, ours vs keras-hub.

    nice -n 19 .venv-bench/bin/python bench/profile_train_step.py                       # small, fp32 + bf16, both models
    nice -n 19 .venv-bench/bin/python bench/profile_train_step.py --frameworks ours \\
        --presets base --precisions bf16 --steps 2 --top 40
    .venv/bin/python bench/profile_train_step.py --from-json /tmp/profile.json            # re-print saved results
    nice -n 19 .venv/bin/python /path/to/modified/copy/bench/profile_train_step.py \\
        --frameworks ours --tag " (modified)"                    # a modified copy of the repo: its keras_transformer

(`.venv` is enough with `--frameworks ours`; keras-hub needs `.venv-bench`.)

Each (framework, preset, precision) runs in its own subprocess, built exactly
as bench/peers_throughput.py builds it (ours: `training.fit.build_and_compile`;
keras-hub: `peers_throughput.keras_hub_model` + the same compile step), under a
one-device MirroredStrategy, on the same synthetic batch (128 x 32 tokens per
side, vocabulary 8000, no padding). After `--warmup` untimed `model.fit` steps
it traces `--steps` more with `tf.profiler.experimental.start/stop` and turns
the trace (`*.xplane.pb`, parsed with `tensorflow.tsl.profiler.protobuf.xplane_pb2`,
no TensorBoard needed) into per-op self times. It prints, per configuration:

- the top `--top` ops by self time (ms per step, % of the summed op time);
- the share of each category (`CATEGORIES` below: output projection, Q/K/V/O
  projections, attention, feed-forward matmuls, softmax, layer norm, dropout,
  loss, metric, casts, transposes, optimizer, masks, ...), matched on op type
  and on the op's name scope, first rule wins;
- the median step time of an untraced run of `--steps` more steps.

Op self times are summed over the executor's threads, so with inter-op
parallelism their sum can exceed the step time: read the shares, not the
absolute sum. The machine is shared: compare configurations run back-to-back.
`--json` saves every op row so that `--from-json` re-categorizes without re-running.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from train_throughput import run_worker, worker_env  # noqa: E402

# (category, op-type regex or None, op-name regex or None); the first rule whose
# given patterns all match (type: fullmatch, name: search) wins. Names are the
# ops' name scopes in the traced train function, e.g.
# StatefulPartitionedCall/gradient_tape/transformer_1/decoder_1/layer_0_1/cross_attention_1/query_1/MatMul/Sum_1.
MATMUL_TYPES = r"_?(Mkl)?(Native)?(Fused)?(Batch)?MatMul(V2|V3)?|_?(Mkl)?Einsum|Conv.*"
BATCHED_MATMUL_TYPES = r"_?(Mkl)?(Native)?(Fused)?BatchMatMul(V2|V3)?|_?(Mkl)?Einsum"
TOP = r"^(StatefulPartitionedCall/)?(gradient_tape/)?[^/]*(transformer|functional)[^/]*/"
QKVO = r"attention[^/]*/(query|key|value|attention_output)[^/]*/"
CATEGORIES = [
    ("input pipeline", r"Dataset|IteratorGetNext.*|MultiDeviceIterator.*|_Send|_Recv", None),
    ("optimizer (Adam)", None, r"(^|/)(adam|Adam|optimizer|SGD|update_step)[^/]*/"),
    ("metric (argmax, accuracy)", None, r"ArgMax|masked_accuracy|compile_metrics"
                                        r"|^(StatefulPartitionedCall/)?(Max|GatherV2|GreaterEqual|Equal|LogicalAnd)(_\d+)?$"),
    ("loss (log_softmax, gather)", None, r"compile_loss|crossentropy|cross_entropy|LogSoftmax"),
    ("output projection: matmul", MATMUL_TYPES, TOP + r"(MatMul|embedding[^/]*/(MatMul|Tensordot|transpose)|logits)"),
    ("output projection: broadcast-grad Sum", r"Sum", TOP + r"MatMul"),
    ("output projection: other", None, TOP + r"(MatMul|Cast(_\d+)?$|embedding[^/]*/(Tensordot|transpose|Cast)|logits)"),
    ("dropout (random)", None, r"dropout"),
    ("dropout (random)", r"Stateless.*|Random.*|.*RandomUniform.*|.*GetKeyCounter.*", None),
    ("attention softmax", None, r"[Ss]oftmax"),
    ("layer norm", None, r"_norm|layer_norm|LayerNorm|layernorm"),
    ("mask building", None, r"mask|band_part|BandPart|LogicalAnd|NotEqual|ones_like"),
    ("Q/K/V/O projections: matmul", MATMUL_TYPES, QKVO),
    ("Q/K/V/O projections: broadcast-grad Sum", r"Sum", QKVO),
    ("Q/K/V/O projections: bias, other", None, QKVO),
    ("attention QK^T / PV (einsum, matmul)", BATCHED_MATMUL_TYPES, r"attention"),
    ("Q/K/V/O projections: matmul", MATMUL_TYPES, r"attention"),  # 2-D matmuls in an attention scope
    ("feed-forward matmuls", MATMUL_TYPES, r"feed_?forward"),
    ("other matmuls", MATMUL_TYPES, None),
    ("bias add (+ grad)", r"_?(Mkl)?BiasAdd(Grad)?", None),
    ("casts", r"Cast|_MklCast", None),
    ("transposes", r"_?(Mkl)?(Conjugate)?Transpose", None),
    ("embedding lookup", None, r"embedding|Embedding|UnsortedSegmentSum|ResourceGather|GatherV2"),
    ("elementwise (relu, residual add, scale)",
     r"_?(Mkl)?(Relu|ReluGrad|Add|AddV2|AddN|Mul|Sub|RealDiv|Neg|Square|Sqrt|Rsqrt|Maximum|Minimum|SelectV2)", None),
    ("reductions", r"Sum|Mean|Max|Min|Prod", None),
    ("shape / reshape / misc", None, None),
]


def categorize(op_type: str, name: str) -> str:
    for category, type_re, name_re in CATEGORIES:
        if type_re is not None and not re.fullmatch(type_re, op_type):
            continue
        if name_re is not None and not re.search(name_re, name):
            continue
        return category
    return "shape / reshape / misc"


_OP_EVENT = re.compile(r"^([^ :]+):([A-Za-z_][A-Za-z0-9_]*)$")


def op_rows(logdir: str) -> list[dict]:
    """[{type, name, count, self_us, total_us}] for every op in the newest xplane.pb under `logdir`.

    The host plane holds one line per thread; the executor records each kernel
    as an event named "op_name:OpType". Self time = duration minus the op events
    nested inside it on the same thread. (The profiler's own `framework_op_stats`
    tool, `_pywrap_profiler_plugin.xspace_to_tools_data([path], "framework_op_stats")`,
    gives the same numbers but only for the top 500 ops.)
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    files = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not files:
        raise RuntimeError(f"no *.xplane.pb under {logdir}")
    space = xplane_pb2.XSpace()
    space.ParseFromString(Path(files[-1]).read_bytes())
    agg = defaultdict(lambda: [0, 0, 0])  # (type, name) -> [self_ps, count, total_ps]
    for plane in space.planes:
        if not plane.name.startswith("/host:"):
            continue
        kinds = {}
        for mid, md in plane.event_metadata.items():
            m = _OP_EVENT.match(md.name)
            if m:
                kinds[mid] = (m.group(2), m.group(1))
        for line in plane.lines:
            events = sorted(((e.offset_ps, e.offset_ps + e.duration_ps, kinds[e.metadata_id])
                             for e in line.events if e.metadata_id in kinds), key=lambda t: (t[0], -t[1]))
            stack = []  # [end, key, nested time, duration]

            def pop():
                _, key, nested, duration = stack.pop()
                a = agg[key]
                a[0] += duration - nested
                a[1] += 1
                a[2] += duration

            for start, end, key in events:
                while stack and stack[-1][0] <= start:
                    pop()
                if stack:
                    stack[-1][2] += end - start
                stack.append([end, key, 0, end - start])
            while stack:
                pop()
    return [{"type": t, "name": n, "count": c, "self_us": s / 1e6, "total_us": tot / 1e6}
            for (t, n), (s, c, tot) in agg.items()]


# ---------------------------------------------------------------- worker


def worker(args) -> dict:
    sys.path.insert(0, str(REPO))
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    import keras
    import peers_throughput as peers

    model = peers.build_compiled(args.framework, args.preset, args.precision, args.vocab_size)
    src, tgt_in, tgt_out = peers.synthetic_batch(args)
    ds = tf.data.Dataset.from_tensors(((src, tgt_in), tgt_out)).repeat()

    times = []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, step, logs=None):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, step, logs=None):
            float(logs["loss"])
            times.append(time.perf_counter() - self.t0)

    model.fit(ds, epochs=1, steps_per_epoch=args.warmup, verbose=0)
    logdir = tempfile.mkdtemp(prefix="kt_profile_")
    tf.profiler.experimental.start(logdir)
    model.fit(ds, epochs=1, steps_per_epoch=args.steps, verbose=0, callbacks=[Timer()])
    tf.profiler.experimental.stop()
    traced = list(times)
    times.clear()
    model.fit(ds, epochs=1, steps_per_epoch=args.steps, verbose=0, callbacks=[Timer()])
    return {"framework": args.framework, "preset": args.preset, "precision": args.precision,
            "steps": args.steps, "traced_step_s": traced, "step_s": list(times),
            "rows": op_rows(logdir), "logdir": logdir}


# ---------------------------------------------------------------- report


def group_name(name: str) -> str:
    """The op name without the function prefix and with layer indices folded: one row per op across layers."""
    name = re.sub(r"^StatefulPartitionedCall/", "", name)
    return re.sub(r"\b(layer|encoder|decoder|dropout)_\d+(_\d+)?", r"\1_*", name)


def short(name: str, width: int = 100) -> str:
    return name if len(name) <= width else "..." + name[-(width - 3):]


def report(result: dict, top: int) -> dict:
    rows, steps = result["rows"], result["steps"]
    rows = [dict(r, category=categorize(r["type"], r["name"])) for r in rows]
    rows = [r for r in rows if r["category"] != "input pipeline"]
    total = sum(r["self_us"] for r in rows)
    label = f"{result['framework']} {result['preset']} {result['precision']}"
    print(f"\n### {label}: median step {statistics.median(result['step_s']):.3f} s untraced, "
          f"{statistics.median(result['traced_step_s']):.3f} s traced; op self time {total / steps / 1e3:.0f} ms/step "
          f"(summed over threads)\n")
    groups = defaultdict(lambda: [0.0, 0])
    for r in rows:
        g = groups[(r["type"], group_name(r["name"]), r["category"])]
        g[0] += r["self_us"]
        g[1] += 1
    print("| # | op type | op name (layers folded: ops x count) | category | ms/step | % |")
    print("|---|---|---|---|---|---|")
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    for i, ((op_type, name, cat), (us, n)) in enumerate(ranked[:top], 1):
        print(f"| {i} | {op_type} | `{short(name)}` x{n} | {cat} | {us / steps / 1e3:.1f} | {100 * us / total:.1f} |")
    by_cat = defaultdict(float)
    by_type = defaultdict(float)
    for r in rows:
        by_cat[r["category"]] += r["self_us"]
        by_type[r["type"]] += r["self_us"]
    print("\n| category | ms/step | % |\n|---|---|---|")
    for cat, us in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        print(f"| {cat} | {us / steps / 1e3:.1f} | {100 * us / total:.1f} |")
    print("\n| op type | ms/step | % |\n|---|---|---|")
    for t, us in sorted(by_type.items(), key=lambda kv: -kv[1])[:top]:
        print(f"| {t} | {us / steps / 1e3:.1f} | {100 * us / total:.1f} |")
    shares = {cat: round(100 * us / total, 1) for cat, us in by_cat.items()}
    shares["_ms_per_step"] = round(total / steps / 1e3, 1)
    shares["_step_s"] = round(statistics.median(result["step_s"]), 3)
    return shares


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frameworks", nargs="+", default=["ours", "keras-hub"], choices=["ours", "keras-hub"])
    p.add_argument("--presets", nargs="+", default=["small"], choices=["small", "base"])
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--warmup", type=int, default=2, help="untraced steps first (the first one compiles)")
    p.add_argument("--steps", type=int, default=3, help="traced steps, then as many untraced timed steps")
    p.add_argument("--top", type=int, default=25, help="rows in the top-ops and op-type tables")
    p.add_argument("--tokens-per-batch", type=int, default=4096)
    p.add_argument("--length", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--tag", default="", help="appended to the framework's name in the tables (e.g. for a modified copy)")
    p.add_argument("--json", help="save all results (every op row) here")
    p.add_argument("--from-json", help="re-print a saved --json file instead of running")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--framework", help=argparse.SUPPRESS)
    p.add_argument("--preset", help=argparse.SUPPRESS)
    p.add_argument("--precision", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0

    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        env = worker_env()
        results = []
        for preset in args.presets:
            for precision in args.precisions:
                for framework in args.frameworks:
                    cmd = [sys.executable, __file__, "--worker", "--framework", framework, "--preset", preset,
                           "--precision", precision, "--warmup", str(args.warmup), "--steps", str(args.steps),
                           "--tokens-per-batch", str(args.tokens_per_batch), "--length", str(args.length),
                           "--vocab-size", str(args.vocab_size), "--threads", str(args.threads)]
                    result, seconds = run_worker(cmd, env, f"{framework} {preset} {precision}")
                    if result is None:
                        continue
                    result["framework"] += args.tag
                    results.append(result)
                    print(f"[{framework} {preset} {precision}: {seconds:.0f}s]", file=sys.stderr, flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results))
    shares = {}
    for r in results:
        shares[(r["framework"], r["preset"], r["precision"])] = report(r, args.top)
    if len(shares) > 1:
        keys = list(shares)
        cats = [c for c, *_ in CATEGORIES if any(c in s for s in shares.values())]
        cats = list(dict.fromkeys(cats))
        print("\n### category shares (% of op self time)\n")
        print("| category | " + " | ".join(" ".join(k) for k in keys) + " |")
        print("|---|" + "---|" * len(keys))
        print("| median step, untraced (s) | " + " | ".join(f"{shares[k]['_step_s']:.3f}" for k in keys) + " |")
        print("| op self time (ms/step) | " + " | ".join(f"{shares[k]['_ms_per_step']:.0f}" for k in keys) + " |")
        for c in cats:
            print(f"| {c} | " + " | ".join(f"{shares[k].get(c, 0.0):.1f}" for k in keys) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
