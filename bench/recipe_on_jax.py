"""A kt-train recipe's first epochs on Keras' JAX backend, from the TensorFlow pipeline's own batches (not a test).

Why: `configs/multi30k-best.json` loses its encoder's feed-forward units early
in its warm-up under kt-train (TensorFlow) on CPU, in float32 and in
mixed_bfloat16, with every seed tried, while the issue's GPU run of the same
recipe with this library, on JAX, reached the anchor's BLEU (issue 41; the
figures are in docs/benchmarks-log.md, "The best recipe's feed-forward layers die"). This trains the run's model
(its config.json), optimizer, loss and batches on JAX instead, so that the two
backends can be compared over a run at the recipe's batch size, not only over a
few steps. Two steps, because the JAX virtualenv has no TensorFlow:

    # 1. TensorFlow virtualenv: the training pipeline's batches, epoch by epoch, and the validation batches,
    #    padded to their length bucket's longest length (JAX compiles once per shape), with a kt-train run's
    #    config.json and tokenizer (a run of a few seconds, or any earlier run of the recipe, gives them)
    .venv/bin/python bench/recipe_on_jax.py dump --model-dir runs/multi30k-best-en-de --epochs 16 \\
        --out /tmp/best-batches
    # 2. JAX virtualenv: train on them; epoch checkpoints and history.csv as kt-train writes them
    KERAS_BACKEND=jax .venv-jax/bin/python bench/recipe_on_jax.py train --batches /tmp/best-batches \\
        --model-dir runs/best-jax-en-de
    .venv/bin/python bench/ffn_activity.py --model-dir runs/best-jax-en-de --epochs 5 12 16
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def dump(args):
    """Writes epoch-NNN.npz (the shuffled training batches of epoch NNN) and val.npz into args.out, with the
    run's config.json and tokenizer.model."""
    from export.tokenizer import make_tokenizer
    from keras_transformer.text import read_tokenizer_proto
    from training.data import load_text_pairs
    from training.fit import data_spec
    from training.pipeline import make_batches

    import keras

    run, out = Path(args.model_dir), Path(args.out)
    config = json.loads((run / "config.json").read_text())
    cfg = config["training"]
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(run / "config.json", out / "config.json")
    shutil.copyfile(run / config["tokenizer_file"], out / config["tokenizer_file"])
    keras.utils.set_random_seed(cfg["seed"])
    tokenizer = make_tokenizer(read_tokenizer_proto(run / config["tokenizer_file"]))
    spec = data_spec(cfg)
    common = dict(max_length=cfg["max_length"], tokens_per_batch=cfg["tokens_per_batch"], pad_to_bucket_boundary=True)
    train = make_batches(load_text_pairs(spec, "train"), tokenizer, shuffle=True,
                         shuffle_buffer=cfg["shuffle_buffer"], seed=cfg["seed"], **common)
    val = make_batches(load_text_pairs(spec, "validation"), tokenizer, shuffle=False, **common)

    def save(path, batches):
        arrays = {}
        for i, ((source, target_in), target_out) in enumerate(batches.as_numpy_iterator()):
            arrays.update({f"{i}/source": source, f"{i}/target_in": target_in, f"{i}/target_out": target_out})
        np.savez(path, **arrays)
        return len(arrays) // 3

    print(f"val: {save(out / 'val.npz', val)} batches", flush=True)
    for epoch in range(1, args.epochs + 1):  # each pass over `train` is shuffled anew, as in fit()
        print(f"epoch {epoch}: {save(out / f'epoch-{epoch:03d}.npz', train)} batches", flush=True)


def load_batches(path):
    with np.load(path) as data:
        n = len(data.files) // 3
        return [((data[f"{i}/source"], data[f"{i}/target_in"]), data[f"{i}/target_out"]) for i in range(n)]


def train(args):
    """Trains config.json's model on the dumped batches, one fit() per epoch file, on the current backend."""
    import keras

    import keras_transformer as kt

    batches, run = Path(args.batches), Path(args.model_dir)
    config = json.loads((batches / "config.json").read_text())
    cfg = config["training"]
    run.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", config["tokenizer_file"]):
        shutil.copyfile(batches / name, run / name)
    epochs = sorted(batches.glob("epoch-*.npz"))[: args.epochs]
    print(f"backend {keras.backend.backend()}, policy {args.policy}, {len(epochs)} epochs", flush=True)

    class Batches(keras.utils.PyDataset):
        def __init__(self, items):
            super().__init__()
            self.items = items

        def __len__(self):
            return len(self.items)

        def __getitem__(self, i):
            return self.items[i]

    keras.mixed_precision.set_global_policy(args.policy)
    keras.utils.set_random_seed(cfg["seed"])
    model = kt.Transformer.from_config(config["model_config"])
    # What `training.fit.compile_model` builds, which cannot be imported here: training/fit.py imports
    # TensorFlow, and the JAX virtualenv has none. (XLA needs no jit_compile setting on JAX.)
    options = {"gradient_accumulation_steps": cfg["grad_accum"] if (cfg["grad_accum"] or 1) > 1 else None,
               "epsilon": cfg.get("adam_epsilon"), "global_clipnorm": cfg.get("global_clipnorm")}
    optimizer = kt.paper_adam(model.d_model, warmup_steps=cfg["warmup_steps"], scale=cfg["learning_rate_scale"],
                              **{name: value for name, value in options.items() if value is not None})
    loss = kt.MaskedSparseCategoricalCrossentropy(label_smoothing=cfg["label_smoothing"])
    model.compile(optimizer=optimizer, loss=loss, metrics=[kt.MaskedAccuracy()])
    val = Batches(load_batches(batches / "val.npz"))
    callbacks = [keras.callbacks.ModelCheckpoint(str(run / "checkpoints" / "epoch-{epoch:03d}.weights.h5"),
                                                 save_weights_only=True),
                 keras.callbacks.CSVLogger(str(run / "history.csv"), append=True)]
    for epoch, path in enumerate(epochs):
        model.fit(Batches(load_batches(path)), validation_data=val, initial_epoch=epoch, epochs=epoch + 1,
                  callbacks=callbacks, verbose=2, shuffle=False)
        print(f"epoch {epoch + 1} done: update {int(model.optimizer.iterations):,}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump", help="TensorFlow: write a run's training batches, epoch by epoch, and its "
                       "validation batches")
    d.add_argument("--model-dir", required=True, help="a kt-train run of the recipe (config.json, tokenizer.model)")
    d.add_argument("--epochs", type=int, required=True)
    d.add_argument("--out", required=True)
    t = sub.add_parser("train", help="any backend: train on the dumped batches")
    t.add_argument("--batches", required=True, help="the folder `dump` wrote")
    t.add_argument("--model-dir", required=True, help="where to write checkpoints/ and history.csv")
    t.add_argument("--epochs", type=int, help="at most this many of the dumped epochs (default all)")
    t.add_argument("--policy", default="mixed_bfloat16", help="Keras dtype policy (default mixed_bfloat16, the "
                   "issue's GPU run's)")
    args = p.parse_args(argv)
    dump(args) if args.command == "dump" else train(args)


if __name__ == "__main__":
    main()
