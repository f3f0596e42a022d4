"""Constituency trees for the paper's parsing experiment (section 6.3, after Vinyals et al. 2015): reading a
treebank, a tree as a sequence of tokens and back, and EVALB's bracket scores with COLLINS.prm's conventions.

A tree is a `Tree(label, children)`: a preterminal's one child is its word (a `str`), every other node's children
are `Tree`s. The linearisation is Vinyals et al.'s: an opening token per constituent (`(NP`), `XX` per word (the
part-of-speech tags are not predicted), a closing token naming what it closes (`)NP`):

    (S (NP (DT The) (NN cat)) (VP (VBD sat)))  ->  (S (NP XX XX )NP (VP XX )VP )S

A predicted sequence need not be a tree; `delinearize` makes one of it, given the sentence, and counts each repair
it made (`Repairs`).

The scores are EVALB's (Sekine and Collins 1997) with COLLINS.prm: words tagged with a punctuation tag (`, : `` ''
.`) or `-NONE-` are removed from both trees before spans are counted; a bracket's label is cut at its first `-` or
`=` (`NP-SBJ-1` is `NP`); brackets spanning no word, and `TOP`'s, are dropped; `ADVP` and `PRT` are one label; a
test bracket matches one gold bracket of the same span and label (a multiset: a unary chain `S -> S` counts twice).
Preterminals are not brackets. EVALB decides what to remove by each tree's own tags, so a predicted tree is given
the gold tree's tags (`delinearize(..., tags=)`): the linearisation predicts none.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

# kt-evaluate's scores (kt-train's "metric" setting): BLEU of translations, EVALB's F1 of linearised parses.
METRICS = ("bleu", "evalb")
WORD = "XX"  # the token that stands for a word in a linearised tree
# COLLINS.prm: the labels whose words and brackets EVALB deletes, and the labels it takes as one.
DELETED_LABELS = frozenset({"TOP", "-NONE-", ",", ":", "``", "''", "."})
EQUAL_LABELS = {"PRT": "ADVP"}
EMPTY_ELEMENT = "-NONE-"


class TreeError(ValueError):
    """A treebank's text that is not a bracketed tree: names the file, the tree and what is wrong."""


@dataclasses.dataclass(frozen=True)
class Tree:
    """A constituent: `label` and `children`, `Tree`s, or for a preterminal (a part-of-speech tag) its word."""

    label: str
    children: tuple

    @property
    def is_preterminal(self) -> bool:
        return len(self.children) == 1 and isinstance(self.children[0], str)

    def leaves(self) -> list[tuple[str, str]]:
        """The (tag, word) of each word, in order."""
        if self.is_preterminal:
            return [(self.label, self.children[0])]
        return [leaf for child in self.children for leaf in child.leaves()]

    def words(self) -> list[str]:
        return [word for _, word in self.leaves()]

    def tags(self) -> list[str]:
        return [tag for tag, _ in self.leaves()]

    def __str__(self) -> str:
        if self.is_preterminal:
            return f"({self.label} {self.children[0]})"
        return f"({self.label} {' '.join(str(c) for c in self.children)})"


_TOKEN = re.compile(r"\(|\)|[^\s()]+")


def parse_trees(text: str, source: str = "<text>") -> Iterator[Tree]:
    """The trees of a bracketed text, one per top-level bracket, however they are laid out on lines (one a line,
    or the Penn Treebank's .mrg files: a tree over many lines, in an unlabelled outer bracket, which is dropped).
    A `TreeError` names `source`, the tree's number and what is wrong."""
    stack: list[tuple[str | None, list]] = []
    number = 0
    tokens = _TOKEN.findall(text)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "(":
            label = None
            if i + 1 < len(tokens) and tokens[i + 1] not in "()":
                label, i = tokens[i + 1], i + 1
            stack.append((label, []))
        elif token == ")":
            if not stack:
                raise TreeError(f"{source}: tree {number + 1}: a ')' closes nothing")
            label, children = stack.pop()
            node = _node(label, children, source, number + 1)
            if stack:
                stack[-1][1].append(node)
            else:
                number += 1
                yield node if label is not None else _unwrap(node, source, number)
        else:
            if not stack:
                raise TreeError(f"{source}: tree {number + 1}: {token!r} is outside any bracket")
            stack[-1][1].append(token)
        i += 1
    if stack:
        raise TreeError(f"{source}: tree {number + 1}: {len(stack)} bracket(s) left open at the end")


