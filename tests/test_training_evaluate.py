"""Evaluation (sacreBLEU), decoding a trained model, checkpoint averaging."""

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import multi30k_lines as _lines
from conftest import history_rows, needs_multi30k
from conftest import write_lines as _write
from keras_transformer.renamed import REMOVED_IN

SACREBLEU = Path(sys.executable).parent / "sacrebleu"
pytestmark = needs_multi30k


def _perturb(sentences):
    """Deterministic imperfect 'translations': drop / swap / replace some words."""
    out = []
    for i, s in enumerate(sentences):
        w = s.split()
        if i % 3 == 0 and len(w) > 3:
            del w[len(w) // 2]
        if i % 4 == 1 and len(w) > 2:
            w[0], w[1] = w[1], w[0]
        if i % 5 == 2:
            w = [x if j % 3 else "etwas" for j, x in enumerate(w)]
        out.append(" ".join(w))
    return out


def test_bleu_equals_sacrebleu_cli(tmp_path, capsys):
    from training.evaluate import main

    refs = _lines("test_2016_flickr.de", 60)
    ref = _write(tmp_path / "ref.de", refs)
    hyp = _write(tmp_path / "hyp.de", _perturb(refs))
    scores_path = tmp_path / "scores.json"
    assert main(["--hypotheses", str(hyp), "--references", str(ref), "--output", str(scores_path)]) == 0
    printed = capsys.readouterr().out
    ours = json.loads(scores_path.read_text())
    cli = subprocess.run([str(SACREBLEU), str(ref), "-i", str(hyp), "-m", "bleu", "chrf", "-w", "4"],
                         capture_output=True, text=True, check=True)
    cli_bleu, cli_chrf = json.loads(cli.stdout)
    assert 10 < cli_bleu["score"] < 95  # a non-trivial comparison
    assert round(ours["bleu"], 4) == cli_bleu["score"]
    assert round(ours["chrf"], 4) == cli_chrf["score"]
    assert ours["bleu_signature"] == cli_bleu["signature"]
    assert ours["chrf_signature"] == cli_chrf["signature"]
    # The printed line carries the signature, as sacreBLEU prints it.
    assert f"BLEU|{cli_bleu['signature']} = {cli_bleu['score']:.2f}" in printed
    assert f"chrF2|{cli_chrf['signature']} = {cli_chrf['score']:.2f}" in printed


def test_a_case_folding_models_output_is_scored_as_sacrebleu_lowercase_scores_it(tmp_path):
    """A model trained with `kt-train --lowercase` writes lowercase text: kt-evaluate scores a run whose config.json
    records that as `sacrebleu --lowercase --chrf-lowercase` does, and a cased run as before."""
    from training.evaluate import main

    refs = _lines("test_2016_flickr.de", 60)
    ref = _write(tmp_path / "ref.de", refs)
    hyp = _write(tmp_path / "hyp.de", [line.lower() for line in _perturb(refs)])
    scores = {}
    for lowercase in (True, False):
        run = tmp_path / f"run-{lowercase}"
        run.mkdir()
        (run / "config.json").write_text(json.dumps({"target_lang": "de", "training": {"lowercase": lowercase}}))
        out = tmp_path / f"scores-{lowercase}.json"
        assert main(["--hypotheses", str(hyp), "--references", str(ref), "--model-dir", str(run),
                     "--output", str(out)]) == 0
        scores[lowercase] = json.loads(out.read_text())
    for lowercase, flags in ((True, ["--lowercase", "--chrf-lowercase"]), (False, [])):
        cli = subprocess.run([str(SACREBLEU), str(ref), "-i", str(hyp), "-m", "bleu", "chrf", "-w", "4", *flags],
                             capture_output=True, text=True, check=True)
        cli_bleu, cli_chrf = json.loads(cli.stdout)
        assert round(scores[lowercase]["bleu"], 4) == cli_bleu["score"]
        assert round(scores[lowercase]["chrf"], 4) == cli_chrf["score"]
        assert scores[lowercase]["bleu_signature"] == cli_bleu["signature"]
    assert "case:lc" in scores[True]["bleu_signature"] and "case:mixed" in scores[False]["bleu_signature"]
    assert scores[True]["bleu"] > scores[False]["bleu"] + 5  # every capital of the references counts against it
    # The Multi30k protocol lowercases both sides anyway.
    assert scores[True]["multi30k_bleu"] == scores[False]["multi30k_bleu"]


def test_the_multi30k_protocol_tokenises_the_references_as_the_official_files():
    """The official tokenised test2016 German reference (lowercase.perl | normalize-punctuation.perl -l de |
    tokenizer.perl -l de) has 12,103 tokens."""
    from training.evaluate import moses_tokenised

    references = moses_tokenised(_lines("test_2016_flickr.de", 1000), "de")
    assert len(references) == 1000
    assert sum(len(line.split()) for line in references) == 12103
    assert all(line == line.lower() for line in references)


def test_evaluate_prints_the_multi30k_protocol_bleu(tmp_path, capsys):
    """Labelled, beside the cased BLEU; it ignores case, which the cased BLEU does not, and it is sacreBLEU
    with no tokeniser on the Moses-tokenised lines."""
    from sacrebleu.metrics import BLEU

    from training.evaluate import main, moses_tokenised

    refs = _lines("test_2016_flickr.de", 60)
    ref = _write(tmp_path / "ref.de", refs)
    hyps = [h.upper() if i % 2 else h for i, h in enumerate(_perturb(refs))]
    hyp = _write(tmp_path / "hyp.de", hyps)
    scores_path = tmp_path / "scores.json"
    argv = ["--hypotheses", str(hyp), "--references", str(ref), "--output", str(scores_path), "--target-lang", "de"]
    assert main(argv) == 0
    printed, scores = capsys.readouterr().out, json.loads(scores_path.read_text())
    expected = BLEU(tokenize="none").corpus_score(moses_tokenised(hyps, "de"), [moses_tokenised(refs, "de")]).score
    assert scores["multi30k_bleu"] == pytest.approx(expected)
    assert scores["multi30k_bleu"] > scores["bleu"] + 10  # the upper-cased half counts only here
    assert f"Multi30k protocol (lowercased, Moses punctuation-normalised and tokenised; sacrebleu -tok none), de: " \
           f"BLEU|" in printed
    # Without a language (no model, no --target-lang) there is no protocol BLEU, and no error.
    assert main(["--hypotheses", str(hyp), "--references", str(ref)]) == 0
    assert "Multi30k protocol" not in capsys.readouterr().out


def test_the_multi30k_protocol_scores_tokenised_lines_without_sacrebleus_detokenize_warning(caplog):
    """Its lines are Moses-tokenised on purpose; sacreBLEU warns of "forgot to detokenize" from 100 lines
    ending in " ." unless told."""
    from training.evaluate import multi30k_protocol_bleu

    refs = _lines("test_2016_flickr.de", 300)
    with caplog.at_level("WARNING", logger="sacrebleu"):
        score, signature = multi30k_protocol_bleu(_perturb(refs), refs, "de")
    assert not [r.getMessage() for r in caplog.records if r.name == "sacrebleu"]
    assert 0 < score.score < 100 and "tok:none" in str(signature)


def test_the_compound_split_is_tensor2tensors_and_fairseqs_perl_substitution():
    """`perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'`, a match taking the character after its hyphen: a
    one-character part keeps its next hyphen; a hyphen beside a space stays."""
    from training.evaluate import compound_split

    assert compound_split("Kosten-Nutzen-Verhältnis") == "Kosten ##AT##-##AT## Nutzen ##AT##-##AT## Verhältnis"
    assert compound_split("Die E-Mail kam .") == "Die E ##AT##-##AT## Mail kam ."
    assert compound_split("U-S-Bahn") == "U ##AT##-##AT## S-Bahn"
    assert compound_split("Vor- und Nachteile - gut") == "Vor- und Nachteile - gut"


# A hand-worked example of the paper's BLEU (3 sentences; "@" below stands for the token "##AT##-##AT##").
PAPER_REFERENCES = ["Das ist ein gutes Kosten-Nutzen-Verhältnis.", "Die E-Mail kam gestern an.",
                    "Wir sehen uns morgen."]
PAPER_HYPOTHESES = ["Das ist ein Kosten-Nutzen-Verhältnis.", "Die E-Mail kam heute an.", "Wir sehen uns morgen."]


def test_the_papers_bleu_of_a_hand_worked_example():
    """Moses-tokenised (the final "." split off), compounds split, then cased BLEU of the tokens, unsmoothed:
    1) hyp "Das ist ein Kosten @ Nutzen @ Verhältnis ." (9 tokens), ref with "gutes" (10): 1-grams 9/9,
       2-grams 7/8 (not "ein Kosten"), 3-grams 5/7, 4-grams 3/6;
    2) hyp "Die E @ Mail kam heute an ." (8), ref "gestern" for "heute" (8): 7/8, 5/7, 3/6, 2/5;
    3) "Wir sehen uns morgen ." both (5): 5/5, 4/4, 3/3, 2/2.
    Corpus: 21/22, 16/19, 11/16, 7/13; 22 tokens against 23: BLEU = exp(1 - 23/22) (21/22 16/19 11/16 7/13)^(1/4)
    = 70.58. Unsplit ("Kosten-Nutzen-Verhältnis" and "E-Mail" one token each): 15/16, 10/13, 5/10, 2/7, 16 tokens
    against 17: exp(1 - 17/16) (15/16 10/13 5/10 2/7)^(1/4) = 53.22."""
    import math

    from sacrebleu.metrics import BLEU
    from sacremoses import MosesTokenizer

    from training.evaluate import compound_split_bleu

    score, signature = compound_split_bleu(PAPER_HYPOTHESES, PAPER_REFERENCES, "de")
    assert (score.counts, score.totals, score.sys_len, score.ref_len) == ([21, 16, 11, 7], [22, 19, 16, 13], 22, 23)
    by_hand = 100 * math.exp(1 - 23 / 22) * (21 / 22 * 16 / 19 * 11 / 16 * 7 / 13) ** 0.25
    assert score.score == pytest.approx(by_hand) and round(by_hand, 2) == 70.58
    assert "case:mixed" in str(signature) and "tok:none" in str(signature) and "smooth:none" in str(signature)

    tokenizer = MosesTokenizer("de")
    unsplit = BLEU(tokenize="none", smooth_method="none", force=True).corpus_score(
        [tokenizer.tokenize(h, return_str=True) for h in PAPER_HYPOTHESES],
        [[tokenizer.tokenize(r, return_str=True) for r in PAPER_REFERENCES]])
    assert (unsplit.counts, unsplit.totals) == ([15, 10, 5, 2], [16, 13, 10, 7])
    assert unsplit.score == pytest.approx(100 * math.exp(1 - 17 / 16) * (15 / 16 * 10 / 13 * 5 / 10 * 2 / 7) ** 0.25)
    assert score.score > unsplit.score + 15
    # Cased, as multi-bleu.perl without -lc: a lowercased hypothesis loses its capitals' n-grams.
    lowered, _ = compound_split_bleu([h.lower() for h in PAPER_HYPOTHESES], PAPER_REFERENCES, "de")
    assert lowered.counts[0] == 21 - 8  # Das, Kosten, Nutzen, Verhältnis, Die, E, Mail, Wir no longer match
    assert lowered.score < score.score


def test_evaluate_prints_the_papers_bleu_for_wmt_datasets_and_with_paper_bleu(tmp_path, capsys):
    """A model whose config.json records a TFDS "wmt..." dataset gets the paper's BLEU line (labelled) and not the
    Multi30k protocol's; a Multi30k model the Multi30k protocol's alone, as before; --paper-bleu adds the line for
    any dataset, e.g. for files scored without a model; it needs a language."""
    from training.evaluate import compound_split_bleu, main, multi30k_protocol_bleu

    refs = _lines("test_2016_flickr.de", 60) + PAPER_REFERENCES
    hyps = _perturb(_lines("test_2016_flickr.de", 60)) + PAPER_HYPOTHESES
    ref, hyp = _write(tmp_path / "ref.de", refs), _write(tmp_path / "hyp.de", hyps)
    paper, paper_signature = compound_split_bleu(hyps, refs, "de")
    multi30k, _ = multi30k_protocol_bleu(hyps, refs, "de")
    paper_line = f"Paper protocol (Moses-tokenised, compounds split ##AT##-##AT##, multi-bleu.perl; " \
                 f"tensor2tensor's get_ende_bleu.sh), de: {paper.format(signature=str(paper_signature))}"
    assert paper.score != multi30k.score

    def evaluated(*flags, dataset=None):
        argv = ["--hypotheses", str(hyp), "--references", str(ref), "--output", str(tmp_path / "scores.json")]
        if dataset:
            run = tmp_path / dataset.replace("/", "-")
            run.mkdir(exist_ok=True)
            (run / "config.json").write_text(json.dumps({"target_lang": "de", "training": {"dataset": dataset}}))
            argv += ["--model-dir", str(run)]
        assert main(argv + list(flags)) == 0
        return capsys.readouterr().out, json.loads((tmp_path / "scores.json").read_text())

    printed, scores = evaluated(dataset="wmt14_translate/de-en")
    assert paper_line in printed.splitlines() and "Multi30k protocol" not in printed
    assert scores["paper_bleu"] == pytest.approx(paper.score) and scores["paper_bleu_lang"] == "de"
    assert scores["paper_bleu_signature"] == str(paper_signature) and "multi30k_bleu" not in scores
    printed, scores = evaluated(dataset="multi30k")
    assert "Paper protocol" not in printed and "paper_bleu" not in scores
    assert scores["multi30k_bleu"] == pytest.approx(multi30k.score) and "Multi30k protocol" in printed
    printed, scores = evaluated("--dataset", "files", "--target-lang", "de", "--paper-bleu")
    assert paper_line in printed.splitlines() and "Multi30k protocol" not in printed
    assert scores["paper_bleu"] == pytest.approx(paper.score)
    with pytest.raises(SystemExit, match="--paper-bleu needs the target language.*--target-lang"):
        main(["--hypotheses", str(hyp), "--references", str(ref), "--paper-bleu"])


def test_crlf_files_reach_sacrebleu_without_carriage_returns(tmp_path, monkeypatch):
    """Windows line ends are line ends: no '\\r' is fed to sacreBLEU (sacreBLEU's own tokenizer happens to
    hide it today, so this checks what evaluate passes on)."""
    import training.evaluate as evaluate

    refs = _lines("test_2016_flickr.de", 20)
    ref = tmp_path / "ref.de"
    ref.write_bytes("".join(line + "\r\n" for line in refs).encode("utf-8"))
    hyp = tmp_path / "hyp.de"
    hyp.write_bytes("".join(line + "\r\n" for line in _perturb(refs)).encode("utf-8"))
    seen = []
    monkeypatch.setattr(evaluate, "score", lambda hyps, references, lang=None, **_: seen.append((hyps, references)) or
                        {"bleu_text": "", "chrf_text": ""})
    assert evaluate.main(["--hypotheses", str(hyp), "--references", str(ref)]) == 0
    (hyps, references), = seen
    assert references == refs and hyps == _perturb(refs)


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory):
    """A tiny model trained on a slice of Multi30k (in-process): epochs of 8 updates and no epoch limit
    ("epochs": null), stopped by --max-updates 20 in the middle of the third, with the settings of the commands
    after training recorded. What it printed is in train.log beside the run."""
    from training.config import resolve_settings
    from training.fit import train

    d = tmp_path_factory.mktemp("eval")
    src = _write(d / "train.en", _lines("train.en", 400))
    tgt = _write(d / "train.de", _lines("train.de", 400))
    (d / "config.json").write_text(json.dumps({"epochs": None}))
    cfg = resolve_settings(["--config", str(d / "config.json"), "--preset", "tiny", "--train-files", str(src),
                          str(tgt), "--model-dir", str(d / "run"), "--vocab-size", "400", "--tokens-per-batch", "500",
                          "--max-sentence-length", "40", "--steps-per-epoch", "8", "--max-updates", "20",
                          "--warmup-steps", "20", "--average-last", "2", "--beam-size", "3", "--length-penalty", "0.8",
                          "--no-validation", "--verbose", "2"])
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        train(cfg)
    (d / "run" / "train.log").write_text(log.getvalue())
    return d / "run"


