"""The serving engine's contract on a trained model: in float32, the export decodes what the library decodes,
with every option of the library's searches.

    .venv/bin/python bench/engine_contract.py --model-dir runs/en-de --model-file runs/en-de/averaged.keras \
        --json runs/bench/engine_contract.json
    .venv/bin/python bench/engine_contract.py --model-dir runs/en-de --limit 40 --options greedy_prefix,sample

Not a test: it needs a trained model (`make train`), and takes some minutes. tests/test_engine.py checks the
same contract on every CI run, on the copy task and on the quick model's 100 val sentences, and
tests/test_export_signatures.py each signature's options on the quick model.

The model's weights are mapped to float32 (`export.engine_weights.engine_model`). On the library's side,
`kt.greedy_decode`, `kt.beam_search` and `kt.sample_decode` (`--beam-size`, `--length-penalty`), each in a
`tf.function`. On the export's side, the `Translator` that `kt-export --precision float32` saves (its other
options at their defaults), saved as a SavedModel and loaded back with `tf.saved_model.load`, as TF Serving
loads it; for `no_repeat_ngram`, a second one saved with `no_repeat_ngram_size` (`kt-export
--no-repeat-ngram-size`). Both read the source ids that the SavedModel's `tokenize` signature gives, in
batches of `--batch-size` sentences in file order. A text signature's output is compared with the library's
tokens detokenized by the same tokenizer (the text signatures give no tokens); `translate_ids` gives tokens.

Compared, sentence by sentence, for each of `--options` (default: all):
- greedy: the engine's own greedy search (`export.search.engine_greedy_decode`, in process, on the same float32
  weights) against `kt.greedy_decode`, token for token; and the SavedModel's `greedy` text;
- beam: the SavedModel's `translate_ids` tokens against `kt.beam_search`; and its `serving_default` text;
- n_best: the SavedModel's `n_best` texts against `kt.beam_search(..., n_best=beam_size)`, a sentence agreeing
  when all its n entries are equal;
- beam_prefix, greedy_prefix: the `prefix` and `greedy_prefix` signatures against `kt.beam_search` and
  `kt.greedy_decode` with `prefix_ids`. Each sentence's prefix is the first 2 pieces of its reference
  translation (`--target-lang`), so the forced path is a plausible one that often leaves the greedy output's
  (the count of prefixes that differ from the greedy output's first pieces is printed). It is sent to the
  signature as the pieces' detokenized text; the signature forces that text's whole pieces, so the library is
  given the pieces the tokenizer makes of it (the same 2 unless their text tokenizes otherwise: counted too);
- sample: the `sample` signature with seed i (the sentence's number in the file), temperature 1.0 and top_k 0
  against `kt.sample_decode` with the same per-row seeds;
- no_repeat_ngram: the `greedy` text and `translate_ids` tokens of the export with `--no-repeat-ngram-size`
  (3) against `kt.greedy_decode` and `kt.beam_search` with that `no_repeat_ngram_size`.

Exits 1 unless greedy, greedy_prefix, sample and no_repeat_ngram's greedy agree on every sentence, and beam,
n_best, beam_prefix and no_repeat_ngram's beam on at least `--beam-agreement` of them (0.99).
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
LENGTH_PENALTY = 0.6  # --length-penalty's default


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


# The options compared (`--options`), and each one's checks: (name, rule), the rule "every" (each sentence must
# agree) or "beam" (at least --beam-agreement of them: a beam search's near-ties may go another way when a sum
# rounds differently in another batch shape, greedy decoding and sampling have no such ties to break).
CHECKS = {
    "greedy": [("greedy tokens (engine in process)", "every"), ("greedy text (SavedModel `greedy`)", "every")],
    "beam": [("beam tokens (SavedModel `translate_ids`)", "beam"),
             ("beam text (SavedModel `serving_default`)", "beam")],
    "n_best": [("n-best texts, all n (SavedModel `n_best`)", "beam")],
    "beam_prefix": [("beam with prefix text (SavedModel `prefix`)", "beam")],
    "greedy_prefix": [("greedy with prefix text (SavedModel `greedy_prefix`)", "every")],
    "sample": [("sample text, seed i (SavedModel `sample`)", "every")],
    "no_repeat_ngram": [("no-repeat greedy text (SavedModel `greedy`)", "every"),
                        ("no-repeat beam tokens (SavedModel `translate_ids`)", "beam")],
}
# Pieces of the reference translation that make a sentence's prefix (beam_prefix, greedy_prefix).
PREFIX_PIECES = 2


def _options(p, value):
    """`--options`' comma list -> the options, in CHECKS' order; an argparse error names an unknown one."""
    asked = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in asked if name not in CHECKS]
    if unknown or not asked:
        p.error(f"--options: {', '.join(unknown) or 'none given'}; choose among {', '.join(CHECKS)}")
    return [name for name in CHECKS if name in asked]


def build_parser() -> argparse.ArgumentParser:
    from common.run_dir import add_renamed_flags

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True, help="directory written by kt-train")
    p.add_argument("--model-file", help="another .keras file in place of MODEL_DIR/model.keras (e.g. averaged)")
    p.add_argument("--data-dir", default=str(REPO.parent / "shared" / "data" / "multi30k"))
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--source-lang", default="en")
    p.add_argument("--target-lang", default="de", help="the references whose first pieces make the prefixes")
    p.add_argument("--limit", type=int, help="only the first N sentences (a quick check)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--beam-size", type=int, default=4)
    p.add_argument("--length-penalty", type=float, metavar="A",
                   help=f"the length penalty of the library's searches and the export's (default {LENGTH_PENALTY})")
    add_renamed_flags(p, "alpha")  # --alpha, still read (with a note): see main
    p.add_argument("--no-repeat-ngram-size", type=int, default=3, metavar="N",
                   help="the ban of the no_repeat_ngram option's export and library searches (default 3)")
    p.add_argument("--options", default=",".join(CHECKS),
                   help=f"comma list of the options to compare (default all: {','.join(CHECKS)})")
    p.add_argument("--beam-agreement", type=float, default=0.99,
                   help="least share of equal outputs for beam, n_best, beam_prefix and no_repeat_ngram's beam")
    p.add_argument("--json", help="also write the figures here")
    return p


def main(argv=None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from common.run_dir import take_renamed_flags

    p = build_parser()
    args = p.parse_args(argv)
    take_renamed_flags(p, args, f"{p.prog}:")
    if args.length_penalty is None:  # no default in the parser: --alpha, its old name, may give it
        args.length_penalty = LENGTH_PENALTY
    options = _options(p, args.options)
    if args.no_repeat_ngram_size < 1:
        p.error(f"--no-repeat-ngram-size must be >= 1, got {args.no_repeat_ngram_size}")

    import numpy as np
    import tensorflow as tf

    import keras_transformer as kt
    from export import search
    from export.engine_weights import engine_model
    from common.tokenizer import decode_output
    from export.translator import GREEDY_PREFIX_SIGNATURE, GREEDY_SIGNATURE, IDS_SIGNATURE, N_BEST_SIGNATURE
    from export.translator import PREFIX_SIGNATURE, SAMPLE_SIGNATURE, TEXT_SIGNATURE, TOKENIZE_SIGNATURE
    from export.translator import Translator, load_model_dir
    from keras_transformer.text import END_ID, PAD_ID, START_ID, read_lines

    sources = read_lines(Path(args.data_dir) / f"{args.split}.{args.source_lang}")[: args.limit]
    references = read_lines(Path(args.data_dir) / f"{args.split}.{args.target_lang}")[: args.limit]
    batches = [sources[i : i + args.batch_size] for i in range(0, len(sources), args.batch_size)]
    t0 = time.time()

    def saved_and_loaded(**options):
        """The float32 export's SavedModel signatures, saved and loaded back as TF Serving loads them."""
        translator = Translator.from_model_dir(args.model_dir, model_file=args.model_file, beam_size=args.beam_size,
                                               length_penalty=args.length_penalty, precision="float32",
                                               parallel_loops="auto", **options)
        with tempfile.TemporaryDirectory() as tmp:
            translator.save(Path(tmp) / "1")
            return tf.saved_model.load(str(Path(tmp) / "1"))

    exported = saved_and_loaded()
    signatures = exported.signatures
    banned = (saved_and_loaded(no_repeat_ngram_size=args.no_repeat_ngram_size).signatures
              if "no_repeat_ngram" in options else None)
    model, tokenizer, _ = load_model_dir(args.model_dir, model_file=args.model_file)
    model = engine_model(model, "float32")
    beam, alpha, ngram = args.beam_size, args.length_penalty, args.no_repeat_ngram_size
    library = {
        "greedy": tf.function(lambda s: kt.greedy_decode(model, s, START_ID, END_ID, length_penalty=alpha)),
        "beam": tf.function(lambda s: kt.beam_search(model, s, START_ID, END_ID, beam, alpha)),
        "n_best": tf.function(lambda s: kt.beam_search(model, s, START_ID, END_ID, beam, alpha, n_best=beam)),
        "beam_prefix": tf.function(lambda s, prefix: kt.beam_search(model, s, START_ID, END_ID, beam, alpha,
                                                                    prefix_ids=prefix)),
        "greedy_prefix": tf.function(lambda s, prefix: kt.greedy_decode(model, s, START_ID, END_ID, length_penalty=alpha,
                                                                        prefix_ids=prefix)),
        "sample": tf.function(lambda s, seed: kt.sample_decode(model, s, START_ID, END_ID, seed=seed,
                                                               temperature=1.0, top_k=0, length_penalty=alpha)),
        "no_repeat_greedy": tf.function(lambda s: kt.greedy_decode(model, s, START_ID, END_ID, length_penalty=alpha,
                                                                   no_repeat_ngram_size=ngram)),
        "no_repeat_beam": tf.function(lambda s: kt.beam_search(model, s, START_ID, END_ID, beam, alpha,
                                                               no_repeat_ngram_size=ngram)),
    }
    engine_greedy = tf.function(lambda s: search.engine_greedy_decode(model, s, START_ID, END_ID, length_penalty=alpha))

    def texts(tokens):
        """The library's tokens `[batch, length]` detokenized as the export detokenizes its own."""
        return decode_output(tokenizer, tokens).numpy()

    def prefixes(reference_text, greedy_tokens):
        """(prefix strings `[batch]` for the signature, the ids `[batch, p]` its tokenizer makes of them for the
        library, how many differ from the pieces they were made of, how many differ from the greedy output's
        first pieces): the first PREFIX_PIECES pieces of each reference `[batch]`, detokenized."""
        pieces = [row[:PREFIX_PIECES] for row in tokenizer.tokenize(tf.constant(reference_text)).to_list()]
        strings = tokenizer.detokenize(tf.ragged.constant(pieces, dtype=tf.int32, ragged_rank=1)).numpy()
        forced = tokenizer.tokenize(tf.constant(strings)).to_list()
        other = sum(row != expected for row, expected in zip(forced, pieces))
        off_greedy = sum(tuple(row) != greedy[: len(row)] for row, greedy in zip(forced, _trimmed_rows(greedy_tokens)))
        padded = tf.ragged.constant(forced, dtype=tf.int32, ragged_rank=1).to_tensor(PAD_ID)
        return strings, padded, other, off_greedy

    agree = {check: 0 for option in options for check, _ in CHECKS[option]}
    differing, retokenized, off_greedy = [], 0, 0
    for number, batch in enumerate(batches, 1):
        first = (number - 1) * args.batch_size
        text = tf.constant(batch)
        source = signatures[TOKENIZE_SIGNATURE](text=text)["source_ids"]
        # (check, the library's comparable rows, the export's, the library's text, the export's text)
        compared = []
        if {"greedy", "beam_prefix", "greedy_prefix"} & set(options):
            greedy_tokens = library["greedy"](source)[0].numpy()
        if "greedy" in options:
            library_rows = _trimmed_rows(greedy_tokens)
            library_text, served = texts(greedy_tokens), signatures[GREEDY_SIGNATURE](text=text)["translation"].numpy()
            compared += [(CHECKS["greedy"][0][0], library_rows, _trimmed_rows(engine_greedy(source)[0].numpy()),
                          library_text, served),
                         (CHECKS["greedy"][1][0], library_text, served, library_text, served)]
        if "beam" in options:
            tokens = library["beam"](source)[0].numpy()
            library_text, served = texts(tokens), signatures[TEXT_SIGNATURE](text=text)["translation"].numpy()
            compared += [(CHECKS["beam"][0][0], _trimmed_rows(tokens),
                          _trimmed_rows(signatures[IDS_SIGNATURE](source_ids=source)["tokens"].numpy()),
                          library_text, served),
                         (CHECKS["beam"][1][0], library_text, served, library_text, served)]
        if "n_best" in options:
            tokens = library["n_best"](source)[0].numpy()  # [batch, n, length]
            library_text = texts(tokens.reshape(-1, tokens.shape[-1])).reshape(len(batch), beam)
            served = signatures[N_BEST_SIGNATURE](text=text)["translations"].numpy()
            joined = [np.array([b" ||| ".join(row) for row in rows]) for rows in (library_text, served)]
            compared.append((CHECKS["n_best"][0][0], [tuple(row) for row in library_text],
                             [tuple(row) for row in served], *joined))
        if "beam_prefix" in options or "greedy_prefix" in options:
            prefix_text, prefix_ids, other, off = prefixes(references[first : first + len(batch)], greedy_tokens)
            retokenized, off_greedy = retokenized + other, off_greedy + off
        for option, signature in (("beam_prefix", PREFIX_SIGNATURE), ("greedy_prefix", GREEDY_PREFIX_SIGNATURE)):
            if option in options:
                library_text = texts(library[option](source, prefix_ids)[0])
                served = signatures[signature](text=text, prefix=tf.constant(prefix_text))["translation"].numpy()
                compared.append((CHECKS[option][0][0], library_text, served, library_text, served))
        if "sample" in options:
            seeds = np.arange(first, first + len(batch))
            library_text = texts(library["sample"](source, tf.constant(seeds, tf.int32))[0])
            served = signatures[SAMPLE_SIGNATURE](
                text=text, seed=tf.constant(seeds, tf.int64), temperature=tf.ones([len(batch)], tf.float32),
                top_k=tf.zeros([len(batch)], tf.int32))["translation"].numpy()
            compared.append((CHECKS["sample"][0][0], library_text, served, library_text, served))
        if "no_repeat_ngram" in options:
            library_text = texts(library["no_repeat_greedy"](source)[0])
            served = banned[GREEDY_SIGNATURE](text=text)["translation"].numpy()
            compared.append((CHECKS["no_repeat_ngram"][0][0], library_text, served, library_text, served))
            tokens = library["no_repeat_beam"](source)[0].numpy()
            compared.append((CHECKS["no_repeat_ngram"][1][0], _trimmed_rows(tokens),
                             _trimmed_rows(banned[IDS_SIGNATURE](source_ids=source)["tokens"].numpy()),
                             texts(tokens), banned[TEXT_SIGNATURE](text=text)["translation"].numpy()))
        for check, library_rows, served_rows, library_text, served_text in compared:
            equal = [a == b for a, b in zip(library_rows, served_rows)]
            agree[check] += sum(equal)
            differing += [{"check": check, "sentence": first + i, "source": batch[i],
                           "library": library_text[i].decode(), "export": served_text[i].decode()}
                          for i, same in enumerate(equal) if not same]
        print(f"\r{number}/{len(batches)} batches, {time.time() - t0:.0f}s", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)

    n = len(sources)
    print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, flags: {_cpu_flags()}")
    print(f"{args.split}: {n} sentences, float32, beam {args.beam_size}, alpha {args.length_penalty}, "
          f"no_repeat_ngram_size {args.no_repeat_ngram_size}, {time.time() - t0:.0f}s")
    checks = {}
    for option in options:
        for check, rule in CHECKS[option]:
            need = n if rule == "every" else args.beam_agreement * n
            checks[check] = {"option": option, "equal": agree[check], "sentences": n, "rule": rule,
                             "passed": agree[check] >= need}
            goal = "every sentence" if rule == "every" else f"goal >= {100 * args.beam_agreement:g}%"
            print(f"  {option:15s} {check:52s} equal to the library's: {agree[check]}/{n} "
                  f"({100 * agree[check] / max(n, 1):.1f}%; {goal}){'' if checks[check]['passed'] else '  FAILED'}")
    if "beam_prefix" in options or "greedy_prefix" in options:
        print(f"  prefixes (the references' first {PREFIX_PIECES} pieces) that leave the greedy output: "
              f"{off_greedy}/{n}; whose text tokenizes to other pieces: {retokenized}/{n}")
    for d in differing[:10]:
        print(f"  differs ({d['check']}, sentence {d['sentence']}): {d['source']!r}\n"
              f"    library: {d['library']!r}\n    export:  {d['export']!r}")
    passed = all(check["passed"] for check in checks.values())
    print("contract: " + ("met" if passed else "NOT met: " + ", ".join(
        name for name, check in checks.items() if not check["passed"])))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "sentences": n, "split": args.split, "beam_size": args.beam_size, "alpha": args.length_penalty,
            "no_repeat_ngram_size": args.no_repeat_ngram_size, "beam_agreement": args.beam_agreement,
            "options": options, "checks": checks, "agree": agree, "prefixes_retokenized_otherwise": retokenized,
            "prefixes_off_greedy": off_greedy,
            "differing": differing, "cpu_flags": _cpu_flags(), "passed": passed}, indent=2))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
