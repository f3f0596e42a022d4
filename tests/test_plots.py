"""training.plots: each subcommand writes a PNG for a run directory."""

import pytest

pytest.importorskip("matplotlib")

SENTENCES = [
    "A man in an orange hat starring at something.",
    "Two dogs are playing in the snow.",
    "A girl in a red dress is running on the beach.",
    "Ein Mann mit einem orangefarbenen Hut starrt etwas an.",
    "Zwei Hunde spielen im Schnee.",
    "Ein Mädchen in einem roten Kleid läuft am Strand.",
] * 5


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory as kt-train writes it, with an untrained tiny model (nothing is trained)."""
    import keras_transformer as kt
    from common.run_dir import MODEL_FILENAME, TOKENIZER_FILENAME
    from keras_transformer.text import train_sentencepiece, vocab_size_of
    from training.config import resolve_settings, write_config

    d = tmp_path_factory.mktemp("plots") / "run"
    d.mkdir()
    proto = train_sentencepiece(SENTENCES, vocab_size=300)
    (d / TOKENIZER_FILENAME).write_bytes(proto)
    vocab_size = vocab_size_of(proto)
    model = kt.Transformer.from_preset("tiny", vocab_size=vocab_size)
    model.build()
    model.save(d / MODEL_FILENAME)
    cfg = resolve_settings(["--preset", "tiny", "--model-dir", str(d), "--warmup-steps", "20"])
    write_config(cfg, d, vocab_size, model, "float32", extra={"last_run": {"optimizer_steps": 90}})
    (d / "history.csv").write_text(
        "epoch,loss,masked_accuracy,val_loss,val_masked_accuracy\n"
        "0,6.5,0.1,6.0,0.15\n"
        "1,5.5,0.2,5.2,0.25\n"
        "2,4.8,0.3,4.9,0.3\n"
    )
    return d


def _assert_png(path):
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = matplotlib.image.imread(path).shape[:2]
    assert 300 < width < 8000 and 200 < height < 8000, (width, height)


@pytest.mark.parametrize(
    "command",
    [
        ["schedule"],
        ["schedule", "--model-dir", "{run}"],
        ["loss", "--model-dir", "{run}"],
        ["attention", "--model-dir", "{run}", "--source", SENTENCES[0], "--max-output-length", "8"],
        ["attention", "--model-dir", "{run}", "--source", SENTENCES[1], "--max-output-length", "5", "--per-head"],
    ],
    ids=["schedule", "schedule-of-run", "loss", "attention", "attention-per-head"],
)
def test_writes_a_png(run_dir, tmp_path, command):
    from training.plots import main

    out = tmp_path / "images" / "figure.png"  # the directory is created
    assert main([a.format(run=run_dir) for a in command] + ["--out", str(out)]) == 0
    _assert_png(out)


def test_history_keeps_the_last_row_of_a_repeated_epoch(tmp_path):
    from training.plots import read_history

    path = tmp_path / "history.csv"
    # A resumed run appends: epoch 1 (0-based) again, and no validation here.
    path.write_text("epoch,loss,val_loss\n0,6.0,\n1,5.0,\n1,4.5,\n2,4.0,\n")
    history = read_history(path)
    assert history == {"loss": [(1, 6.0), (2, 4.5), (3, 4.0)]}


def test_attention_rows_follow_the_translation(run_dir):
    import numpy as np

    from export.translator import load_model_dir
    from training.plots import translate_with_attention

    model, tokenizer, cfg = load_model_dir(run_dir)
    source, output, translation, weights = translate_with_attention(model, tokenizer, cfg, SENTENCES[1], 6)
    assert source[-1] == "</s>" and "".join(source[:-1]).replace("\u2581", " ").strip() == SENTENCES[1]
    assert 1 <= len(output) <= 6 and isinstance(translation, str)
    cross = weights["decoder_cross_attention"][-1].numpy()
    assert cross.shape == (1, model.num_heads, len(output), len(source))
    np.testing.assert_allclose(cross.sum(axis=-1), 1.0, atol=1e-5)
