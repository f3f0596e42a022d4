"""A run directory, as kt-train writes it and kt-average-checkpoints, kt-evaluate and kt-export read it:
its file names, its config.json, its checkpoints and the model it holds.

    MODEL_DIR/config.json        the languages, ids, vocabulary, longest source (`max_source_length`), model and
                                 training settings (`read_config`)
    MODEL_DIR/tokenizer.model    the sentencepiece vocabulary (`tokenizer_path`); in a run with one per side
                                 (an imported Marian model), the source's, and the target's is config.json's
                                 "target_tokenizer_file" (`target_tokenizer_path`)
    MODEL_DIR/model.keras        the trained model (`load_or_build_model`; with the tokenizer: `load_model_dir`)
    MODEL_DIR/checkpoints/       epoch-NNN.weights.h5 every epoch (`epoch_checkpoints`), or, in a run by
                                 updates, update-NNNNNNN.weights.h5 every N updates (`update_checkpoints`)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import NamedTuple

import keras

import keras_transformer as kt
from keras_transformer.renamed import renamed_note
from keras_transformer.text import END_ID, PAD_ID, START_ID, UNK_ID, read_tokenizer_proto

CONFIG_FILENAME = "config.json"
MODEL_FILENAME = "model.keras"
TOKENIZER_FILENAME = "tokenizer.model"
TARGET_TOKENIZER_FILENAME = "target_tokenizer.model"  # a run with a vocabulary per side: the target's
CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_PATTERN = "epoch-{epoch:03d}.weights.h5"
# With --checkpoint-every N: a checkpoint every N optimizer updates, named by the update it was taken after.
UPDATE_CHECKPOINT_PATTERN = "update-{update:07d}.weights.h5"
_EPOCH = re.compile(r"epoch-(\d+)\.weights\.h5$")
_UPDATE = re.compile(r"update-(\d+)\.weights\.h5$")  # not the staged update-NNNNNNN.tmp.weights.h5


def read_config(model_dir) -> dict:
    """A model directory's config.json; a clear error if it is not one."""
    path = Path(model_dir) / CONFIG_FILENAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {model_dir} a directory written by kt-train?")
    return json.loads(path.read_text(encoding="utf-8"))