def test_model_dir_has_everything(trained_dir):
    cfg = json.loads((trained_dir / "config.json").read_text())
    assert (cfg["source_lang"], cfg["target_lang"]) == ("en", "de")
    assert (cfg["pad_id"], cfg["unk_id"], cfg["bos_id"], cfg["eos_id"]) == (0, 1, 2, 3)
    assert cfg["vocab_size"] == 400 and cfg["model_config"]["vocab_size"] == 400
    for name in ("model.keras", "tokenizer.model", "history.csv"):
        assert (trained_dir / name).is_file(), name
    assert sorted(p.name for p in (trained_dir / "checkpoints").iterdir()) == [
        "epoch-001.weights.h5", "epoch-002.weights.h5", "epoch-003.weights.h5"]
    assert any((trained_dir / "logs" / "train").iterdir())  # TensorBoard events


def test_max_updates_stops_in_the_middle_of_an_epoch_and_records_the_batches(trained_dir):
    """--max-updates 20 with epochs of 8: the run stops after update 20, in epoch 3, which still ends as an
    epoch (history row and checkpoint); config.json records what a batch held, as kt-train printed it."""
    cfg = json.loads((trained_dir / "config.json").read_text())
    assert cfg["last_run"]["optimizer_steps"] == 20 and cfg["last_run"]["stopped_by_max_updates"]
    assert cfg["last_run"]["epochs_run"] == [1, 2, 3]
    assert [int(row["epoch"]) for row in history_rows(trained_dir)] == [0, 1, 2]
    batches = cfg["batches"]
    assert 0 < batches["target_tokens"] <= batches["padded_target_tokens"] <= 500  # --tokens-per-batch
    assert batches["target_tokens_per_update"] == round(batches["target_tokens"])


