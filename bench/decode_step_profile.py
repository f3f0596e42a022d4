"""Where a decoding step's time goes in the served export: a per-op profile against the step's arithmetic
(BENCHMARKS.md's "where a served step's time goes" row; not a test).

    .venv/bin/python bench/decode_step_profile.py --saved-model /tmp/ct2/ours32/translator/1 \\
        --model-dir runs/en-de --inter-op-threads 2 --intra-op-threads 1 --json runs/bench/step_profile.json

The SavedModel is loaded as TF Serving loads it (a TF1 session over the `serve` graph, with the session's
inter-op and intra-op thread pools) and one signature (`greedy`, or `serving_default`: the beam search)
translates a batch: the first sentence of the split for batch 1, its first 64 for batch 64. For each:

- wall time: the median of `--repeats` untraced calls, after `--warm-up` calls;
- a traced call (RunOptions FULL_TRACE): every op the executor ran, with its duration. Ops whose name is
  inside a `while` loop are the decoding steps'; the rest are tokenization, the encoder, the cross-attention
  keys and values, detokenization. The steps are counted from the loops' `LoopCond` ops (one more
  execution than iterations per loop). Op counts and op times are per iteration (the loops' totals over
  their iterations): the mean step of the call, whose self-attention cache grows from 1 to the output
  length. Loops run side by side (`kt-export --parallel-loops`), so wall time per step is the loop's
  share of the call's wall time over the longest loop's iterations;
- the arithmetic of the mean step, from the model's shape (MODEL_DIR/config.json) and the translations:
  each sentence's output tokens (pieces + the end token) are steps it takes, each step a row of the
  decoder's products (beam: `beam_size` rows). Per row at cache length t and source length s:
  L x (2*4*d^2 + 2*2*d^2 + 2*2*d*d_ff + 4*d*t + 4*d*s) + 2*d*V floating-point operations (self-attention
  Q, K, V and output projections; cross-attention Q and output projections (its keys and values are
  computed once per sentence, outside the loop); the feed-forward network; the two attention products;
  the output projection). GFLOP/s = those operations over the loop's wall time;
- the same products at their best on this machine: a [rows, d] x [d, V] float32 matmul (a step's largest)
  repeated in a session on the same threads, at 1 row and at 64 x beam rows, as the ceiling of what a step's
  products reach. At one row a product reads each weight once for 2 operations, so memory, not arithmetic,
  bounds it: the step's weights (every decoder projection and the output projection, in float32) over that
  matmul's rate of reading weights is the least a batch-1 step can take on these threads.

The trace costs time of its own for each op (more for small ones), so the op table's sum exceeds the
untraced wall time; the shares between op types are what it shows. Time on an idle machine.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.native_logs import import_tensorflow_quietly  # noqa: E402

tf = import_tensorflow_quietly()

import sentencepiece as spm  # noqa: E402
import tensorflow_text  # noqa: E402,F401  (registers the sentencepiece ops the graph uses)
from tensorflow.core.protobuf import config_pb2  # noqa: E402

from bench.served_speed import cpu_line  # noqa: E402
from export.translate import resolve_saved_model  # noqa: E402
from keras_transformer.text import read_lines  # noqa: E402

SIGNATURES = {"greedy": 1, "serving_default": None}  # signature -> rows per sentence (None: the beam size)
LOOP_MARK = "/while/"


def op_type(node_stats) -> str:
    """'name = MatMul(a, b)' -> 'MatMul'."""
    label = node_stats.timeline_label
    return label.split("=", 1)[1].split("(", 1)[0].strip() if "=" in label else node_stats.node_name


def step_weights(config) -> int:
    """The weights a decoder step multiplies a row by: each layer's self-attention Q, K, V and output and
    cross-attention Q and output projections and its feed-forward network, then the output projection."""
    d, d_ff, layers = config["d_model"], config["d_ff"], config["num_decoder_layers"]
    vocab = config.get("target_vocab_size") or config["vocab_size"]
    return layers * (6 * d * d + 2 * d * d_ff) + d * vocab


def step_flops(config, rows_lengths, source_lengths, beam_rows):
    """Floating-point operations of the decoder steps the translations took (see the module docstring):
    2 per weight and row, and the two attention products over t cached positions and s source positions."""
    d, layers = config["d_model"], config["num_decoder_layers"]
    total = 0
    for steps, source in zip(rows_lengths, source_lengths):
        for t in range(1, steps + 1):
            total += beam_rows * (2 * step_weights(config) + layers * (4 * d * t + 4 * d * source))
    return total


def step_weight_bytes(config) -> int:
    """Bytes of float32 weights a decoder step reads."""
    return 4 * step_weights(config)


def matmul_ceiling(session_config, rows, d, vocab, seconds=2.0) -> float:
    """GFLOP/s of a [rows, d] x [d, vocab] float32 matmul in a session on `session_config`'s threads,
    repeated for about `seconds`."""
    with tf.compat.v1.Session(graph=tf.Graph(), config=session_config) as sess:
        a = tf.Variable(tf.random.normal([rows, d]))
        b = tf.Variable(tf.random.normal([d, vocab]))
        product = tf.reduce_sum(tf.matmul(a, b))  # fetch a scalar: no copy of the product out of the graph
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(product)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            sess.run(product)
            n += 1
        return 2 * rows * d * vocab * n / (time.perf_counter() - t0) / 1e9


def profile(sess, signature_def, texts, repeats, warm_up):
    fetches = {k: v.name for k, v in signature_def.outputs.items()}
    feed = {signature_def.inputs["text"].name: [t.encode("utf-8") for t in texts]}
    for _ in range(warm_up):
        outputs = sess.run(fetches, feed)
    walls = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outputs = sess.run(fetches, feed)
        walls.append(time.perf_counter() - t0)
    metadata = config_pb2.RunMetadata()
    sess.run(fetches, feed, options=config_pb2.RunOptions(trace_level=config_pb2.RunOptions.FULL_TRACE),
             run_metadata=metadata)
    in_loop, outside, executions = collections.Counter(), collections.Counter(), collections.Counter()
    by_node = collections.Counter()  # "op type: node name inside the loop" -> microseconds
    loop_conds = collections.Counter()
    loop_span = [float("inf"), 0]
    for device in metadata.step_stats.dev_stats:
        for node in device.node_stats:
            kind, micros = op_type(node), node.op_end_rel_micros - node.op_start_rel_micros
            if LOOP_MARK in node.node_name:
                in_loop[kind] += micros
                executions[kind] += 1
                by_node[f"{kind}: {node.node_name.rsplit(LOOP_MARK, 1)[-1]}"] += micros
                loop_span[0] = min(loop_span[0], node.all_start_micros)
                loop_span[1] = max(loop_span[1], node.all_start_micros + node.all_end_rel_micros)
                if kind == "LoopCond":
                    loop_conds[node.node_name] += 1
            else:
                outside[kind] += micros
    iterations = [n - 1 for n in loop_conds.values()]  # a loop's condition runs once more than its body
    return outputs, statistics.median(walls), in_loop, outside, executions, iterations, loop_span, by_node


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--saved-model", required=True, help="EXPORT_DIR/NAME[/VERSION], decoding in float32")
    p.add_argument("--model-dir", required=True, help="the kt-train directory it came from (config.json: the shape)")
    p.add_argument("--data-dir", default="../shared/data/multi30k")
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--signatures", default="greedy,serving_default")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--beam-size", type=int, default=4, help="the beam size serving_default was exported with")
    p.add_argument("--inter-op-threads", type=int, default=0, help="as TF Serving's (0: one per core)")
    p.add_argument("--intra-op-threads", type=int, default=0, help="as TF Serving's (0: one per core)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warm-up", type=int, default=3)
    p.add_argument("--top", type=int, default=14, help="op types listed per profile (default 14)")
    p.add_argument("--nodes", type=int, default=0, help="also list the N costliest ops of the loop by name")
    p.add_argument("--json", help="also write the results here")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    config = json.loads((Path(args.model_dir) / "config.json").read_text())
    model = config["model_config"]
    data = Path(args.data_dir)
    sources = read_lines(data / f"{args.split}.{config['source_lang']}")
    path = resolve_saved_model(args.saved_model)
    sp = spm.SentencePieceProcessor(model_file=str(path / "assets" / "tokenizer.model"))
    session_config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=args.inter_op_threads,
                                              intra_op_parallelism_threads=args.intra_op_threads)
    print(f"CPU: {cpu_line()}\nTensorFlow {tf.__version__}; {path}; model d_model {model['d_model']}, d_ff "
          f"{model['d_ff']}, {model['num_decoder_layers']} decoder layers, vocab {model['vocab_size']}; session "
          f"threads inter-op {args.inter_op_threads or 'default'}, intra-op {args.intra_op_threads or 'default'}",
          flush=True)

    results = []
    with tf.compat.v1.Session(graph=tf.Graph(), config=session_config) as sess:
        meta_graph = tf.compat.v1.saved_model.loader.load(sess, ["serve"], str(path))
        for signature in args.signatures.split(","):
            for batch_size in (int(b) for b in args.batch_sizes.split(",")):
                texts = sources[:batch_size]
                outputs, wall, in_loop, outside, executions, iterations, span, by_node = profile(
                    sess, meta_graph.signature_def[signature], texts, args.repeats, args.warm_up)
                # Loops run side by side: the call's wall time is the longest loop's, a "step" one of its
                # iterations (with the other loops' work done meanwhile); ops and op times are per iteration.
                steps, wall_steps = max(sum(iterations), 1), max(max(iterations, default=0), 1)
                translations = [t.decode("utf-8") for t in outputs["translation"].ravel().tolist()]
                output_tokens = [len(ids) + 1 for ids in sp.encode(translations)]
                source_tokens = [len(ids) + 1 for ids in sp.encode(texts)]
                rows = SIGNATURES[signature] or args.beam_size
                flops = step_flops(model, output_tokens, source_tokens, rows)
                loop_share = sum(in_loop.values()) / (sum(in_loop.values()) + sum(outside.values()))
                loop_wall = wall * loop_share  # the untraced wall time, split as the traced op times split
                row = {
                    "signature": signature, "batch_size": batch_size, "loop_iterations": iterations,
                    "output_tokens": sum(output_tokens), "wall_ms": round(wall * 1e3, 2),
                    "loop_share_of_op_time": round(loop_share, 3),
                    "wall_ms_per_step": round(loop_wall * 1e3 / wall_steps, 3),
                    "ops_per_step": round(sum(executions.values()) / steps, 1),
                    "step_flops_mean": round(flops / wall_steps),
                    "gflops_per_s": round(flops / loop_wall / 1e9, 2),
                    "traced_loop_span_ms": round((span[1] - span[0]) / 1e3, 2),
                    "loop_op_us_per_step": {k: round(v / steps, 2) for k, v in in_loop.most_common()},
                    "loop_ops_per_step": {k: round(executions[k] / steps, 2) for k, _ in in_loop.most_common()},
                    "outside_op_ms": {k: round(v / 1e3, 3) for k, v in outside.most_common(args.top)},
                }
                results.append(row)
                total = sum(in_loop.values()) / steps
                print(f"\n## {signature}, batch {batch_size}: {wall * 1e3:.1f} ms a call (untraced median), "
                      f"loop iterations {'+'.join(map(str, iterations))}, {sum(output_tokens)} output tokens; "
                      f"the loop has {loop_share:.0%} of the traced op time; mean step "
                      f"{row['wall_ms_per_step']} ms wall, {row['ops_per_step']} ops, "
                      f"{row['step_flops_mean'] / 1e6:.2f} MFLOP ({row['gflops_per_s']} GFLOP/s)")
                print("| op type (in the loop) | us per step (traced) | share | ops per step |")
                print("|---|---:|---:|---:|")
                for kind, micros in in_loop.most_common(args.top):
                    print(f"| {kind} | {micros / steps:.1f} | {micros / steps / total:.0%} | "
                          f"{executions[kind] / steps:.1f} |")
                if args.nodes:
                    print(f"The {args.nodes} costliest ops of the loop (us per step, traced): " + "; ".join(
                        f"{name} {micros / steps:.1f}" for name, micros in by_node.most_common(args.nodes)))
                print("outside the loop (ms): " + ", ".join(f"{k} {v / 1e3:.2f}"
                                                            for k, v in outside.most_common(6)), flush=True)

    ceiling = {}
    print()
    for rows in (1, max(int(b) for b in args.batch_sizes.split(",")) * args.beam_size):
        gflops = matmul_ceiling(session_config, rows, model["d_model"], model["vocab_size"])
        # Its weights are read once per product: at one row that, not the arithmetic, bounds it.
        gbytes = gflops / (2 * rows) * 4
        ceiling[rows] = {"gflops_per_s": round(gflops, 1), "weight_gbytes_per_s": round(gbytes, 1)}
        print(f"Ceiling: a [{rows}, {model['d_model']}] x "
              f"[{model['d_model']}, {model['vocab_size']}] float32 matmul on these threads: {gflops:.1f} GFLOP/s, "
              f"its weights read at {gbytes:.1f} GB/s")
    print(f"A step reads {step_weight_bytes(model) / 1e6:.1f} MB of float32 weights: at batch 1, "
          f"{step_weight_bytes(model) / (ceiling[1]['weight_gbytes_per_s'] * 1e9) * 1e3:.2f} ms at the 1-row rate")
    if args.json:
        summary = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                   "cpu": cpu_line(), "tensorflow": tf.__version__, "saved_model": str(path),
                   "command": " ".join([sys.executable, *sys.argv]), "model": model,
                   "inter_op_threads": args.inter_op_threads, "intra_op_threads": args.intra_op_threads,
                   "matmul_ceiling": ceiling, "step_weight_bytes": step_weight_bytes(model), "results": results,
                   "load_average_at_end": os.getloadavg()}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
