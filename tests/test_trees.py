"""training/trees.py: reading treebanks, the linearisation both ways with its repairs counted, and EVALB's bracket
scores under COLLINS.prm, on examples worked by hand from EVALB's definition (evalb.c: terminals of a deleted tag
removed, zero-span brackets dropped, labels cut at '-' or '=', ADVP = PRT, one test bracket per gold bracket)."""

import pytest

from training.trees import (Repairs, Tree, TreeError, brackets, clean, delinearize, evalb, gold_trees, linearize, main,
                            parse_trees, read_treebank, score_parses)


def tree(text):
    (t,) = parse_trees(text)
    return t


GOLD = "(S (NP (DT The) (NN cat)) (VP (VBD sat) (PP (IN on) (NP (DT the) (NN mat)))) (. .))"


def test_a_treebank_of_one_tree_a_line_and_an_mrg_file_read_the_same_trees(tmp_path):
    lines = tmp_path / "train.trees"
    lines.write_text(GOLD + "\n(S (VP (VB Go)) (. !))\n")
    mrg = tmp_path / "wsj_0001.mrg"
    # The Penn Treebank's layout: each tree over several lines, in an unlabelled outer bracket.
    mrg.write_text("( (S \n    (NP (DT The) (NN cat))\n    (VP (VBD sat)\n      (PP (IN on)\n        (NP (DT the) "
                   "(NN mat))))\n    (. .)))\n( (S (VP (VB Go)) (. !)) )\n")
    assert read_treebank([lines]) == read_treebank([mrg])
    first = read_treebank([mrg])[0]
    assert first.words() == ["The", "cat", "sat", "on", "the", "mat", "."]
    assert first.tags() == ["DT", "NN", "VBD", "IN", "DT", "NN", "."]
    assert str(first) == GOLD


@pytest.mark.parametrize("text,message", [
    ("(S (NP (DT The) (NN cat))", "left open"),
    (")(S (DT The))", "closes nothing"),
    ("(NP (DT The) cat)", "beside other children"),
    ("(S (NP))", "is empty"),
])
def test_a_malformed_treebank_is_refused_naming_the_file_and_the_tree(text, message):
    with pytest.raises(TreeError, match=rf"wsj\.mrg: tree 1: .*{message}"):
        list(parse_trees(text, "wsj.mrg"))


def test_cleaning_removes_empty_elements_and_function_tags():
    gold = tree("(S (NP-SBJ-1 (-NONE- *)) (VP (VB Go) (NP=2 (-NONE- *T*-1))) (. .))")
    assert str(clean(gold)) == "(S (VP (VB Go)) (. .))"


def test_linearize_is_vinyals_and_delinearize_undoes_it_without_a_repair():
    gold = tree(GOLD)
    tokens = linearize(gold)
    assert " ".join(tokens) == "(S (NP XX XX )NP (VP XX (PP XX (NP XX XX )NP )PP )VP XX )S"
    back, repairs = delinearize(tokens, gold.words(), gold.tags())
    assert back == gold and repairs == Repairs() and repairs.total == 0


@pytest.mark.parametrize("sequence,expected,counts", [
    # a closing that names the wrong label closes the open one
    ("(S (NP XX XX )VP XX )S", "(S (NP (XX a) (XX b)) (XX c))", {"relabelled": 1}),
    # still open at the end: closed
    ("(S (NP XX XX )NP XX", "(S (NP (XX a) (XX b)) (XX c))", {"unclosed": 1}),
    # a word too many is dropped; a word too few is added to the top constituent
    ("(S XX XX XX XX )S", "(S (XX a) (XX b) (XX c))", {"extra_words": 1}),
    ("(S (NP XX )NP )S", "(S (NP (XX a)) (XX b) (XX c))", {"missing_words": 2}),
    # cut short inside a constituent: what is open is closed first, so the missing words still come last
    ("(S (NP XX", "(S (NP (XX a)) (XX b) (XX c))", {"unclosed": 2, "missing_words": 2}),
    # a closing with nothing open, an unknown token, an empty constituent
    (")NP (S XX dog XX (VP )VP XX )S", "(S (XX a) (XX b) (XX c))", {"unopened": 1, "unknown": 1, "empty": 1}),
    # two top constituents are put under one
    ("(NP XX )NP (VP XX XX )VP", "(S (NP (XX a)) (VP (XX b) (XX c)))", {"wrapped": 1}),
])
def test_delinearize_repairs_a_sequence_that_is_not_a_tree_and_counts_each_repair(sequence, expected, counts):
    back, repairs = delinearize(sequence.split(), ["a", "b", "c"])
    assert str(back) == expected
    assert {k: v for k, v in vars(repairs).items() if v} == counts
    assert back.words() == ["a", "b", "c"]