def test_a_run_with_no_epoch_limit_prints_its_epochs_against_the_update_budget(trained_dir):
    """"epochs": null gives fit() a stand-in epoch count that is never reached; the progress lines name the
    update budget instead of that count."""
    log = (trained_dir / "train.log").read_text()
    assert [line for line in log.splitlines() if line.startswith("Epoch")] == [
        f"Epoch {n} (to update 20)" for n in (1, 2, 3)]
    assert "/1000000" not in log and "[kt-train] epoch 3 (update 20/20) done" in log


def test_evaluate_decodes_like_direct_decoding(trained_dir, tmp_path, capsys):
    import sentencepiece as spm
    import tensorflow as tf

    import keras_transformer as kt
    from export.translator import load_model_dir
    from training.evaluate import main

    sources = _lines("test_2016_flickr.en", 12)
    refs = _lines("test_2016_flickr.de", 12)
    src, ref = _write(tmp_path / "src.en", sources), _write(tmp_path / "ref.de", refs)
    out = tmp_path / "hyp.de"
    assert main(["--model-dir", str(trained_dir), "--source-file", str(src), "--references", str(ref),
                 "--beam-size", "1", "--batch-size", "5", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "BLEU|nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:" in printed and "chrF2|" in printed
    hyps = out.read_text(encoding="utf-8").split("\n")[:-1]
    assert len(hyps) == 12
    scores = json.loads(Path(str(out) + ".scores.json").read_text())
    assert scores["sentences"] == 12 and scores["beam_size"] == 1

    # Reference: each sentence decoded alone (no batching or padding), tokenized
    # and detokenized with the sentencepiece package.
    model, _, _ = load_model_dir(trained_dir)
    sp = spm.SentencePieceProcessor(model_file=str(trained_dir / "tokenizer.model"))
    decode = tf.function(lambda ids: kt.greedy_decode(model, ids, start_id=2, end_id=3,
                                                      max_output_length=tf.shape(ids)[1] + 50),
                         input_signature=[tf.TensorSpec([1, None], tf.int32)])
    for s, h in zip(sources, hyps):
        tokens, _ = decode(tf.constant([sp.encode(s) + [3]], tf.int32))
        toks = tokens[0].numpy().tolist()
        toks = toks[: toks.index(3)] if 3 in toks else [t for t in toks if t != 0]
        assert h == sp.decode(toks)

    # Beam search runs through the same path.
    assert main(["--model-dir", str(trained_dir), "--source-file", str(src), "--references", str(ref),
                 "--beam-size", "3", "--max-examples", "4", "--output", str(tmp_path / "beam.de")]) == 0
    assert len((tmp_path / "beam.de").read_text(encoding="utf-8").split("\n")[:-1]) == 4


def test_average_checkpoints(trained_dir):
    import keras

    import keras_transformer  # noqa: F401
    from training.average_checkpoints import main

    out = trained_dir / "avg2.keras"
    assert main(["--model-dir", str(trained_dir), "--last", "2", "--output", str(out)]) == 0
    model = keras.models.load_model(trained_dir / "model.keras", compile=False)
    model.load_weights(trained_dir / "checkpoints" / "epoch-002.weights.h5")
    w2 = model.get_weights()
    model.load_weights(trained_dir / "checkpoints" / "epoch-003.weights.h5")
    w3 = model.get_weights()
    avg = keras.models.load_model(out, compile=False).get_weights()
    assert max(float(np.abs(a - b).max()) for a, b in zip(w2, w3)) > 1e-4  # checkpoints differ
    for a, b, m in zip(w2, w3, avg):
        np.testing.assert_allclose(m, (a.astype(np.float64) + b) / 2, rtol=1e-6, atol=1e-7)


def test_the_commands_after_training_take_the_settings_kt_train_recorded(trained_dir, tmp_path, capsys):
    """kt-train --average-last 2 --beam-size 3 --length-penalty 0.8 (a recipe's config): kt-average-checkpoints and
    kt-evaluate use them when their own flags are not given (the length penalty also from an older run's config.json,
    which called it "alpha"); their flags still win, kt-evaluate's old --alpha too, with a note."""
    import keras

    import keras_transformer  # noqa: F401
    from conftest import as_recorded_before_the_renames
    from training.average_checkpoints import main as average
    from training.evaluate import main as evaluate

    assert average(["--model-dir", str(trained_dir), "--output", str(tmp_path / "recorded.keras")]) == 0
    assert "epoch-002.weights.h5, epoch-003.weights.h5 ->" in capsys.readouterr().out
    assert average(["--model-dir", str(trained_dir), "--last", "2", "--output", str(tmp_path / "two.keras")]) == 0
    assert average(["--model-dir", str(trained_dir), "--last", "3", "--output", str(tmp_path / "three.keras")]) == 0
    assert "Averaged 3 checkpoint(s)" in capsys.readouterr().out
    recorded = keras.models.load_model(tmp_path / "recorded.keras", compile=False).get_weights()
    two = keras.models.load_model(tmp_path / "two.keras", compile=False).get_weights()
    for a, b in zip(recorded, two):
        np.testing.assert_array_equal(a, b)

    src = _write(tmp_path / "src.en", _lines("test_2016_flickr.en", 3))
    ref = _write(tmp_path / "ref.de", _lines("test_2016_flickr.de", 3))
    common = ["--model-dir", str(trained_dir), "--source-file", str(src), "--references", str(ref)]
    assert evaluate(common + ["--output", str(tmp_path / "recorded.de")]) == 0
    scores = json.loads((tmp_path / "recorded.de.scores.json").read_text())
    assert (scores["beam_size"], scores["length_penalty"]) == (3, 0.8) and "alpha" not in scores
    old_run = as_recorded_before_the_renames(trained_dir, tmp_path / "old-run")
    assert evaluate(["--model-dir", str(old_run), "--model-file", str(trained_dir / "model.keras"),
                     *common[2:], "--output", str(tmp_path / "old.de")]) == 0
    old = json.loads((tmp_path / "old.de.scores.json").read_text())
    assert (old["beam_size"], old["length_penalty"]) == (3, 0.8)
    assert old["max_source_length"] == scores["max_source_length"] == 40  # an older run's "max_length"
    assert (tmp_path / "old.de").read_text() == (tmp_path / "recorded.de").read_text()
    capsys.readouterr()
    assert evaluate(common + ["--beam-size", "1", "--length-penalty", "0.6", "--output", str(tmp_path / "flags.de")]) == 0
    scores = json.loads((tmp_path / "flags.de.scores.json").read_text())
    assert (scores["beam_size"], scores["length_penalty"]) == (1, 0.6)
    assert "is now --length-penalty" not in capsys.readouterr().err
    assert evaluate(common + ["--beam-size", "1", "--alpha", "0.7", "--output", str(tmp_path / "old-flag.de")]) == 0
    scores = json.loads((tmp_path / "old-flag.de.scores.json").read_text())
    assert (scores["beam_size"], scores["length_penalty"]) == (1, 0.7)
    assert ("kt-evaluate: --alpha is now --length-penalty (read as such; the old name will be removed in "
            f"keras-transformer {REMOVED_IN})") in capsys.readouterr().err.splitlines()
    with pytest.raises(SystemExit):
        evaluate(common + ["--alpha", "0.7", "--length-penalty", "0.6"])
    assert "--alpha is the old name of --length-penalty: give --length-penalty only" in capsys.readouterr().err


def test_a_negative_extra_output_length_is_a_usage_error_in_kt_evaluate_and_kt_export(trained_dir, tmp_path,
                                                                                   capsys):
    """`--extra-output-length -1` is the room beyond each source, which cannot be negative: both commands stop with
    a usage error naming the flag and the value, before loading the model (no traceback)."""
    from export.export_model import main as export
    from training.evaluate import main as evaluate

    for command, args in ((evaluate, ["--model-dir", str(trained_dir)]),
                          (export, ["--model-dir", str(trained_dir), "--export-dir", str(tmp_path / "export")])):
        with pytest.raises(SystemExit) as exit_:
            command(args + ["--extra-output-length", "-1"])
        assert exit_.value.code == 2
        assert "--extra-output-length must be >= 0, got -1" in capsys.readouterr().err
    assert not (tmp_path / "export").exists()


def test_a_gold_tree_that_is_not_one_is_named_before_anything_is_decoded(trained_dir, tmp_path, capsys):
    """kt-evaluate --metric evalb reads the gold trees before it loads the model: a bad line is named (exit 2)
    and no hypotheses file is written."""
    from training.evaluate import main as evaluate

    src = _write(tmp_path / "test.words", ["the cat sat", "a dog"])
    gold = _write(tmp_path / "test.gold", ["(S (NP (DT the) (NN cat)) (VP (VBD sat)))", "(S (NP a dog"])
    out = tmp_path / "hyp.linear"
    assert evaluate(["--model-dir", str(trained_dir), "--metric", "evalb", "--source-file", str(src),
                     "--references", str(gold), "--output", str(out)]) == 2
    assert f"kt-evaluate: error: {gold}, line 2" in capsys.readouterr().err
    assert not out.exists()


def test_evaluate_scores_a_checkpoint_of_a_run_that_has_no_model_keras_yet(trained_dir, tmp_path, capsys):
    """While kt-train runs there is no model.keras: `kt-evaluate --weights CHECKPOINT` builds the model from
    config.json and translates as it does with model.keras. Without --weights, one line names the ways out."""
    import shutil

    from training.evaluate import main as evaluate

    running = tmp_path / "running"
    shutil.copytree(trained_dir, running, ignore=shutil.ignore_patterns("*.keras"))
    checkpoint = sorted((trained_dir / "checkpoints").glob("epoch-*.weights.h5"))[1]
    src = _write(tmp_path / "src.en", _lines("test_2016_flickr.en", 4))
    ref = _write(tmp_path / "ref.de", _lines("test_2016_flickr.de", 4))
    common = ["--source-file", str(src), "--references", str(ref), "--beam-size", "2", "--no-progress"]
    for model_dir, name in ((trained_dir, "with"), (running, "without")):
        assert evaluate(["--model-dir", str(model_dir), "--weights", str(checkpoint), "--output",
                         str(tmp_path / f"{name}.de"), *common]) == 0
    assert (tmp_path / "with.de").read_text() == (tmp_path / "without.de").read_text()
    capsys.readouterr()
    assert evaluate(["--model-dir", str(running), "--output", str(tmp_path / "x.de"), *common]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kt-evaluate: error:") and "model.keras not found" in err and "--weights" in err, err


def test_average_checkpoints_of_a_run_without_model_keras(trained_dir, tmp_path, capsys):
    """While kt-train runs, or after it was stopped, there is no model.keras yet: the average is built from
    config.json's architecture and equals the one made with model.keras. Without either, one clear line."""
    import shutil

    import keras

    import keras_transformer  # noqa: F401
    from training.average_checkpoints import main

    assert main(["--model-dir", str(trained_dir), "--last", "2", "--output", str(tmp_path / "with.keras")]) == 0
    running = tmp_path / "running"
    shutil.copytree(trained_dir, running, ignore=shutil.ignore_patterns("model.keras", "*.keras"))
    assert not (running / "model.keras").exists()
    assert main(["--model-dir", str(running), "--last", "2", "--output", str(tmp_path / "without.keras")]) == 0
    with_model = keras.models.load_model(tmp_path / "with.keras", compile=False)
    without = keras.models.load_model(tmp_path / "without.keras", compile=False)
    unnamed = lambda m: {k: v for k, v in m.get_config().items() if k != "name"}  # noqa: E731
    assert unnamed(without) == unnamed(with_model)
    for a, b in zip(with_model.get_weights(), without.get_weights()):
        np.testing.assert_array_equal(a, b)

    cfg = json.loads((running / "config.json").read_text())
    del cfg["model_config"]
    (running / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    assert main(["--model-dir", str(running), "--last", "2", "--output", str(tmp_path / "x.keras")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kt-average-checkpoints: error:") and "model.keras not found" in err, err
    assert "model_config" in err and "\n" not in err


def test_translate_all_shows_progress_over_the_batches(capsys):
    """kt-evaluate's progress bar (stderr): it counts every sentence, batch after batch, to the total."""
    import tensorflow as tf

    from training.evaluate import translate_all

    calls = []

    class Echo:  # a Translator's greedy function: the text back, with a score, and the "long" sources cut
        @staticmethod
        def translate_greedy(text):
            calls.append(int(tf.size(text)))
            return {"translation": text, "score": tf.zeros(tf.shape(text)),
                    "truncated": tf.strings.regex_full_match(text, ".*long.*")}

    sources = [f"sentence {i}" if i % 50 else f"long sentence {i}" for i in range(150)]
    translated = translate_all(Echo(), sources, beam_size=1, batch_size=64, progress=True)
    assert translated.texts == sources and translated.truncated_lines == [1, 51, 101]
    assert calls == [64, 64, 22]
    assert "150/150" in capsys.readouterr().err
    translate_all(Echo(), sources, beam_size=1, batch_size=64, progress=False)
    assert "150/150" not in capsys.readouterr().err


def test_evaluate_counts_the_sources_cut_to_the_models_limit(trained_dir, tmp_path, capsys):
    """A source with more pieces than config.json's max_source_length keeps (end id included) is cut before it is
    translated: kt-evaluate says how many of the sources were, against the limit, and records the count; with
    no such source, no line and a count of 0."""
    import sentencepiece as spm

    from training.evaluate import main

    limit = json.loads((trained_dir / "config.json").read_text())["max_source_length"]
    sp = spm.SentencePieceProcessor(model_file=str(trained_dir / "tokenizer.model"))
    fits = [s for s in _lines("test_2016_flickr.en", 40) if len(sp.encode(s)) + 1 <= limit][:3]
    long = " ".join(_lines("test_2016_flickr.en", 8))
    assert len(fits) == 3 and len(sp.encode(long)) + 1 > limit
    refs = _lines("test_2016_flickr.de", 4)
    ref = _write(tmp_path / "ref.de", refs)
    common = ["--model-dir", str(trained_dir), "--references", str(ref), "--beam-size", "1", "--no-progress"]
    for name, sources, cut in (("one-long", [fits[0], long, fits[1], fits[2]], 1), ("fitting", fits + [fits[0]], 0)):
        src, out = _write(tmp_path / f"{name}.en", sources), tmp_path / f"{name}.de"
        assert main(common + ["--source-file", str(src), "--output", str(out)]) == 0
        printed = capsys.readouterr().out
        line = (f"1 of 4 sources were longer than the model's limit of {limit} tokens (config.json "
                f"max_source_length, end token included) and were cut before translation (their BLEU counts the cut translation)")
        assert (line in printed.splitlines()) == bool(cut), printed
        assert ("were cut before translation" in printed) == bool(cut)
        scores = json.loads(Path(f"{out}.scores.json").read_text())
        assert (scores["truncated_sources"], scores["max_source_length"], scores["sentences"]) == (cut, limit, 4)
