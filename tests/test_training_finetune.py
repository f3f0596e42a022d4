"""Fine-tuning (`kt-train --init-from`), the validation BLEU of every epoch (`--val-bleu`) and averaging the
best checkpoints (`kt-average-checkpoints --best N`)."""

import csv
import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from sacrebleu.metrics import BLEU

import keras_transformer as kt
from conftest import QUICK_MODEL_MAX_SENTENCE_LENGTH, history_rows, multi30k_lines, write_lines
from common.tokenizer import decode_output, encode_source, make_tokenizer
from common.run_dir import read_config
from keras_transformer.text import END_ID, START_ID
from training import average_checkpoints
from training.config import resolve_settings
from training.fit import compile_model, train
from training.keras_internals import ignoring_ran_out_of_data
from training.pipeline import make_batches
from keras_transformer.distributed import UpdateStep

TRAIN_LINES = 29000


def _dog_pairs(first, n):
    """`n` Multi30k training pairs about dogs, from line `first` on: a domain narrower than the quick
    model's first 2,000 lines."""
    en, de = multi30k_lines("train.en", TRAIN_LINES), multi30k_lines("train.de", TRAIN_LINES)
    pairs = [(s, t) for s, t in zip(en[first:], de[first:]) if " dog" in s]
    return pairs[:n]


@pytest.fixture(scope="module")
def fine_tuned(quick_model_dir, tmp_path_factory):
    """The quick model fine-tuned for 3 epochs on dog sentences, recording the validation BLEU."""
    tmp = tmp_path_factory.mktemp("fine-tune")
    pairs = _dog_pairs(2000, 500)
    train_pairs, val_pairs = pairs[:400], pairs[400:]
    files = {}
    for name, chunk in (("train", train_pairs), ("val", val_pairs)):
        files[name] = (write_lines(tmp / f"{name}.en", [s for s, _ in chunk]),
                       write_lines(tmp / f"{name}.de", [t for _, t in chunk]))
    model_dir = tmp / "run"
    cfg = resolve_settings([
        "--init-from", str(quick_model_dir), "--model-dir", str(model_dir),
        "--train-files", *map(str, files["train"]), "--valid-files", *map(str, files["val"]),
        "--epochs", "3", "--steps-per-epoch", "15", "--warmup-steps", "200", "--tokens-per-batch", "1024",
        "--max-sentence-length", str(QUICK_MODEL_MAX_SENTENCE_LENGTH), "--no-mixed-precision", "--val-bleu",
        "--verbose", "0"])
    summary = train(cfg)
    return {"model_dir": model_dir, "summary": summary, "val_pairs": val_pairs, "cfg": cfg}


def test_init_from_reuses_the_vocabulary_architecture_and_weights(quick_model_dir, fine_tuned):
    model_dir, summary = fine_tuned["model_dir"], fine_tuned["summary"]
    assert (model_dir / "tokenizer.model").read_bytes() == (quick_model_dir / "tokenizer.model").read_bytes()
    assert read_config(model_dir)["model_config"] == read_config(quick_model_dir)["model_config"]
    # A fresh optimizer: its step counts this run's 3 x 15 steps only.
    assert summary["optimizer_steps"] == 45
    # The loss it starts from is the trained model's on the new validation data, measured here apart.
    init = keras.models.load_model(quick_model_dir / "model.keras", compile=False)
    compile_model(init, fine_tuned["cfg"])
    UpdateStep.install(init)  # evaluate() counts the loss as kt-train's does: the mean over the real tokens
    tokenizer = make_tokenizer((quick_model_dir / "tokenizer.model").read_bytes())
    val = tf.data.Dataset.from_tensor_slices(tuple(map(list, zip(*fine_tuned["val_pairs"]))))
    batches = make_batches(val, tokenizer, max_sentence_length=QUICK_MODEL_MAX_SENTENCE_LENGTH, tokens_per_batch=1024,
                           shuffle=False)
    with ignoring_ran_out_of_data():  # bucketed batches, as in kt-train
        expected = init.evaluate(batches, verbose=0, return_dict=True)["loss"]
    assert summary["initial_val_loss"] == pytest.approx(expected, rel=1e-5)
    # An untrained model of that size would start near log(vocabulary size).
    assert summary["initial_val_loss"] < np.log(init.vocab_size) - 1.0


def test_fine_tuning_lowers_the_validation_loss_on_the_new_domain(fine_tuned):
    val_losses = [float(row["val_loss"]) for row in history_rows(fine_tuned["model_dir"])]
    assert len(val_losses) == 3
    assert val_losses[-1] < fine_tuned["summary"]["initial_val_loss"] - 0.1, val_losses


