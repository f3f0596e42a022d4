"""The paper's WMT14 English-German recipes (configs/wmt14-base.json, configs/wmt14-big.json): their settings
against the paper's, and `make train` with one of them end to end on TFDS' own mock data of
wmt14_translate/de-en, through to an export that translates."""

import json
import subprocess

import pytest

from conftest import COMMAND_ENV, REPO, load_saved_model, mock_tfds_python

# "Attention Is All You Need", section 5 and table 3: the settings of its base and big WMT14 en-de models.
PAPER = {
    "base": {"d_model": 512, "d_ff": 2048, "num_heads": 8, "dropout": 0.1, "updates": 100_000, "averaged": 5},
    "big": {"d_model": 1024, "d_ff": 4096, "num_heads": 16, "dropout": 0.3, "updates": 300_000, "averaged": 20},
}


@pytest.mark.parametrize("size", ["base", "big"])
def test_the_wmt14_recipes_have_the_papers_settings(size):
    import keras_transformer as kt
    from training.config import check_settings, resolve_settings

    cfg = resolve_settings(["--config", str(REPO / "configs" / f"wmt14-{size}.json")])
    check_settings(cfg)
    paper = PAPER[size]
    model = kt.Transformer.from_preset(cfg.preset, vocab_size=cfg.vocab_size, **cfg.model)
    got = {key: getattr(model, key, None) for key in ("d_model", "d_ff", "num_heads", "dropout")}
    assert got == {key: paper[key] for key in got}, got
    assert (model.num_encoder_layers, model.num_decoder_layers) == (6, 6)
    # Post-norm residuals, sinusoidal positions, the embeddings shared with the pre-softmax projection.
    assert not model.norm_first and not model.learned_positions and model.tie_output_embedding
    assert (cfg.dataset, cfg.source_lang, cfg.target_lang) == ("wmt14_translate/de-en", "en", "de")
    # A shared source-target vocabulary of about 37,000 byte-pair pieces, from all 4.5M pairs' both sides.
    assert (cfg.vocab_size, cfg.vocab_type, cfg.vocab_sample) == (37_000, "bpe", 9_000_000)
    # About 25,000 source and 25,000 target tokens an update, on any number of replicas.
    assert cfg.tokens_per_batch == 25_000 and not cfg.tokens_per_replica
    assert (cfg.label_smoothing, cfg.warmup_steps, cfg.adam_epsilon) == (0.1, 4000, 1e-9)
    assert (cfg.max_updates, cfg.epochs, cfg.average_last) == (paper["updates"], None, paper["averaged"])
    assert cfg.checkpoint_every and (cfg.beam_size, cfg.length_penalty) == (4, 0.6)


def test_make_train_runs_the_wmt14_recipe_on_tfds_mock_data_through_to_an_export(tmp_path):
    """`make train CONFIG=configs/wmt14-base.json` with the model shrunk and 6 updates by TRAIN_FLAGS, each
    command under `tfds.testing.mock_data`: the corpus is prepared into the run, trained by updates
    (checkpoints at updates 2, 4 and 6), the last 2 averaged, newstest2014's split scored, and the export
    translates."""
    import tensorflow as tf

    run, export = tmp_path / "wmt14-base-en-de", tmp_path / "export"
    flags = ("--preset tiny --vocab-size 1000 --vocab-sample 20000 --max-length 64 --tokens-per-batch 600 "
             "--max-updates 6 --checkpoint-every 2 --average-last 2 --verbose 0")
    done = subprocess.run(["make", "-o", ".venv/.installed", "train", "CONFIG=configs/wmt14-base.json",
                           f"RUN={run}", f"EXPORT={export}", f"TRAIN_FLAGS={flags}", f"PY={mock_tfds_python(tmp_path)}"],
                          cwd=REPO, env=COMMAND_ENV, capture_output=True, text=True, timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "= 600 tokens per update" in out  # the batch plan, printed at the start
    assert (run / "prepared" / "manifest.json").is_file()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        f"update-{u:07d}.weights.h5" for u in (2, 4, 6)]
    assert "Averaged 2 checkpoint(s): update-0000004.weights.h5, update-0000006.weights.h5" in out
    config = json.loads((run / "config.json").read_text())
    assert config["training"]["dataset"] == "wmt14_translate/de-en" and config["last_run"]["optimizer_steps"] == 6
    assert "BLEU|nrefs:1|case:mixed" in out  # kt-evaluate scored the test split: sacreBLEU, and the paper's BLEU
    assert "Paper protocol (Moses-tokenised, compounds split" in out and "Multi30k protocol" not in out
    versions = sorted((export / "translator").iterdir())
    served = load_saved_model(versions[-1]).signatures["serving_default"](text=tf.constant(["a b c", ""]))
    assert [type(t) for t in served["translation"].numpy().tolist()] == [bytes, bytes]
