"""kt-import: a Hugging Face Marian directory (a small OPUS-MT-like model that transformers trains and saves in
tests/marian_reference.py) becomes a run directory, and its TF Serving export translates text as transformers and
its `MarianTokenizer` do."""

import json

import numpy as np
import pytest
import sentencepiece as spm
import tensorflow as tf
import tensorflow_text  # noqa: F401  (registers the sentencepiece ops the export's graph holds)

from conftest import (MULTI30K, REPO, backend_python, built_once, history_rows, multi30k_lines, run_on_backend,
                      write_lines)
from training.import_marian import main as kt_import
from keras_transformer.text import END_ID
from training.marian import MarianIds

EXTRA_OUTPUT_LENGTH = 20  # tests/marian_reference.py's: transformers' max_new_tokens over the source's length


@pytest.fixture(scope="session")
def marian_dir(tmp_path_factory):
    """A Hugging Face Marian directory and transformers' outputs (reference.json), made once per test run."""
    if not (MULTI30K / "train.en").is_file():
        pytest.skip(f"Multi30k not found in {MULTI30K}")
    backend_python("torch")  # skips without the PyTorch virtualenv, where transformers is

    def build(folder):
        sentences = write_lines(folder / "sentences.txt", multi30k_lines("val.en", 20) + [""])
        run_on_backend("torch", (REPO / "tests" / "marian_reference.py").read_text(encoding="utf-8"),
                       folder / "marian", MULTI30K / "train.en", MULTI30K / "train.de", sentences, cwd=folder)
        return folder / "marian"

    return built_once(tmp_path_factory, "marian-reference", build)


