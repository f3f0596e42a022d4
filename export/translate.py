"""Translate text, one sentence per line, through an exported SavedModel
(or a TF Serving server that serves it).

    python -m export.translate --saved-model exports/translator < input.en > output.de
    kt-translate --saved-model exports/translator/1 --input test.en --output test.de --greedy
    kt-translate --server http://localhost:8501 --model-name translator --input test.en
    kt-translate --saved-model exports/translator --input test.en --n-best   # "0 ||| translation ||| score"
    kt-translate --saved-model exports/translator --input test.en --sample --temperature 0.8 --top-k 20 --seed 1
    kt-translate --saved-model exports/translator --input test.en --prefix prefixes.de   # begins with its prefix
    kt-translate --saved-model exports/translator --input test.en --prefix prefixes.de --greedy   # greedy_prefix
    kt-translate --saved-model exports/translator --input test.en --score test.de   # "score<TAB>log_prob"
    kt-translate --saved-model exports/translator --input test.en --align   # "translation ||| 0-0 1-2 ..."

--saved-model takes a version directory (EXPORT_DIR/NAME/VERSION) or the
model's base directory (EXPORT_DIR/NAME: its highest version is used).
Lines are translated in batches of similar length and written in input order;
blank lines stay blank. A progress bar goes to stderr for inputs of more than
one batch (--no-progress to hide it). A line longer than the model's limit
(config.json `max_source_length` pieces, end id included) is translated from its
beginning only: kt-translate says so on stderr, with the line numbers.
--n-best, --sample, --prefix, --score and --align each call a signature of
their own (n_best, sample, prefix, score, align; --prefix with --greedy:
greedy_prefix), in process or through --server alike; see each flag's help.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common.native_logs import VERBOSE_HELP, quiet_import_for_commands

# Before TensorFlow is imported: a command prints none of its C++ start-up lines (see common/native_logs.py).
quiet_import_for_commands(__name__)

import tensorflow as tf  # noqa: E402
import tensorflow_text  # noqa: F401  (registers the sentencepiece ops the SavedModel uses)
from tqdm import tqdm  # noqa: E402

from typing import NamedTuple  # noqa: E402

from export.client import INPUT_DTYPES, RestClient, SignatureMethods, TranslatedBatch  # noqa: E402
from keras_transformer.text import split_lines  # noqa: E402


def resolve_saved_model(path) -> Path:
    """A version directory: `path` itself if it holds saved_model.pb, else its highest integer subdirectory."""
    path = Path(path)
    if (path / "saved_model.pb").is_file():
        return path
    versions = sorted((int(p.name) for p in path.iterdir() if p.name.isdigit() and (p / "saved_model.pb").is_file())
                      if path.is_dir() else [])
    if not versions:
        raise FileNotFoundError(f"No SavedModel in {path} (expected saved_model.pb or NAME/VERSION/saved_model.pb)")
    return path / str(versions[-1])


class SavedModelTranslator(SignatureMethods):
    """Calls the signatures of an exported SavedModel in process, with RestClient's and GrpcClient's methods
    (`translate_batch`, `n_best`, `sample`, `translate_with_prefix`, `score`, `align`, ...); called, list of
    str/bytes -> `TranslatedBatch` (translations, scores, truncated) of `signature`."""

    def __init__(self, saved_model, signature="serving_default"):
        self.path = resolve_saved_model(saved_model)
        self._loaded = tf.saved_model.load(str(self.path))
        self.signature = signature
        self._fn = self._signature(signature)

    def _signature(self, name):
        if name not in self._loaded.signatures:
            raise ValueError(f"{self.path} has no signature {name!r}; it has {sorted(self._loaded.signatures)}")
        return self._loaded.signatures[name]

    def _outputs(self, texts, signature, inputs):
        inputs = {name: tf.constant(values, dtype=INPUT_DTYPES[name]) for name, values in inputs.items()}
        out = self._signature(signature)(text=tf.constant(texts, dtype=tf.string), **inputs)
        return {name: value.numpy().tolist() for name, value in out.items()}

    def __call__(self, texts) -> TranslatedBatch:
        return self.translate_batch(texts)


def _one_line(text):
    """A translation (or a list of them) without line breaks: one output line per line."""
    return [_one_line(t) for t in text] if isinstance(text, list) else text.replace("\r", " ").replace("\n", " ")


class Translated(NamedTuple):
    """`translate_lines`' result, in input order."""

    texts: list  # a str per line; with the n_best signature, a list of them
    scores: list  # a float per line (a list with n_best); None for a blank line
    truncated_lines: list[int]  # 1-based numbers of the lines whose source was cut to the model's limit


