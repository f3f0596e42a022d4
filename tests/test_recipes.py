"""The paper's WMT14 recipes (configs/wmt14-base.json and configs/wmt14-big.json, English-German;
configs/wmt14-en-fr-big.json, English-French): their settings against the paper's, and `make train` with the
en-fr one end to end on TFDS' own mock data of wmt14_translate, through to an export that translates. The
paper's table 3 (its rows A-E and big) as the kt-train flags docs/training.md gives them: every row builds,
with the parameter count the paper gives or the difference docs/training.md accounts for. The parsing recipe
(configs/parsing-wsj.json): its settings against section 6.3's."""

import json
import re
import shlex
import subprocess

import pytest

from conftest import COMMAND_ENV, REPO, grammar_tree, load_saved_model, mock_tfds_python

# "Attention Is All You Need", section 5 and tables 2 and 3: the settings of its base and big WMT14 en-de
# models, and of its big en-fr one (dropout 0.1 instead of 0.3, a 32,000 word-piece vocabulary from 36M pairs).
PAPER = {
    "base": {"d_model": 512, "d_ff": 2048, "num_heads": 8, "dropout": 0.1, "updates": 100_000, "averaged": 5,
             "checkpoint_every": 1400, "dataset": ("wmt14_translate/de-en", "en", "de"), "vocab_size": 37_000},
    "big": {"d_model": 1024, "d_ff": 4096, "num_heads": 16, "dropout": 0.3, "updates": 300_000, "averaged": 20,
            "checkpoint_every": 600, "dataset": ("wmt14_translate/de-en", "en", "de"), "vocab_size": 37_000},
    "en-fr-big": {"d_model": 1024, "d_ff": 4096, "num_heads": 16, "dropout": 0.1, "updates": 300_000,
                  "averaged": 20, "checkpoint_every": 600, "dataset": ("wmt14_translate/fr-en", "en", "fr"),
                  "vocab_size": 32_000},
}


@pytest.mark.parametrize("size", ["base", "big", "en-fr-big"])
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
    assert (cfg.dataset, cfg.source_lang, cfg.target_lang) == paper["dataset"]
    # A shared source-target vocabulary: 37,000 byte-pair pieces from all 4.5M en-de pairs' both sides; 32,000
    # word-pieces for en-fr (sentencepiece has no word-piece model: BPE, merges as word-piece grows its
    # vocabulary), from a sample of 9M of its 72M lines.
    assert (cfg.vocab_size, cfg.vocab_type, cfg.vocab_sample) == (paper["vocab_size"], "bpe", 9_000_000)
    # About 25,000 source and 25,000 target tokens an update, on any number of replicas.
    assert cfg.tokens_per_batch == 25_000 and not cfg.tokens_per_replica
    assert (cfg.label_smoothing, cfg.warmup_steps, cfg.adam_epsilon) == (0.1, 4000, 1e-9)
    assert (cfg.max_updates, cfg.epochs, cfg.average_last) == (paper["updates"], None, paper["averaged"])
    # Checkpoints every 10 minutes of the paper's step time (0.4 s base, 1.0 s big), beam 4, length penalty 0.6.
    assert (cfg.checkpoint_every, cfg.beam_size, cfg.length_penalty) == (paper["checkpoint_every"], 4, 0.6)