def test_an_imported_marian_model_serves_what_transformers_translates(marian_dir, tmp_path, capsys):
    """kt-import, then kt-export (beam 4, length penalty 0, source + 20 pieces, as the reference's searches), then
    the SavedModel: its tokenize signature gives MarianTokenizer's ids (in the model's numbering), greedy gives
    `generate(num_beams=1)`'s text, and the beam `generate(num_beams=4)`'s, or where it differs the greedy
    output, more probable than transformers' (our beam also keeps the greedy hypothesis). Every other signature
    answers. An empty source gives "" (our export's rule; transformers translates the lone `</s>`)."""
    from export.export_model import export

    reference = json.loads((marian_dir / "reference.json").read_text(encoding="utf-8"))
    run = tmp_path / "run"
    assert kt_import(["--marian", str(marian_dir), "--model-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert "en->de" in out and "kt-export --model-dir" in out, out
    config = json.loads((run / "config.json").read_text())
    assert config["target_tokenizer_file"] and config["training"]["beam_size"] == 4

    saved = export(run, tmp_path / "export", check_ops=False, beam_size=4, length_penalty=0.0,
                   extra_output_length=EXTRA_OUTPUT_LENGTH)
    loaded = tf.saved_model.load(str(saved))
    texts = tf.constant(reference["sentences"])
    marian_vocab = json.loads((marian_dir / "vocab.json").read_text(encoding="utf-8"))
    ids = MarianIds(len(marian_vocab))
    empty = [i for i, text in enumerate(reference["sentences"]) if not text]
    rows = [i for i in range(len(reference["sentences"])) if i not in empty]

    source = loaded.signatures["tokenize"](text=texts)["source_ids"].numpy()
    for i in rows:
        assert [int(t) for t in source[i] if t] == ids.marian_to_ours[reference["source_ids"][i]].tolist(), i

    greedy = [t.decode() for t in loaded.signatures["greedy"](text=texts)["translation"].numpy()]
    assert [greedy[i] for i in rows] == [reference["greedy"][i] for i in rows]
    beam = loaded.signatures["serving_default"](text=texts)
    translations = [t.decode() for t in beam["translation"].numpy()]
    same = [i for i in rows if translations[i] == reference["beam"][i]]
    for i in sorted(set(rows) - set(same)):
        assert translations[i] == greedy[i] and beam["score"].numpy()[i] > reference["beam_score"][i] + 1e-4, i
    assert len(same) >= 0.8 * len(rows), (len(same), len(rows))
    assert all(greedy[i] == "" and translations[i] == "" for i in empty)

    two = tf.constant(reference["sentences"][:2])
    answers = {
        "n_best": loaded.signatures["n_best"](text=two)["translations"],
        "sample": loaded.signatures["sample"](text=two, seed=tf.constant([1, 2], tf.int64),
                                              temperature=tf.constant([1.0, 1.0]), top_k=tf.constant([0, 5]))[
            "translation"],
        "prefix": loaded.signatures["prefix"](text=two, prefix=tf.constant(["Ein", ""]))["translation"],
        "align": loaded.signatures["align"](text=two)["target_pieces"],
    }
    assert answers["n_best"].shape == (2, 4) and answers["n_best"][0, 0].numpy().decode() == translations[0]
    assert answers["prefix"][0].numpy().decode().startswith("Ein")
    assert answers["prefix"][1].numpy().decode() == translations[1]
    scored = loaded.signatures["score"](text=two, target=tf.constant(translations[:2]))
    assert np.all(np.isfinite(scored["log_prob"].numpy()))


def test_kt_import_refuses_what_it_cannot_read_naming_it(marian_dir, tmp_path, capsys):
    """A directory with pytorch_model.bin only, one without vocab.json, and a config the mapping does not cover:
    each a one-line error naming the file or key, status 2, and no run directory written."""
    import shutil

    for case, change in (
        ("bin", lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin")),
        ("vocab", lambda d: (d / "vocab.json").unlink()),
        ("config", lambda d: (d / "config.json").write_text(json.dumps(
            {**json.loads((d / "config.json").read_text()), "normalize_before": True}))),
    ):
        d = tmp_path / case
        shutil.copytree(marian_dir, d)
        change(d)
        assert kt_import(["--marian", str(d), "--model-dir", str(tmp_path / f"run-{case}")]) == 2
        err = capsys.readouterr().err
        assert {"bin": "pytorch_model.bin but no model.safetensors", "vocab": "vocab.json is missing",
                "config": "normalize_before=True is not supported"}[case] in err, err
        assert not (tmp_path / f"run-{case}" / "config.json").exists()


def test_an_imported_model_fine_tunes_on_multi30k_with_its_vocabulary_and_the_result_exports_and_serves(
        marian_dir, tmp_path, capsys):
    """`kt-train --init-from` an imported run, on 400 Multi30k training pairs (--train-files, prepared into the run)
    with 100 of its validation pairs (read as text): the run keeps both tokenizers (config.json's
    "target_tokenizer_file"), its prepared corpus holds each source as source.spm segments it and each target as
    target.spm does, it starts from a validation loss below a uniform guess's (label smoothing's share of the
    never-output pad and start ids is finite: `training.marian.MASKED_LOGIT`), and lowers it. kt-evaluate scores the
    import and the fine-tuned run, and the fine-tuned run's export translates text into target pieces. A corpus
    prepared with one vocabulary is refused by name."""
    import collections

    from export.export_model import export
    from training.config import resolve_settings
    from training.evaluate import main as kt_evaluate
    from training.errors import ConfigError
    from training.fit import train
    from training.prepare import main as kt_prepare
    from training.prepared_corpus import open_prepared, stream_batches

    imported = tmp_path / "imported"
    assert kt_import(["--marian", str(marian_dir), "--model-dir", str(imported)]) == 0
    files, lines = {}, {}
    for split, first, n in (("train", 2000, 400), ("val", 0, 100)):
        lines[split] = [multi30k_lines(f"{split}.{lang}", first + n)[first:] for lang in ("en", "de")]
        files[split] = [str(write_lines(tmp_path / f"{split}.{lang}", side))
                        for lang, side in zip(("en", "de"), lines[split])]
    run = tmp_path / "run"
    args = ["--init-from", str(imported), "--model-dir", str(run), "--train-files", *files["train"],
            "--valid-files", *files["val"], "--epochs", "2", "--steps-per-epoch", "10", "--warmup-steps", "20",
            "--learning-rate-scale", "0.05", "--tokens-per-batch", "1024", "--no-mixed-precision", "--verbose", "0"]
    joint = tmp_path / "joint"  # the sources' vocabulary for both sides
    assert kt_prepare(["--out", str(joint), "--train-files", *files["train"], "--tokenizer",
                       str(imported / "tokenizer.model"), "--shards", "2"]) == 0
    with pytest.raises(ConfigError, match="prepared with another vocabulary than --init-from's: .*--target-tokenizer"):
        train(resolve_settings([*args[:2], "--model-dir", str(tmp_path / "refused"), "--prepared", str(joint),
                                *args[7:]]))  # not --train-files
    summary = train(resolve_settings(args))
    out = capsys.readouterr().out
    assert "target tokenizer: " in out and "--target-tokenizer" in out, out
    config = json.loads((run / "config.json").read_text())
    assert config["target_tokenizer_file"] == "target_tokenizer.model"
    for name in ("tokenizer.model", "target_tokenizer.model"):
        assert (run / name).read_bytes() == (imported / name).read_bytes(), name

    corpus = open_prepared(run / "prepared")
    assert corpus.target_tokenizer_file.read_bytes() == (imported / "target_tokenizer.model").read_bytes()
    sides = [spm.SentencePieceProcessor(model_file=str(imported / name))
             for name in ("tokenizer.model", "target_tokenizer.model")]
    source, target = (sp.encode(side) for sp, side in zip(sides, lines["train"]))
    expected = collections.Counter((tuple(s) + (END_ID,), tuple(t) + (END_ID,)) for s, t in zip(source, target))
    epoch = stream_batches(corpus, list(range(len(corpus.shards))), max_sentence_length=512, tokens_per_replica=4000,
                           seed=1, epochs=1)
    assert collections.Counter((tuple(int(x) for x in s[r] if x), tuple(int(x) for x in to[r] if x))
                               for (s, _), to in epoch for r in range(len(s))) == expected

    vocab_size = json.loads((imported / "config.json").read_text())["vocab_size"]
    val_losses = [float(row["val_loss"]) for row in history_rows(run)]
    assert summary["initial_val_loss"] < np.log(vocab_size), (summary["initial_val_loss"], np.log(vocab_size))
    assert val_losses[-1] < summary["initial_val_loss"] - 0.05, (summary["initial_val_loss"], val_losses)

    for scored in (imported, run):  # kt-evaluate takes the import and the fine-tuned run alike
        assert kt_evaluate(["--model-dir", str(scored), "--source-file", files["val"][0], "--references",
                            files["val"][1], "--max-examples", "16", "--beam-size", "1", "--no-progress"]) == 0
        scores = json.loads(next(scored.glob("hyp.*.scores.json")).read_text())
        assert scores["sentences"] == 16 and scores["bleu"] > 0, (scored, scores)

    saved = export(run, tmp_path / "export", check_ops=False, beam_size=2)
    loaded = tf.saved_model.load(str(saved))
    texts = tf.constant(multi30k_lines("val.en", 3))
    served = loaded.signatures["serving_default"](text=texts)["translation"].numpy()
    pieces = loaded.signatures["align"](text=texts)["target_pieces"].numpy()
    target_pieces = set(spm_pieces(imported / "target_tokenizer.model"))
    for text, row in zip(served, pieces):
        used = [p.decode() for p in row if p]
        assert text.decode() and used[-1] == "</s>" and set(used[:-1]) <= target_pieces, (text, used)


def spm_pieces(path):
    """The pieces a sentencepiece model produces (not its unused or control ones)."""
    model = spm.SentencePieceProcessor(model_file=str(path))
    return [model.id_to_piece(i) for i in range(model.get_piece_size())
            if not (model.is_unused(i) or model.is_control(i))]