def _node(label, children, source, number):
    if label is None:
        if not children or any(isinstance(c, str) for c in children):
            raise TreeError(f"{source}: tree {number}: a bracket without a label that holds no tree")
        return Tree("", tuple(children))
    words = [c for c in children if isinstance(c, str)]
    if words and len(children) > 1:
        raise TreeError(f"{source}: tree {number}: ({label} ...) holds a word beside other children: a word "
                        f"must be alone under its tag")
    if not children:
        raise TreeError(f"{source}: tree {number}: ({label}) is empty")
    return Tree(label, tuple(children))


def _unwrap(node: Tree, source: str, number: int) -> Tree:
    """The .mrg files' `( (S ...) )`: the tree inside the unlabelled bracket."""
    if len(node.children) != 1:
        raise TreeError(f"{source}: tree {number}: an unlabelled outer bracket holds {len(node.children)} trees")
    return node.children[0]


def read_treebank(paths: Iterable[str | Path]) -> list[Tree]:
    """Every tree of `paths` (files of one bracketed tree a line, or .mrg files), in order."""
    trees = []
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"Treebank file not found: {path}")
        trees.extend(parse_trees(path.read_text(encoding="utf-8"), str(path)))
    return trees


def base_label(label: str) -> str:
    """A label without its function tags and indices (`NP-SBJ-1` -> `NP`, `PP=2` -> `PP`); labels that start
    with `-` (`-NONE-`, `-LRB-`) are kept whole."""
    if label.startswith("-"):
        return label
    return re.split(r"[-=]", label, maxsplit=1)[0]


def clean(tree: Tree) -> Tree | None:
    """The tree a parser learns: empty elements (`-NONE-`) and the constituents left without a word removed,
    function tags and indices cut from constituent labels (tags are kept as they are). None if no word is left."""
    if tree.is_preterminal:
        return None if tree.label == EMPTY_ELEMENT else tree
    children = tuple(c for c in (clean(child) for child in tree.children) if c is not None)
    return Tree(base_label(tree.label), children) if children else None


def linearize(tree: Tree) -> list[str]:
    """The tree as tokens: `(LABEL` ... `)LABEL` per constituent, `XX` per word (its tag dropped)."""
    if tree.is_preterminal:
        return [WORD]
    return [f"({tree.label}", *(t for child in tree.children for t in linearize(child)), f"){tree.label}"]


@dataclasses.dataclass
class Repairs:
    """What `delinearize` changed to make a tree of a sequence, one count per kind."""

    unknown: int = 0  # tokens that are neither `(X`, `)X` nor `XX`, dropped
    unopened: int = 0  # closings with no constituent open, dropped
    relabelled: int = 0  # closings naming another label than the constituent they close
    unclosed: int = 0  # constituents still open at the end, closed
    extra_words: int = 0  # `XX` beyond the sentence's words, dropped
    missing_words: int = 0  # words the sequence had no `XX` for, added at the end of the top constituent
    empty: int = 0  # constituents without a word, dropped
    wrapped: int = 0  # sequences of several top constituents (or words outside any), put under one

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))

    def add(self, other: Repairs) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


