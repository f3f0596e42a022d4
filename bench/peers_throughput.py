"""Training throughput of this project's Transformer next to keras-hub and PyTorch, on this machine.

    .venv-bench/bin/python bench/peers_throughput.py --json /tmp/peers.json
    .venv-bench/bin/python bench/peers_throughput.py --presets small --precisions fp32 \\
        --steps 3 --warmup 1 --matmul-sizes 512                                    # smoke run
    git worktree add /tmp/kt-a0 a0afafa && .venv/bin/python bench/peers_throughput.py --frameworks ours \\
        --baseline a0afafa=/tmp/kt-a0 --rounds 3 --matmul-sizes                     # against an older commit
    ONEDNN_MAX_CPU_ISA=AVX2 .venv-bench/bin/python bench/peers_throughput.py --precisions fp32   # AVX2 stand-in

Needs a separate virtualenv with the peers (they are not project dependencies):

    make bench-venv    # torch from /opt/wheels' CPU wheel (PyPI's brings CUDA), keras-hub, ctranslate2

What is measured, for each framework x preset (small, base) x precision (fp32,
bf16), on the same synthetic batches (`--tokens-per-batch` target tokens:
128 sentences x 32 tokens per side, ids drawn like bench/train_throughput.py,
no padding, shared vocabulary 8000): the median time of one training step
(forward, backward, Adam update, loss read back) after `--warmup` untimed
steps, and target tokens / median step. Every configuration runs in its own
subprocess, one after the other (dtype policy and thread counts are set before
the framework initializes; TensorFlow and PyTorch never share a process). All
use `--threads` threads (default: all cores), paper Adam (beta_2 0.98, eps 1e-9,
the paper's warm-up schedule, `kt.TransformerSchedule`, warm-up 4000), label
smoothing 0.1, a loss masked at pad id 0, dropout 0.1, post-norm, float32 logits.

- ours: `training.fit.build_and_compile` (the model and compile step of
  kt-train) under a one-device MirroredStrategy, `model.fit`, as
  bench/train_throughput.py. (kt-train now uses TensorFlow's default strategy on
  one device; the figures were measured with this one-device MirroredStrategy for
  every framework alike, which changes no step: what the default strategy avoids
  is a stall between epochs.) bf16 = Keras policy mixed_bfloat16.
- keras-hub: a functional Keras model of `keras_hub.layers.TransformerEncoder`
  / `TransformerDecoder` (post-norm, LayerNorm eps 1e-6), `ReversibleEmbedding`
  (shared by source and target, tied output projection, init stddev
  d_model^-0.5) x sqrt(d_model) + `SinePositionEncoding`, dropout; same
  strategy, compile (our loss, metric and optimizer) and `model.fit` as ours.
  Differences from ours: keras-hub also applies dropout 0.1 to the attention
  probabilities (ours: none); the output projection transposes the embedding
  matrix each step (ours: matmul with transpose_b); glorot-uniform kernels.
- torch: `torch.nn.Transformer(batch_first=True, norm_first=False,
  layer_norm_eps=1e-6)`, embedding x sqrt(d_model) + sinusoidal positions,
  output `F.linear` tied to the embedding, `CrossEntropyLoss(label_smoothing=0.1,
  ignore_index=0)`, `torch.optim.Adam` + `LambdaLR` with the same schedule, a
  plain eager loop (no torch.compile). bf16 = `torch.autocast("cpu",
  dtype=torch.bfloat16)` around forward and loss (weights stay float32).
  Differences from ours: attention-probability dropout 0.1; nn.Transformer
  adds a final LayerNorm after the encoder and after the decoder even in
  post-norm; no accuracy metric.

Matmul peak: square C = A @ B of `--matmul-sizes` in float32 and bfloat16,
in TensorFlow and in PyTorch (one subprocess each), median of
`--matmul-repeats` after one warm-up; the peak per dtype is the best over
frameworks and sizes. Rows in fp32 are compared with the float32 peak, bf16
rows with the bfloat16 peak.

Training FLOPs per step (the same count for all three models; B sentences,
S source and T target tokens each, d = d_model, f = d_ff, V = vocabulary,
N_e / N_d encoder / decoder layers; a matmul of an [m, k] by a [k, n] matrix
is 2mkn FLOPs; training = 3 x forward: the backward pass computes the
gradients of both the inputs and the weights):

    6 * B * S * N_e * (4 d^2 + 2 d f)             encoder: Q K V O projections, feed-forward
  + 6 * B * T * N_d * (6 d^2 + 2 d f)             decoder: self-attn Q K V O, cross-attn Q O, feed-forward
  + 6 * B * S * N_d * 2 d^2                       decoder: cross-attn K V of the encoder output
  + 6 * B * T * d V                               output projection (tied to the embedding)
  + 3 * 4 d * B * (N_e S^2 + N_d (T^2 + T S))     attention scores Q K^T and probabilities x V

Embedding lookups, softmax, LayerNorm, dropout, biases and the optimizer
update are not counted; the causal decoder self-attention is counted in full
(all three implementations compute the full T x T scores).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from train_throughput import AVX2_CAP, run_worker, worker_env  # noqa: E402  (bench/, beside this file)
from training import ONEDNN_ENV  # noqa: E402  (imports no TensorFlow; train_throughput put the repo on the path)
FRAMEWORKS = ["ours", "keras-hub", "torch"]
# Copied from keras_transformer/model.py PRESETS (not imported: the parent process
# must not initialize TensorFlow).
PRESETS = {
    "small": dict(d_model=256, num_heads=4, d_ff=1024, num_encoder_layers=3, num_decoder_layers=3, dropout=0.1),
    "base": dict(d_model=512, num_heads=8, d_ff=2048, num_encoder_layers=6, num_decoder_layers=6, dropout=0.1),
}
WARMUP_STEPS = 4000  # the learning-rate schedule's warm-up (kt-train's default warmup_steps)


def train_flops(c, batch, src_len, tgt_len, vocab_size):
    """Matmul FLOPs of one training step (formula in the module docstring)."""
    d, f, n_e, n_d = c["d_model"], c["d_ff"], c["num_encoder_layers"], c["num_decoder_layers"]
    s_tokens, t_tokens = batch * src_len, batch * tgt_len
    weights = (s_tokens * n_e * (4 * d * d + 2 * d * f) + t_tokens * n_d * (6 * d * d + 2 * d * f)
               + s_tokens * n_d * 2 * d * d + t_tokens * d * vocab_size)
    attention = 4 * d * batch * (n_e * src_len**2 + n_d * (tgt_len**2 + tgt_len * src_len))
    return 6 * weights + 3 * attention


def synthetic_batch(args):
    """The batch of bench/train_throughput.py: (source, target_in, target_out) int32 arrays."""
    import numpy as np

    batch = args.tokens_per_batch // args.length
    rng = np.random.default_rng(0)
    src = rng.integers(4, args.vocab_size, size=(batch, args.length), dtype=np.int32)
    tgt = rng.integers(4, args.vocab_size, size=(batch, args.length + 1), dtype=np.int32)
    return src, tgt[:, :-1], tgt[:, 1:]


def schedule(step, d_model):
    """kt.TransformerSchedule, for PyTorch."""
    return d_model**-0.5 * min(max(step, 1) ** -0.5, step * WARMUP_STEPS**-1.5)


# ---------------------------------------------------------------- workers


def keras_hub_model(c, vocab_size):
    """Encoder-decoder from keras-hub layers, shaped like kt.Transformer."""
    import keras
    import keras_hub

    d = c["d_model"]
    embedding = keras_hub.layers.ReversibleEmbedding(
        vocab_size, d, tie_weights=True,
        embeddings_initializer=keras.initializers.RandomNormal(stddev=d**-0.5), name="embedding")
    positions = keras_hub.layers.SinePositionEncoding(name="positions")
    dropout = keras.layers.Dropout(c["dropout"], name="embedding_dropout")
    layer_args = dict(intermediate_dim=c["d_ff"], num_heads=c["num_heads"], dropout=c["dropout"],
                      layer_norm_epsilon=1e-6, normalize_first=False)

    def embed(ids):
        x = embedding(ids) * math.sqrt(d)
        return dropout(x + positions(x))

    source = keras.Input((None,), dtype="int32", name="source_ids")
    target = keras.Input((None,), dtype="int32", name="target_ids")
    source_mask, target_mask = keras.ops.not_equal(source, 0), keras.ops.not_equal(target, 0)
    x = embed(source)
    for i in range(c["num_encoder_layers"]):
        x = keras_hub.layers.TransformerEncoder(**layer_args, name=f"encoder_{i}")(x, padding_mask=source_mask)
    y = embed(target)
    for i in range(c["num_decoder_layers"]):
        y = keras_hub.layers.TransformerDecoder(**layer_args, name=f"decoder_{i}")(
            y, x, decoder_padding_mask=target_mask, encoder_padding_mask=source_mask)
    logits = keras.layers.Activation("linear", dtype="float32", name="logits")(embedding(y, reverse=True))
    return keras.Model((source, target), logits)


def build_compiled(framework, preset, precision, vocab_size):
    """Ours or the keras-hub model at `preset`, compiled alike (loss, metric, paper Adam), under one-CPU MirroredStrategy.

    Sets the global mixed-precision policy for `precision` ("fp32" or "bf16").
    """
    sys.path.insert(0, str(REPO))
    import keras
    import tensorflow as tf

    import keras_transformer as kt
    from keras_transformer.model import PRESETS as KT_PRESETS
    from training.config import TrainSettings
    from training.fit import build_and_compile, compile_model

    assert KT_PRESETS[preset] == PRESETS[preset], "PRESETS here differ from keras_transformer/model.py"
    keras.mixed_precision.set_global_policy("mixed_bfloat16" if precision == "bf16" else "float32")
    cfg = TrainSettings(preset=preset)
    with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():
        if framework == "ours":
            return build_and_compile(cfg, vocab_size)
        c = PRESETS[preset]
        model = keras_hub_model(c, vocab_size)
        compile_model(model, cfg, optimizer=kt.paper_adam(c["d_model"], warmup_steps=WARMUP_STEPS))
        return model


def keras_worker(args) -> dict:
    """ours or keras-hub, trained with model.fit."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    import keras

    from train_throughput import timed_fit

    model = build_compiled(args.framework, args.preset, args.precision, args.vocab_size)
    src, tgt_in, tgt_out = synthetic_batch(args)
    ds = tf.data.Dataset.from_tensors(((src, tgt_in), tgt_out)).repeat()

    return {"times": timed_fit(model, ds, args.warmup, args.steps), "params": model.count_params(),
            "version": f"tensorflow {tf.__version__}, keras {keras.__version__}"
                       + ("" if args.framework == "ours" else f", keras-hub {__import__('keras_hub').__version__}")}