def test_val_bleu_is_the_greedy_bleu_of_that_epoch(fine_tuned):
    """history.csv's val_bleu of the last epoch, recomputed from that epoch's checkpoint."""
    model_dir = fine_tuned["model_dir"]
    rows = history_rows(model_dir)
    assert [row["epoch"] for row in rows] == ["0", "1", "2"]
    model = keras.models.load_model(model_dir / "model.keras", compile=False)
    model.load_weights(model_dir / "checkpoints" / "epoch-003.weights.h5")
    tokenizer = make_tokenizer((model_dir / "tokenizer.model").read_bytes())
    sources = [s for s, _ in fine_tuned["val_pairs"]]
    ids = encode_source(tokenizer, tf.constant(sources), QUICK_MODEL_MAX_SENTENCE_LENGTH).to_tensor()
    tokens, _ = kt.greedy_decode(model, ids, START_ID, END_ID)
    hypotheses = [t.decode() for t in decode_output(tokenizer, tokens).numpy().tolist()]
    expected = BLEU().corpus_score(hypotheses, [[t for _, t in fine_tuned["val_pairs"]]]).score
    assert float(rows[-1]["val_bleu"]) == pytest.approx(expected, abs=0.05)
    assert all(0.0 <= float(row["val_bleu"]) <= 100.0 for row in rows)


@pytest.mark.parametrize("by", ["val_loss", "val_bleu"])
def test_average_the_best_checkpoints(fine_tuned, tmp_path, capsys, by):
    model_dir = fine_tuned["model_dir"]
    scores = {int(row["epoch"]) + 1: float(row[by]) for row in history_rows(model_dir)}
    higher_is_better = by == "val_bleu"
    ranked = sorted(scores, key=lambda e: -scores[e] if higher_is_better else scores[e])
    out = tmp_path / "best.keras"
    assert average_checkpoints.main(["--model-dir", str(model_dir), "--best", "2", "--by", by,
                                     "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"The 2 best by {by}: epoch-{ranked[0]:03d}.weights.h5" in printed
    model = keras.models.load_model(model_dir / "model.keras", compile=False)
    expected = []
    for epoch in ranked[:2]:
        model.load_weights(model_dir / "checkpoints" / f"epoch-{epoch:03d}.weights.h5")
        expected.append(model.get_weights())
    averaged = keras.models.load_model(out, compile=False).get_weights()
    for got, a, b in zip(averaged, *expected):
        np.testing.assert_allclose(got, (a + b) / 2, rtol=1e-6, atol=1e-7)


def _fake_run(tmp_path, rows, epochs=4):
    (tmp_path / "checkpoints").mkdir()
    for epoch in range(1, epochs + 1):
        (tmp_path / "checkpoints" / f"epoch-{epoch:03d}.weights.h5").write_bytes(b"")
    with open(tmp_path / "history.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return tmp_path


def test_best_ranks_the_last_row_of_a_resumed_epoch(tmp_path):
    """A resumed run appends to history.csv: an epoch's later row replaces its earlier one."""
    rows = [{"epoch": 0, "val_loss": 3.0}, {"epoch": 1, "val_loss": 2.0}, {"epoch": 1, "val_loss": 2.6},
            {"epoch": 2, "val_loss": 2.5}, {"epoch": 3, "val_loss": 2.4}]
    best = average_checkpoints.best_checkpoints(_fake_run(tmp_path, rows), 2)
    assert [(p.name, s) for p, s in best] == [("epoch-004.weights.h5", 2.4), ("epoch-003.weights.h5", 2.5)]


def test_best_without_the_score_says_how_to_record_it(tmp_path, capsys):
    run = _fake_run(tmp_path, [{"epoch": 0, "loss": 3.0, "val_loss": 2.9}])
    (run / "config.json").write_text(json.dumps({"model_file": "model.keras"}))
    assert average_checkpoints.main(["--model-dir", str(run), "--best", "2", "--by", "val_bleu"]) == 2
    assert "has no val_bleu column (train with kt-train --val-bleu to record it)" in capsys.readouterr().err


def test_init_from_errors_name_the_problem(quick_model_dir, tmp_path, capsys):
    from training.train import main

    src = write_lines(tmp_path / "a.en", ["a dog runs ."] * 3)
    tgt = write_lines(tmp_path / "a.de", ["ein Hund rennt ."] * 3)
    base = ["--model-dir", str(tmp_path / "run"), "--train-files", str(src), str(tgt), "--epochs", "1",
            "--max-sentence-length", str(QUICK_MODEL_MAX_SENTENCE_LENGTH)]
    assert main(base + ["--init-from", str(tmp_path / "nowhere")]) == 2
    assert "--init-from" in capsys.readouterr().err
    assert main(base + ["--init-from", str(quick_model_dir), "--tokenizer", str(quick_model_dir / "tokenizer.model")]) == 2
    assert "drop --tokenizer" in capsys.readouterr().err
    d_model = read_config(quick_model_dir)["model_config"]["d_model"]
    assert main(base + ["--init-from", str(quick_model_dir), "--model-arg", f"d_model={d_model * 2}"]) == 2
    err = capsys.readouterr().err
    assert "settings that change the architecture cannot be fine-tuned from it" in err and "shape" in err
