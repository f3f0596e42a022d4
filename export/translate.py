"""Translate text, one sentence per line, through an exported SavedModel
(or a TF Serving server that serves it).

    python -m export.translate --saved-model exports/translator < input.en > output.de
    kt-translate --saved-model exports/translator/1 --input test.en --output test.de --greedy
    kt-translate --server http://localhost:8501 --model-name translator --input test.en
    kt-translate --saved-model exports/translator --input test.en --n-best   # "0 ||| translation ||| score"

--saved-model takes a version directory (EXPORT_DIR/NAME/VERSION) or the
model's base directory (EXPORT_DIR/NAME: its highest version is used).
Lines are translated in batches of similar length and written in input order;
blank lines stay blank. A progress bar goes to stderr for inputs of more than
one batch (--no-progress to hide it). A line longer than the model's limit
(config.json `max_length` pieces, end id included) is translated from its
beginning only: kt-translate says so on stderr, with the line numbers.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from export.native_logs import VERBOSE_HELP, quiet_import_for_commands

# Before TensorFlow is imported: a command prints none of its C++ start-up lines (see export/native_logs.py).
quiet_import_for_commands(__name__)

import tensorflow as tf  # noqa: E402
import tensorflow_text  # noqa: F401  (registers the sentencepiece ops the SavedModel uses)
from tqdm import tqdm  # noqa: E402

from typing import NamedTuple  # noqa: E402

from export.client import RestClient, TranslatedBatch  # noqa: E402
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


class SavedModelTranslator:
    """Calls a signature of an exported SavedModel in process: list of str/bytes -> `TranslatedBatch`
    (translations, scores, truncated)."""

    def __init__(self, saved_model, signature="serving_default"):
        self.path = resolve_saved_model(saved_model)
        self._loaded = tf.saved_model.load(str(self.path))
        if signature not in self._loaded.signatures:
            raise ValueError(f"{self.path} has no signature {signature!r}; it has {sorted(self._loaded.signatures)}")
        self._fn = self._loaded.signatures[signature]

    def __call__(self, texts) -> TranslatedBatch:
        out = self._fn(text=tf.constant(list(texts), dtype=tf.string))
        truncated = out["truncated"].numpy().tolist() if "truncated" in out else [False] * len(texts)
        many = "translations" in out  # the n_best signature: a list per text
        translations = out["translations" if many else "translation"].numpy().tolist()
        return TranslatedBatch(_decoded(translations), out["scores" if many else "score"].numpy().tolist(),
                               [bool(t) for t in truncated])


def _decoded(texts):
    """bytes -> str, in a list or a list of lists (n-best)."""
    return [_decoded(t) if isinstance(t, list) else t.decode("utf-8", errors="replace") for t in texts]


def _one_line(text):
    """A translation (or a list of them) without line breaks: one output line per line."""
    return [_one_line(t) for t in text] if isinstance(text, list) else text.replace("\r", " ").replace("\n", " ")


class Translated(NamedTuple):
    """`translate_lines`' result, in input order."""

    texts: list  # a str per line; with the n_best signature, a list of them
    scores: list  # a float per line (a list with n_best); None for a blank line
    truncated_lines: list[int]  # 1-based numbers of the lines whose source was cut to the model's limit


def translate_lines(translate, lines, batch_size=32, progress=None) -> Translated:
    """Translates `lines` (str or bytes) with `translate(batch) -> (translations, scores[, truncated])` in
    batches of similar length. Blank lines give ("", None)."""
    out, scores, truncated_lines = [""] * len(lines), [None] * len(lines), []
    todo = sorted((i for i, line in enumerate(lines) if line.strip()), key=lambda i: len(lines[i]))
    for start in range(0, len(todo), batch_size):
        idx = todo[start:start + batch_size]
        translations, batch_scores, *truncated = translate([lines[i] for i in idx])
        if len(translations) != len(idx):
            raise RuntimeError(f"Asked for {len(idx)} translations, got {len(translations)}")
        for i, text, score in zip(idx, translations, batch_scores):
            out[i], scores[i] = _one_line(text), score
        if truncated:
            truncated_lines += [i + 1 for i, cut in zip(idx, truncated[0]) if cut]
        if progress is not None:
            progress.update(len(idx))
    return Translated(out, scores, sorted(truncated_lines))


def truncation_warning(truncated_lines, shown: int = 20) -> str:
    """The stderr line for sources cut to the model's limit, naming the line numbers (the first `shown`)."""
    numbers = ", ".join(map(str, truncated_lines[:shown])) + (", ..." if len(truncated_lines) > shown else "")
    return (f"kt-translate: warning: {len(truncated_lines)} line(s) longer than the model's limit were translated "
            f"from their beginning only (config.json max_length pieces, end id included): line(s) {numbers}")


def build_parser():
    p = argparse.ArgumentParser(prog="kt-translate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--saved-model", help="EXPORT_DIR/NAME/VERSION, or EXPORT_DIR/NAME for its latest version")
    src.add_argument("--server", help="TF Serving REST address, e.g. http://localhost:8501")
    p.add_argument("--model-name", default="translator", help="with --server: the served model's name")
    p.add_argument("--input", help="text file, one sentence per line (default: stdin)")
    p.add_argument("--output", help="where to write the translations (default: stdout)")
    p.add_argument("--greedy", action="store_true", help="greedy decoding (the 'greedy' signature) instead of beam")
    p.add_argument("--signature", help="signature to call (default serving_default, or greedy with --greedy)")
    p.add_argument("--batch-size", type=int, default=32, help="sentences per request (default 32)")
    p.add_argument("--scores", action="store_true", help="write 'score<TAB>translation' lines")
    p.add_argument("--n-best", action="store_true",
                   help="write each line's n-best list (the n_best signature: n = the export's beam size), as "
                   "'LINE ||| translation ||| score' lines, best first, LINE counting from 0 (Moses' n-best "
                   "format); blank lines get no entries")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    return p


def main(argv=None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    args = build_parser().parse_args(argv)
    if args.n_best and (args.greedy or args.scores):
        print("kt-translate: error: --n-best writes every hypothesis with its score; drop --greedy/--scores",
              file=sys.stderr)
        return 2
    signature = args.signature or ("n_best" if args.n_best else "greedy" if args.greedy else "serving_default")
    if args.input:
        with open(args.input, "rb") as f:
            lines = split_lines(f.read())
    else:
        lines = split_lines(sys.stdin.buffer.read())
    try:
        if args.server:
            translate = RestClient(args.server, args.model_name, signature=signature).translate_batch
        else:
            translate = SavedModelTranslator(args.saved_model, signature)
    except (FileNotFoundError, ValueError) as e:
        print(f"kt-translate: error: {e}", file=sys.stderr)
        return 2
    progress = None
    if not args.no_progress and len(lines) > args.batch_size:
        progress = tqdm(total=sum(1 for line in lines if line.strip()), unit="sent", file=sys.stderr)
    try:
        translations, scores, truncated_lines = translate_lines(translate, lines, args.batch_size, progress)
    finally:
        if progress is not None:
            progress.close()
    if truncated_lines:
        print(truncation_warning(truncated_lines), file=sys.stderr)
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
