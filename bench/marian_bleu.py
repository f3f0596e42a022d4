"""Our export of a Marian (OPUS-MT) translator against transformers on the same test set: sacreBLEU of each,
the difference, and how many outputs are identical (not a test).

    .venv/bin/python bench/marian_bleu.py --marian opus-mt-en-de --source-file test.en --references test.de

In the project's virtualenv: `kt-import` (training/import_marian.py) turns the Hugging Face directory into a run
directory, `export.export_model.export` writes its SavedModel (beam search, float32), and the source file is
translated through the loaded SavedModel's `serving_default` signature in batches of similar length, text in,
text out. Then the same sentences go through transformers in the PyTorch virtualenv (`--torch-python`, made by
`make venv-torch`), which this script runs as a subprocess of itself (`--transformers-worker`):
`MarianMTModel.generate` on `MarianTokenizer`'s ids, one sentence at a time, decoded with
`skip_special_tokens=True`. Both outputs are scored with sacreBLEU's defaults (13a tokenisation, cased) against
the references. The work directory (`--work-dir`, a new temporary one by default) keeps the imported run, the
export, both hypotheses files and a JSON of the results; the rows where the two differ are listed in
diff.MODE.jsonl.

Output length: each output has at most its source's length (MarianTokenizer's ids, `</s>` included) plus
`--extra-output-length` tokens, its end included, in both. transformers gets that as `max_new_tokens`, which is
one limit per `generate` call: translating one sentence per call gives each sentence its own limit, as the
export does (a padded batch would give every sentence the longest source's limit, and its padding can change
the last digits of the scores a close tie is decided on).

The modes:

- `same-objective` (the default): both search for the same thing, so their BLEU should agree. Ours at length
  penalty 0 ranks hypotheses by log P, and transformers gets length penalty 0 (also log P), `early_stopping=True`
  (done once `--beam-size` hypotheses have ended, as ours is) and `on_our_terms`, a logits processor that scores
  tokens as ours does (see its docstring). The rows where the outputs still differ are then rows where our beam
  kept its greedy hypothesis, which is more probable (docs/marian.md); the table counts which side's output
  is more probable on the rows that differ. Exits 1 if the two BLEU scores differ by more than
  `SAME_OBJECTIVE_TOLERANCE`.
- `defaults`: what each gives out of the box. transformers' stock `generate` with the model's
  generation_config.json (its length penalty, 1.0 in OPUS-MT's, divides log P by the length; `early_stopping`
  False; the end forced at the limit), ours at length penalty 1.0 (what kt-import records), which divides log P
  by ((5 + length) / 6): the objectives differ, so the figures are informational and the exit status is 0.

The seconds are each side's translating time alone (after loading), ours in batches (`--batch-size`) on
TensorFlow's thread pools, transformers one sentence at a time on torch's default threads: they say how long
the run took, not which engine is faster (bench/served_speed.py and BENCHMARKS.md compare speeds).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("same-objective", "defaults")
# |ours - transformers| in BLEU points above which same-objective mode fails: the two search for the same
# output, so the BLEU scores should be equal, but for the rows where our beam keeps a more probable greedy
# hypothesis (docs/marian.md).
SAME_OBJECTIVE_TOLERANCE = 0.1
# Two beam scores this close (log P, at length penalty 0) are a tie: float32 against float32 in two engines.
SCORE_TIE = 1e-4
LENGTH_PENALTY = {"same-objective": 0.0, "defaults": 1.0}  # ours; transformers' is in `transformers_worker`
WORKER_FLAG = "--transformers-worker"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/marian_bleu.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--marian", required=True, metavar="DIR",
                   help="a Hugging Face Marian directory (config.json, model.safetensors, source.spm, target.spm, "
                        "vocab.json), e.g. a download of Helsinki-NLP/opus-mt-en-de")
    p.add_argument("--source-file", required=True, help="the source sentences, one a line")
    p.add_argument("--references", required=True, help="their reference translations, one a line")
    p.add_argument("--max-examples", type=int, default=0, metavar="N",
                   help="the first N lines only (default: all of them)")
    p.add_argument("--work-dir", help="where the imported run, the export, the hypotheses and results.MODE.json "
                                      "go (default: a new temporary directory, kept and printed)")
    p.add_argument("--mode", choices=MODES, default="same-objective",
                   help="same-objective: length penalty 0 in both, transformers with early_stopping=True and "
                        "on_our_terms, the exact comparison (exit 1 if BLEU differs by more than "
                        f"{SAME_OBJECTIVE_TOLERANCE}); defaults: transformers' generation_config.json against "
                        "our length penalty 1.0, informational (default: %(default)s)")
    p.add_argument("--beam-size", type=int, default=4, help="the beam of both (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=32,
                   help="sentences per call of our SavedModel (transformers translates one at a time: see the "
                        "docstring; default: %(default)s)")
    p.add_argument("--extra-output-length", type=int, default=20, metavar="N",
                   help="each output has at most its source's length + N tokens, in both (default: %(default)s)")
    p.add_argument("--torch-python", default=str(REPO / ".venv-torch" / "bin" / "python"),
                   help="the interpreter of a virtualenv with torch, transformers and sentencepiece "
                        "(default: %(default)s, made by `make venv-torch`)")
    return p


def log(message):
    print(f"marian_bleu: {message}", file=sys.stderr, flush=True)


class Progress:
    """`update(n)` prints "WHAT: done/total sentences, S s" on stderr now and then (translate_lines calls it)."""

    def __init__(self, what, total, every=30.0):
        self.what, self.total, self.every, self.done = what, total, every, 0
        self.start = self.last = time.perf_counter()

    def update(self, n):
        self.done += n
        now = time.perf_counter()
        if now - self.last >= self.every or self.done >= self.total:
            self.last = now
            log(f"{self.what}: {self.done}/{self.total} sentences, {now - self.start:.0f} s")


# ------------------------------------------------------------ ours (the project's virtualenv)

def translate_with_our_export(args, work, sources, mode):
    """Imports --marian, exports it for `mode` and translates `sources`: ([translation], [score or None],
    seconds translating, [1-based lines cut to the model's source limit])."""
    sys.path.insert(0, str(REPO))
    from common.native_logs import LOG_LEVEL_ENV, QUIET_LOG_LEVEL, import_tensorflow_quietly

    os.environ.setdefault(LOG_LEVEL_ENV, QUIET_LOG_LEVEL)  # TensorFlow's C++ lines would bury the progress
    import_tensorflow_quietly()
    import tensorflow_text  # noqa: F401  (registers the sentencepiece ops the export's graph holds)

    from export.export_model import export
    from export.translate import SavedModelTranslator, translate_lines
    from training.import_marian import main as kt_import

    run = work / "run"
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # kt-import's lines (its notes) are progress, not the table
        status = kt_import(["--marian", str(args.marian), "--model-dir", str(run), "--force"])
    if status:
        raise SystemExit(status)
    log(f"imported into {run} in {time.perf_counter() - t0:.0f} s")

    export_dir = work / f"export-{mode}"
    shutil.rmtree(export_dir, ignore_errors=True)  # this script's own folder: each run exports afresh
    t0 = time.perf_counter()
    saved = export(run, export_dir, beam_size=args.beam_size, length_penalty=LENGTH_PENALTY[mode],
                   extra_output_length=args.extra_output_length, precision="float32", check_ops=False)
    log(f"exported {saved} (beam {args.beam_size}, length penalty {LENGTH_PENALTY[mode]}, outputs at most "
        f"source + {args.extra_output_length}) in {time.perf_counter() - t0:.0f} s")

    translator = SavedModelTranslator(saved)
    translator(["warm-up"])  # the first call traces the signature's function: not translating time
    t0 = time.perf_counter()
    done = translate_lines(translator, sources, batch_size=args.batch_size,
                           progress=Progress("ours", len(sources)))
    seconds = time.perf_counter() - t0
    return done.texts, done.scores, seconds, done.truncated_lines


# ------------------------------------------------------------ transformers (the PyTorch virtualenv)

def on_our_terms(pad_id, eos_id, max_length):
    """A transformers `LogitsProcessor` that makes its beam search score tokens as ours does, in the two places
    where their conventions differ (`max_length` counts the decoder's start, as transformers' does). Used here
    and by the tests that compare our searches with transformers' (tests/marian_reference.py, test_marian.py).

    - Marian's <pad> is never an output. transformers bans it (`bad_words_ids`) after the log-softmax, so its
      probability is lost and the other tokens' log-probabilities no longer sum to 1; our mapping masks it before
      (as transformers' Marian did until 2023, and as `renormalize_logits=True` does, which transformers PR #25459
      asks Marian's generation configs to set). Here: the log-softmax again, over every id but <pad>.
    - At the length limit our searches force the end token and count its log-probability. transformers without
      `forced_eos_token_id` ends there on whatever token comes (no EOS), and with it scores the forced EOS as
      log-probability 0 (and so would `renormalize_logits`, applied after every processor). Here: at the last
      position only EOS, at its own log-probability.
    """
    import math

    import torch  # the PyTorch virtualenv's: this module imports neither at its top
    from transformers import LogitsProcessor

    class OnOurTerms(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores = scores.clone()
            scores[:, pad_id] = -math.inf
            scores = torch.log_softmax(scores, dim=-1)
            if input_ids.shape[-1] == max_length - 1:  # the position of the last token: only EOS may come
                only_eos = torch.full_like(scores, -math.inf)
                only_eos[:, eos_id] = scores[:, eos_id]
                scores = only_eos
            return scores

    return OnOurTerms()


def transformers_worker(spec_json) -> int:
    """Run by `--torch-python` as `marian_bleu.py --transformers-worker JSON`: translates spec["source_file"]
    with transformers and writes spec["output"] (one translation a line) and spec["result"] (JSON: scores,
    seconds, versions). Imports nothing of the project, which the PyTorch virtualenv need not have."""
    import torch
    import transformers
    from transformers import GenerationConfig, LogitsProcessorList, MarianMTModel, MarianTokenizer

    spec = json.loads(spec_json)
    # generate() warns once a call that `max_new_tokens` takes precedence over generation_config.json's
    # `max_length` (OPUS-MT's set 512): it is the limit meant here, so the warning is dropped, and nothing else.
    transformers.utils.logging.get_logger("transformers.generation.utils").addFilter(
        lambda record: "seem to have been set" not in record.getMessage())
    tokenizer = MarianTokenizer.from_pretrained(spec["marian"])
    model = MarianMTModel.from_pretrained(spec["marian"]).eval()
    config = model.config
    stock = model.generation_config
    if spec["mode"] == "same-objective":
        # generate() fills every option its caller leaves unset (None) from the model's generation config, so
        # generation_config.json could change what is searched for (`renormalize_logits`, which some OPUS-MT
        # configs set; a `no_repeat_ngram_size`; `forced_eos_token_id`, which its caller cannot unset by
        # giving None in a GenerationConfig of its own): the model keeps its ids only, and the search's options
        # are generate()'s arguments, as tests/marian_reference.py gives them.
        model.generation_config = GenerationConfig(
            decoder_start_token_id=config.decoder_start_token_id, eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id)
    sources = Path(spec["source_file"]).read_text(encoding="utf-8").split("\n")[:-1]
    beam, extra, mode = spec["beam_size"], spec["extra_output_length"], spec["mode"]
    if mode == "defaults" and stock.num_beams != beam:
        print(f"marian_bleu: transformers: generation_config.json's num_beams is {stock.num_beams}; "
              f"--beam-size {beam} is used in both", file=sys.stderr)
    translations, scores = [], []
    progress_every, last = 30.0, time.perf_counter()
    t0 = last
    with torch.no_grad():
        for i, sentence in enumerate(sources):
            ids = tokenizer(sentence, truncation=True)["input_ids"]  # MarianTokenizer's </s> included
            limit = len(ids) + extra
            common = dict(max_new_tokens=limit, num_beams=beam, do_sample=False, return_dict_in_generate=True,
                          output_scores=True)
            if mode == "same-objective":
                # As tests/marian_reference.py's beam: length penalty 0, done once `beam` hypotheses have
                # ended, no forced end (on_our_terms forces it, at its own log-probability), no renormalising
                # after the processors (that would score the forced end as log-probability 0 again).
                result = model.generate(
                    torch.tensor([ids]), length_penalty=0.0, early_stopping=True, forced_eos_token_id=None,
                    renormalize_logits=False, **common, logits_processor=LogitsProcessorList(
                        [on_our_terms(config.pad_token_id, config.eos_token_id, limit + 1)]))
            else:  # generation_config.json as it is, but for the beam and the limit, which both share
                result = model.generate(torch.tensor([ids]), **common)
            tokens = result.sequences[0, 1:].tolist()  # after the decoder's start
            translations.append(tokenizer.decode(tokens, skip_special_tokens=True).replace("\n", " "))
            scores.append(float(result.sequences_scores[0]) if beam > 1 else None)
            now = time.perf_counter()
            if now - last >= progress_every or i + 1 == len(sources):
                last = now
                print(f"marian_bleu: transformers: {i + 1}/{len(sources)} sentences, {now - t0:.0f} s",
                      file=sys.stderr, flush=True)
    seconds = time.perf_counter() - t0
    Path(spec["output"]).write_text("".join(t + "\n" for t in translations), encoding="utf-8")
    Path(spec["result"]).write_text(json.dumps({
        "seconds": seconds, "scores": scores, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "transformers": transformers.__version__,
        "generation_config": {key: getattr(stock, key, None) for key in (
            "num_beams", "length_penalty", "early_stopping", "renormalize_logits", "forced_eos_token_id",
            "bad_words_ids", "max_length")}}, indent=1), encoding="utf-8")
    return 0


def translate_with_transformers(args, work, source_file, mode):
    """Runs `transformers_worker` in --torch-python: ([translation], its result JSON)."""
    output, result = work / f"hyp.transformers.{mode}.txt", work / f"transformers.{mode}.json"
    spec = {"marian": str(Path(args.marian).resolve()), "source_file": str(source_file), "output": str(output),
            "result": str(result), "mode": mode, "beam_size": args.beam_size,
            "extra_output_length": args.extra_output_length}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of this virtualenv's
    proc = subprocess.run([args.torch_python, str(Path(__file__).resolve()), WORKER_FLAG, json.dumps(spec)],
                          env=env, stdout=sys.stderr, cwd=str(work))
    if proc.returncode:
        raise SystemExit(f"marian_bleu: error: the transformers worker ({args.torch_python}) exited "
                         f"{proc.returncode}")
    return output.read_text(encoding="utf-8").split("\n")[:-1], json.loads(result.read_text(encoding="utf-8"))


# ------------------------------------------------------------ the comparison

def read_lines(path, limit):
    lines = Path(path).read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines[:limit] if limit else lines


def differing_rows(sources, ours, our_scores, theirs, their_scores, mode):
    """The rows whose outputs differ, each a dict; in same-objective mode with which output is more probable
    (both scores are log P there)."""
    rows = []
    for i, (source, a, b) in enumerate(zip(sources, ours, theirs)):
        if a == b:
            continue
        row = {"line": i + 1, "source": source, "ours": a, "transformers": b,
               "ours_score": our_scores[i], "transformers_score": their_scores[i]}
        if mode == "same-objective":
            if our_scores[i] is None or their_scores[i] is None:
                row["more_probable"] = "n/a"  # a blank source (ours gives "") or greedy search
            elif abs(our_scores[i] - their_scores[i]) <= SCORE_TIE:
                row["more_probable"] = "tie"
            else:
                row["more_probable"] = "ours" if our_scores[i] > their_scores[i] else "transformers"
        rows.append(row)
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == [WORKER_FLAG]:  # this file run by --torch-python: nothing else of main's
        return transformers_worker(argv[1])
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("marian", "source_file", "references"):
        if not Path(getattr(args, name)).exists():
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: no such file or directory")
    if not Path(args.torch_python).is_file():
        parser.error(f"--torch-python {args.torch_python}: no such interpreter (`make venv-torch` makes it)")
    if args.beam_size < 1 or args.batch_size < 1 or args.extra_output_length < 0 or args.max_examples < 0:
        parser.error("--beam-size and --batch-size must be >= 1, --extra-output-length and --max-examples >= 0")
    sources = read_lines(args.source_file, args.max_examples)
    references = read_lines(args.references, args.max_examples)
    if len(sources) != len(references):
        parser.error(f"{len(sources)} source lines but {len(references)} references")
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="marian-bleu-"))
    work.mkdir(parents=True, exist_ok=True)
    mode = args.mode
    log(f"{mode}: {len(sources)} sentences, work directory {work}")
    source_file = work / "source.txt"  # what both translate: the first --max-examples lines
    source_file.write_text("".join(s + "\n" for s in sources), encoding="utf-8")

    ours, our_scores, our_seconds, truncated = translate_with_our_export(args, work, sources, mode)
    (work / f"hyp.ours.{mode}.txt").write_text("".join(t + "\n" for t in ours), encoding="utf-8")
    if truncated:
        log(f"note: {len(truncated)} sources were cut to the model's length limit by ours (lines "
            f"{', '.join(map(str, truncated[:10]))}{', ...' if len(truncated) > 10 else ''})")
    theirs, worker = translate_with_transformers(args, work, source_file, mode)
    if len(theirs) != len(sources):
        raise SystemExit(f"marian_bleu: error: transformers gave {len(theirs)} lines for {len(sources)} sources")

    from sacrebleu.metrics import BLEU

    bleu = BLEU()  # sacreBLEU's defaults: 13a tokenisation, cased, exponential smoothing
    our_bleu = bleu.corpus_score(ours, [references])
    their_bleu = bleu.corpus_score(theirs, [references])
    difference = our_bleu.score - their_bleu.score
    shown = round(difference, 2) + 0.0  # not -0.00
    rows = differing_rows(sources, ours, our_scores, theirs, worker["scores"], mode)
    with (work / f"diff.{mode}.jsonl").open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    identical = len(sources) - len(rows)
    blanks = sum(not s.strip() for s in sources)

    what = {"same-objective": "length penalty 0 in both, early stopping, transformers with on_our_terms",
            "defaults": "ours at length penalty 1.0, transformers with generation_config.json"}[mode]
    print(f"{mode}: {len(sources)} sentences, beam {args.beam_size}, outputs at most source + "
          f"{args.extra_output_length} ({what})")
    print(f"{'':18}{'BLEU':>8}{'seconds':>10}")
    print(f"{'ours (export)':18}{our_bleu.score:8.2f}{our_seconds:10.1f}   batches of {args.batch_size}")
    print(f"{'transformers':18}{their_bleu.score:8.2f}{worker['seconds']:10.1f}   one sentence at a time, "
          f"{worker['threads']} torch threads (transformers {worker['transformers']})")
    print(f"{'difference':18}{shown:+8.2f}")
    print(f"identical outputs: {identical} of {len(sources)}" + (f" ({blanks} blank sources: ours gives \"\", "
                                                                 "transformers translates </s>)" if blanks else ""))
    if mode == "same-objective" and rows:
        counts = {key: sum(row["more_probable"] == key for row in rows) for key in ("ours", "transformers", "tie",
                                                                                   "n/a")}
        print(f"differing rows: {len(rows)}; the more probable output (log P) is ours in {counts['ours']}, "
              f"transformers' in {counts['transformers']}, a tie in {counts['tie']}"
              + (f", not scored in {counts['n/a']}" if counts["n/a"] else "") + f" ({work / f'diff.{mode}.jsonl'})")
    print(f"sacreBLEU: {bleu.get_signature()}")
    (work / f"results.{mode}.json").write_text(json.dumps({
        "mode": mode, "sentences": len(sources), "beam_size": args.beam_size,
        "extra_output_length": args.extra_output_length, "length_penalty_ours": LENGTH_PENALTY[mode],
        "bleu_ours": our_bleu.score, "bleu_transformers": their_bleu.score, "difference": difference,
        "identical": identical, "seconds_ours": our_seconds, "seconds_transformers": worker["seconds"],
        "signature": str(bleu.get_signature()), "transformers": worker}, indent=1), encoding="utf-8")
    if mode == "same-objective" and abs(difference) > SAME_OBJECTIVE_TOLERANCE:
        print(f"FAIL: same-objective BLEU differs by {difference:+.2f} (more than {SAME_OBJECTIVE_TOLERANCE}): "
              f"see {work / f'diff.{mode}.jsonl'}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