def read_config_or_exit(model_dir, command: str) -> dict:
    """`read_config` for a command line tool: a missing config.json prints one line naming `command` and the
    directory, and exits with status 2 (as argparse does for a bad argument)."""
    try:
        return read_config(model_dir)
    except FileNotFoundError as e:
        print(f"{command}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def load_or_build_model(model_dir, config):
    """MODEL_DIR/model.keras, or, while kt-train is still running (or after it was stopped, before it wrote
    model.keras), a new, built model of the architecture and dtype policy `config` (its config.json) records,
    for a checkpoint's weights. `FileNotFoundError` when there is neither."""
    path = Path(model_dir) / config.get("model_file", MODEL_FILENAME)
    if path.is_file():
        return keras.models.load_model(path, compile=False)
    if "model_config" not in config:
        raise FileNotFoundError(f"{path} not found, and {Path(model_dir) / CONFIG_FILENAME} records no "
                                "model_config to build the model from")
    model = kt.Transformer.from_config({**config["model_config"], "dtype": config.get("dtype_policy")})
    model.build()
    return model


def tokenizer_path(model_dir, config) -> Path:
    return Path(model_dir) / config.get("tokenizer_file", TOKENIZER_FILENAME)


def target_tokenizer_path(model_dir, config) -> Path | None:
    """The target side's sentencepiece model of a run with one per side (config.json's "target_tokenizer_file");
    None for a run with one joint vocabulary."""
    name = config.get("target_tokenizer_file")
    return None if name is None else Path(model_dir) / name


def write_run_config(model_dir, *, source_lang: str, target_lang: str, vocab_size: int, max_source_length,
                     model, policy: str, preset, training: dict, target_tokenizer: bool = False,
                     extra: dict | None = None) -> Path:
    """Writes MODEL_DIR/config.json atomically (`read_config` reads it): the languages, the ids, the vocabulary's
    file names (with `target_tokenizer`, a run with one per side: "target_tokenizer_file" too), the longest source
    the model translates (`max_source_length`), the model's configuration (`model.get_config()`), its dtype
    `policy`, the `preset` it was built from (None: none), the settings it was made with (`training`, as the
    commands after it read them: beam_size, length_penalty, lowercase, ...), and `extra`'s keys. kt-train
    (`training.config.write_config`) and kt-import write through it."""
    tokenizers = ("tokenizer_file", "target_tokenizer_file") if target_tokenizer else ("", "")
    out = {
        "source_lang": source_lang,
        "target_lang": target_lang,
        "vocab_size": vocab_size,
        "pad_id": PAD_ID, "unk_id": UNK_ID, "bos_id": START_ID, "eos_id": END_ID,
        "start_id": START_ID, "end_id": END_ID,
        "source_format": f"sentencepiece pieces{tokenizers[0] and f' ({tokenizers[0]})'} + [eos_id]",
        "target_format": f"decoder input [bos_id] + pieces{tokenizers[1] and f' ({tokenizers[1]})'}; "
                         "output pieces + [eos_id]",
        "max_source_length": max_source_length,
        "tokenizer_file": TOKENIZER_FILENAME,
        **({"target_tokenizer_file": TARGET_TOKENIZER_FILENAME} if target_tokenizer else {}),
        "model_file": MODEL_FILENAME,
        "checkpoint_dir": CHECKPOINT_DIR,
        "preset": preset,
        "model_config": {k: v for k, v in model.get_config().items() if k not in ("name", "trainable", "dtype")},
        "dtype_policy": policy,
        "training": training,
        **(extra or {}),
    }
    path = Path(model_dir) / CONFIG_FILENAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(out, indent=2, default=str))
    os.replace(tmp, path)
    return path


def load_tokenizer(model_dir, config):
    """A run's tokenizer (`common.tokenizer`): one joint sentencepiece model, or a `SourceTargetTokenizer` of
    the two of a run with one per side."""
    from common.tokenizer import SourceTargetTokenizer, make_tokenizer  # TensorFlow: for those who load a model

    source = make_tokenizer(read_tokenizer_proto(tokenizer_path(model_dir, config)))
    target = target_tokenizer_path(model_dir, config)
    return source if target is None else SourceTargetTokenizer(source, make_tokenizer(read_tokenizer_proto(target)))


def load_model_dir(model_dir, model_file=None, weights=None):
    """(model, tokenizer, config) from a directory written by kt-train: what kt-evaluate, kt-export, the plots
    and the benchmarks load.

    `model_file` picks another .keras file (e.g. averaged.keras); `weights`
    loads a .weights.h5 checkpoint into the model, which may then be one
    built from config.json while kt-train still runs (`load_or_build_model`).
    """
    config = read_config(model_dir)
    if model_file:
        if not Path(model_file).is_file():
            raise FileNotFoundError(f"Model file {model_file} not found.")
        model = keras.models.load_model(model_file, compile=False)
    elif weights:
        model = load_or_build_model(model_dir, config)
    else:
        path = Path(model_dir) / config.get("model_file", MODEL_FILENAME)
        if not path.is_file():
            raise FileNotFoundError(f"Model file {path} not found (train first, pass --model-file, or --weights "
                                    "with one of the run's checkpoints).")
        model = keras.models.load_model(path, compile=False)
    if weights:
        model.load_weights(weights)
    return model, load_tokenizer(model_dir, config), config


# The settings of the commands that follow kt-train when neither their command line nor the run's config.json
# (kt-train's --beam-size, --length-penalty, --average-last) sets them: kt-evaluate's and kt-export's search,
# kt-average-checkpoints' count (the paper averaged the last 5 checkpoints of its base models).
DEFAULT_BEAM_SIZE = 4
DEFAULT_LENGTH_PENALTY = 0.6
DEFAULT_AVERAGE_LAST = 5


