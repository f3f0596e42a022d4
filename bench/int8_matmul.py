"""Does a stock-TensorFlow int8 matrix product beat float32 at the shapes of a decoding step, on this CPU?

    .venv/bin/python bench/int8_matmul.py                               # TensorFlow's default oneDNN setting
    TF_ENABLE_ONEDNN_OPTS=1 .venv/bin/python bench/int8_matmul.py       # oneDNN on (off by default on AVX2 CPUs)

The products of one decoder step of the `small` preset (d_model 256, d_ff 1024, vocabulary 8000) at the
row counts a search feeds them (`--rows`: 1 = greedy at batch 1, 4 = beam 4 at batch 1, 256 = beam 4 at
batch 64), each timed four ways inside one `tf.function` (`--repeats` products in a chain, so they cannot
overlap, on 1 intra-op and 1 inter-op thread, as the export is served):

- `float32`: `tf.matmul` of float32 activations and weights (what the export decodes with);
- `bfloat16`: the same in bfloat16;
- `int8 product`: `tf.matmul(int8, int8, output_type=tf.int32)` alone (Keras 3's int8 `Dense` calls
  this: TensorFlow's `BatchMatMulV3` with an int32 output), the floor of any int8 path;
- `int8 dense`: what an int8 layer must do around it: quantize the activations per row (abs-max
  scale, round, cast: the per-row scale keeps a sentence's product independent of its batch), the
  int8 product, and the float32 rescale by the row and per-channel weight scales (Keras 3's
  `Dense.quantize("int8")` computes the same);
- `int8 XLA`: the same int8 product compiled by XLA (`jit_compile=True`; TF Serving runs XLA only with
  `--xla_cpu_compilation_enabled`). XLA would compute only the element the chain reads, so here the
  whole product is summed into the chain (a cost of rows x N additions);
- `float32 XLA`: the float32 product under XLA, what the export's batch-1 graph (`--xla-max-batch`) runs;
- `QuantizedMatMul`: TensorFlow's older quantized op (`tf.raw_ops.QuantizedMatMul`, quint8 x quint8 ->
  qint32; its quint8 x qint8 form has no CPU kernel).

Prints microseconds per product, int8 dense / float32, and the fastest int8 path over the fastest float
one, float32, bfloat16 or float32 XLA (< 1: int8 faster).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from export.native_logs import quiet_import_for_commands  # noqa: E402

quiet_import_for_commands(__name__)  # before TensorFlow: its C++ start-up lines are not this table's

import tensorflow as tf  # noqa: E402
from keras_transformer.hardware import cpu_flags  # noqa: E402
from training import ONEDNN_ENV  # noqa: E402

# (name, K, N, times per decoding step) of the small preset's decoder-step products: in each of its 3 decoder
# layers, 6 projections (self-attention Q, K, V, O; cross-attention Q, O: the source's K and V are cached) and
# the feed-forward's two; then the output projection once.
SHAPES = [("Q/K/V/O projection", 256, 256, 18), ("feed-forward in", 256, 1024, 3),
          ("feed-forward out", 1024, 256, 3), ("output projection", 256, 8000, 1)]
FLOAT_PATHS, INT8_PATHS = ("float32", "bfloat16", "float32 XLA"), ("int8 product", "int8 dense", "int8 XLA",
                                                                    "QuantizedMatMul")


def quantize_rows(x):
    """int8 rows and their float32 scales: x ~= q / scale, one scale per row (abs-max)."""
    scale = 127.0 / tf.maximum(tf.reduce_max(tf.abs(x), axis=-1, keepdims=True), 1e-12)
    return tf.cast(tf.clip_by_value(tf.round(x * scale), -127.0, 127.0), tf.int8), scale


def timed(fn, *args, repeats):
    """Microseconds per product: the median of 5 calls of `fn` (a chain of `repeats` products), after 2."""
    for _ in range(2):
        fn(*args).numpy()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn(*args).numpy()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) / repeats * 1e6


def chain(product, repeats, jit_compile=False):
    """A tf.function applying `product(x)` `repeats` times, each input depending on the last output."""

    @tf.function(jit_compile=jit_compile)
    def run(x):
        def body(i, x, acc):
            y = product(x)
            # The next input depends on this output (a scalar of it), so the products cannot overlap. XLA
            # would slice the product down to that scalar, so under XLA the scalar is the whole sum.
            s = tf.reduce_sum(tf.cast(y, tf.float32)) if jit_compile else tf.cast(y[0, 0], tf.float32)
            return i + 1, x + tf.cast(tf.minimum(tf.abs(s), 0.0), x.dtype), acc + s

        return tf.while_loop(lambda i, *_: i < repeats, body, (0, x, 0.0))[2]

    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", type=int, default=[1, 4, 256])
    p.add_argument("--repeats", type=int, default=200, help="products per timed call")
    args = p.parse_args(argv)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)

    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma")))
    print(f"TensorFlow {tf.__version__}, {ONEDNN_ENV}={os.environ.get(ONEDNN_ENV, 'unset')}, "
          f"CPU flags: {' '.join(flags)}")
    print("| product | rows | float32 (µs) | bfloat16 (µs) | float32 XLA (µs) | int8 product (µs) | int8 dense (µs) "
          "| int8 XLA (µs) | QuantizedMatMul (µs) | int8 dense / float32 | best int8 / best float |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    step = {rows: dict.fromkeys(FLOAT_PATHS + INT8_PATHS, 0.0) for rows in args.rows}
    for name, k, n, per_step in SHAPES:
        w = rng.normal(0, k ** -0.5, (k, n)).astype("float32")
        w_scale = 127.0 / np.abs(w).max(axis=0)  # per output channel
        w_q = tf.constant(np.round(w * w_scale).astype("int8"))
        w_uint8 = (w_q.numpy().astype("int32") + 128).astype("uint8")
        w_scale = tf.constant(w_scale)
        w32, w16 = tf.constant(w), tf.constant(w, tf.bfloat16)
        for rows in args.rows:
            x = tf.constant(rng.normal(0, 1, (rows, k)).astype("float32"))
            x_q, _ = quantize_rows(x)

            def int8_dense(x):
                q, scale = quantize_rows(x)
                return tf.cast(tf.matmul(q, w_q, output_type=tf.int32), tf.float32) / (scale * w_scale)

            f32 = timed(chain(lambda x: tf.matmul(x, w32), args.repeats), x, repeats=args.repeats)
            bf16 = timed(chain(lambda x: tf.matmul(x, w16), args.repeats), tf.cast(x, tf.bfloat16),
                         repeats=args.repeats)
            i8 = timed(chain(lambda x: tf.matmul(x, w_q, output_type=tf.int32), args.repeats), x_q,
                       repeats=args.repeats)
            dense = timed(chain(int8_dense, args.repeats), x, repeats=args.repeats)
            xla = timed(chain(lambda x: tf.matmul(x, w_q, output_type=tf.int32), args.repeats, jit_compile=True),
                        x_q, repeats=args.repeats)
            f32_xla = timed(chain(lambda x: tf.matmul(x, w32), args.repeats, jit_compile=True), x,
                            repeats=args.repeats)

            def quantized_matmul(x):
                x = tf.bitcast(tf.cast(tf.cast(x, tf.int32) + 128, tf.uint8), tf.quint8)
                # A constant made in the loop's body: a captured quint8 tensor would be a loop variable, and
                # quint8 has no CPU kernel for the loop's NextIteration.
                w = tf.bitcast(tf.constant(w_uint8), tf.quint8)
                return tf.bitcast(tf.raw_ops.QuantizedMatMul(a=x, b=w, min_a=-1.0, max_a=1.0, min_b=-1.0,
                                                             max_b=1.0, Toutput=tf.qint32)[0], tf.int32)

            old = timed(chain(quantized_matmul, args.repeats), x_q, repeats=args.repeats)
            best = min(i8, dense, xla, old) / min(f32, bf16, f32_xla)
            for path, t in zip(FLOAT_PATHS + INT8_PATHS, (f32, bf16, f32_xla, i8, dense, xla, old)):
                step[rows][path] += per_step * t
            print(f"| {name} {k}x{n} | {rows} | {f32:.1f} | {bf16:.1f} | {f32_xla:.1f} | {i8:.1f} | {dense:.1f} | {xla:.1f} "
                  f"| {old:.1f} | {dense / f32:.2f} | {best:.2f} |", flush=True)
    # A graph runs one path for the whole step, so the paths compete on the sum of a step's products.
    print("\nOne decoding step's products (sum over the step, µs):\n")
    print("| rows | " + " | ".join(FLOAT_PATHS + INT8_PATHS) + " | best int8 path / best float path |")
    print("|---:|" + "---:|" * (len(FLOAT_PATHS + INT8_PATHS) + 1))
    for rows, totals in step.items():
        best_float = min(FLOAT_PATHS, key=totals.get)
        best_int8 = min(INT8_PATHS, key=totals.get)
        print(f"| {rows} | " + " | ".join(f"{t:,.0f}" for t in totals.values())
              + f" | {totals[best_int8] / totals[best_float]:.2f} ({best_int8} / {best_float}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