def test_evalb_on_a_pp_attached_wrong():
    """Gold: the PP holds "on the mat". Test: the PP holds "on" alone, the NP beside it. The '.' is removed, so
    S spans words 0-6. Gold brackets S(0,6) NP(0,2) VP(2,6) PP(3,6) NP(4,6); test S(0,6) NP(0,2) VP(2,6)
    PP(3,4) NP(4,6): 4 of 5 match, recall = precision = F1 = 0.8."""
    gold = tree(GOLD)
    test = tree("(S (NP (DT The) (NN cat)) (VP (VBD sat) (PP (IN on)) (NP (DT the) (NN mat))) (. .))")
    assert brackets(gold) == {("S", 0, 6): 1, ("NP", 0, 2): 1, ("VP", 2, 6): 1, ("PP", 3, 6): 1, ("NP", 4, 6): 1}
    scores = evalb([gold], [test])
    assert (scores["matched"], scores["gold_brackets"], scores["test_brackets"]) == (4, 5, 5)
    assert [scores[k] for k in ("recall", "precision", "f1")] == pytest.approx([0.8, 0.8, 0.8])
    assert scores["complete_match"] == 0


def test_evalb_labels_function_tags_advp_prt_top_and_empty_elements():
    # NP-SBJ is NP; PRT and ADVP are one label; TOP is not a bracket; the -NONE- word is removed, so the
    # bracket holding only it spans no word and is dropped.
    gold = tree("(TOP (S (NP-SBJ (PRP He)) (VP (VBD gave) (PRT (RP up)) (NP (-NONE- *))) (. .)))")
    test = tree("(S (NP (PRP He)) (VP (VBD gave) (ADVP (RP up))) (. .))")
    assert brackets(gold) == {("S", 0, 3): 1, ("NP", 0, 1): 1, ("VP", 1, 3): 1, ("ADVP", 2, 3): 1}
    scores = evalb([gold], [test])
    assert scores["f1"] == 1.0 and scores["complete_match"] == 1


def test_evalb_counts_a_unary_chain_as_a_multiset_and_micro_averages_sentences():
    # Gold has S over S (two brackets of one span) and VP; the test one S and VP: 2 matches of 3 gold. With a
    # second sentence of 3 of 3: recall 5/6, precision 5/5.
    gold = [tree("(S (S (VP (VB Go))))"), tree("(S (NP (NN Dogs)) (VP (VBP bark)))")]
    test = [tree("(S (VP (VB Go)))"), tree("(S (NP (NN Dogs)) (VP (VBP bark)))")]
    scores = evalb(gold, test)
    assert (scores["matched"], scores["gold_brackets"], scores["test_brackets"]) == (5, 6, 5)
    assert scores["recall"] == pytest.approx(5 / 6) and scores["precision"] == 1.0
    assert scores["f1"] == pytest.approx(2 * (5 / 6) / (1 + 5 / 6))


def test_evalb_skips_a_sentence_whose_words_differ_as_an_error():
    gold = [tree("(S (NP (NN Dogs)) (VP (VBP bark)))"), tree("(S (VP (VB Go)))")]
    test = [tree("(S (NP (NN Cats)) (VP (VBP bark)))"), tree("(S (VP (VB Go)))")]
    scores = evalb(gold, test)
    assert scores["errors"] == 1 and scores["sentences"] == 2
    assert (scores["matched"], scores["gold_brackets"]) == (2, 2)


def test_a_delinearized_prediction_with_gold_tags_scores_against_the_gold_tree():
    gold = tree(GOLD)
    predicted = "(S (NP XX XX )NP (VP XX (PP XX )PP (NP XX XX )NP )VP XX )S".split()
    test, repairs = delinearize(predicted, gold.words(), gold.tags())
    assert repairs.total == 0
    assert evalb([gold], [test])["matched"] == 4
    assert isinstance(test, Tree)


