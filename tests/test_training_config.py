"""Configuration precedence, and a mixed-precision run (bf16 compute, float32 weights/logits/loss)."""

import json
import math
from pathlib import Path

import pytest

from training.train import DEFAULTS, resolve_config

REPO = Path(__file__).resolve().parents[1]
MULTI30K = REPO.parent / "shared" / "data" / "multi30k"


def test_config_precedence(tmp_path):
    cfg = resolve_config([])
    assert cfg["preset"] == DEFAULTS["preset"] and cfg["tokens_per_batch"] == DEFAULTS["tokens_per_batch"]
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"preset": "base", "epochs": 30, "warmup_steps": 100,
                             "model": {"dropout": 0.2, "norm_first": True}}))
    cfg = resolve_config(["--config", str(f), "--epochs", "5", "--model-arg", "dropout=0.3",
                          "--model-arg", "num_heads=4"])
    assert cfg["preset"] == "base" and cfg["warmup_steps"] == 100  # from the file
    assert cfg["epochs"] == 5  # flag beats file
    assert cfg["model"] == {"dropout": 0.3, "norm_first": True, "num_heads": 4}
    assert resolve_config(["--train-files", "a", "b"])["dataset"] == "files"
    f.write_text(json.dumps({"epoch": 3}))
    with pytest.raises(SystemExit, match="epoch"):
        resolve_config(["--config", str(f)])


@pytest.mark.skipif(not MULTI30K.is_dir(), reason="needs ../shared/data/multi30k")
def test_mixed_precision_training(tmp_path):
    import keras
    import numpy as np

    import keras_transformer  # noqa: F401
    from training.train import train

    src, tgt = tmp_path / "s.en", tmp_path / "s.de"
    for lang, p in (("en", src), ("de", tgt)):
        p.write_text("\n".join((MULTI30K / f"train.{lang}").read_text(encoding="utf-8").split("\n")[:300]) + "\n")
    cfg = resolve_config(["--preset", "tiny", "--train-files", str(src), str(tgt), "--model-dir", str(tmp_path / "run"),
                          "--vocab-size", "500", "--tokens-per-batch", "400", "--max-length", "40", "--epochs", "1",
                          "--steps-per-epoch", "4", "--warmup-steps", "10", "--mixed-precision", "--no-validation",
                          "--verbose", "0"])
    summary = train(cfg)
    assert math.isfinite(summary["final_loss"]) and summary["optimizer_steps"] == 4
    assert keras.mixed_precision.global_policy().name == "float32"  # restored after training
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["dtype_policy"] == "mixed_bfloat16"
    model = keras.models.load_model(tmp_path / "run" / "model.keras", compile=False)
    assert model.dtype_policy.name == "mixed_bfloat16"
    assert all(w.dtype == "float32" for w in model.weights)
    ids = np.array([[5, 6, 7, 3]], "int32")
    assert model((ids, ids)).dtype == "float32"
