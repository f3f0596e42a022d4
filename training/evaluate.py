r"""Translate a test split with a trained model and score it with sacreBLEU.

    python -m training.evaluate --model-dir runs/en-de --data-dir ../shared/data/multi30k \
        --split test_2016_flickr

Translates with the functions `kt-export` saves (`export.translator.Translator`:
tokenize, beam search, detokenize in one `tf.function`; beam 4 by default,
`--beam-size 1` for greedy decoding), so the scores printed are those of the
exported model. Prints sacreBLEU's corpus BLEU with its signature and chrF
(case-insensitive, `case:lc`, for a model trained with `kt-train --lowercase`),
for Multi30k the BLEU of the Multi30k protocol (`multi30k_protocol_bleu`), for
WMT datasets (and with `--paper-bleu`) the paper's BLEU (`compound_split_bleu`),
and how many sources were longer than the model's limit and cut before
translation; writes the hypotheses (one per line, input order) and a JSON of
the scores. A progress bar goes to stderr when it is a terminal.

The Multi30k protocol is how the Multi30k literature scores (e.g. Wu et al.,
2021): lowercased, punctuation-normalised, Moses-tokenised text, as in the
official tokenised Multi30k files (`lowercase.perl | normalize-punctuation.perl
-l LANG | tokenizer.perl -l LANG`), scored with `sacrebleu -tok none`. The same
pipeline in Python (sacremoses) is applied to the detokenised output and to the
raw references.

The paper's BLEU is the one "Attention Is All You Need" reports for WMT 2014,
as tensor2tensor's `get_ende_bleu.sh` computes it (the compound split is there
"comparable to papers like GNMT, ConvS2S", its comment says): output and references Moses-tokenised (`tokenizer.perl -l LANG`),
every hyphen between two non-spaces split off as `##AT##-##AT##`
(`perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g'`), then cased
`multi-bleu.perl` (sacreBLEU with no tokeniser and no smoothing). It is printed
when the dataset (`--dataset`, else the one config.json records) is a TFDS
name beginning with `wmt`, and for any dataset with `--paper-bleu`.

With `--metric evalb` (recorded by the parsing recipe, configs/parsing-wsj.json)
the outputs are linearised parses and the references gold trees, one a line
(kt-treebank's PREFIX.gold): it prints EVALB's bracket F1 with COLLINS.prm's
conventions, and how many parses had to be repaired into trees
(`training.trees.score_parses`).

`--hypotheses FILE --references FILE` scores an existing file without decoding
(`--target-lang LANG --paper-bleu` for the paper's BLEU of, e.g., newstest2014).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from common.native_logs import VERBOSE_HELP, quiet_import_for_commands

# Before TensorFlow is imported: a command prints none of its C++ start-up lines (see common/native_logs.py).
quiet_import_for_commands(__name__)

import tensorflow as tf  # noqa: E402
import tensorflow_datasets as tfds  # noqa: E402
from sacrebleu.metrics import BLEU, CHRF  # noqa: E402
from sacremoses import MosesPunctNormalizer, MosesTokenizer  # noqa: E402
from tqdm import tqdm  # noqa: E402

from export.translate import Translated, translate_lines  # noqa: E402
from common.run_dir import (DEFAULT_BEAM_SIZE, DEFAULT_LENGTH_PENALTY, add_renamed_flags, read_config,  # noqa: E402
                            recorded_setting, take_renamed_flags)
from export.translator import Translator  # noqa: E402
from keras_transformer.text import read_lines  # noqa: E402
from training.data import DataSpec, load_text_pairs  # noqa: E402
from training.errors import DataError  # noqa: E402
from training.trees import METRICS, TreeError, gold_trees, score_parses  # noqa: E402
from keras_transformer.decoding import EXTRA_OUTPUT_LENGTH  # noqa: E402


MULTI30K_PROTOCOL = "Multi30k protocol (lowercased, Moses punctuation-normalised and tokenised; sacrebleu -tok none)"
PAPER_PROTOCOL = ("Paper protocol (Moses-tokenised, compounds split ##AT##-##AT##, multi-bleu.perl; "
                  "tensor2tensor's get_ende_bleu.sh)")
# tensor2tensor's and fairseq's `perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g'`. ASCII: that Perl reads bytes,
# to which only ASCII whitespace is \s (a no-break space is \S there, as here).
_COMPOUND_HYPHEN = re.compile(r"(\S)-(\S)", re.ASCII)


def moses_tokenised(lines: list[str], lang: str) -> list[str]:
    """`lines` as the official tokenised Multi30k files have them: lowercased, punctuation-normalised and
    Moses-tokenised for `lang` (`lowercase.perl | normalize-punctuation.perl -l LANG | tokenizer.perl -l LANG`)."""
    normalizer, tokenizer = MosesPunctNormalizer(lang), MosesTokenizer(lang)
    return [tokenizer.tokenize(normalizer.normalize(line.lower()), return_str=True, escape=True) for line in lines]


def multi30k_protocol_bleu(hypotheses: list[str], references: list[str], lang: str):
    """Corpus BLEU of the Multi30k protocol (`MULTI30K_PROTOCOL`): `(sacrebleu BLEUScore, its signature)`."""
    # force: these lines are tokenised on purpose (the protocol's), which sacreBLEU would otherwise warn
    # about at every evaluation ("It looks like you forgot to detokenize your test data").
    bleu = BLEU(tokenize="none", force=True)
    tokenised = bleu.corpus_score(moses_tokenised(hypotheses, lang), [moses_tokenised(references, lang)])
    return tokenised, bleu.get_signature()


def compound_split(line: str) -> str:
    r"""`line` (Moses-tokenised) with every hyphen between two non-space characters split off as
    `##AT##-##AT##`: "Kosten-Nutzen-Verhältnis" -> "Kosten ##AT##-##AT## Nutzen ##AT##-##AT## Verhältnis".
    Exactly tensor2tensor's and fairseq's `perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g'`, quirk included:
    a match takes the character after the hyphen, so a one-character part keeps its next hyphen
    ("U-S-Bahn" -> "U ##AT##-##AT## S-Bahn")."""
    return _COMPOUND_HYPHEN.sub(r"\1 ##AT##-##AT## \2", line)


def compound_split_bleu(hypotheses: list[str], references: list[str], lang: str, lowercase: bool = False):
    """The paper's BLEU (`PAPER_PROTOCOL`): tokenised BLEU with compound splitting, as "Attention Is All You
    Need" reports it for WMT 2014; `(sacrebleu BLEUScore, its signature)`.

    Follows tensor2tensor's `tensor2tensor/utils/get_ende_bleu.sh`: `tokenizer.perl -l LANG` (here
    sacremoses' `MosesTokenizer(lang)` with tokenizer.perl's defaults: no aggressive hyphen splitting,
    `&`, `<`, `"` ... escaped), then `compound_split`, then cased `multi-bleu.perl`, which is sacreBLEU's
    BLEU with no tokeniser and no smoothing: whitespace-split 1- to 4-gram precisions, clipped by the
    reference's counts, their geometric mean times the brevity penalty, 0 when a precision is 0.
    `lowercase` (for a case-folding model) lowercases both sides first, as `multi-bleu.perl -lc` does,
    but all letters (sacreBLEU's `lowercase`), where Perl's byte-wise `lc` leaves "Ä" as it is.

    fairseq's `scripts/compound_split_bleu.sh` is the same on output already Moses-tokenised. Here the
    detokenised `hypotheses` and the raw `references` are tokenised alike. (Later versions of
    get_ende_bleu.sh also pass the hypotheses, not the references, through
    `replace-unicode-punctuation.perl`; that step is not taken here.)"""
    tokenizer = MosesTokenizer(lang)

    def prepared(lines):
        return [compound_split(tokenizer.tokenize(line, return_str=True, escape=True)) for line in lines]

    # force: tokenised on purpose, as for the Multi30k protocol.
    bleu = BLEU(tokenize="none", smooth_method="none", lowercase=lowercase, force=True)
    return bleu.corpus_score(prepared(hypotheses), [prepared(references)]), bleu.get_signature()


def score(hypotheses: list[str], references: list[str], lang: str | None = None, lowercase: bool = False,
          multi30k: bool = True, paper: bool = False) -> dict:
    """sacreBLEU corpus BLEU and chrF (default settings, one reference), and with the target language
    `lang` the BLEU of the Multi30k protocol (`multi30k_protocol_bleu`; unless not `multi30k`) and, with
    `paper`, the paper's BLEU (`compound_split_bleu`). `lowercase` scores BLEU, chrF and the paper's BLEU
    case-insensitively (sacreBLEU's `lowercase`; its signature says `case:lc`), as for a model whose
    vocabulary case-folds (`kt-train --lowercase`) and so writes lowercase text."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    bleu, chrf = BLEU(lowercase=lowercase), CHRF(lowercase=lowercase)
    b = bleu.corpus_score(hypotheses, [references])
    c = chrf.corpus_score(hypotheses, [references])
    scores = {
        "bleu": b.score, "bleu_signature": str(bleu.get_signature()), "bleu_text": b.format(signature=str(bleu.get_signature())),
        "chrf": c.score, "chrf_signature": str(chrf.get_signature()), "chrf_text": c.format(signature=str(chrf.get_signature())),
        "sentences": len(hypotheses),
    }
    if lang and multi30k:
        m, signature = multi30k_protocol_bleu(hypotheses, references, lang)
        scores.update({"multi30k_bleu": m.score, "multi30k_bleu_lang": lang,
                       "multi30k_bleu_text": f"{MULTI30K_PROTOCOL}, {lang}: {m.format(signature=str(signature))}"})
    if lang and paper:
        p, signature = compound_split_bleu(hypotheses, references, lang, lowercase=lowercase)
        scores.update({"paper_bleu": p.score, "paper_bleu_lang": lang, "paper_bleu_signature": str(signature),
                       "paper_bleu_text": f"{PAPER_PROTOCOL}, {lang}: {p.format(signature=str(signature))}"})
    return scores


def translate_all(translator, sources: list[str], beam_size: int = 4, batch_size: int = 64,
                  progress: bool = False) -> Translated:
    """Translates `sources` with a `Translator`'s exported functions, in batches of similar length.

    Beam search (`serving_default`) when `beam_size > 1`, else `greedy`: the very
    functions `kt-export` saves, so the BLEU printed is the export's. Returns
    `export.translate.Translated`: the hypotheses (`texts`) and scores in input
    order, a blank source line giving an empty hypothesis, and `truncated_lines`,
    the 1-based numbers of the sources cut to the model's limit (the functions'
    `truncated` output) before they were translated.
    """
    function = translator.translate if beam_size > 1 else translator.translate_greedy

    def translate(batch):
        out = function(tf.constant(batch))
        texts = [t.decode("utf-8", errors="replace") for t in out["translation"].numpy().tolist()]
        return texts, out["score"], out["truncated"].numpy().tolist()

    bar = tqdm(total=len(sources), unit="sent", file=sys.stderr, disable=not progress)
    with bar:
        return translate_lines(translate, sources, batch_size, bar)


def truncation_line(truncated: int, sources: int, max_source_length: int) -> str:
    """kt-evaluate's line for `truncated` of `sources` sources cut to the model's limit."""
    return (f"{truncated} of {sources} sources were longer than the model's limit of {max_source_length} tokens "
            "(config.json max_source_length, end token included) and were cut before translation "
            "(their BLEU counts the cut translation)")


def build_parser():
    p = argparse.ArgumentParser(prog="kt-evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", help="directory written by kt-train")
    p.add_argument("--model-file", help="another .keras file to evaluate (e.g. MODEL_DIR/averaged.keras)")
    p.add_argument("--weights", help="a .weights.h5 checkpoint to load into the model (e.g. MODEL_DIR/checkpoints/"
                   "epoch-020.weights.h5; while kt-train still runs, the model is built from config.json)")
    p.add_argument("--dataset", help="multi30k | files | TFDS name (default: the one trained on)")
    p.add_argument("--data-dir", help="raw Multi30k directory")
    p.add_argument("--tfds-data-dir")
    p.add_argument("--split", help="default: test_2016_flickr for Multi30k, test for TFDS datasets")
    p.add_argument("--source-file", help="plain source text to translate (with --references)")
    p.add_argument("--references", help="reference translations, one per line")
    p.add_argument("--hypotheses", help="score this hypothesis file instead of decoding")
    p.add_argument("--target-lang", help="the language of the Multi30k-protocol BLEU's and the paper's BLEU's Moses "
                                         "normalisation and tokenisation (default: the model's target language; "
                                         "without a model and without this, those BLEUs are not computed)")
    p.add_argument("--paper-bleu", action="store_true",
                   help="also print the paper's BLEU (Moses-tokenised, compound-split, multi-bleu.perl; printed "
                        "without this flag for datasets whose TFDS name begins with 'wmt') for any dataset, "
                        "e.g. for --hypotheses/--references files of newstest2014; needs the target language")
    p.add_argument("--beam-size", type=int, help="1 = greedy (default: the one kt-train --beam-size recorded in "
                   f"config.json, else {DEFAULT_BEAM_SIZE})")
    p.add_argument("--length-penalty", type=float, metavar="A",
                   help="length penalty: a hypothesis scores log P / ((5 + length) / 6)^A (default: the one "
                   f"kt-train --length-penalty recorded in config.json, else {DEFAULT_LENGTH_PENALTY})")
    p.add_argument("--metric", choices=METRICS,
                   help="bleu: sacreBLEU's BLEU and chrF of translations; evalb: EVALB's bracket F1 (COLLINS.prm) "
                        "of linearised parses (kt-treebank's PREFIX.linear as the target) against --references, "
                        "the gold trees one a line (its PREFIX.gold). Default: the one kt-train --metric "
                        "recorded in config.json, else bleu")
    p.add_argument("--extra-output-length", type=int, metavar="N",
                   help="an output has at most its source's length + N pieces (default: the one kt-train "
                        f"--extra-output-length recorded in config.json, else {EXTRA_OUTPUT_LENGTH})")
    # The old name of --length-penalty, still read (with a note): see main.
    add_renamed_flags(p, "alpha")  # --alpha, still read (with a note)
    p.add_argument("--batch-size", type=int, default=64, help="sentences per decoding batch")
    p.add_argument("--max-examples", type=int, help="decode only the first N sentences")
    p.add_argument("--output", help="hypothesis file (default MODEL_DIR/hyp.SPLIT.LANG)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (shown on stderr when there is more than one batch, as kt-translate does)")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    return p


def _source_and_refs(args, cfg):
    """(sources, references) for the requested split or files."""
    if args.source_file:
        if not args.references:
            raise SystemExit("--source-file needs --references")
        return read_lines(args.source_file), read_lines(args.references)
    t = cfg.get("training", {})
    dataset = _dataset(args, cfg)
    if dataset == "files":
        raise SystemExit("This model was trained on plain files: pass --source-file and --references")
    spec = DataSpec(dataset=dataset, source_lang=cfg["source_lang"], target_lang=cfg["target_lang"],
                    data_dir=args.data_dir or t.get("data_dir"), tfds_data_dir=args.tfds_data_dir or t.get("tfds_data_dir"))
    split = args.split or ("test_2016_flickr" if dataset == "multi30k" else "test")
    pairs = list(load_text_pairs(spec, split, max_examples=args.max_examples).as_numpy_iterator())
    return [s.decode("utf-8") for s, _ in pairs], [r.decode("utf-8") for _, r in pairs]


def _dataset(args, cfg: dict) -> str:
    """The dataset evaluated: `--dataset`, else the one config.json records, else Multi30k."""
    return args.dataset or cfg.get("training", {}).get("dataset", "multi30k")


def _protocols(args, cfg: dict, lang: str | None) -> dict:
    """`score`'s `multi30k` and `paper` for `args` and config.json `cfg`: the Multi30k protocol for Multi30k,
    the paper's BLEU for datasets whose TFDS name begins with "wmt" and with `--paper-bleu`."""
    dataset = _dataset(args, cfg)
    if args.paper_bleu and not lang:
        raise SystemExit("--paper-bleu needs the target language, for its Moses tokenisation: pass --target-lang "
                         "LANG (or --model-dir of a model)")
    return {"multi30k": dataset == "multi30k", "paper": args.paper_bleu or dataset.startswith("wmt")}


def _metric(args, cfg: dict) -> str:
    """The score: `--metric`, else the one kt-train recorded, else BLEU. EVALB's needs gold trees in a file."""
    metric = recorded_setting(cfg, "metric", args.metric, "bleu")
    if metric == "evalb" and not args.references:
        raise SystemExit("--metric evalb scores parses against gold trees: pass --references GOLD (kt-treebank's "
                         "PREFIX.gold) and --source-file (its PREFIX.words) or --hypotheses")
    return metric


def _lowercases(cfg: dict) -> bool:
    """Whether kt-train recorded a case-folding vocabulary (`--lowercase`) in config.json."""
    return bool(cfg.get("training", {}).get("lowercase"))


def scorer(references: list[str], metric: str, args, cfg: dict, lang: str | None):
    """`hypotheses -> scores` against `references` (lines) by `metric`: `score`'s BLEU and chrF, or for "evalb"
    EVALB's of parses against the gold trees the references are (`training.trees.score_parses`). Made before
    anything is decoded, so that a bad option or gold tree is named first; the gold trees are read once."""
    if metric == "evalb":
        gold = gold_trees(references, args.references)  # `_metric` requires the file
        return lambda hypotheses: score_parses(hypotheses, gold)
    protocols, lowercase = _protocols(args, cfg, lang), _lowercases(cfg)
    return lambda hypotheses: score(hypotheses, references, lang, lowercase=lowercase, **protocols)


def print_scores(scores: dict) -> None:
    if "evalb_text" in scores:
        print(scores["evalb_text"])
        return
    print(scores["bleu_text"])
    print(scores["chrf_text"])
    if "multi30k_bleu_text" in scores:
        print(scores["multi30k_bleu_text"])
    if "paper_bleu_text" in scores:
        print(scores["paper_bleu_text"])


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    take_renamed_flags(parser, args, "kt-evaluate:")
    if args.extra_output_length is not None and args.extra_output_length < 0:
        parser.error(f"--extra-output-length must be >= 0, got {args.extra_output_length}")
    try:
        return evaluate(args)
    except (FileNotFoundError, DataError, TreeError) as e:
        print(f"kt-evaluate: error: {e}", file=sys.stderr)
        return 2


def evaluate(args) -> int:
    """kt-evaluate's work for parsed `args` (see `build_parser`)."""
    if args.hypotheses:
        if not args.references and not args.model_dir:
            raise SystemExit("--hypotheses needs --references (or --model-dir and --split)")
        hyps = read_lines(args.hypotheses)
        cfg = read_config(args.model_dir) if args.model_dir else {}
        refs = read_lines(args.references) if args.references else _source_and_refs(args, cfg)[1]
        lang = args.target_lang or cfg.get("target_lang")
        scores = scorer(refs, _metric(args, cfg), args, cfg, lang)(hyps)
        print_scores(scores)
        if args.output:
            Path(args.output).write_text(json.dumps(scores, indent=2))
        return 0

    if not args.model_dir:
        raise SystemExit("--model-dir is required to decode")
    tfds.disable_progress_bar()
    cfg = read_config(args.model_dir)
    lang = args.target_lang or cfg["target_lang"]
    sources, refs = _source_and_refs(args, cfg)
    if args.max_examples:
        sources, refs = sources[: args.max_examples], refs[: args.max_examples]
    scoring = scorer(refs, _metric(args, cfg), args, cfg, lang)
    args.beam_size = recorded_setting(cfg, "beam_size", args.beam_size, DEFAULT_BEAM_SIZE)
    args.length_penalty = recorded_setting(cfg, "length_penalty", args.length_penalty, DEFAULT_LENGTH_PENALTY)
    args.extra_output_length = recorded_setting(cfg, "extra_output_length", args.extra_output_length,
                                                EXTRA_OUTPUT_LENGTH)
    translator = Translator.from_model_dir(args.model_dir, model_file=args.model_file, weights=args.weights,
                                           beam_size=args.beam_size, length_penalty=args.length_penalty,
                                           extra_output_length=args.extra_output_length)
    t0 = time.time()
    progress = not args.no_progress and len(sources) > args.batch_size
    translated = translate_all(translator, sources, args.beam_size, args.batch_size, progress=progress)
    hyps, truncated = translated.texts, len(translated.truncated_lines)
    elapsed = time.time() - t0
    default_split = "test_2016_flickr" if _dataset(args, cfg) == "multi30k" else "test"
    name = Path(args.source_file).name if args.source_file else (args.split or default_split)
    out = Path(args.output) if args.output else Path(args.model_dir) / f"hyp.{name}.{cfg['target_lang']}"
    out.write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    scores = scoring(hyps)
    scores.update({"beam_size": args.beam_size, "length_penalty": args.length_penalty, "hypotheses_file": str(out),
                   "decode_seconds": round(elapsed, 1), "truncated_sources": truncated,
                   "max_source_length": translator.max_source_length})
    out.with_suffix(out.suffix + ".scores.json").write_text(json.dumps(scores, indent=2))
    print(f"Decoded {len(hyps)} sentences in {elapsed:.1f}s (beam {args.beam_size}) -> {out}")
    if truncated:
        print(truncation_line(truncated, len(sources), translator.max_source_length))
    print_scores(scores)
    return 0


if __name__ == "__main__":
    sys.exit(main())