def translate_lines(translate, lines, batch_size=32, progress=None, inputs=None) -> Translated:
    """Translates `lines` (str or bytes) with `translate(batch) -> (translations, scores[, truncated])` in
    batches of similar length. Blank lines give ("", None). `inputs`: more per-line values (name -> one value
    per line), passed batched alongside, `translate(batch, name=[the batch's values], ...)`."""
    inputs = inputs or {}
    for name, values in inputs.items():
        if len(values) != len(lines):
            raise ValueError(f"{name}: {len(values)} values for {len(lines)} lines")
    out, scores, truncated_lines = [""] * len(lines), [None] * len(lines), []
    todo = sorted((i for i, line in enumerate(lines) if line.strip()), key=lambda i: len(lines[i]))
    for start in range(0, len(todo), batch_size):
        idx = todo[start:start + batch_size]
        batch_inputs = {name: [values[i] for i in idx] for name, values in inputs.items()}
        translations, batch_scores, *truncated = translate([lines[i] for i in idx], **batch_inputs)
        if len(translations) != len(idx):
            raise RuntimeError(f"Asked for {len(idx)} translations, got {len(translations)}")
        for i, text, score in zip(idx, translations, batch_scores):
            out[i], scores[i] = _one_line(text), score
        if truncated:
            truncated_lines += [i + 1 for i, cut in zip(idx, truncated[0]) if cut]
        if progress is not None:
            progress.update(len(idx))
    return Translated(out, scores, sorted(truncated_lines))


def truncation_warning(truncated_lines, shown: int = 20, scored: bool = False) -> str:
    """The stderr line for sources cut to the model's limit, naming the line numbers (the first `shown`);
    `scored`: for --score, whose targets are cut too."""
    numbers = ", ".join(map(str, truncated_lines[:shown])) + (", ..." if len(truncated_lines) > shown else "")
    what = ("whose source or target is longer than the model's limit were scored" if scored
            else "longer than the model's limit were translated")
    return (f"kt-translate: warning: {len(truncated_lines)} line(s) {what} "
            f"from their beginning only (config.json max_source_length pieces, end id included): line(s) {numbers}")


# sentencepiece's word-start marker, at the start of a piece that begins a word; and the end token's piece.
WORD_START = "\u2581"
END_PIECE = "</s>"


def piece_words(pieces) -> list:
    """The word each piece belongs to (0, 1, ...): a piece that starts with WORD_START ("\u2581") begins a
    word, and so does the first piece; None for the end token's piece, which is no word."""
    words, word = [], -1
    for piece in pieces:
        if piece == END_PIECE:
            words.append(None)
            continue
        if word < 0 or piece.startswith(WORD_START):
            word += 1
        words.append(word)
    return words


def word_alignment(alignment, source_pieces, target_pieces) -> list[tuple[int, int]]:
    """(source piece, target piece) index pairs (`AlignedBatch.alignments`) -> the distinct (source word,
    target word) pairs they join, sorted; pairs with an end token ("</s>") on either side are left out."""
    source_words, target_words = piece_words(source_pieces), piece_words(target_pieces)
    return sorted({(source_words[i], target_words[j]) for i, j in alignment
                   if source_words[i] is not None and target_words[j] is not None})


def pharaoh(pairs) -> str:
    """Word pairs in Pharaoh format: "0-0 1-2 ..." (source word - target word)."""
    return " ".join(f"{i}-{j}" for i, j in pairs)


def _aligned_lines(aligned) -> TranslatedBatch:
    """An `AlignedBatch` as --align writes it: "translation ||| 0-0 1-2 ..." per text."""
    lines = [f"{_one_line(t)} ||| {pharaoh(word_alignment(a, s, tg))}"
             for t, a, s, tg in zip(aligned.translations, aligned.alignments, aligned.source_pieces,
                                    aligned.target_pieces)]
    return TranslatedBatch(lines, aligned.scores, aligned.truncated)


