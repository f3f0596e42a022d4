"""Fine-tuning (`kt-train --init-from`): the trained model a run starts from, and its weights.

The run reuses that model's vocabulary (one joint sentencepiece model, or one per side, as an imported Marian
model has) and architecture, loads its weights into the new model, and trains with a fresh optimizer and
learning-rate schedule (`training.fit`).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import keras

from common.run_dir import MODEL_FILENAME, read_config, target_tokenizer_path, tokenizer_path
from training.errors import ConfigError


class InitFrom(NamedTuple):
    """The trained model a fine-tuning run (`--init-from`) starts from."""

    model_file: Path
    tokenizer_file: Path  # the source's, in a run with a vocabulary per side
    model_config: dict
    preset: str | None
    target_tokenizer_file: Path | None = None  # the target's, in a run with a vocabulary per side (an import)


def resolve_init_from(path) -> InitFrom:
    """`--init-from PATH`: a directory written by kt-train (its model file), or a `.keras` file in one."""
    p = Path(path)
    if p.is_file() and p.suffix == ".keras":
        model_dir, model_file = p.parent, p
    elif p.is_dir():
        model_dir, model_file = p, None
    else:
        raise ConfigError(f"--init-from {path}: no such model directory or .keras file")
    try:
        config = read_config(model_dir)
    except FileNotFoundError as e:
        raise ConfigError(f"--init-from {path}: {e}") from None
    model_file = model_file or model_dir / config.get("model_file", MODEL_FILENAME)
    tokenizer_file, target_file = tokenizer_path(model_dir, config), target_tokenizer_path(model_dir, config)
    for needed in (model_file, tokenizer_file, target_file):
        if needed is not None and not needed.is_file():
            raise ConfigError(f"--init-from {path}: {needed} is missing")
    return InitFrom(model_file, tokenizer_file, config["model_config"], config.get("preset"), target_file)


def init_weights(init: InitFrom) -> list:
    """The weights of the model a fine-tuning run starts from, as numpy arrays in `model.weights` order."""
    source = keras.models.load_model(init.model_file, compile=False)
    return source.get_weights()


def set_init_weights(model, weights, init: InitFrom) -> None:
    """Loads `weights` into `model`; a `ConfigError` naming the first weight whose shape differs."""
    mine = model.weights
    if len(mine) != len(weights):
        raise ConfigError(f"--init-from {init.model_file}: it has {len(weights)} weights, this model "
                          f"{len(mine)}; settings that change the architecture cannot be fine-tuned from it")
    for variable, value in zip(mine, weights):
        if tuple(variable.shape) != value.shape:
            raise ConfigError(f"--init-from {init.model_file}: weight {variable.path} has shape {value.shape} "
                              f"there but {tuple(variable.shape)} here; settings that change the architecture "
                              "cannot be fine-tuned from it")
    model.set_weights(weights)