def test_whatever_the_sequence_delinearize_makes_a_tree_of_the_sentences_words_in_order():
    """EVALB skips a sentence whose words differ from gold's, so every repair must keep the words and their order:
    on 2,000 random sequences of brackets and words (what an untrained model writes), the tree's words are the
    sentence's, and a sequence needing no repair is the linearisation of the tree made of it."""
    import random

    rng = random.Random(0)
    alphabet = ["(S", ")S", "(NP", ")NP", "(VP", ")VP", "XX", "XX", "XX", "junk"]
    for _ in range(2000):
        words = [f"w{i}" for i in range(rng.randint(1, 6))]
        sequence = [rng.choice(alphabet) for _ in range(rng.randint(0, 14))]
        back, repairs = delinearize(sequence, words)
        assert back.words() == words, (sequence, str(back))
        if repairs.total == 0:
            assert linearize(back) == sequence


def test_score_parses_makes_trees_over_the_gold_words_and_tags_and_sums_the_repairs():
    """Two parses of GOLD: its linearisation, and the same missing its final `)S`, which `delinearize` closes
    (one repair): both have gold's 5 brackets (S, NP, VP, PP, NP), so 10 of 10 match."""
    gold = gold_trees([GOLD, GOLD])
    right = " ".join(linearize(gold[0]))
    unclosed = right.rsplit(" ", 1)[0]  # the final )S missing
    scores = score_parses([right, unclosed], gold)
    assert (scores["matched"], scores["gold_brackets"], scores["test_brackets"]) == (10, 10, 10)
    assert scores["f1"] == 1.0 and scores["complete_match"] == 2
    assert scores["repaired"] == 1 and scores["repairs"]["unclosed"] == 1 and sum(scores["repairs"].values()) == 1
    # A flat parse: only S matches of gold's 5 (precision 1/1, recall 1/5, F1 1/3).
    flat = score_parses(["(S " + "XX " * 6 + ")S"], gold[:1])
    assert (flat["matched"], flat["test_brackets"], flat["f1"]) == (1, 1, pytest.approx(1 / 3))
    assert "bracket F1 33.33 (recall 20.00, precision 100.00)" in flat["evalb_text"]
    with pytest.raises(ValueError, match="1 hypotheses but 2 gold trees"):
        score_parses([right], gold)


def test_gold_trees_are_cleaned_and_a_line_that_is_not_one_tree_is_named():
    (t,) = gold_trees(["(S (NP-SBJ (-NONE- *) ) (NP (PRP It)) (VP (VBZ is)))"])
    assert str(t) == "(S (NP (PRP It)) (VP (VBZ is)))"
    for bad in ("(S (NP (DT a)) (VP (VBZ is))) (S (NP (DT b)))", "(S (-NONE- *))"):
        with pytest.raises(TreeError, match=r"gold.txt, line 2: expected one bracketed tree with words"):
            gold_trees([GOLD, bad], "gold.txt")


def test_kt_treebank_writes_the_words_the_linearised_trees_and_the_cleaned_gold(tmp_path, capsys):
    mrg = tmp_path / "wsj_0001.mrg"
    mrg.write_text("( (S (NP-SBJ (DT The) (NN cat)) (VP (VBD sat) (NP (-NONE- *T*-1))) (. .)) )\n"
                   "( (S (-NONE- *)) )\n( (S (NP-SBJ (PRP It)) (VP (VBD rained))) )\n", encoding="utf-8")
    assert main(["--treebank", str(mrg), "--out", str(tmp_path / "out" / "train")]) == 0
    read = {suffix: (tmp_path / "out" / f"train.{suffix}").read_text(encoding="utf-8").splitlines()
            for suffix in ("words", "linear", "gold")}
    assert read == {"words": ["The cat sat .", "It rained"],
                    "linear": ["(S (NP XX XX )NP (VP XX )VP XX )S", "(S (NP XX )NP (VP XX )VP )S"],
                    "gold": ["(S (NP (DT The) (NN cat)) (VP (VBD sat)) (. .))", "(S (NP (PRP It)) (VP (VBD rained)))"]}
    assert "2 trees (1 with no word but empty elements left out)" in capsys.readouterr().out
    assert main(["--treebank", str(tmp_path / "missing.mrg"), "--out", str(tmp_path / "x")]) == 2
    assert "kt-treebank: error: Treebank file not found" in capsys.readouterr().err