class Renamed(NamedTuple):
    new: str    # the setting's name now
    type: type  # its old flag's value type


# Settings renamed since runs recorded them: {old name: Renamed(new name, flag type)}. The old name is still read:
# as a key of a kt-train --config file and as a flag (`add_renamed_flags`, `take_renamed_flags`), with a note that
# says when it goes (`keras_transformer.renamed.renamed_note`), and in an older run's config.json
# (`recorded_setting`), without one.
RENAMED_SETTINGS = {
    "alpha": Renamed("length_penalty", float),
    "max_length": Renamed("max_sentence_length", int),  # the training-pair filter, not the model's or a search's
}


def recorded_setting(config: dict, key: str, given=None, default=None):
    """`given` (a command-line value) if it is not None, else what kt-train recorded for the commands
    that follow it (config.json's "training": "beam_size", "length_penalty", "average_last"; under a renamed
    setting's old name in an older run), else `default`."""
    if given is not None:
        return given
    training = config.get("training", {})
    recorded = training.get(key)
    for old, renamed in RENAMED_SETTINGS.items():
        if recorded is None and key == renamed.new:
            recorded = training.get(old)
    return default if recorded is None else recorded


def max_source_length(config: dict) -> int | None:
    """The most source tokens (end id included) a run's model translates: config.json's "max_source_length",
    the training pairs' longest (kt-train's max_sentence_length); "max_length" in a run written before that
    name. None: no limit."""
    return config.get("max_source_length", config.get("max_length"))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_renamed_flags(parser, *old_names: str) -> None:
    """The old flags `old_names` of renamed settings (`--alpha` for `--length-penalty`, `--max-length` for
    `--max-sentence-length`), each taking a value of its new flag's type, hidden from --help;
    `take_renamed_flags` reads them."""
    for old in old_names:
        parser.add_argument(_flag(old), type=RENAMED_SETTINGS[old].type, dest=f"renamed_{old}",
                            help=argparse.SUPPRESS)


def take_renamed_flags(parser, args, note: str) -> None:
    """Moves each old flag's value (`add_renamed_flags`) in `args` onto its new name, printing `NOTE --OLD is
    now --NEW (read as such; ...)` (`renamed_note`) on stderr; the old and the new flag together are a usage
    error."""
    for old, renamed in RENAMED_SETTINGS.items():
        new = renamed.new
        value = getattr(args, f"renamed_{old}", None)
        if hasattr(args, f"renamed_{old}"):
            delattr(args, f"renamed_{old}")
        if value is None:
            continue
        if getattr(args, new, None) is not None:
            parser.error(f"{_flag(old)} is the old name of {_flag(new)}: give {_flag(new)} only")
        setattr(args, new, value)
        print(f"{note} {renamed_note(_flag(old), _flag(new))}", file=sys.stderr, flush=True)


def epoch_checkpoints(model_dir) -> list[tuple[int, Path]]:
    """(epoch, path) of each epoch checkpoint, in epoch order (epochs count from 1, as in their file names)."""
    d = Path(model_dir) / CHECKPOINT_DIR
    return sorted((int(m.group(1)), p) for p in d.glob("epoch-*.weights.h5") if (m := _EPOCH.search(p.name)))


def update_checkpoints(model_dir) -> list[tuple[int, Path]]:
    """(update, path) of each checkpoint a run by updates wrote (`UPDATE_CHECKPOINT_PATTERN`), in update order."""
    d = Path(model_dir) / CHECKPOINT_DIR
    return sorted((int(m.group(1)), p) for p in d.glob(UPDATE_CHECKPOINT_PATTERN.split("{")[0] + "*.weights.h5")
                  if (m := _UPDATE.search(p.name)))