def torch_worker(args) -> dict:
    """torch.nn.Transformer, a plain eager training loop."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    c = PRESETS[args.preset]
    d = c["d_model"]

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(args.vocab_size, d)
            nn.init.normal_(self.embedding.weight, std=d**-0.5)
            self.dropout = nn.Dropout(c["dropout"])
            self.transformer = nn.Transformer(
                d, c["num_heads"], c["num_encoder_layers"], c["num_decoder_layers"], c["d_ff"], c["dropout"],
                layer_norm_eps=1e-6, batch_first=True, norm_first=False)
            position = torch.arange(1024, dtype=torch.float32)[:, None]
            angles = position / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
            self.register_buffer("pe", torch.stack([angles.sin(), angles.cos()], -1).reshape(1024, d))

        def embed(self, ids):
            return self.dropout(self.embedding(ids) * math.sqrt(d) + self.pe[: ids.shape[1]])

        def forward(self, src, tgt):
            causal = torch.triu(torch.ones(tgt.shape[1], tgt.shape[1], dtype=torch.bool), 1)
            h = self.transformer(self.embed(src), self.embed(tgt), tgt_mask=causal, tgt_is_causal=True,
                                 src_key_padding_mask=src == 0, tgt_key_padding_mask=tgt == 0,
                                 memory_key_padding_mask=src == 0)
            return F.linear(h, self.embedding.weight)

    model = Model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    lr_schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule(step, d))
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1, ignore_index=0)
    src, tgt_in, tgt_out = (torch.from_numpy(a.astype("int64")) for a in synthetic_batch(args))
    model.train()
    times = []
    for _ in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            logits = model(src, tgt_in)
            loss = loss_fn(logits.float().reshape(-1, args.vocab_size), tgt_out.reshape(-1))
        loss.backward()
        optimizer.step()
        lr_schedule.step()
        loss.item()
        times.append(time.perf_counter() - t0)
    return {"times": times[args.warmup:], "params": sum(p.numel() for p in model.parameters()),
            "version": f"torch {torch.__version__}"}


def matmul_worker(args) -> list:
    """Median GFLOP/s of square matmuls, float32 and bfloat16, in one framework."""
    if args.framework == "torch":
        import torch

        torch.set_num_threads(args.threads)
        dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}

        def make(n, dtype):
            a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
            return lambda: torch.mm(a, b)[0, 0].item()
    else:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        dtypes = {"fp32": tf.float32, "bf16": tf.bfloat16}

        def make(n, dtype):
            a, b = tf.cast(tf.random.normal((n, n)), dtype), tf.cast(tf.random.normal((n, n)), dtype)
            return lambda: float(tf.matmul(a, b)[0, 0])

    rows = []
    for precision, dtype in dtypes.items():
        if precision not in args.precisions:
            continue
        for n in args.matmul_sizes:
            run = make(n, dtype)
            run()
            times = []
            for _ in range(args.matmul_repeats):
                t0 = time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)
            rows.append({"framework": args.framework, "precision": precision, "size": n,
                         "gflops": round(2 * n**3 / statistics.median(times) / 1e9, 1)})
    return rows


# ---------------------------------------------------------------- driver


def _native_bf16_flags():
    """keras_transformer.hardware.native_bf16_flags(), loaded from its file alone: importing the package
    would import TensorFlow into this parent process."""
    spec = importlib.util.spec_from_file_location("kt_hardware", REPO / "keras_transformer" / "hardware.py")
    hardware = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hardware)
    return hardware.native_bf16_flags()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frameworks", nargs="+", default=FRAMEWORKS, choices=FRAMEWORKS)
    p.add_argument("--presets", nargs="+", default=["small", "base"], choices=list(PRESETS))
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--force-bf16", action="store_true",
                   help="measure bf16 even on a CPU without native bfloat16 (skipped there by default: it is "
                   "emulated, and torch's bf16 matmul ran for over 18 minutes on an AVX2-only EPYC)")
    p.add_argument("--tokens-per-batch", type=int, default=4096)
    p.add_argument("--length", type=int, default=32, help="tokens per sentence (source and target)")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (default 3 small, 2 base)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10 small, 4 base)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads per framework (default: all cores)")
    p.add_argument("--matmul-sizes", nargs="*", type=int, default=[1024, 2048, 4096],
                   help="square matmul sizes for the peak (none: skip the peak)")
    p.add_argument("--matmul-repeats", type=int, default=5)
    p.add_argument("--baseline", action="append", default=[], metavar="NAME=DIR",
                   help="also train `ours` from another checkout of this project (e.g. a `git worktree` of an "
                        "older commit), labelled NAME; repeat for several")
    p.add_argument("--rounds", type=int, default=1,
                   help="runs of every configuration, the contenders alternating within each round; rows report "
                        "the median over rounds and the first framework's speed-up over each, round by round")
    p.add_argument("--json", help="also write the results here")
    # internal: one configuration
    p.add_argument("--worker", choices=["train", "matmul"], help=argparse.SUPPRESS)
    p.add_argument("--framework", help=argparse.SUPPRESS)
    p.add_argument("--preset", help=argparse.SUPPRESS)
    p.add_argument("--precision", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    if args.worker == "matmul":
        print("RESULT " + json.dumps(matmul_worker(args)), flush=True)
        return 0
    if args.worker == "train":
        result = torch_worker(args) if args.framework == "torch" else keras_worker(args)
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    if "bf16" in args.precisions and not _native_bf16_flags() and not args.force_bf16:
        args.precisions = [p for p in args.precisions if p != "bf16"]
        print("skipping bf16: this CPU has no native bfloat16 (avx512_bf16/amx_bf16); --force-bf16 measures it",
              flush=True)
        if not args.precisions:
            return 0
    env = worker_env()
    caps = " ".join(f"{k}={env[k]}" for k in ("ONEDNN_MAX_CPU_ISA", *AVX2_CAP) if k in env)
    print(f"{ONEDNN_ENV}={env[ONEDNN_ENV]} in every worker{', capped: ' + caps if caps else ''}", flush=True)
    common = ["--threads", str(args.threads), "--tokens-per-batch", str(args.tokens_per_batch),
              "--length", str(args.length), "--vocab-size", str(args.vocab_size)]
    t_start = time.time()

    matmuls = []
    if args.matmul_sizes:
        for framework in ("tensorflow", "torch"):
            cmd = [sys.executable, __file__, "--worker", "matmul", "--framework", framework,
                   "--precisions", *args.precisions,
                   "--matmul-repeats", str(args.matmul_repeats), "--matmul-sizes",
                   *map(str, args.matmul_sizes), *common]
            rows, wall = run_worker(cmd, env, f"matmul peak {framework}")
            for r in rows or []:
                print(f"matmul {framework:10s} {r['precision']} {r['size']:5d}^3  {r['gflops']:8.1f} GFLOP/s",
                      flush=True)
            matmuls += rows or []
    peak = {prec: max([r["gflops"] for r in matmuls if r["precision"] == prec], default=None)
            for prec in ("fp32", "bf16")}

    # (label, framework, checkout): each framework from this checkout, then `ours` from each --baseline one.
    contenders = [(framework, framework, REPO) for framework in args.frameworks]
    for baseline in args.baseline:
        label, _, checkout = baseline.partition("=")
        contenders.append((label, "ours", Path(checkout).resolve()))
    results = []
    batch = args.tokens_per_batch // args.length
    for preset in args.presets:
        heavy = preset == "base"
        warmup = args.warmup if args.warmup is not None else (2 if heavy else 3)
        steps = args.steps if args.steps is not None else (4 if heavy else 10)
        flops = train_flops(PRESETS[preset], batch, args.length, args.length, args.vocab_size)
        for precision in args.precisions:
            rounds = {label: [] for label, _, _ in contenders}  # per contender: one worker's output per round
            for round_index in range(args.rounds):  # the contenders alternate, so a noisy minute slows them alike
                for label, framework, checkout in contenders:
                    cmd = [sys.executable, str(checkout / "bench" / "peers_throughput.py"), "--worker", "train",
                           "--framework", framework, "--preset", preset, "--precision", precision,
                           "--warmup", str(warmup), "--steps", str(steps), *common]
                    # A baseline checkout's own packages come first on the path (not this one's install).
                    checkout_env = env if checkout == REPO else dict(env, PYTHONPATH=str(checkout))
                    out, wall = run_worker(cmd, checkout_env, f"{label} {preset} {precision}", cwd=checkout)
                    if out is None:
                        continue
                    rounds[label].append(dict(out, wall=wall, median=statistics.median(out["times"])))
                    print(f"{label:9s} {preset:5s} {precision}  round {round_index + 1}/{args.rounds}  "
                          f"{batch * args.length / rounds[label][-1]['median']:9.1f} target tok/s  "
                          f"({wall:.0f}s wall)", flush=True)
            for label, framework, checkout in contenders:
                if not rounds[label]:
                    continue
                median = statistics.median(run["median"] for run in rounds[label])
                gflops = flops / median / 1e9
                first = contenders[0][0]
                # This checkout's first framework over each contender, round by round (> 1: the first is faster).
                ratios = [b["median"] / a["median"] for a, b in zip(rounds[first], rounds[label])]
                r = {"framework": label, "checkout": str(checkout), "version": rounds[label][0]["version"],
                     ONEDNN_ENV.lower(): env[ONEDNN_ENV],
                     "preset": preset, "precision": precision,
                     "batch": f"{batch}x{args.length}", "target_tokens_per_step": batch * args.length,
                     "params": rounds[label][0]["params"], "median_step_s": round(median, 4),
                     "target_tokens_per_s": round(batch * args.length / median, 1),
                     "train_gflop_per_step": round(flops / 1e9, 2), "gflops": round(gflops, 1),
                     "fraction_of_peak": round(gflops / peak[precision], 3) if peak[precision] else None,
                     "round_median_steps_s": [round(run["median"], 4) for run in rounds[label]],
                     f"{first}_speedup_per_round": [round(x, 3) for x in ratios],
                     "step_times_s": [[round(t, 4) for t in run["times"]] for run in rounds[label]],
                     "wall_s": round(sum(run["wall"] for run in rounds[label]), 1)}
                results.append(r)
                print(f"{label:9s} {preset:5s} {precision}  {r['target_tokens_per_s']:9.1f} target tok/s  "
                      f"(median of {len(rounds[label])} round(s): step {median:.3f}s, {gflops:.1f} GFLOP/s; "
                      f"{first} / {label} per round: {', '.join(f'{x:.3f}' for x in ratios)})", flush=True)

    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} CPU cores, {args.threads} threads, "
          f"Python {platform.python_version()}; total {time.time() - t_start:.0f}s\n")
    if matmuls:
        print("| matmul | dtype | n (n×n @ n×n) | GFLOP/s |")
        print("|---|---|---|---|")
        for r in matmuls:
            print(f"| {r['framework']} | {r['precision']} | {r['size']} | {r['gflops']:,.1f} |")
        measured = ", ".join(f"{prec} {gflops:,.1f} GFLOP/s" for prec, gflops in peak.items() if gflops is not None)
        print(f"\npeak (best of the above): {measured}; "
              f"% of peak below: fp32 rows vs the fp32 peak, bf16 rows vs the bf16 peak\n")
    print("| framework | preset | precision | params | median step (s) | target tokens/s | GFLOP/s | % of peak |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        frac = "–" if r["fraction_of_peak"] is None else f"{100 * r['fraction_of_peak']:.0f} %"
        print(f"| {r['framework']} | {r['preset']} | {r['precision']} | {r['params'] / 1e6:.1f} M "
              f"| {r['median_step_s']:.3f} | {r['target_tokens_per_s']:,.0f} | {r['gflops']:,.1f} | {frac} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"peak_gflops": peak, "matmul": matmuls, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
