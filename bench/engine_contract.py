"""The serving engine's contract on a trained model: in float32, the export decodes what the library decodes.

    .venv/bin/python bench/engine_contract.py --model-dir runs/en-de --model-file runs/en-de/averaged.keras \
        --json runs/bench/engine_contract.json

Not a test: it needs a trained model (`make train`), and takes some minutes. tests/test_engine.py checks the
same contract on every CI run, on the copy task and on the quick model's 100 val sentences.

The model's weights are mapped to float32 (`export.engine_weights.engine_model`). On the library's side,
`kt.greedy_decode` and `kt.beam_search` (`--beam-size`, `--alpha`), each in a `tf.function`. On the export's
side, the `Translator` that `kt-export --precision float32` saves (its other options at their defaults), saved
as a SavedModel and loaded back with `tf.saved_model.load`, as TF Serving loads it. Both read the source ids
that the SavedModel's `tokenize` signature gives, in batches of `--batch-size` sentences in file order.

Compared, sentence by sentence:
- greedy, token for token: the engine's own greedy search (`export.search`, in process, on the same float32
  weights) against the library's; and the SavedModel's `greedy` text against the library's tokens
  detokenized by the same tokenizer;
- beam, token for token: the SavedModel's `translate_ids` against the library's `beam_search`; and its
  `serving_default` text against the library's tokens detokenized.

Exits 1 unless greedy agrees on every sentence and beam on at least `--beam-agreement` of them (0.99).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _trimmed_rows(tokens):
    """Each row of int tokens `[batch, length]` up to and including its end id, as a tuple."""
    from keras_transformer.text import END_ID

    rows = []
    for row in tokens:
        row = list(row)
        rows.append(tuple(row[: row.index(END_ID) + 1] if END_ID in row else [t for t in row if t != 0]))
    return rows


def _cpu_flags():
    from keras_transformer.hardware import cpu_flags

    flags = cpu_flags()
    if not flags:
        return "unknown"
    return " ".join(sorted(f for f in flags if f in ("avx2", "fma") or f.startswith(("avx512", "amx"))))


def main(argv=None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True, help="directory written by kt-train")
    p.add_argument("--model-file", help="another .keras file in place of MODEL_DIR/model.keras (e.g. averaged)")
    p.add_argument("--data-dir", default=str(REPO.parent / "shared" / "data" / "multi30k"))
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--source-lang", default="en")
    p.add_argument("--limit", type=int, help="only the first N sentences")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--beam-size", type=int, default=4)
    p.add_argument("--alpha", type=float, default=0.6)
    p.add_argument("--beam-agreement", type=float, default=0.99, help="least share of equal beam outputs")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)

    import numpy as np
    import tensorflow as tf

    import keras_transformer as kt
    from export import search
    from export.engine_weights import engine_model
    from export.tokenizer import decode_output
    from export.translator import GREEDY_SIGNATURE, IDS_SIGNATURE, TEXT_SIGNATURE, TOKENIZE_SIGNATURE, Translator
    from export.translator import load_model_dir
    from keras_transformer.text import END_ID, START_ID, read_lines

    sources = read_lines(Path(args.data_dir) / f"{args.split}.{args.source_lang}")[: args.limit]
    batches = [sources[i : i + args.batch_size] for i in range(0, len(sources), args.batch_size)]
    t0 = time.time()
    translator = Translator.from_model_dir(args.model_dir, model_file=args.model_file, beam_size=args.beam_size,
                                           alpha=args.alpha, precision="float32", parallel_loops="auto")
    with tempfile.TemporaryDirectory() as tmp:
        translator.save(Path(tmp) / "1")
        exported = tf.saved_model.load(str(Path(tmp) / "1"))
    model, tokenizer, _ = load_model_dir(args.model_dir, model_file=args.model_file)
    model = engine_model(model, "float32")
    library = {
        "greedy": tf.function(lambda s: kt.greedy_decode(model, s, START_ID, END_ID, alpha=args.alpha)),
        "beam": tf.function(lambda s: kt.beam_search(model, s, START_ID, END_ID, args.beam_size, args.alpha)),
    }
    engine_greedy = tf.function(lambda s: search.greedy_decode(model, s, START_ID, END_ID, alpha=args.alpha))
    signatures = exported.signatures

    agree = {"greedy tokens (engine in process)": 0, "greedy text (SavedModel `greedy`)": 0,
             "beam tokens (SavedModel `translate_ids`)": 0, "beam text (SavedModel `serving_default`)": 0}
    differing = []
    for number, batch in enumerate(batches, 1):
        text = tf.constant(batch)
        source = signatures[TOKENIZE_SIGNATURE](text=text)["source_ids"]
        for name, run in library.items():
            tokens, _ = run(source)
            library_rows = _trimmed_rows(tokens.numpy())
            library_text = decode_output(tokenizer, tokens).numpy()
            if name == "greedy":
                engine_rows = _trimmed_rows(engine_greedy(source)[0].numpy())
                served_text = signatures[GREEDY_SIGNATURE](text=text)["translation"].numpy()
                token_key, text_key = "greedy tokens (engine in process)", "greedy text (SavedModel `greedy`)"
            else:
                engine_rows = _trimmed_rows(signatures[IDS_SIGNATURE](source_ids=source)["tokens"].numpy())
                served_text = signatures[TEXT_SIGNATURE](text=text)["translation"].numpy()
                token_key = "beam tokens (SavedModel `translate_ids`)"
                text_key = "beam text (SavedModel `serving_default`)"
            agree[token_key] += sum(a == b for a, b in zip(engine_rows, library_rows))
            agree[text_key] += int(np.sum(served_text == library_text))
            differing += [{"search": name, "sentence": (number - 1) * args.batch_size + i, "source": batch[i],
                           "library": library_text[i].decode(), "export": served_text[i].decode()}
                          for i, (a, b) in enumerate(zip(engine_rows, library_rows)) if a != b]
        print(f"\r{number}/{len(batches)} batches, {time.time() - t0:.0f}s", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)

    n = len(sources)
    print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, flags: {_cpu_flags()}")
    print(f"{args.split}: {n} sentences, float32, beam {args.beam_size}, alpha {args.alpha}, "
          f"{time.time() - t0:.0f}s")
    for key, count in agree.items():
        print(f"  {key:45s} equal to the library's: {count}/{n} ({100 * count / n:.1f}%)")
    for d in differing[:10]:
        print(f"  differs ({d['search']}, sentence {d['sentence']}): {d['source']!r}\n"
              f"    library: {d['library']!r}\n    export:  {d['export']!r}")
    passed = (agree["greedy tokens (engine in process)"] == n and agree["greedy text (SavedModel `greedy`)"] == n
              and agree["beam tokens (SavedModel `translate_ids`)"] >= args.beam_agreement * n)
    print("contract: " + ("met" if passed else "NOT met"))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"sentences": n, "split": args.split, "agree": agree,
                                               "differing": differing, "cpu_flags": _cpu_flags(),
                                               "passed": passed}, indent=2))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
