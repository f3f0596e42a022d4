"""kt-import: a Hugging Face Marian directory (a small OPUS-MT-like model that transformers trains and saves in
tests/marian_reference.py) becomes a run directory, and its TF Serving export translates text as transformers and
its `MarianTokenizer` do."""

import json

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_text  # noqa: F401  (registers the sentencepiece ops the export's graph holds)

from conftest import MULTI30K, REPO, backend_python, built_once, multi30k_lines, run_on_backend, write_lines
from training.import_marian import main as kt_import
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


def test_init_from_a_run_with_a_vocabulary_per_side_is_refused_by_name(tmp_path):
    """Fine-tuning reads one joint vocabulary: `kt-train --init-from` an imported run (two tokenizers) is refused
    with a `ConfigError` saying so, before anything trains, instead of reading its targets with the source's."""
    from training.errors import ConfigError
    from training.fine_tune import resolve_init_from

    (tmp_path / "config.json").write_text(json.dumps({"tokenizer_file": "tokenizer.model", "model_file": "model.keras",
                                                      "target_tokenizer_file": "target_tokenizer.model",
                                                      "model_config": {}}))
    for name in ("tokenizer.model", "target_tokenizer.model", "model.keras"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(ConfigError, match="a vocabulary per side .* not supported yet"):
        resolve_init_from(tmp_path)
