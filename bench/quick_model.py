"""A small translator trained in about a minute, laid out like kt-train's output
(model.keras, tokenizer.model, config.json): the model bench/decode_throughput.py
measures without --model-dir, and the tests' (tests/conftest.py's `quick_model_dir`).

    python bench/quick_model.py --data-dir ../shared/data/multi30k --model-dir /tmp/quick-en-de

It is a "tiny" Transformer trained for a few hundred steps on the first lines
of Multi30k: its translations are poor, but they end with the end id like a
trained model's do (an untrained model runs every sentence to the length limit).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import keras  # noqa: E402
import sentencepiece as spm  # noqa: E402
import tensorflow as tf  # noqa: E402

from common.run_dir import MODEL_FILENAME, TOKENIZER_FILENAME  # noqa: E402
from keras_transformer.text import read_lines, train_sentencepiece, vocab_size_of  # noqa: E402
from common.tokenizer import make_tokenizer  # noqa: E402
from training.config import TrainSettings, write_config  # noqa: E402
from training.fit import build_and_compile  # noqa: E402
from training.pipeline import make_batches  # noqa: E402


def build_quick_model_dir(model_dir, data_dir, *, source_lang="en", target_lang="de", lines=2000, vocab_size=400,
                          steps=300, preset="tiny", learning_rate=3e-3, max_sentence_length=64,
                          tokens_per_batch=1024,
                          seed=1234) -> Path:
    """Trains a sentencepiece vocabulary and a small model on the first `lines` Multi30k training
    pairs and saves them with training's own functions. Returns `model_dir`."""
    # First: seeding clears TensorFlow's kernel caches, which destroys the kernel-owned
    # sentencepiece resource of any tokenizer created before it.
    keras.utils.set_random_seed(seed)
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    data_dir = Path(data_dir)
    sources = read_lines(data_dir / f"train.{source_lang}")[:lines]
    targets = read_lines(data_dir / f"train.{target_lang}")[:lines]

    spm.set_random_generator_seed(seed)
    proto = train_sentencepiece(sources + targets, vocab_size)
    (model_dir / TOKENIZER_FILENAME).write_bytes(proto)
    tokenizer = make_tokenizer(proto)
    vocab = vocab_size_of(proto)

    settings = TrainSettings(preset=preset, source_lang=source_lang, target_lang=target_lang, model_dir=str(model_dir),
                             vocab_size=vocab_size, max_sentence_length=max_sentence_length,
                             tokens_per_batch=tokens_per_batch, seed=seed, steps_per_epoch=steps, epochs=1,
                             dataset="files", validation=False)
    pairs = tf.data.Dataset.from_tensor_slices((sources, targets))
    batches = make_batches(pairs, tokenizer, max_sentence_length=max_sentence_length, tokens_per_batch=tokens_per_batch,
                           shuffle=True, seed=seed, repeat=True)
    model = build_and_compile(settings, vocab, optimizer=keras.optimizers.Adam(learning_rate))
    t0 = time.time()
    history = model.fit(batches, epochs=1, steps_per_epoch=steps, verbose=0, shuffle=False)  # the dataset shuffles itself
    summary = {"optimizer_steps": steps, "final_loss": float(history.history["loss"][-1]),
               "seconds": round(time.time() - t0, 1), "quick_model": {"lines": lines, "learning_rate": learning_rate}}
    model.save(model_dir / MODEL_FILENAME)
    write_config(settings, model_dir, vocab, model, "float32", extra={"last_run": summary})
    return model_dir


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/quick_model.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="../shared/data/multi30k", help="raw Multi30k directory")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--source-lang", default="en")
    p.add_argument("--target-lang", default="de")
    p.add_argument("--lines", type=int, default=2000)
    p.add_argument("--vocab-size", type=int, default=400)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--preset", default="tiny")
    return p


def main(argv=None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    args = build_parser().parse_args(argv)
    t0 = time.time()
    build_quick_model_dir(args.model_dir, args.data_dir, source_lang=args.source_lang, target_lang=args.target_lang,
                          lines=args.lines, vocab_size=args.vocab_size, steps=args.steps, preset=args.preset)
    print(f"Wrote {args.model_dir} in {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