def _scored_lines(scored) -> TranslatedBatch:
    """A `ScoredBatch` as --score writes it: "score<TAB>log_prob" per text."""
    return TranslatedBatch([f"{s:.4f}\t{p:.4f}" for s, p in zip(scored.scores, scored.log_probs)], scored.scores,
                           scored.truncated)


# The modes that call a signature of their own and write their own lines, mutually exclusive: flag -> signature.
MODE_SIGNATURES = {"n_best": "n_best", "sample": "sample", "prefix": "prefix", "score": "score", "align": "align"}
# The modes with a greedy form, --greedy's signature for them: flag -> signature.
GREEDY_MODE_SIGNATURES = {"prefix": "greedy_prefix"}


def build_parser():
    p = argparse.ArgumentParser(prog="kt-translate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--saved-model", help="EXPORT_DIR/NAME/VERSION, or EXPORT_DIR/NAME for its latest version")
    src.add_argument("--server", help="TF Serving REST address, e.g. http://localhost:8501")
    p.add_argument("--model-name", default="translator", help="with --server: the served model's name")
    p.add_argument("--input", help="text file, one sentence per line (default: stdin)")
    p.add_argument("--output", help="where to write the translations (default: stdout)")
    p.add_argument("--greedy", action="store_true", help="greedy decoding instead of beam search: the 'greedy' "
                   "signature, or with --prefix the 'greedy_prefix' one")
    p.add_argument("--signature", help="signature to call (default serving_default, or greedy with --greedy)")
    p.add_argument("--batch-size", type=int, default=32, help="sentences per request (default 32)")
    p.add_argument("--scores", action="store_true", help="write 'score<TAB>translation' lines")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--n-best", action="store_true",
                      help="write each line's n-best list (the n_best signature: n = the export's beam size), as "
                      "'LINE ||| translation ||| score' lines, best first, LINE counting from 0 (Moses' n-best "
                      "format); blank lines get no entries")
    mode.add_argument("--sample", action="store_true",
                      help="sample each translation from the model (the sample signature; --temperature, --top-k, "
                      "--seed): line i (counting from 0) with seed SEED + i, so the same line number and seed give "
                      "the same output however the file is batched")
    mode.add_argument("--prefix", metavar="FILE",
                      help="one prefix per input line: each translation begins with its line's prefix (whole "
                      "sentencepiece pieces): beam search (the prefix signature; a blank prefix: plain beam search), "
                      "or with --greedy greedy decoding (the greedy_prefix signature; a blank prefix: plain greedy "
                      "decoding)")
    mode.add_argument("--score", metavar="FILE",
                      help="one target per input line: write 'score<TAB>log_prob' per line, how likely the model "
                      "finds the target as the line's translation (the score signature; score as --scores writes "
                      "it: log_prob / ((5 + length) / 6)^alpha); blank input lines stay blank")
    mode.add_argument("--align", action="store_true",
                      help="write 'translation ||| alignment' per line (the align signature: beam search), the "
                      "alignment as Pharaoh 'i-j' pairs of source word i and translation word j (words counted "
                      "from 0; a word begins at a sentencepiece piece that starts with U+2581), each target "
                      "piece aligned to the source piece it attends to most")
    p.add_argument("--temperature", type=float, help="with --sample: > 0, default 1.0 (lower: closer to greedy)")
    p.add_argument("--top-k", type=int, help="with --sample: sample from the K most likely tokens; default 0 (all)")
    p.add_argument("--seed", type=int, help="with --sample: line i's seed is SEED + i; default 0")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    return p


def _read_lines(path):
    with open(path, "rb") as f:
        return split_lines(f.read())