def delinearize(tokens: Iterable[str], words: list[str], tags: list[str] | None = None,
                root: str = "S") -> tuple[Tree, Repairs]:
    """The tree of a (predicted) linearised sequence over `words`, and the repairs it took (`Repairs`; all 0 for
    a sequence `linearize` made of a tree of these words). Word i's preterminal is `tags[i]` (the gold tree's, for
    EVALB), or `XX`. A sequence with several top constituents, or words outside any, is put under one `root`."""
    if tags is not None and len(tags) != len(words):
        raise ValueError(f"{len(tags)} tags for {len(words)} words")
    repairs = Repairs()
    top: list = []  # the finished top-level nodes
    stack: list[tuple[str, list]] = []
    used = 0

    def close(label, children):
        if children:
            (stack[-1][1] if stack else top).append(Tree(label, tuple(children)))
        else:
            repairs.empty += 1

    for token in tokens:
        if token == WORD:
            if used == len(words):
                repairs.extra_words += 1
                continue
            leaf = Tree(tags[used] if tags is not None else WORD, (words[used],))
            used += 1
            (stack[-1][1] if stack else top).append(leaf)
        elif token.startswith("(") and len(token) > 1:
            stack.append((token[1:], []))
        elif token.startswith(")") and len(token) > 1:
            if not stack:
                repairs.unopened += 1
                continue
            label, children = stack.pop()
            if token[1:] != label:
                repairs.relabelled += 1
            close(label, children)
        else:
            repairs.unknown += 1
    while stack:  # closed before the missing words are added, which then come after every word placed
        repairs.unclosed += 1
        close(*stack.pop())
    missing = [Tree(tags[i] if tags is not None else WORD, (words[i],)) for i in range(used, len(words))]
    repairs.missing_words = len(missing)
    if missing and len(top) == 1 and not top[0].is_preterminal:
        top[0] = Tree(top[0].label, top[0].children + tuple(missing))
    else:
        top.extend(missing)
    if len(top) == 1 and not top[0].is_preterminal:
        return top[0], repairs
    repairs.wrapped += 1
    return Tree(root, tuple(top)), repairs


def brackets(tree: Tree) -> Counter:
    """EVALB's brackets of `tree` under COLLINS.prm: a multiset of (label, start, end), spans in words once the
    words tagged with a deleted label are removed; no preterminal, no bracket spanning no word, none of a
    deleted label; labels cut at `-`/`=`, PRT as ADVP."""
    found: Counter = Counter()

    def walk(node: Tree, start: int) -> int:
        if node.is_preterminal:
            return start + (node.label not in DELETED_LABELS)
        end = start
        for child in node.children:
            end = walk(child, end)
        label = base_label(node.label)
        label = EQUAL_LABELS.get(label, label)
        if end > start and label not in DELETED_LABELS:
            found[(label, start, end)] += 1
        return end

    walk(tree, 0)
    return found


def scored_words(tree: Tree) -> list[str]:
    """The words EVALB compares (those whose tag is not a deleted label)."""
    return [word for tag, word in tree.leaves() if tag not in DELETED_LABELS]


def evalb(gold: Iterable[Tree], test: Iterable[Tree]) -> dict:
    """EVALB's totals over sentence pairs: bracket recall, precision and F1 (fractions, micro-averaged: matched
    brackets over all gold, over all test), the complete matches, and the sentences skipped as EVALB skips
    them, whose words differ (`errors`), which count in no total."""
    matched = gold_count = test_count = complete = sentences = errors = 0
    for g, t in zip(gold, test, strict=True):
        sentences += 1
        if scored_words(g) != scored_words(t):
            errors += 1
            continue
        gb, tb = brackets(g), brackets(t)
        m = sum((gb & tb).values())
        n_gold, n_test = sum(gb.values()), sum(tb.values())
        matched, gold_count, test_count = matched + m, gold_count + n_gold, test_count + n_test
        complete += m == n_gold == n_test
    recall = matched / gold_count if gold_count else 0.0
    precision = matched / test_count if test_count else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"recall": recall, "precision": precision, "f1": f1, "matched": matched, "gold_brackets": gold_count,
            "test_brackets": test_count, "complete_match": complete, "sentences": sentences, "errors": errors}