# One run of `make train` stands for the three recipes (one costs about two minutes of the suite): en-fr, which
# also takes its languages from the config; the en-de recipes differ from it only in their settings.
@pytest.mark.parametrize("recipe,dataset", [("wmt14-en-fr-big", "wmt14_translate/fr-en")])
def test_make_train_runs_the_wmt14_recipe_on_tfds_mock_data_through_to_an_export(tmp_path, recipe, dataset):
    """`make train CONFIG=configs/RECIPE.json` (no SRC or TGT: the languages are the config's) with the model
    shrunk and 6 updates by TRAIN_FLAGS, each command under `tfds.testing.mock_data`: the corpus is prepared into
    the run, trained by updates (checkpoints at updates 2, 4 and 6), the last 2 averaged, newstest2014's split
    scored, and the export translates."""
    import tensorflow as tf

    run, export = tmp_path / recipe, tmp_path / "export"
    flags = ("--preset tiny --vocab-size 1000 --vocab-sample 20000 --max-length 64 --tokens-per-batch 600 "
             "--max-updates 6 --checkpoint-every 2 --average-last 2 --verbose 0")
    done = subprocess.run(["make", "-o", ".venv/.installed", "train", f"CONFIG=configs/{recipe}.json",
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
    assert config["training"]["dataset"] == dataset and config["last_run"]["optimizer_steps"] == 6
    target = dataset[-5:-3]  # the config's target_lang: de, fr
    assert (config["training"]["source_lang"], config["training"]["target_lang"]) == ("en", target)
    assert "BLEU|nrefs:1|case:mixed" in out  # kt-evaluate scored the test split: sacreBLEU, and the paper's BLEU
    assert "Paper protocol (Moses-tokenised, compounds split" in out and "Multi30k protocol" not in out
    versions = sorted((export / "translator").iterdir())
    served = load_saved_model(versions[-1]).signatures["serving_default"](text=tf.constant(["a b c", ""]))
    assert [type(t) for t in served["translation"].numpy().tolist()] == [bytes, bytes]


# The paper's table 3, in its order: (row, N, d_model, d_ff, h, d_k, d_v, P_drop, eps_ls, learned positions,
# updates, parameters in millions; None where the paper leaves the column empty: the base model's). Its
# parameter counts are of a shared source-target vocabulary of about 37,000 pieces, the embeddings tied.
TABLE_3 = [
    ("base", 6, 512, 2048, 8, 64, 64, 0.1, 0.1, False, 100_000, 65),
    ("A", 6, 512, 2048, 1, 512, 512, 0.1, 0.1, False, 100_000, None),
    ("A", 6, 512, 2048, 4, 128, 128, 0.1, 0.1, False, 100_000, None),
    ("A", 6, 512, 2048, 16, 32, 32, 0.1, 0.1, False, 100_000, None),
    ("A", 6, 512, 2048, 32, 16, 16, 0.1, 0.1, False, 100_000, None),
    ("B", 6, 512, 2048, 8, 16, 64, 0.1, 0.1, False, 100_000, 58),
    ("B", 6, 512, 2048, 8, 32, 64, 0.1, 0.1, False, 100_000, 60),
    ("C", 2, 512, 2048, 8, 64, 64, 0.1, 0.1, False, 100_000, 36),
    ("C", 4, 512, 2048, 8, 64, 64, 0.1, 0.1, False, 100_000, 50),
    ("C", 8, 512, 2048, 8, 64, 64, 0.1, 0.1, False, 100_000, 80),
    ("C", 6, 256, 2048, 8, 32, 32, 0.1, 0.1, False, 100_000, 28),
    ("C", 6, 1024, 2048, 8, 128, 128, 0.1, 0.1, False, 100_000, 168),
    ("C", 6, 512, 1024, 8, 64, 64, 0.1, 0.1, False, 100_000, 53),
    ("C", 6, 512, 4096, 8, 64, 64, 0.1, 0.1, False, 100_000, 90),
    ("D", 6, 512, 2048, 8, 64, 64, 0.0, 0.1, False, 100_000, None),
    ("D", 6, 512, 2048, 8, 64, 64, 0.2, 0.1, False, 100_000, None),
    ("D", 6, 512, 2048, 8, 64, 64, 0.1, 0.0, False, 100_000, None),
    ("D", 6, 512, 2048, 8, 64, 64, 0.1, 0.2, False, 100_000, None),
    ("E", 6, 512, 2048, 8, 64, 64, 0.1, 0.1, True, 100_000, None),
    ("big", 6, 1024, 4096, 16, 64, 64, 0.3, 0.1, False, 300_000, 213),
]
TABLE_3_HEADING = "## The paper's table 3"
# docs/training.md's explanation of the base-sized rows' counts: a tied embedding of 41,000 rows instead of
# 37,000 gives, rounded to millions, each figure the paper gives for them.
PAPER_COUNT_VOCABULARY = 41_000


def table_3_of_the_docs():
    """docs/training.md's table 3: per row, (its row cell, the kt-train arguments its command cell gives, the
    parameter count of its "ours" cell)."""
    text = (REPO / "docs" / "training.md").read_text(encoding="utf-8")
    section = text[text.index(TABLE_3_HEADING):]
    section = section[:section.index("\n## ", 1)]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| ") or not re.fullmatch(r"\(?[A-E]\)?|base|big", cells[0].strip("*")):
            continue
        (command,) = re.findall(r"`([^`]+)`", cells[2])
        words = shlex.split(command)
        config = "configs/wmt14-base.json"
        if words and words[0].startswith("CONFIG="):
            config = words.pop(0).partition("=")[2]
        rows.append((cells[0].strip("*()"), ["--config", str(REPO / config), *words], int(cells[-1].replace(",", ""))))
    return rows


def test_every_row_of_table_3_is_a_command_with_the_papers_settings_and_parameter_count():
    """Each row of docs/training.md's table 3 resolves (the config and flags its command gives, as kt-train
    reads them) to the paper's N, d_model, d_ff, h, d_k, d_v, P_drop, eps_ls, positions and training steps,
    and its model, built with the shared vocabulary of 37,000 pieces and tied embeddings (built without
    values: the shapes of its weights, `keras.StatelessScope`), has the count its "ours" cell gives. That
    count is within 1% of the paper's, or (the base-sized rows) docs/training.md's account of the difference
    holds: an embedding of 41,000 rows, rounded to millions, gives the paper's figure; the rows whose figure the
    paper leaves empty have the base count (learned positions: plus their table)."""
    import keras

    import keras_transformer as kt
    from training.config import check_settings, resolve_settings

    rows = table_3_of_the_docs()
    assert [row for row, _, _ in rows] == [row[0] for row in TABLE_3]
    counts = []
    for (row, args, documented), paper in zip(rows, TABLE_3):
        _, n, d_model, d_ff, h, d_k, d_v, p_drop, eps_ls, learned, updates, millions = paper
        cfg = resolve_settings(args)
        check_settings(cfg)
        with keras.StatelessScope():  # weights with shapes and no values: no 200M random numbers drawn
            model = kt.Transformer.from_preset(cfg.preset, vocab_size=cfg.vocab_size, **cfg.model)
            model.build()
        attention = model.decoder.decoder_layers[0].cross_attention
        got = (model.num_encoder_layers, model.num_decoder_layers, model.d_model, model.d_ff, model.num_heads,
               attention.key_dim, attention.value_dim, model.dropout, cfg.label_smoothing, model.learned_positions,
               cfg.max_updates, cfg.vocab_size, model.tie_output_embedding)
        assert got == (n, n, d_model, d_ff, h, d_k, d_v, p_drop, eps_ls, learned, updates, 37_000, True), (row, args)
        count = model.count_params()
        assert count == documented, (row, args, count)
        counts.append(count)
        if millions is None:
            # Learned positions: a table of one row per position of the longest pair kt-train keeps.
            assert not learned or model.max_positions == cfg.max_sentence_length == 256
            table = model.max_positions * d_model if learned else 0
            assert count == counts[0] + table, (row, args)
        elif abs(count - millions * 1e6) > 0.01 * millions * 1e6:
            assert round((count + (PAPER_COUNT_VOCABULARY - 37_000) * d_model) / 1e6) == millions, (row, count)
    assert abs(counts[-1] - 213e6) <= 0.01 * 213e6  # big: within 1% of the paper's 213M


# "Attention Is All You Need", section 6.3: the WSJ-only parsing model and its decoding. Where the paper is silent
# (dropout, warm-up, the tied output embedding), tensor2tensor's `transformer_parsing_base` is followed.
PARSING = {"layers": 4, "d_model": 1024, "vocab_size": 16_000, "beam_size": 21, "length_penalty": 0.3,
           "extra_output_length": 300}


def test_the_parsing_recipe_has_the_papers_settings():
    import keras_transformer as kt
    from training.config import check_settings, resolve_settings

    cfg = resolve_settings(["--config", str(REPO / "configs" / "parsing-wsj.json")])
    check_settings(cfg)
    with __import__("keras").StatelessScope():
        model = kt.Transformer.from_preset(cfg.preset, vocab_size=cfg.vocab_size, **cfg.model)
    assert (model.num_encoder_layers, model.num_decoder_layers, model.d_model) == (
        PARSING["layers"], PARSING["layers"], PARSING["d_model"])
    # The rest of the base model's, as the paper says; dropout 0.2 in the residuals and the attention
    # (tensor2tensor's transformer_parsing_base).
    assert (model.d_ff, model.num_heads, model.dropout, model.attention_dropout) == (2048, 8, 0.2, 0.2)
    assert not model.norm_first and not model.learned_positions
    assert (cfg.vocab_size, cfg.beam_size, cfg.length_penalty, cfg.extra_output_length) == (
        PARSING["vocab_size"], PARSING["beam_size"], PARSING["length_penalty"], PARSING["extra_output_length"])
    assert cfg.metric == "evalb" and (cfg.source_lang, cfg.target_lang) == ("words", "linear")
    # A linearised WSJ tree runs to about 4 tokens a word: pairs of up to 512 pieces are kept.
    assert cfg.max_sentence_length == 512 and cfg.warmup_steps == 16_000



def test_make_train_on_the_parsing_recipe_learns_a_synthetic_grammar(tmp_path):
    """The recipe end to end, as docs/training.md runs it on the WSJ: kt-treebank makes each split of a treebank
    (here 4,000 training trees of conftest's small grammar, 200 validation, 300 test, drawn apart) into parallel
    text and gold trees, and `make train CONFIG=configs/parsing-wsj.json` prepares, trains, averages, scores with
    EVALB and exports. The model is shrunk and trained for 1,000 updates (TRAIN_FLAGS; its learning rate scaled to
    the small model), the search is the recipe's (beam 21, length penalty 0.3, source + 300). It learns the
    grammar: its bracket F1 on the held-out trees is far above a flat parse's (one S over the words), and the
    export parses as kt-evaluate does."""
    import random

    import tensorflow as tf

    from training.trees import gold_trees, main as treebank, score_parses

    data = tmp_path / "data"
    data.mkdir()
    for split, n, seed in (("train", 4000, 1), ("dev", 200, 2), ("test", 300, 3)):
        rng = random.Random(seed)
        (data / f"{split}.trees").write_text("".join(grammar_tree(rng) + "\n" for _ in range(n)), encoding="utf-8")
        assert treebank(["--treebank", str(data / f"{split}.trees"), "--out", str(data / split)]) == 0
    run, export = tmp_path / "parsing", tmp_path / "export"
    flags = ("--model-arg d_model=64 --model-arg num_heads=4 --model-arg d_ff=256 --model-arg num_encoder_layers=2 "
             "--model-arg num_decoder_layers=2 --dropout 0 --model-arg attention_dropout=0 --tokens-per-batch 1200 "
             "--warmup-steps 300 --learning-rate-scale 0.3 --max-updates 1000 --checkpoint-every 250 "
             "--average-last 2")
    done = subprocess.run(
        ["make", "-o", ".venv/.installed", "train", "CONFIG=configs/parsing-wsj.json", f"RUN={run}", f"EXPORT={export}",
         f"TRAIN={data}/train.words {data}/train.linear", f"VALID={data}/dev.words {data}/dev.linear",
         f"TEST={data}/test.words {data}/test.gold", "PREPARE_FLAGS=--vocab-size 400", f"TRAIN_FLAGS={flags}"],
        cwd=REPO, env=COMMAND_ENV, capture_output=True, text=True, timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "Averaged 2 checkpoint(s): update-0000750.weights.h5, update-0001000.weights.h5" in out
    assert "EVALB (COLLINS.prm): bracket F1" in out and "BLEU" not in out
    scores = json.loads((run / "hyp.test.words.linear.scores.json").read_text())
    assert (scores["beam_size"], scores["length_penalty"], scores["sentences"], scores["errors"]) == (21, 0.3, 300, 0)
    gold = gold_trees((data / "test.gold").read_text().splitlines())
    flat = score_parses(["(S " + "XX " * len(tree.words()) + ")S" for tree in gold], gold)
    assert flat["f1"] < 0.3  # one bracket of the 5 to 6 of a tree
    assert scores["f1"] > flat["f1"] + 0.3, (scores["evalb_text"], flat["evalb_text"])
    # The export (the recipe's search, recorded by kt-train) parses the first test sentences as kt-evaluate did.
    words = (data / "test.words").read_text().splitlines()[:4]
    parsed = (run / "hyp.test.words.linear").read_text().splitlines()[:4]
    served = load_saved_model(sorted((export / "translator").iterdir())[-1]).signatures["serving_default"](
        text=tf.constant(words))
    assert [t.decode() for t in served["translation"].numpy().tolist()] == parsed
