"""Does a sentence translate the same alone as inside a batch, in each decoding precision? (issue 27, item 3)

    .venv/bin/python bench/batch_invariance.py --model-dir runs/en-de --model-file runs/en-de/averaged.keras \
        --data-dir ../shared/data/multi30k --split val --sentences 40 --batch-sizes 2 64 512

For each precision (`--precisions`, default float32 and bfloat16), the export's graph (`Translator`, the one
`kt-export` saves) beam-decodes the first `--sentences` source sentences of the split alone, then inside batches
of the split's other sentences: for a batch size B, the first max(B, sentences) sentences in consecutive batches
of B, so that each probed sentence shares its batch with B - 1 others, shorter and longer. Prints, per precision
and batch size, how many probed sentences got another translation than alone, and the largest difference of
their scores. A measurement of this CPU's kernels, not a test: the tests check the default precision
(tests/test_export_savedmodel.py, tests/test_engine.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from export.native_logs import quiet_import_for_commands  # noqa: E402

quiet_import_for_commands(__name__)  # before TensorFlow: its C++ start-up lines are not this table's

import tensorflow as tf  # noqa: E402
from export.translator import Translator  # noqa: E402
from keras_transformer.hardware import cpu_flags  # noqa: E402
from training.multi30k import multi30k_files  # noqa: E402


def translate(translator, sentences, batch_size):
    """(translations, scores) of `sentences`, decoded in consecutive batches of `batch_size`."""
    texts, scores = [], []
    for start in range(0, len(sentences), batch_size):
        out = translator.translate(tf.constant(sentences[start:start + batch_size]))
        texts += [t.decode("utf-8") for t in out["translation"].numpy()]
        scores += out["score"].numpy().tolist()
    return texts, np.array(scores)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--model-file", help="e.g. RUN/averaged.keras (default: the directory's model)")
    p.add_argument("--data-dir", default="../shared/data/multi30k")
    p.add_argument("--source-lang", default="en")
    p.add_argument("--split", default="val")
    p.add_argument("--sentences", type=int, default=40, help="sentences probed alone")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[2, 64, 512])
    p.add_argument("--precisions", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--beam-size", type=int, default=4)
    p.add_argument("--alpha", type=float, default=1.0)
    args = p.parse_args(argv)

    path = multi30k_files(Path(args.data_dir), args.split, args.source_lang)
    lines = path.read_text(encoding="utf-8").splitlines()
    needed = max([args.sentences, *args.batch_sizes])
    if len(lines) < needed:
        p.error(f"{path} has {len(lines)} sentences; the largest batch needs {needed}")
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx")))
    print(f"TensorFlow {tf.__version__}, CPU flags: {' '.join(flags)}")
    print(f"{args.sentences} sentences of {path.name}, beam {args.beam_size}, alpha {args.alpha}\n")
    print("| precision | batch size | translations unlike alone | largest score difference |")
    print("|---|---:|---:|---:|")
    for precision in args.precisions:
        translator = Translator.from_model_dir(args.model_dir, model_file=args.model_file, beam_size=args.beam_size,
                                               alpha=args.alpha, precision=precision)
        alone, alone_scores = translate(translator, lines[:args.sentences], 1)
        for batch_size in args.batch_sizes:
            texts, scores = translate(translator, lines[:max(batch_size, args.sentences)], batch_size)
            unlike = sum(a != t for a, t in zip(alone, texts))
            gap = float(np.abs(scores[:args.sentences] - alone_scores).max())
            print(f"| {precision} | {batch_size} | {unlike} of {args.sentences} | {gap:.2e} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