def score_parses(hypotheses: Iterable[str], gold: Iterable[Tree]) -> dict:
    """EVALB's scores (`evalb`) of linearised parses, one a line, against the gold trees of the same sentences
    (`clean`ed): each hypothesis made a tree over its gold tree's words and tags (`delinearize`), with the
    repairs that took, summed (`"repairs"`: per kind, and `"repaired"`: the hypotheses that needed any), and a
    line to print (`"evalb_text"`)."""
    gold = list(gold)
    hypotheses = list(hypotheses)
    if len(hypotheses) != len(gold):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(gold)} gold trees")
    repairs, repaired, test = Repairs(), 0, []
    for line, tree in zip(hypotheses, gold):
        parsed, fixed = delinearize(line.split(), tree.words(), tree.tags())
        test.append(parsed)
        repairs.add(fixed)
        repaired += fixed.total > 0
    scores = evalb(gold, test)
    scores.update({"repairs": dataclasses.asdict(repairs), "repaired": repaired})
    kinds = ", ".join(f"{count} {kind.replace('_', ' ')}" for kind, count in scores["repairs"].items() if count)
    scores["evalb_text"] = (
        f"EVALB (COLLINS.prm): bracket F1 {100 * scores['f1']:.2f} (recall {100 * scores['recall']:.2f}, "
        f"precision {100 * scores['precision']:.2f}), {scores['complete_match']} of {scores['sentences']} "
        f"complete matches, {scores['errors']} skipped; {repaired} parse(s) not well-formed, repaired"
        + (f" ({kinds})" if kinds else ""))
    return scores


def gold_trees(lines: Iterable[str], source: str = "<references>") -> list[Tree]:
    """The `clean`ed trees of `lines`, one bracketed tree a line (as `kt-treebank` writes PREFIX.gold); a
    `TreeError` names `source` and the line of a tree that is not one, or has no word."""
    trees = []
    for number, line in enumerate(lines, 1):
        found = list(parse_trees(line, f"{source}, line {number}"))
        cleaned = clean(found[0]) if len(found) == 1 else None
        if cleaned is None:
            raise TreeError(f"{source}, line {number}: expected one bracketed tree with words, got {line[:80]!r}")
        trees.append(cleaned)
    return trees


def build_parser():
    p = argparse.ArgumentParser(
        prog="kt-treebank", description="A treebank as parallel text for kt-train: PREFIX.words (each sentence's "
        "words), PREFIX.linear (its tree, linearised: the target) and PREFIX.gold (its tree cleaned, one a line: "
        "kt-evaluate's references for EVALB's F1). Empty elements (-NONE-) and function tags are removed.",
        epilog="The paper's split of the Wall Street Journal: sections 02-21 train, 22 validation, 23 test, e.g. "
        "kt-treebank --treebank wsj/02/*.mrg ... wsj/21/*.mrg --out data/wsj/train")
    p.add_argument("--treebank", nargs="+", required=True, metavar="FILE",
                   help="bracketed trees: one a line, or the Penn Treebank's .mrg files")
    p.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.words, PREFIX.linear, PREFIX.gold")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        read = read_treebank(args.treebank)
    except (FileNotFoundError, TreeError) as e:
        print(f"kt-treebank: error: {e}", file=sys.stderr)
        return 2
    trees = [t for t in map(clean, read) if t is not None]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for suffix, lines in (("words", (" ".join(t.words()) for t in trees)),
                          ("linear", (" ".join(linearize(t)) for t in trees)), ("gold", (str(t) for t in trees))):
        Path(f"{out}.{suffix}").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    skipped = f" ({len(read) - len(trees)} with no word but empty elements left out)" if len(read) > len(trees) else ""
    print(f"kt-treebank: {len(trees)} trees{skipped} -> {out}.words, {out}.linear, {out}.gold")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
