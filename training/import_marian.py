"""`kt-import`: a pretrained Hugging Face Marian translator (one of the OPUS-MT models) as a run directory, which
kt-evaluate, kt-translate, kt-export and `kt-train --init-from` take as they take one kt-train wrote.

    kt-import --marian opus-mt-en-de --model-dir runs/opus-en-de
    kt-export --model-dir runs/opus-en-de --export-dir exports/opus-en-de

Reads the directory (config.json, model.safetensors, source.spm, target.spm, vocab.json, and
tokenizer_config.json and generation_config.json where they are) with numpy, safetensors and sentencepiece: no
PyTorch, no transformers. `training/marian.py` maps it (what differs from this library's model, and how); a
configuration the mapping does not cover is refused, naming the key. Writes to --model-dir:

    model.keras                  the model (float32)
    tokenizer.model              source.spm in the model's ids (`training.marian.marian_sentencepiece`)
    target_tokenizer.model       target.spm in the model's ids
    config.json                  as kt-train's, with "imported_from"; "training" records the search the
                                 commands after it use: generation_config.json's beam size, and length
                                 penalty 1.0 (see `MARIAN_LENGTH_PENALTY`)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common.native_logs import VERBOSE_HELP, quiet_import_for_commands

# Before TensorFlow is imported: a command prints none of its C++ start-up lines (see common/native_logs.py).
quiet_import_for_commands(__name__)

from common.run_dir import (CONFIG_FILENAME, DEFAULT_BEAM_SIZE, MODEL_FILENAME, TARGET_TOKENIZER_FILENAME,  # noqa: E402
                            TOKENIZER_FILENAME, read_config, write_run_config)
from training.marian import MarianError, marian_sentencepiece, marian_transformer, read_marian_dir  # noqa: E402

# Transformers ranks beam hypotheses by log P / length ** 1.0 by default (OPUS-MT's generation configs set no
# other); this library by log P / ((5 + length) / 6) ** alpha. Their exponents, both 1.0, normalise by length
# alike (not exactly: docs/marian.md); kt-evaluate and kt-export take --length-penalty for another.
MARIAN_LENGTH_PENALTY = 1.0
# The longest source Marian's position table (max_position_embeddings rows) holds, where config.json has none.
MARIAN_MAX_POSITIONS = 512


def languages(checkpoint, source_lang, target_lang, directory) -> tuple[str, str]:
    """--source-lang/--target-lang, else tokenizer_config.json's source_lang/target_lang; a `MarianError`
    when neither gives a language."""
    source = source_lang or checkpoint.tokenizer_config.get("source_lang")
    target = target_lang or checkpoint.tokenizer_config.get("target_lang")
    if not source or not target:
        raise MarianError(f"{directory}/tokenizer_config.json names no source_lang and target_lang: give "
                          "--source-lang and --target-lang (e.g. en and de: kt-evaluate's BLEU protocol reads them)")
    return source, target


def import_marian(directory, model_dir, *, source_lang=None, target_lang=None) -> dict:
    """Writes the run directory `model_dir` of the Marian model in `directory` (module docstring) and returns
    its config.json as a dict."""
    checkpoint = read_marian_dir(directory)
    source, target = languages(checkpoint, source_lang, target_lang, directory)
    model = marian_transformer(checkpoint.config, checkpoint.state)
    out = Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    dropped = {}
    for side, spm, name in (("source", checkpoint.source_spm, TOKENIZER_FILENAME),
                            ("target", checkpoint.target_spm, TARGET_TOKENIZER_FILENAME)):
        proto, dropped[side] = marian_sentencepiece(spm, checkpoint.vocab)
        (out / name).write_bytes(proto)
    model.save(out / MODEL_FILENAME)
    generation = checkpoint.generation_config
    codes = sorted(piece for piece in checkpoint.vocab if piece.startswith(">>") and piece.endswith("<<"))
    write_run_config(
        out, source_lang=source, target_lang=target, vocab_size=model.vocab_size,
        max_source_length=checkpoint.config.get("max_position_embeddings", MARIAN_MAX_POSITIONS), model=model,
        policy="float32", preset=None, target_tokenizer=True,
        training={"beam_size": int(generation.get("num_beams") or DEFAULT_BEAM_SIZE),
                  "length_penalty": MARIAN_LENGTH_PENALTY, "lowercase": False},
        extra={"imported_from": {"format": "marian", "directory": str(Path(directory).resolve()),
                                 "marian_vocab_size": checkpoint.config["vocab_size"],
                                 "pieces_not_in_vocab": dropped, "language_codes": codes}})
    return read_config(out)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kt-import", description="A pretrained Hugging Face Marian translator (OPUS-MT) as a run directory "
        "for kt-evaluate, kt-translate, kt-export and kt-train --init-from. Reads safetensors with numpy: "
        "neither PyTorch nor transformers is needed.")
    parser.add_argument("--marian", required=True, metavar="DIR",
                        help="a Hugging Face Marian model's directory (config.json, model.safetensors, source.spm, "
                             "target.spm, vocab.json), e.g. a download of Helsinki-NLP/opus-mt-en-de")
    parser.add_argument("--model-dir", required=True, help="the run directory to write")
    parser.add_argument("--source-lang", help="the source language (default: tokenizer_config.json's source_lang)")
    parser.add_argument("--target-lang", help="the target language (default: tokenizer_config.json's target_lang)")
    parser.add_argument("--force", action="store_true", help="overwrite a run directory that has a config.json")
    parser.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (Path(args.model_dir) / CONFIG_FILENAME).exists() and not args.force:
        parser.error(f"--model-dir {args.model_dir} already holds a run (config.json): give another, or --force")
    try:
        config = import_marian(args.marian, args.model_dir, source_lang=args.source_lang,
                               target_lang=args.target_lang)
    except (FileNotFoundError, MarianError) as e:
        print(f"kt-import: error: {e}", file=sys.stderr)
        return 2
    info = config["imported_from"]
    model = config["model_config"]
    print(f"kt-import: {args.marian} ({config['source_lang']}->{config['target_lang']}, d_model {model['d_model']}, "
          f"{model['num_encoder_layers']}+{model['num_decoder_layers']} layers, {info['marian_vocab_size']:,} ids) "
          f"-> {args.model_dir}")
    for side, count in info["pieces_not_in_vocab"].items():
        if count:
            print(f"kt-import: note: {count} pieces of {side}.spm are not in vocab.json (MarianTokenizer makes them "
                  "<unk>); they are dropped, and the text they covered is segmented into other pieces")
    if info["language_codes"]:
        shown = ", ".join(info["language_codes"][:5]) + (", ..." if len(info["language_codes"]) > 5 else "")
        print(f"kt-import: note: the vocabulary has target-language codes ({shown}), which the import does not "
              "read: a source beginning with one is segmented as text, not as MarianTokenizer's one token")
    print(f"kt-import: next: kt-export --model-dir {args.model_dir} --export-dir exports/{Path(args.model_dir).name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
