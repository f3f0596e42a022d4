"""Translate a test split with a trained model and score it with sacreBLEU.

    python -m training.evaluate --model-dir runs/en-de --data-dir ../shared/data/multi30k \
        --split test_2016_flickr

Decodes in batches inside a `tf.function` (beam search, beam 4 by default;
`--beam-size 1` for greedy decoding), detokenizes with the model's
sentencepiece tokenizer, prints sacreBLEU's corpus BLEU with its signature and
chrF, writes the hypotheses (one per line, input order) and a JSON of the scores.

`--hypotheses FILE --references FILE` scores an existing file without decoding.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def score(hypotheses: list[str], references: list[str]) -> dict:
    """sacreBLEU corpus BLEU and chrF (default settings, one reference)."""
    from sacrebleu.metrics import BLEU, CHRF

    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    bleu, chrf = BLEU(), CHRF()
    b = bleu.corpus_score(hypotheses, [references])
    c = chrf.corpus_score(hypotheses, [references])
    return {
        "bleu": b.score, "bleu_signature": str(bleu.get_signature()), "bleu_text": b.format(signature=str(bleu.get_signature())),
        "chrf": c.score, "chrf_signature": str(chrf.get_signature()), "chrf_text": c.format(signature=str(chrf.get_signature())),
        "sentences": len(hypotheses),
    }


def _read_lines(path) -> list[str]:
    with open(path, encoding="utf-8", newline="") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def load_trained(model_dir, model_file=None, weights=None):
    """(model, tokenizer, config) from a directory written by training.train.

    `model_file` picks another .keras file (e.g. averaged.keras); `weights` loads
    a .weights.h5 checkpoint into the model.
    """
    import keras

    import keras_transformer  # noqa: F401  (registers the serializable classes)
    from training.tokenizer import load_model_proto, make_tokenizer
    from training.train import load_config

    cfg = load_config(model_dir)
    path = Path(model_file) if model_file else Path(model_dir) / cfg["model_file"]
    if not path.is_file():
        raise FileNotFoundError(f"Model file {path} not found (train first, or pass --model-file).")
    model = keras.models.load_model(path, compile=False)
    if weights:
        model.load_weights(weights)
    tokenizer = make_tokenizer(load_model_proto(Path(model_dir) / cfg["tokenizer_file"]))
    return model, tokenizer, cfg


def make_translate_fn(model, tokenizer, cfg, beam_size: int = 4, alpha: float = 0.6):
    """A function: batch of source strings -> batch of detokenized translations (tf.string).

    Tokenization, decoding and detokenization all run in one `tf.function`.
    """
    import tensorflow as tf

    import keras_transformer as kt
    from training.pipeline import decode_output, encode_source

    start_id, end_id = cfg["start_id"], cfg["end_id"]
    max_length = cfg.get("max_length")

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string)])
    def translate(texts):
        source = encode_source(tokenizer, texts, max_length).to_tensor(0)
        # The default output limit is per sentence (its source length + 50), so a
        # sentence's translation does not depend on the batch it is in.
        if beam_size > 1:
            tokens, _ = kt.beam_search(model, source, start_id=start_id, end_id=end_id, beam_size=beam_size,
                                       alpha=alpha)
        else:
            tokens, _ = kt.greedy_decode(model, source, start_id=start_id, end_id=end_id)
        return decode_output(tokenizer, tokens, end_id)

    return translate


def translate_all(translate, sources: list[str], batch_size: int = 64) -> list[str]:
    """Translates in batches of similar length; returns hypotheses in input order."""
    import tensorflow as tf

    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    out = [None] * len(sources)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        result = translate(tf.constant([sources[i] for i in idx])).numpy()
        for i, text in zip(idx, result):
            out[i] = text.decode("utf-8", errors="replace")
    return out


def build_parser():
    p = argparse.ArgumentParser(prog="kt-evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", help="directory written by training.train")
    p.add_argument("--model-file", help="another .keras file to evaluate (e.g. MODEL_DIR/averaged.keras)")
    p.add_argument("--weights", help="a .weights.h5 checkpoint to load into the model")
    p.add_argument("--dataset", help="multi30k | files | TFDS name (default: the one trained on)")
    p.add_argument("--data-dir", help="raw Multi30k directory")
    p.add_argument("--tfds-data-dir")
    p.add_argument("--split", help="default: test_2016_flickr for Multi30k, test for TFDS datasets")
    p.add_argument("--source-file", help="plain source text to translate (with --references)")
    p.add_argument("--references", help="reference translations, one per line")
    p.add_argument("--hypotheses", help="score this hypothesis file instead of decoding")
    p.add_argument("--beam-size", type=int, default=4, help="1 = greedy (default 4)")
    p.add_argument("--alpha", type=float, default=0.6, help="length penalty (default 0.6)")
    p.add_argument("--batch-size", type=int, default=64, help="sentences per decoding batch")
    p.add_argument("--max-examples", type=int, help="decode only the first N sentences")
    p.add_argument("--output", help="hypothesis file (default MODEL_DIR/hyp.SPLIT.LANG)")
    return p


def _source_and_refs(args, cfg):
    """(sources, references) for the requested split or files."""
    if args.source_file:
        if not args.references:
            raise SystemExit("--source-file needs --references")
        return _read_lines(args.source_file), _read_lines(args.references)
    from training.data import DataSpec, load_text_pairs

    t = cfg.get("training", {})
    dataset = args.dataset or t.get("dataset", "multi30k")
    if dataset == "files":
        raise SystemExit("This model was trained on plain files: pass --source-file and --references")
    spec = DataSpec(dataset=dataset, source_lang=cfg["source_lang"], target_lang=cfg["target_lang"],
                    data_dir=args.data_dir or t.get("data_dir"), tfds_data_dir=args.tfds_data_dir or t.get("tfds_data_dir"))
    split = args.split or ("test_2016_flickr" if dataset == "multi30k" else "test")
    pairs = list(load_text_pairs(spec, split, max_examples=args.max_examples).as_numpy_iterator())
    return [s.decode("utf-8") for s, _ in pairs], [r.decode("utf-8") for _, r in pairs]


def print_scores(scores: dict) -> None:
    print(scores["bleu_text"])
    print(scores["chrf_text"])


def main(argv=None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    args = build_parser().parse_args(argv)

    if args.hypotheses:
        if not args.references and not args.model_dir:
            raise SystemExit("--hypotheses needs --references (or --model-dir and --split)")
        hyps = _read_lines(args.hypotheses)
        if args.references:
            refs = _read_lines(args.references)
        else:
            from training.train import load_config

            _, refs = _source_and_refs(args, load_config(args.model_dir))
        scores = score(hyps, refs)
        print_scores(scores)
        if args.output:
            Path(args.output).write_text(json.dumps(scores, indent=2))
        return 0

    if not args.model_dir:
        raise SystemExit("--model-dir is required to decode")
    import tensorflow_datasets as tfds

    tfds.disable_progress_bar()
    model, tokenizer, cfg = load_trained(args.model_dir, args.model_file, args.weights)
    sources, refs = _source_and_refs(args, cfg)
    if args.max_examples:
        sources, refs = sources[: args.max_examples], refs[: args.max_examples]
    translate = make_translate_fn(model, tokenizer, cfg, beam_size=args.beam_size, alpha=args.alpha)
    t0 = time.time()
    hyps = translate_all(translate, sources, args.batch_size)
    elapsed = time.time() - t0
    dataset = args.dataset or cfg.get("training", {}).get("dataset", "multi30k")
    default_split = "test_2016_flickr" if dataset == "multi30k" else "test"
    name = Path(args.source_file).name if args.source_file else (args.split or default_split)
    out = Path(args.output) if args.output else Path(args.model_dir) / f"hyp.{name}.{cfg['target_lang']}"
    out.write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    scores = score(hyps, refs)
    scores.update({"beam_size": args.beam_size, "alpha": args.alpha, "hypotheses_file": str(out),
                   "decode_seconds": round(elapsed, 1)})
    out.with_suffix(out.suffix + ".scores.json").write_text(json.dumps(scores, indent=2))
    print(f"Decoded {len(hyps)} sentences in {elapsed:.1f}s (beam {args.beam_size}) -> {out}")
    print_scores(scores)
    return 0


if __name__ == "__main__":
    sys.exit(main())
