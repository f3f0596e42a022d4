"""How alive a run's feed-forward layers and embeddings stay, epoch checkpoint by epoch checkpoint (not a test).

For each epoch checkpoint of a `kt-train` run, on its first validation batches,
in inference mode:

- each feed-forward layer's ReLU: the share of inner units max(0, x W_1 + b_1)
  that are positive, over all real tokens and units ("active"), and the number
  of units positive on no token at all ("dead");
- the token embedding matrix E `[vocab, d_model]`: |mean row| / mean |row|,
  how much one common direction takes of the rows (near 0 at initialisation).

Why: `configs/multi30k-best.json` (peak learning rate 0.005) trained to a
model whose encoder feed-forward units were almost all off, while its
validation loss stalled; this shows when that starts in a run, and whether a
change of recipe avoids it (docs/benchmarks-log.md, "The best recipe's
feed-forward layers die").

    .venv/bin/python bench/ffn_activity.py --model-dir runs/multi30k-best-en-de --epochs 1 5 12 20 60
    .venv/bin/python bench/ffn_activity.py --model-dir runs/multi30k-best-en-de --epochs 4 12 20 --parts
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from export.native_logs import quiet_import_for_commands  # noqa: E402

quiet_import_for_commands(__name__)  # before keras: TensorFlow's C++ log lines are not this table's

import keras  # noqa: E402
import keras_transformer as kt  # noqa: E402
from export.tokenizer import make_tokenizer  # noqa: E402
from keras_transformer.text import PAD_ID, read_tokenizer_proto  # noqa: E402
from training.average_checkpoints import epoch_checkpoints  # noqa: E402
from training.data import load_text_pairs  # noqa: E402
from training.fit import data_spec  # noqa: E402
from training.pipeline import make_batches  # noqa: E402


def feed_forward_layers(model):
    """[(name, FeedForward)] of the encoder's layers, then the decoder's."""
    return ([(f"enc{i}", layer.feed_forward) for i, layer in enumerate(model.encoder.encoder_layers)]
            + [(f"dec{i}", layer.feed_forward) for i, layer in enumerate(model.decoder.decoder_layers)])


def capture_inputs(layers):
    """Wraps each FeedForward's `call` so that its inputs are kept: returns {name: [inputs]}."""
    seen = {name: [] for name, _ in layers}
    for name, ff in layers:
        def call(x, training=None, _original=ff.call, _name=name):
            seen[_name].append(keras.ops.convert_to_numpy(x))
            return _original(x, training=training)
        ff.call = call
    return seen


class InnerLayer:
    """A feed-forward layer's inner weights, and its inputs and pre-activations x W_1 + b_1 over real tokens:
    `x` `[tokens, d_model]`, `pre` `[tokens, d_ff]`."""

    def __init__(self, ff, inputs, real):
        self.kernel = keras.ops.convert_to_numpy(ff.inner.kernel)
        self.bias = keras.ops.convert_to_numpy(ff.inner.bias)
        self.x = np.concatenate([x[m] for x, m in zip(inputs, real)])
        self.pre = self.x @ self.kernel + self.bias


def activity(inner):
    """(share of positive inner units over real tokens, units positive on no real token)."""
    on = inner.pre > 0
    return float(on.mean()), int((~on.any(axis=0)).sum())


def pre_activation_parts(inner):
    """Where a layer's inner pre-activations sit, over real tokens: (their mean, the bias' share b_1, the
    mean input's share mean(x) W_1, the mean cosine between a unit's column of W_1 and -mean(x), |mean(x)|).
    A unit whose column points away from the input every token shares is off on most tokens."""
    mean_x = inner.x.mean(axis=0)
    away = -mean_x / np.linalg.norm(mean_x)
    cosines = (away @ inner.kernel) / np.linalg.norm(inner.kernel, axis=0)
    return (float(inner.pre.mean()), float(inner.bias.mean()), float((mean_x @ inner.kernel).mean()),
            float(cosines.mean()), float(np.linalg.norm(mean_x)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", required=True, help="a kt-train run (config.json, tokenizer.model, checkpoints/)")
    p.add_argument("--epochs", type=int, nargs="*", help="epochs to read (default: every checkpoint)")
    p.add_argument("--batches", type=int, default=2, help="validation batches of 4,096 tokens to run (default 2)")
    p.add_argument("--parts", action="store_true",
                   help="also print, per layer, the mean inner pre-activation and its parts (bias, mean input) "
                        "and the mean cosine between the units' W_1 columns and minus the mean input")
    args = p.parse_args(argv)
    run = Path(args.model_dir)
    config = json.loads((run / "config.json").read_text())
    checkpoints = dict(epoch_checkpoints(run))
    epochs = args.epochs or sorted(checkpoints)
    missing = [e for e in epochs if e not in checkpoints]
    if missing:
        p.error(f"no checkpoint for epoch(s) {missing} in {run / 'checkpoints'} (have {sorted(checkpoints)})")

    tokenizer = make_tokenizer(read_tokenizer_proto(run / config["tokenizer_file"]))
    val = make_batches(load_text_pairs(data_spec(config["training"]), "validation"), tokenizer,
                       tokens_per_batch=4096, shuffle=False)
    # Read to the end (val is small): a cached dataset left part-read makes TensorFlow warn that the cache was
    # dropped.
    batches = [((s.numpy(), ti.numpy()), to.numpy()) for (s, ti), to in val][:args.batches]
    model = kt.Transformer.from_config(config["model_config"])
    model(batches[0][0])
    layers = feed_forward_layers(model)
    seen = capture_inputs(layers)
    names = [name for name, _ in layers]
    # Each layer's real tokens: the source's in the encoder, the target's in the decoder.
    real = {name: [(source if name.startswith("enc") else target_in) != PAD_ID for (source, target_in), _ in batches]
            for name in names}
    print(f"{'epoch':>5}  " + "  ".join(f"{n:>10}" for n in names) + "  embedding common share")
    print(f"{'':>5}  " + "  ".join(f"{'active dead':>10}" for _ in names))
    for epoch in epochs:
        model.load_weights(checkpoints[epoch])
        for inputs in seen.values():
            inputs.clear()
        for inputs, _ in batches:
            model(inputs, training=False)
        inners = {name: InnerLayer(ff, seen[name], real[name]) for name, ff in layers}
        cells = []
        for name in names:
            share, dead = activity(inners[name])
            cells.append(f"{share:6.2f} {dead:3d}")
        table = (model.source_embedding or model.target_embedding).token_embedding.embeddings
        e = keras.ops.convert_to_numpy(table)
        common = np.linalg.norm(e.mean(axis=0)) / np.linalg.norm(e, axis=1).mean()
        print(f"{epoch:>5}  " + "  ".join(f"{c:>10}" for c in cells) + f"  {common:.2f}", flush=True)
        if args.parts:
            for name in names:
                mean, from_bias, from_mean_input, cosine, norm = pre_activation_parts(inners[name])
                print(f"{'':>5}  {name}: pre-activation {mean:+.2f} = bias {from_bias:+.2f} + mean input "
                      f"{from_mean_input:+.2f}; |mean input| {norm:.1f}; cos(W_1 column, -mean input) {cosine:+.2f}",
                      flush=True)


if __name__ == "__main__":
    main()