def _check_args(p, args):
    """argparse errors (exit 2) for flags that do not go together."""
    mode = next((flag for flag in MODE_SIGNATURES if getattr(args, flag) not in (None, False)), None)
    sampling = [flag for flag in ("temperature", "top_k", "seed") if getattr(args, flag) is not None]
    if sampling and mode != "sample":
        p.error(f"--{sampling[0].replace('_', '-')} goes with --sample")
    if mode and mode != "n_best":
        option, called = f"--{mode}", MODE_SIGNATURES[mode]
        if args.greedy and mode not in GREEDY_MODE_SIGNATURES:
            # Refused rather than ignored: the output would not be the greedy decoding asked for.
            p.error(f"--greedy does not go with {option}: {option} calls the {called} signature, which has no "
                    f"greedy form (only --prefix has one: --greedy --prefix calls greedy_prefix)")
        if args.signature:
            greedy_form = GREEDY_MODE_SIGNATURES.get(mode)
            p.error(f"--signature does not go with {option}: {option} calls the {called} signature"
                    + (f" ({greedy_form} with --greedy)" if greedy_form else ""))
        if args.scores and mode in ("score", "align"):
            p.error(f"{option} writes lines of its own: drop --scores")
    if mode == "sample":
        args.temperature = 1.0 if args.temperature is None else args.temperature
        args.top_k = 0 if args.top_k is None else args.top_k
        args.seed = 0 if args.seed is None else args.seed
        if not args.temperature > 0:
            p.error(f"--temperature must be > 0, got {args.temperature} (--top-k 1 is greedy decoding)")
        if args.top_k < 0:
            p.error(f"--top-k must be >= 0 (0: all tokens), got {args.top_k}")
    if args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
    return mode


def mode_signature(args, mode) -> str:
    """The signature kt-translate calls: --signature's, else the mode's (its greedy form with --greedy), else
    greedy with --greedy, else serving_default."""
    if args.signature:
        return args.signature
    if args.greedy and mode in GREEDY_MODE_SIGNATURES:
        return GREEDY_MODE_SIGNATURES[mode]
    return MODE_SIGNATURES.get(mode) or ("greedy" if args.greedy else "serving_default")


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.n_best and (args.greedy or args.scores):
        print("kt-translate: error: --n-best writes every hypothesis with its score; drop --greedy/--scores",
              file=sys.stderr)
        return 2
    mode = _check_args(p, args)
    signature = mode_signature(args, mode)
    lines = _read_lines(args.input) if args.input else split_lines(sys.stdin.buffer.read())
    inputs = {}
    if mode == "sample":
        if not -2 ** 63 <= args.seed <= 2 ** 63 - max(len(lines), 1):
            p.error(f"--seed {args.seed}: the seeds SEED + line must fit in 64 bits")
        inputs = {"seed": [args.seed + i for i in range(len(lines))]}
    elif mode in ("prefix", "score"):
        path = getattr(args, mode)
        try:
            others = _read_lines(path)
        except OSError as e:
            p.error(f"--{mode} {path}: {e.strerror or e}")
        if len(others) != len(lines):
            p.error(f"--{mode} {path} has {len(others)} line(s), the input {len(lines)}: give one "
                    f"{'prefix' if mode == 'prefix' else 'target'} per input line")
        inputs = {mode: others}
    try:
        if args.server:
            translator = RestClient(args.server, args.model_name, signature=signature)
        else:
            translator = SavedModelTranslator(args.saved_model, signature)
    except (FileNotFoundError, ValueError) as e:
        print(f"kt-translate: error: {e}", file=sys.stderr)
        return 2
    translate = {
        "sample": lambda texts, seed: translator.sample(texts, seed, args.temperature, args.top_k),
        "prefix": lambda texts, prefix: translator.translate_with_prefix(texts, prefix, greedy=args.greedy),
        "score": lambda texts, score: _scored_lines(translator.score(texts, score)),
        "align": lambda texts: _aligned_lines(translator.align(texts)),
    }.get(mode, translator.translate_batch)
    progress = None
    if not args.no_progress and len(lines) > args.batch_size:
        progress = tqdm(total=sum(1 for line in lines if line.strip()), unit="sent", file=sys.stderr)
    try:
        translations, scores, truncated_lines = translate_lines(translate, lines, args.batch_size, progress, inputs)
    finally:
        if progress is not None:
            progress.close()
    if truncated_lines:
        print(truncation_warning(truncated_lines, scored=mode == "score"), file=sys.stderr)
    if args.n_best:
        text = "".join(f"{i} ||| {t} ||| {s:.4f}\n" for i, (texts, line_scores) in enumerate(zip(translations, scores))
                       if line_scores is not None for t, s in zip(texts, line_scores))
    elif args.scores:
        text = "".join(("" if s is None else f"{s:.4f}") + "\t" + t + "\n" for t, s in zip(translations, scores))
    else:
        text = "".join(t + "\n" for t in translations)
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
