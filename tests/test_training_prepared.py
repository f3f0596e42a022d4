"""Prepared corpora: kt-prepare's shards and manifest, and the batches kt-train streams from them.

The ids are the in-graph tokenizer's (`common.tokenizer.encode_pair`'s
sequences, pair for pair); an epoch holds every pair once, within the budget;
the shuffle spans the whole corpus; a killed prepare is never trained on and
starts again to the same result, its files on the disk before its manifest;
damaged shards and a swapped vocabulary are refused before the first update;
two workers each read only their own shards and take the same updates per
epoch; shards that do not divide among the workers give each as many pairs;
with a chief, a worker checks and streams the shards of its input pipeline; a
stream without a usable pair is an error, not an endless reload.
"""

import collections
import dataclasses
import gzip
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from fractions import Fraction

import numpy as np
import pytest
import sentencepiece as spm
import tensorflow as tf

from conftest import REPO, distributed_env, multi30k_lines, needs_multi30k, start_workers, wait_all, write_lines
from common.tokenizer import make_tokenizer
from keras_transformer.text import END_ID, PAD_ID, START_ID
from training import prepare as prepare_module
from training.errors import ConfigError, DataError, LineCountMismatchError
from training.pipeline import bucket_boundaries
from training.prepare import build_parser, prepare
from training.prepared_corpus import (MANIFEST_FILENAME, PreparedCorpus, ShardPart, open_for_worker, open_prepared,
                                      stream_batches, steps_per_epoch, worker_dataset_fn, worker_shards)
from training.text_files import iter_parallel_chunks

pytestmark = needs_multi30k

PAIRS = 1500  # per half


def _reversed_words(line):
    return " ".join(word[::-1] for word in line.split())


def _corpus(directory):
    """Multi30k's first PAIRS pairs, then the same pairs with every word reversed: a second half unlike the
    first. Returns (source file, target file, source lines, target lines)."""
    src = multi30k_lines("train.en", PAIRS)
    tgt = multi30k_lines("train.de", PAIRS)
    src, tgt = src + [_reversed_words(s) for s in src], tgt + [_reversed_words(t) for t in tgt]
    return (write_lines(directory / "c.en", src), write_lines(directory / "c.de", tgt), src, tgt)


def _prepare_args(out, src, tgt, *extra):
    return build_parser().parse_args(["--out", str(out), "--train-files", str(src), str(tgt), "--vocab-size", "600",
                                      "--shards", "6", *extra])


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """(corpus directory, source lines, target lines, source file, target file)."""
    d = tmp_path_factory.mktemp("prepared")
    src_file, tgt_file, src, tgt = _corpus(d)
    prepare(_prepare_args(d / "out", src_file, tgt_file))
    return d / "out", src, tgt, src_file, tgt_file


def _rows(batches):
    """(source, target_in, target_out) of every row of `batches`, each without its padding."""
    out = []
    for (s, ti), to in batches:
        for r in range(len(s)):
            out.append(tuple(tuple(int(x) for x in a[r] if x != PAD_ID) for a in (s, ti, to)))
    return out


def test_an_epoch_holds_every_pair_once_as_the_in_graph_tokenizer_encodes_it(prepared):
    directory, src, tgt, _, _ = prepared
    corpus = open_prepared(directory)
    tokenizer = make_tokenizer(corpus.tokenizer_file.read_bytes())
    pieces = [tokenizer.tokenize(tf.constant(lines)).to_list() for lines in (src, tgt)]
    expected = collections.Counter((tuple(s) + (END_ID,), (START_ID,) + tuple(t), tuple(t) + (END_ID,))
                                   for s, t in zip(*pieces))
    epoch = stream_batches(corpus, list(range(len(corpus.shards))), max_sentence_length=512, tokens_per_replica=2000,
                           seed=1, epochs=1)
    assert collections.Counter(_rows(epoch)) == expected
    assert corpus.pairs == 2 * PAIRS and corpus.manifest["corpora"][0]["pairs"] == 2 * PAIRS


@pytest.mark.parametrize("pad_to_bucket_boundary", [False, True])
def test_batches_keep_the_budget_and_leave_out_long_pairs(prepared, pad_to_bucket_boundary):
    directory = prepared[0]
    corpus = open_prepared(directory)
    max_sentence_length, budget = 24, 300
    shards = list(range(len(corpus.shards)))
    kept = 0
    widths = set()
    for (s, ti), to in stream_batches(corpus, shards, max_sentence_length=max_sentence_length,
                                      tokens_per_replica=budget, seed=3,
                                      epochs=1, pad_to_bucket_boundary=pad_to_bucket_boundary):
        assert s.dtype == ti.dtype == to.dtype == np.int32
        for a in (s, ti, to):
            assert a.shape[0] * a.shape[1] <= budget and a.shape[1] <= max_sentence_length
        assert ti.shape == to.shape and (ti[:, 0] == START_ID).all()
        assert ((s == END_ID).sum(axis=1) >= 1).all() and ((to == END_ID).sum(axis=1) >= 1).all()
        widths.update((s.shape[1], to.shape[1]))
        kept += len(s)
    lengths = [np.concatenate([corpus.load_shard(i)[f"{side}_lengths"] for i in shards]) for side in ("source", "target")]
    assert kept == int((np.maximum(*lengths) + 1 <= max_sentence_length).sum()) < corpus.pairs
    if pad_to_bucket_boundary:
        assert widths <= {b - 1 for b in bucket_boundaries(max_sentence_length)} | {max_sentence_length}
    # R-Drop: every pair twice in a row, the budget counting it once.
    (s, ti), to = next(stream_batches(corpus, shards, max_sentence_length=max_sentence_length,
                                      tokens_per_replica=budget, seed=3,
                                      copies=2))
    assert (s[0::2] == s[1::2]).all() and (to[0::2] == to[1::2]).all() and len(s) // 2 * s.shape[1] <= budget


def test_steps_per_epoch_is_a_pass_over_the_corpus(prepared):
    corpus = open_prepared(prepared[0])
    shards = list(range(len(corpus.shards)))
    batches = sum(1 for _ in stream_batches(corpus, shards, max_sentence_length=64, tokens_per_replica=500, seed=0,
                                            epochs=1))
    # One pool holds this corpus: its batches are the histogram's, exactly.
    assert steps_per_epoch(corpus, max_sentence_length=64, tokens_per_replica=500, replicas=1) == batches
    assert steps_per_epoch(corpus, max_sentence_length=64, tokens_per_replica=500, replicas=2) == batches // 2


def test_the_shuffle_spans_the_whole_corpus_and_changes_every_epoch(prepared):
    directory, src, tgt, _, _ = prepared
    corpus = open_prepared(directory)
    tokenizer = make_tokenizer(corpus.tokenizer_file.read_bytes())
    second = {tuple(ids) + (END_ID,) for ids in tokenizer.tokenize(tf.constant(src[PAIRS:])).to_list()}
    first = {tuple(ids) + (END_ID,) for ids in tokenizer.tokenize(tf.constant(src[:PAIRS])).to_list()}
    stream = stream_batches(corpus, list(range(len(corpus.shards))), max_sentence_length=128, tokens_per_replica=400,
                            seed=7, pool_pairs=1000, epochs=3)
    batches = list(stream)
    per_epoch = len(batches) // 3
    orders = []
    for e in range(3):
        epoch = batches[e * per_epoch:(e + 1) * per_epoch]
        rows = [r[0] for r in _rows(epoch[: per_epoch // 3])]
        share = sum(r in second for r in rows) / sum(r in second or r in first for r in rows)
        assert 0.4 <= share <= 0.6, (e, share)
        orders.append([r[0] for r in _rows(epoch[:5])])
    assert orders[0] != orders[1] and orders[1] != orders[2] and orders[0] != orders[2]
    # A run resumed 40 batches in goes on with the same orders (tests/test_training_resume.py).
    resumed = stream_batches(corpus, list(range(len(corpus.shards))), max_sentence_length=128, tokens_per_replica=400,
                             seed=7, skip=40, pool_pairs=1000, epochs=3)
    assert _rows(resumed) == _rows(batches[40:])


SPREAD_PAIRS, SPREAD_SHARDS, SPREAD_FIRST = 24_000, 6, 3_000


def _chernoff(mean, low=0.5, high=1.5):
    """A bound on the chance that a binomial count of mean `mean` (or a hypergeometric one: Hoeffding's sampling
    without replacement has the same tails) falls outside [low * mean, high * mean]: P(X >= (1 + d) mean) <=
    exp(-d^2 mean / (2 + d)) and P(X <= (1 - d) mean) <= exp(-d^2 mean / 2)."""
    up, down = high - 1, 1 - low
    return math.exp(-up * up * mean / (2 + up)) + math.exp(-down * down * mean / 2)


def _spread_failures(shard_of: np.ndarray, shards: int) -> list[str]:
    """What is wrong with a deal of lines to shards (`shard_of[i]`: line i's shard) that a uniform random deal
    passes but for a chance below 1e-9 (`test_..._self_check` bounds it), or [] if nothing:

    - every shard holds pairs from every tenth of the corpus, between half and 1.5 times its expected
      share (each of the shards x 10 counts is binomial, of n / 10 trials and chance 1 / shards);
    - lines i and i + 1 share a shard about 1 time in `shards`, between half and 1.5 times as often as
      that (line i + 1's shard minus line i's, modulo shards, is uniform and independent of the others', so
      the count is binomial, of n - 1 trials and chance 1 / shards).

    A deal in file order fails whatever its seed: in contiguous ranges, each shard misses most tenths; in
    blocks of 2 lines or more, dealt round-robin or at random, lines and their neighbours share a shard at
    least half the time; line by line round-robin, never.
    """
    n = len(shard_of)
    counts = np.zeros((shards, 10), np.int64)
    np.add.at(counts, (shard_of, np.arange(n) * 10 // n), 1)
    mean = n / 10 / shards
    failures = []
    if ((counts < mean / 2) | (counts > 1.5 * mean)).any():
        failures.append(f"pairs per shard (rows) from each tenth of the corpus (columns), expected {mean:.0f} "
                        f"each, within half and 1.5 times that:\n{counts}")
    together, expected = int((shard_of[1:] == shard_of[:-1]).sum()), (n - 1) / shards
    if not expected / 2 <= together <= 1.5 * expected:
        failures.append(f"{together} of {n - 1} lines share the next line's shard; a random deal gives about "
                        f"{expected:.0f}")
    return failures


def test_the_shuffle_test_passes_a_random_deal_and_fails_a_file_order_one_on_every_seed_self_check():
    n, shards = SPREAD_PAIRS, SPREAD_SHARDS
    # The chance that a uniform random deal, and the stream's first SPREAD_FIRST pairs, fail the checks of
    # `test_every_shard_and_the_stream_s_first_pool_span_the_whole_corpus`: the shards x 10 cells, the
    # neighbours, the first pool's shard holding fewer than SPREAD_FIRST pairs (each shard's count binomial, of
    # mean n / shards), and SPREAD_FIRST pairs drawn from the whole corpus (hypergeometric) in each tenth.
    chance = (shards * 10 * _chernoff(n / 10 / shards) + _chernoff((n - 1) / shards)
              + shards * _chernoff(n / shards, low=SPREAD_FIRST / (n / shards)) + 10 * _chernoff(SPREAD_FIRST / 10))
    assert chance < 1e-9, chance
    for seed in range(5):
        rng = np.random.default_rng(seed)
        assert not _spread_failures(rng.integers(0, shards, n), shards), seed
        in_order = [np.arange(n) * shards // n,  # contiguous ranges
                    np.arange(n) % shards,  # round-robin, line by line
                    *[(np.arange(n) // block) % shards for block in (2, 7, 20_000)],  # round-robin blocks
                    # blocks of lines dealt at random (the stream's pools, shuffled within)
                    *[np.repeat(rng.integers(0, shards, -(-n // block)), block)[:n] for block in (2, 20_000)],
                    # a random deal within each tenth, the tenths in turn to each shard
                    (np.arange(n) * 10 // n + rng.integers(0, 2, n)) % shards]
        for shard_of in in_order:
            assert _spread_failures(shard_of, shards), (seed, shard_of[:20])


def _indexed_corpus(directory, tokenizer_file, pairs):
    """`pairs` line pairs, line i spelling i in base 10 on both sides with ten words that are one piece each of
    `tokenizer_file`'s vocabulary; returns (source file, target file, {a source line's ids: its index})."""
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_file))
    words = [p[1:] for p in map(sp.id_to_piece, range(sp.get_piece_size()))
             if p.startswith("\u2581") and p[1:].isalpha() and len(p) > 3 and len(sp.encode(p[1:])) == 1][:10]
    assert len(words) == 10, words
    width = len(str(pairs - 1))
    lines = [" ".join(words[int(d)] for d in f"{i:0{width}d}") for i in range(pairs)]
    ids = {tuple(sp.encode(line)): i for i, line in enumerate(lines)}
    assert len(ids) == pairs and {len(k) for k in ids} == {width}  # one length: one bucket, every pair alike
    return (write_lines(directory / "indexed.en", lines), write_lines(directory / "indexed.de", lines),
            ids)


def _shard_of(corpus, index):
    """[i]: the shard holding line i of `_indexed_corpus`'s (each line in exactly one)."""
    shard_of = np.full(len(index), -1)
    for k in range(len(corpus.shards)):
        arrays = corpus.load_shard(k)
        width = len(next(iter(index)))
        for row in arrays["source_ids"].reshape(-1, width):
            line = index[tuple(int(x) for x in row)]
            assert shard_of[line] == -1, f"line {line} in shards {shard_of[line]} and {k}"
            shard_of[line] = k
    assert (shard_of >= 0).all(), f"lines in no shard: {np.flatnonzero(shard_of < 0)[:10]}"
    return shard_of


def test_every_shard_and_the_stream_s_first_pool_span_the_whole_corpus(prepared, tmp_path):
    """A uniform random deal passes, but for a chance below 1e-9 (the self-check above bounds it); a deal in
    file order fails whatever the seed, and so does a stream whose first pool is one contiguous part of the
    corpus, shuffled within."""
    tokenizer = prepared[0] / "tokenizer.model"
    src_file, tgt_file, index = _indexed_corpus(tmp_path, tokenizer, SPREAD_PAIRS)
    out = tmp_path / "out"
    prepare(build_parser().parse_args(["--out", str(out), "--train-files", str(src_file), str(tgt_file),
                                       "--tokenizer", str(tokenizer), "--shards", str(SPREAD_SHARDS)]))
    corpus = open_prepared(out)
    assert len(corpus.shards) == SPREAD_SHARDS
    shard_of = _shard_of(corpus, index)
    failures = _spread_failures(shard_of, SPREAD_SHARDS)
    assert not failures, "\n".join(failures)
    # The stream, a shard a pool: its first SPREAD_FIRST pairs, from the first pool, span the whole corpus too.
    stream = stream_batches(corpus, list(range(SPREAD_SHARDS)), max_sentence_length=64, tokens_per_replica=2000,
                            seed=5, pool_pairs=1, epochs=1)
    first = []
    for (source, _), _ in stream:
        first += [index[tuple(int(x) for x in row[:-1])] for row in source]
        if len(first) >= SPREAD_FIRST:
            break
    tenths = np.bincount(np.asarray(first[:SPREAD_FIRST]) * 10 // SPREAD_PAIRS, minlength=10)
    mean = SPREAD_FIRST / 10
    assert ((tenths >= mean / 2) & (tenths <= 1.5 * mean)).all(), (
        f"the stream's first {SPREAD_FIRST} pairs from each tenth of the corpus, expected {mean:.0f} each: {tenths}")


def test_a_corpus_over_the_shard_bound_is_written_in_a_multiple_of_the_shards_asked_each_within_it(
        prepared, tmp_path, monkeypatch):
    """A shard is built whole, and trained on a pool at a time: past --shards x PAIRS_PER_SHARD pairs, kt-prepare
    writes the least multiple of --shards whose shards hold PAIRS_PER_SHARD pairs or fewer each (on average),
    each a uniform random sample still."""
    shard_count, limit = prepare_module.shard_count, prepare_module.PAIRS_PER_SHARD
    assert [shard_count(n, 64) for n in (1, 64 * limit, 64 * limit + 1, 100_000_000, 10 ** 9)] == [
        64, 64, 128, 64 * -(-100_000_000 // (64 * limit)), 64 * -(-10 ** 9 // (64 * limit))]
    assert shard_count(100_000_000, 64) * limit >= 100_000_000 and shard_count(7 * limit, 3) == 9
    with pytest.raises(ValueError, match="requested shards must be 1 or more"):
        shard_count(10, 0)
    # 2 shards asked, at most 4,000 pairs each: 6 shards of 24,000 pairs (each of the 2 scatter files dealt again
    # to 3, read 4,000 pairs at a time).
    monkeypatch.setattr(prepare_module, "PAIRS_PER_SHARD", SPREAD_PAIRS // SPREAD_SHARDS)
    tokenizer = prepared[0] / "tokenizer.model"
    src_file, tgt_file, index = _indexed_corpus(tmp_path, tokenizer, SPREAD_PAIRS)
    out = tmp_path / "out"
    prepare(build_parser().parse_args(["--out", str(out), "--train-files", str(src_file), str(tgt_file),
                                       "--tokenizer", str(tokenizer), "--shards", "2"]))
    corpus = open_prepared(out)
    assert [s["file"] for s in corpus.shards] == [f"shard-{k:05d}-of-00006.npz" for k in range(6)]
    assert corpus.manifest["pairs_per_shard_limit"] == SPREAD_PAIRS // SPREAD_SHARDS
    assert not (out / prepare_module.SCATTER_DIR).exists()
    shard_of = _shard_of(corpus, index)  # every pair in one shard, once
    sizes = np.bincount(shard_of, minlength=6)
    assert [s["pairs"] for s in corpus.shards] == sizes.tolist()
    # Each binomial, of mean 4,000: above 6,000 with a chance below 6 exp(-400) (`_chernoff`).
    assert sizes.max() <= 1.5 * SPREAD_PAIRS / SPREAD_SHARDS, sizes
    failures = _spread_failures(shard_of, SPREAD_SHARDS)
    assert not failures, "\n".join(failures)


def test_the_same_command_again_does_nothing_and_another_into_the_same_directory_is_refused(prepared, capsys):
    directory, _, _, src_file, tgt_file = prepared
    before = (directory / MANIFEST_FILENAME).stat().st_mtime_ns
    prepare(_prepare_args(directory, src_file, tgt_file))
    assert "prepared already" in capsys.readouterr().out
    assert (directory / MANIFEST_FILENAME).stat().st_mtime_ns == before
    with pytest.raises(ConfigError, match="prepared by another command"):
        prepare(_prepare_args(directory, src_file, tgt_file, "--shards", "3"))


def test_a_vocabulary_changed_at_the_same_path_is_another_command(prepared, tmp_path):
    from keras_transformer.text import train_sentencepiece
    directory, src, _, src_file, tgt_file = prepared
    vocabulary = tmp_path / "v.model"
    shutil.copy(directory / "tokenizer.model", vocabulary)
    out = tmp_path / "out"
    prepare(_prepare_args(out, src_file, tgt_file, "--tokenizer", str(vocabulary)))
    assert (out / "tokenizer.model").read_bytes() == vocabulary.read_bytes()
    vocabulary.write_bytes(train_sentencepiece(src[:500], 500))
    with pytest.raises(ConfigError, match="prepared by another command"):
        prepare(_prepare_args(out, src_file, tgt_file, "--tokenizer", str(vocabulary)))


def test_a_prepare_killed_mid_shard_is_refused_then_prepared_again_whole(prepared, tmp_path, monkeypatch, capsys):
    _, _, _, src_file, tgt_file = prepared
    out = tmp_path / "killed"
    real_savez, written = np.savez, []

    def dies_in_the_third_shard(path, **arrays):
        if len(written) == 2:  # half a shard on disk, then the process is gone
            with open(path, "wb") as f:
                f.write(b"PK\x03\x04" + b"\x00" * 100)
            raise KeyboardInterrupt
        written.append(path)
        real_savez(path, **arrays)

    monkeypatch.setattr(prepare_module.np, "savez", dies_in_the_third_shard)
    with pytest.raises(KeyboardInterrupt):
        prepare(_prepare_args(out, src_file, tgt_file))
    monkeypatch.undo()
    assert not (out / MANIFEST_FILENAME).exists() and len(list(out.glob("shard-*"))) == 3
    with pytest.raises(DataError, match="has no manifest.json.*Run the same kt-prepare command again"):
        open_prepared(out)
    from training.train import main as kt_train
    assert kt_train(["--prepared", str(out), "--model-dir", str(tmp_path / "m"), "--verbose", "0"]) == 2
    assert "has no manifest.json" in capsys.readouterr().err

    prepare(_prepare_args(out, src_file, tgt_file))
    assert "from an earlier run of this command" in capsys.readouterr().out  # the vocabulary was complete
    again = open_prepared(out)
    for i in range(len(again.shards)):
        again.load_shard(i)
    # The same shards, byte for byte, as a prepare that was never killed.
    fresh = tmp_path / "fresh"
    prepare(_prepare_args(fresh, src_file, tgt_file))
    assert ([s["sha256"] for s in again.shards] == [s["sha256"] for s in open_prepared(fresh).shards])
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in fresh.iterdir())


def test_a_prepare_sigkilled_while_dealing_pairs_starts_again(tmp_path):
    """A real SIGKILL, while kt-prepare deals pairs into shards (its scatter directory exists)."""
    lines = [(s, t) for s, t in zip(multi30k_lines("train.en", 29000), multi30k_lines("train.de", 29000)) if s]
    src = write_lines(tmp_path / "big.en", [s for s, _ in lines] * 6)
    tgt = write_lines(tmp_path / "big.de", [t for _, t in lines] * 6)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "training.prepare", "--out", str(out), "--train-files", str(src), str(tgt),
           "--vocab-size", "600", "--vocab-sample", "20000", "--shards", "4", "--no-alignment-check"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=distributed_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while not any((out / ".scatter").glob("*")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    with pytest.raises(DataError, match="has no manifest.json"):
        open_prepared(out)
    done = subprocess.run(cmd, cwd=REPO, env=distributed_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    corpus = open_prepared(out)
    assert corpus.pairs == 6 * len(lines) and not (out / ".scatter").exists()


def test_damaged_shards_and_manifests_are_refused(prepared, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(prepared[0], copy)
    corpus = open_prepared(copy)
    name = corpus.shards[1]["file"]
    data = bytearray((copy / name).read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte changed, the size kept
    (copy / name).write_bytes(bytes(data))
    with pytest.raises(DataError, match=f"{name} does not match .*SHA-256"):
        open_prepared(copy).load_shard(1)
    (copy / name).write_bytes(bytes(data[:-10]))
    with pytest.raises(DataError, match=f"{name} has {len(data) - 10:,} bytes, the manifest says {len(data):,}"):
        open_prepared(copy)
    (copy / name).unlink()
    with pytest.raises(DataError, match=f"{name} is missing"):
        open_prepared(copy)
    (copy / MANIFEST_FILENAME).write_text('{"format": "keras-transformer prepared corpus 1", "shards": [')
    with pytest.raises(DataError, match="not valid JSON"):
        open_prepared(copy)


def test_kt_train_refuses_what_a_prepared_corpus_cannot_do(prepared, tmp_path, capsys):
    from training.train import main as kt_train
    base = ["--prepared", str(prepared[0]), "--model-dir", str(tmp_path / "m"), "--verbose", "0"]
    for extra, message in ((["--subword-sampling", "0.5"], "--prepared cannot be combined with --subword-sampling: "
                            "it draws each sentence's segmentation anew every epoch"),
                           (["--tokenizer", str(prepared[0] / "tokenizer.model")],
                            "--prepared cannot be combined with --tokenizer"),
                           (["--target-lang", "fr"], "--target-lang fr but .* was prepared with de")):
        assert kt_train(base + extra) == 2
        assert re.search(message, capsys.readouterr().err), extra
    with pytest.raises(DataError, match="fewer than the 8 workers"):
        worker_shards(6, 0, 8)
    assert sorted(worker_shards(6, 0, 2) + worker_shards(6, 1, 2)) == [ShardPart(i) for i in range(6)]
    assert not set(worker_shards(6, 0, 2)) & set(worker_shards(6, 1, 2))


def test_shards_that_do_not_divide_among_the_workers_give_every_worker_as_many_pairs(prepared):
    """64 shards on 3 workers: 21 whole shards each and a third of the 64th; 5 on 4: one each and a quarter of
    the fifth. Streamed, 6 shards on 4 workers give each the same pairs, but for the shards' sampling noise,
    and every pair to exactly one of them; kt-train says how the shards are read."""
    for shards, workers in ((64, 3), (5, 4), (6, 4), (64, 8)):
        parts = [worker_shards(shards, w, workers) for w in range(workers)]
        # Every shard read once, whole or in parts that make it whole: every pair is trained on.
        reads = collections.Counter((p.shard, row) for ps in parts for p in ps for row in range(p.first, 24, p.step))
        assert reads == collections.Counter((s, row) for s in range(shards) for row in range(24))
        # As many shards' worth of pairs on every worker (the shards being random samples of equal size).
        assert {sum(Fraction(1, p.step) for p in ps) for ps in parts} == {Fraction(shards, workers)}
        # Whole shards are the worker's own, shared ones the same on every worker.
        assert len({tuple(p.shard for p in ps if p.step > 1) for ps in parts}) == 1
    assert [p.shard for p in worker_shards(64, 1, 3) if p.step == 1] == list(range(1, 63, 3))
    assert worker_shards(64, 2, 3)[-1] == ShardPart(63, 2, 3)

    directory = prepared[0]
    corpus = open_prepared(directory)
    epoch = collections.Counter(_rows(stream_batches(corpus, list(range(6)), max_sentence_length=512,
                                                     tokens_per_replica=2000, seed=5, epochs=1)))
    per_worker = [collections.Counter(_rows(stream_batches(corpus, worker_shards(6, w, 4), max_sentence_length=512,
                                                           tokens_per_replica=2000, seed=5, epochs=1)))
                  for w in range(4)]
    assert sum(per_worker, collections.Counter()) == epoch
    pairs = [sum(c.values()) for c in per_worker]
    assert max(pairs) < 1.15 * min(pairs), pairs  # 750 each, give or take; whole shards alone: 1,000 or 500
    said = []
    _, parts = open_for_worker(directory, 3, 4, max_sentence_length=512, say=said.append)
    assert parts == [ShardPart(3), ShardPart(4, 3, 4), ShardPart(5, 3, 4)]
    assert said[0] == ("6 shards do not divide among 4 workers: each worker reads 1 shard(s) of its own and one pair "
                       "in 4 of the 2 left over (shard(s) 4, 5), so that every worker reads as many pairs and every "
                       "pair is trained on; every worker needs the shard(s) left over on its disk. With kt-prepare "
                       "--shards 4 or 8, each would read only its own.")
    said.clear()
    open_for_worker(directory, 1, 3, max_sentence_length=512, say=said.append)
    assert len(said) == 1 and said[0].startswith("checked the SHA-256 of its 2 shard(s)")


def test_with_a_chief_in_the_cluster_a_worker_checks_and_streams_the_shards_of_its_input_pipeline(
        prepared, tmp_path, monkeypatch, capsys):
    """TF_CONFIG with a chief and two workers: the chief is input pipeline 0 and worker i pipeline i + 1, as
    TensorFlow numbers them. Each task, given a directory with only its own shards (and the manifest and the
    vocabulary), checks those at start-up and streams those; kt-train's start-up passes on the second worker's
    disk, and a stream numbered otherwise than its check is refused."""
    from tensorflow.python.distribute import multi_worker_util

    from training.config import resolve_settings
    from training.distribute import input_pipeline, worker_info
    from training.fit import train

    corpus = open_prepared(prepared[0])
    cluster = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]}
    for task_type, index in (("chief", 0), ("worker", 0), ("worker", 1)):
        monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}}))
        pipeline = (multi_worker_util.id_in_cluster(cluster, task_type, index),
                    multi_worker_util.worker_count(cluster, task_type))
        assert input_pipeline() == pipeline and worker_info()[2] == 3
        d = tmp_path / f"{task_type}{index}"
        d.mkdir()
        for name in (MANIFEST_FILENAME, "tokenizer.model"):
            shutil.copy(prepared[0] / name, d / name)
        own = worker_shards(len(corpus.shards), *pipeline)
        for part in own:
            shutil.copy(prepared[0] / corpus.shards[part.shard]["file"], d)
        checked, parts = open_for_worker(d, *input_pipeline(), max_sentence_length=64, say=lambda _: None)
        assert parts == own and checked.verified == {p.shard for p in own}
        dataset = worker_dataset_fn(checked, parts, input_pipeline(), max_sentence_length=64, tokens_per_replica=500,
                                    seed=0)
        context = tf.distribute.InputContext(num_input_pipelines=pipeline[1], input_pipeline_id=pipeline[0])
        assert len(list(dataset(context).take(3))) == 3  # both its shards loaded: the first pool holds them
    with pytest.raises(RuntimeError, match="numbers this worker's input pipeline 0 of 3, but its shards were picked "
                                           "and checked as pipeline 2 of 3"):
        dataset(tf.distribute.InputContext(num_input_pipelines=3, input_pipeline_id=0))
    # kt-train on worker 1's disk (shards 2 and 5): worker_info's task index 1 would have it check shards 1 and 4.
    # Its start-up passes; then the default strategy numbers its pipeline 0 of 1, which the stream refuses.
    with pytest.raises(RuntimeError, match="numbers this worker's input pipeline 0 of 1, but its shards were picked "
                                           "and checked as pipeline 2 of 3"):
        train(resolve_settings(["--prepared", str(tmp_path / "worker1"), "--preset", "tiny", "--model-dir",
                                str(tmp_path / "m"), "--tokens-per-replica", "500", "--max-sentence-length", "64",
                                "--no-validation", "--verbose", "0"]), strategy=tf.distribute.get_strategy())
    out = capsys.readouterr().out
    assert f"checked the SHA-256 of its 2 shard(s)" in out and "missing" not in out


def test_a_stream_without_a_usable_pair_is_an_error_at_start_up_and_in_the_stream(prepared, tmp_path, capsys):
    """Every pair over --max-sentence-length, or shards without pairs: kt-train refuses at start-up from the
    manifest (each shard's shortest pair; an older manifest's histogram), and a stream that makes a whole pass
    without a batch raises, naming its shards and the limit, instead of reading them again forever."""
    from training.train import main as kt_train

    directory = prepared[0]
    corpus = open_prepared(directory)
    for i, entry in enumerate(corpus.shards):
        arrays = corpus.load_shard(i)
        assert entry["shortest"] == int((np.maximum(arrays["source_lengths"], arrays["target_lengths"]) + 1).min())
    shortest = min(s["shortest"] for s in corpus.shards)
    limit = shortest - 1

    counting = PreparedCorpus(corpus.directory, corpus.manifest, set(corpus.verified))
    loads = [0]

    def load_shard(index, _load=counting.load_shard):
        loads[0] += 1
        assert loads[0] <= 2 * len(corpus.shards), "the stream reads its shards again and again without a batch"
        return _load(index)

    counting.load_shard = load_shard
    with pytest.raises(DataError, match=f"A pass over {re.escape(str(directory))}/{{shard-00000-of-00006.npz, .* and 2 "
                                        f"more}} gave "
                                        f"no batch: none of their 3,000 pairs fits the length limit of {limit} "
                                        f"tokens \\(--max-sentence-length; the shortest is {shortest} tokens"):
        next(stream_batches(counting, list(range(6)), max_sentence_length=limit, tokens_per_replica=500, seed=0))
    assert loads[0] == 6

    with pytest.raises(DataError, match=f"No pair of {directory}/.* fits the length limit of {limit} tokens "
                                        f"\\(--max-sentence-length\\): the shortest is {shortest} tokens"):
        open_for_worker(directory, 0, 2, max_sentence_length=limit, say=lambda _: None)
    # A manifest from before the shards recorded their shortest pair: the whole corpus's histogram tells.
    old = tmp_path / "old"
    shutil.copytree(directory, old)
    manifest = json.loads((old / MANIFEST_FILENAME).read_text())
    for entry in manifest["shards"]:
        del entry["shortest"]
    (old / MANIFEST_FILENAME).write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=f"No pair of the corpus {old} fits the length limit of {limit} tokens"):
        open_for_worker(old, 0, 1, max_sentence_length=limit, say=lambda _: None)
    assert kt_train(["--prepared", str(directory), "--model-dir", str(tmp_path / "m"), "--max-sentence-length",
                     str(limit), "--verbose", "0"]) == 2
    out, err = capsys.readouterr()
    assert f"fits the length limit of {limit} tokens" in err and "batch plan" not in out

    # Shards without a pair: 3 pairs dealt to 8 shards.
    few = tmp_path / "few"
    src = write_lines(tmp_path / "f.en", prepared[1][:3])
    tgt = write_lines(tmp_path / "f.de", prepared[2][:3])
    prepare(_prepare_args(few, src, tgt, "--tokenizer", str(directory / "tokenizer.model"), "--shards", "8"))
    sparse = open_prepared(few)
    empty = [i for i, s in enumerate(sparse.shards) if not s["pairs"]]
    assert len(empty) >= 5 and all(sparse.shards[i]["shortest"] is None for i in empty)
    with pytest.raises(DataError, match=f"{few / sparse.shards[empty[0]]['file']} hold\\(s\\) no pair"):
        open_for_worker(few, empty[0], 8, max_sentence_length=64, say=lambda _: None)
    with pytest.raises(DataError, match="gave no batch: they hold no pair"):
        next(stream_batches(sparse, empty[:2], max_sentence_length=64, tokens_per_replica=500, seed=0))


def test_a_damaged_shard_or_a_swapped_vocabulary_is_refused_before_the_first_update(prepared, tmp_path, capsys):
    """A shard with a byte changed (its size kept) and a tokenizer.model replaced by another vocabulary: kt-train
    checks its shards' SHA-256 digests and the vocabulary's against the manifest at start-up, and stops before it builds
    a batch, naming the file."""
    from keras_transformer.text import train_sentencepiece
    from training.train import main as kt_train

    def refused(directory, message):
        model_dir = tmp_path / f"m-{directory.name}"
        assert kt_train(["--prepared", str(directory), "--preset", "tiny", "--model-dir", str(model_dir),
                         "--max-updates", "1", "--epochs", "1", "--no-validation", "--verbose", "0"]) == 2
        out, err = capsys.readouterr()
        assert re.search(message, err), err
        assert "batch plan" not in out and not (model_dir / "config.json").exists()

    damaged = tmp_path / "damaged"
    shutil.copytree(prepared[0], damaged)
    name = open_prepared(damaged).shards[4]["file"]
    data = bytearray((damaged / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (damaged / name).write_bytes(bytes(data))
    refused(damaged, f"kt-train: error: {re.escape(str(damaged / name))} does not match "
                     f"{re.escape(str(damaged / MANIFEST_FILENAME))}: its SHA-256 is not the one recorded there.*"
                     f"Copy it again from the directory kt-prepare wrote")

    swapped = tmp_path / "swapped"
    shutil.copytree(prepared[0], swapped)
    (swapped / "tokenizer.model").write_bytes(train_sentencepiece(prepared[1][:500], 500))
    refused(swapped, f"kt-train: error: {re.escape(str(swapped / 'tokenizer.model'))} is not the vocabulary "
                     f"{re.escape(str(swapped))} was prepared with: its SHA-256 is not the one .* records.*"
                     f"Put back the tokenizer.model kt-prepare wrote")


def test_kt_prepare_puts_the_shards_and_the_vocabulary_on_the_disk_before_the_manifest(prepared, tmp_path,
                                                                                        monkeypatch):
    """Every shard and the vocabulary fsynced, and the directory holding their names, before the manifest is
    written: a power cut cannot leave a manifest naming a file the disk lost."""
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    out = tmp_path / "synced"
    src = write_lines(tmp_path / "s.en", prepared[1][:200])
    tgt = write_lines(tmp_path / "s.de", prepared[2][:200])
    prepare(_prepare_args(out, src, tgt, "--tokenizer", str(prepared[0] / "tokenizer.model"), "--shards", "3"))
    manifest = synced.index(str(out / (MANIFEST_FILENAME + ".tmp")))
    before = synced[:manifest]
    for i in range(3):
        assert str(out / f"shard-{i:05d}-of-00003.npz.tmp.npz") in before
    assert str(out / "tokenizer.model.tmp") in before
    # The directory after the last shard was renamed into it; and again after the manifest was.
    last_shard = max(before.index(str(out / f"shard-{i:05d}-of-00003.npz.tmp.npz")) for i in range(3))
    assert str(out) in before[last_shard + 1:] and synced[-1] == str(out)


def test_streamed_files_give_the_whole_file_readers_errors(tmp_path):
    good = [f"line {i} of a corpus" for i in range(30)]
    src = write_lines(tmp_path / "a.en", good)
    bad = list(good)
    bad[24] = b"caf\xe9 latin-1"
    tgt = write_lines(tmp_path / "a.de", bad)
    with pytest.raises(DataError, match="a.de, line 25: not UTF-8 \\(byte 0xe9 at byte 4 of the line\\)"):
        list(iter_parallel_chunks(src, tgt, chunk_lines=7, check_shift=False))
    gz = tmp_path / "a.de.gz"
    gz.write_bytes(gzip.compress(b"".join(line.encode() + b"\n" for line in good[:-1])))
    with pytest.raises(LineCountMismatchError, match="a.en has 30 lines but .*a.de.gz has 29 lines"):
        list(iter_parallel_chunks(src, gz, chunk_lines=7, check_shift=False))
    gz.write_bytes(gzip.compress(b"".join(line.encode() + b"\n" for line in good))[:-12])
    with pytest.raises(DataError, match="a damaged or incomplete gzip file"):
        list(iter_parallel_chunks(src, gz, chunk_lines=7, check_shift=False))
    gz.write_bytes(gzip.compress(b"".join(line.encode() + b"\n" for line in good)))
    chunks = list(iter_parallel_chunks(src, gz, chunk_lines=7, check_shift=False))
    assert [len(c[0]) for c in chunks] == [7, 7, 7, 7, 2] and sum((c[1] for c in chunks), []) == good


def test_two_workers_read_their_own_shards_and_take_the_same_updates(prepared, tmp_path):
    """MultiWorkerMirroredStrategy on 127.0.0.1, each worker given a directory with only its own shards (and
    the manifest and vocabulary): a worker that read another's shard would fail. Both train the same number
    of updates per epoch and end with the same loss; neither trains or waits for a vocabulary."""
    corpus = open_prepared(prepared[0])
    dirs = []
    for w in range(2):
        d = tmp_path / f"worker{w}"
        d.mkdir()
        for name in (MANIFEST_FILENAME, "tokenizer.model"):
            shutil.copy(prepared[0] / name, d / name)
        for part in worker_shards(len(corpus.shards), w, 2):
            shutil.copy(prepared[0] / corpus.shards[part.shard]["file"], d)
        dirs.append(d)
    model_dir = tmp_path / "mw"
    cmds = [[sys.executable, "-m", "training.train", "--prepared", str(d), "--preset", "tiny", "--model-dir",
             str(model_dir), "--tokens-per-replica", "600", "--max-sentence-length", "40", "--epochs", "2",
             "--no-validation", "--verbose", "2"] for d in dirs]
    procs = start_workers(cmds, [tmp_path / f"worker{i}.log" for i in range(2)])
    wait_all(procs, 600)
    outs = [(tmp_path / f"worker{i}.log").read_text() for i in range(2)]
    for (p, _), out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    steps = steps_per_epoch(corpus, max_sentence_length=40, tokens_per_replica=600, replicas=2)
    summaries = [json.loads(out.split("[kt-train] done ")[1].splitlines()[0]) for out in outs]
    for i, (out, summary) in enumerate(zip(outs, summaries)):
        assert f"worker {i + 1}/2 reads 3); an epoch is {steps:,} updates" in out
        assert summary["optimizer_steps"] == 2 * steps and summary["epochs_run"] == [1, 2]
        assert "trained on" not in out and "waited" not in out
    assert f"tokenizer: {dirs[0] / 'tokenizer.model'} (--prepared)" in outs[0]
    assert summaries[0]["final_loss"] == pytest.approx(summaries[1]["final_loss"], rel=1e-6)


def test_kt_train_streams_a_prepared_corpus_on_two_replicas_with_its_validation_set(tmp_path):
    src = write_lines(tmp_path / "t.en", multi30k_lines("train.en", 400))
    tgt = write_lines(tmp_path / "t.de", multi30k_lines("train.de", 400))
    val = [write_lines(tmp_path / f"v.{lang}", multi30k_lines(f"val.{lang}", 40)) for lang in ("en", "de")]
    out = tmp_path / "p"
    prepare(_prepare_args(out, src, tgt, "--vocab-size", "400", "--valid-files", *map(str, val)))
    model_dir = tmp_path / "m"
    done = subprocess.run([sys.executable, "-m", "training.train", "--prepared", str(out), "--preset", "tiny",
                           "--model-dir", str(model_dir), "--cpu-replicas", "2", "--tokens-per-replica", "300",
                           "--grad-accum", "2", "--max-updates", "3", "--verbose", "2"],
                          cwd=REPO, env=distributed_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2 replica(s) x 300 tokens per replica x 2 batch(es) per update" in done.stdout
    assert "of one replica, 2 replicas, 2 batches per update" in done.stdout
    summary = json.loads(done.stdout.split("[kt-train] done ")[1].splitlines()[0])
    assert summary["optimizer_steps"] == 3
    config = json.loads((model_dir / "config.json").read_text())
    assert config["training"]["prepared"] == str(out)
    assert (model_dir / "tokenizer.model").read_bytes() == (out / "tokenizer.model").read_bytes()
    assert "val_loss" in (model_dir / "history.csv").read_text()


def test_a_tfds_corpus_is_prepared_and_trained_on_with_its_validation_split(tmp_path):
    """`tfds.testing.mock_data` runs TFDS' own reading code on generated examples: kt-prepare reads
    wmt14_translate/de-en's train split, and kt-train validates on its validation split, as the manifest
    records."""
    import tensorflow_datasets as tfds

    from training.config import resolve_settings
    from training.evaluate import main as evaluate
    from training.fit import train

    out = tmp_path / "wmt"
    with tfds.testing.mock_data(num_examples=120):
        manifest = prepare(build_parser().parse_args(
            ["--out", str(out), "--tfds", "wmt14_translate/de-en", "--source-lang", "en", "--target-lang", "de",
             "--vocab-size", "1000", "--shards", "2"]))
        assert manifest["corpora"] == [{"name": "wmt14_translate/de-en (train)", "lines": 120, "pairs": 120,
                                        "empty_pairs_skipped": 0}]
        assert manifest["validation"]["tfds"] == "wmt14_translate/de-en"
        summary = train(resolve_settings(["--prepared", str(out), "--preset", "tiny", "--model-dir",
                                        str(tmp_path / "m"), "--max-updates", "2", "--epochs", "1",
                                        "--tokens-per-batch", "600", "--verbose", "0"]))
        # kt-evaluate finds the test split of the corpus the model was prepared from.
        assert evaluate(["--model-dir", str(tmp_path / "m"), "--max-examples", "4", "--beam-size", "1",
                         "--no-progress"]) == 0
    assert summary["optimizer_steps"] == 2
    assert "val_loss" in (tmp_path / "m" / "history.csv").read_text()
    assert len((tmp_path / "m" / "hyp.test.de").read_text().splitlines()) == 4


def test_kt_train_prepares_train_files_into_its_run_first_and_reuses_them_on_resume(tmp_path, capsys):
    """`kt-train --train-files` trains as `kt-prepare` then `kt-train --prepared` would: the corpus is prepared
    into MODEL_DIR/prepared (the vocabulary trained there, with kt-train's settings) and streamed from it; run
    again to go further, the preparation is reused, not redone."""
    from training.config import resolve_settings
    from training.fit import train

    src = write_lines(tmp_path / "t.en", multi30k_lines("train.en", 300))
    tgt = write_lines(tmp_path / "t.de", multi30k_lines("train.de", 300))
    val = [str(write_lines(tmp_path / f"v.{lang}", multi30k_lines(f"val.{lang}", 20))) for lang in ("en", "de")]
    model_dir = tmp_path / "m"
    args = ["--train-files", str(src), str(tgt), "--valid-files", *val, "--preset", "tiny", "--model-dir",
            str(model_dir), "--vocab-size", "400", "--tokens-per-batch", "600", "--verbose", "0"]
    first = train(resolve_settings(args + ["--max-updates", "2", "--epochs", "1"]))
    out = capsys.readouterr().out
    corpus = open_prepared(model_dir / "prepared")
    assert corpus.pairs == 300 and corpus.manifest["vocabulary"]["pieces"] == 400
    assert corpus.manifest["validation"] == {"files": [str(tmp_path / "v.en"), str(tmp_path / "v.de")]}
    assert (model_dir / "tokenizer.model").read_bytes() == (model_dir / "prepared" / "tokenizer.model").read_bytes()
    assert f"data: {model_dir / 'prepared'} (300 pairs" in out and "tokenized every epoch" not in out
    assert json.loads((model_dir / "config.json").read_text())["training"]["prepared"] == str(model_dir / "prepared")
    assert first["optimizer_steps"] == 2
    manifest_before = (model_dir / "prepared" / MANIFEST_FILENAME).read_bytes()
    again = train(resolve_settings(args + ["--max-updates", "3", "--epochs", "2"]))
    assert "is prepared already" in capsys.readouterr().out
    assert (model_dir / "prepared" / MANIFEST_FILENAME).read_bytes() == manifest_before
    assert again["optimizer_steps"] == 3 and "val_loss" in (model_dir / "history.csv").read_text()


def test_kt_train_prepares_a_tfds_corpus_and_reads_text_only_where_it_must(tmp_path, capsys):
    """A TFDS name is prepared into the run like --train-files (here wmt14_translate/de-en on TFDS' own mock
    data, its validation split recorded); Multi30k, --subword-sampling (a new segmentation of each sentence's
    text every epoch) and --max-train-examples read text, and say so."""
    import tensorflow_datasets as tfds

    from training.config import resolve_settings
    from training.fit import text_reason, train

    model_dir = tmp_path / "wmt"
    with tfds.testing.mock_data(num_examples=120):
        summary = train(resolve_settings(["--dataset", "wmt14_translate/de-en", "--preset", "tiny", "--model-dir",
                                        str(model_dir), "--vocab-size", "1000", "--max-updates", "1", "--epochs",
                                        "1", "--tokens-per-batch", "600", "--verbose", "0"]))
    assert summary["optimizer_steps"] == 1
    manifest = open_prepared(model_dir / "prepared").manifest
    assert [c["name"] for c in manifest["corpora"]] == ["wmt14_translate/de-en (train)"]
    assert manifest["validation"]["tfds"] == "wmt14_translate/de-en"
    assert json.loads((model_dir / "config.json").read_text())["training"]["dataset"] == "wmt14_translate/de-en"
    files = resolve_settings(["--train-files", "a.en", "a.de"])
    assert text_reason(files) is None
    assert text_reason(resolve_settings([])) == "Multi30k"
    assert text_reason(dataclasses.replace(files, subword_sampling=0.1)) == "--subword-sampling"
    assert text_reason(dataclasses.replace(files, max_train_examples=100)) == "--max-train-examples"
    src = write_lines(tmp_path / "s.en", multi30k_lines("train.en", 200))
    tgt = write_lines(tmp_path / "s.de", multi30k_lines("train.de", 200))
    capsys.readouterr()
    train(resolve_settings(["--train-files", str(src), str(tgt), "--subword-sampling", "0.1", "--preset", "tiny",
                          "--model-dir", str(tmp_path / "sampled"), "--vocab-size", "400", "--max-updates", "1",
                          "--epochs", "1", "--no-validation", "--tokens-per-batch", "600", "--verbose", "0"]))
    assert "tokenized every epoch (--subword-sampling" in capsys.readouterr().out
    assert not (tmp_path / "sampled" / "prepared").exists()


def test_make_train_prepares_your_own_text_then_trains_scores_and_exports_it():
    """`make train TRAIN=... VALID=... TEST=... RUN=...`: the commands it runs (make -n), in order."""
    done = subprocess.run(["make", "-n", "train", "TRAIN=a.en a.de b.en.gz b.de.gz", "VALID=v.en v.de",
                           "TEST=t.en t.de", "RUN=runs/mine"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.replace("\\\n", " ").split())
    prepare_at = text.index("-m training.prepare --config configs/multi30k.json --train-files a.en a.de "
                            "--train-files b.en.gz b.de.gz --valid-files v.en v.de --source-lang en --target-lang "
                            "de --out runs/mine/prepared &&")
    train_at = text.index("-m training.train --config configs/multi30k.json --source-lang en --target-lang de "
                          "--model-dir runs/mine --prepared runs/mine/prepared --valid-files v.en v.de;")
    evaluate_at = text.index("-m training.evaluate --model-dir runs/mine --model-file runs/mine/averaged.keras "
                             "--source-file t.en --references t.de")
    export_at = text.index("--export-dir exports/mine")
    assert prepare_at < train_at < evaluate_at < export_at
    multi30k = subprocess.run(["make", "-n", "train"], cwd=REPO, capture_output=True, text=True, timeout=60).stdout
    # kt-evaluate picks the test split of the dataset trained on (Multi30k's test_2016_flickr).
    assert "training.prepare" not in multi30k and "--split" not in multi30k


def test_kt_prepare_takes_the_vocabulary_settings_of_a_kt_train_config(tmp_path):
    from training.prepare import parse_args
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"vocab_size": 5000, "lowercase": True, "seed": 9, "epochs": 3}))
    args = parse_args(["--out", "o", "--config", str(config), "--train-files", "a", "b"])
    assert (args.vocab_size, args.lowercase, args.seed, args.vocab_sample) == (5000, True, 9, 2_000_000)
    assert parse_args(["--out", "o", "--config", str(config), "--vocab-size", "700"]).vocab_size == 700
    config.write_text("{")
    with pytest.raises(ConfigError, match="--config .*c.json"):
        parse_args(["--out", "o", "--config", str(config)])


def test_kt_prepare_refuses_a_target_vocabulary_without_its_source_or_of_other_ids(prepared, tmp_path):
    """--target-tokenizer (a vocabulary per side) needs --tokenizer, the sources', numbering the same ids."""
    directory, _, _, src_file, tgt_file = prepared
    tokenizer = str(directory / "tokenizer.model")
    with pytest.raises(ConfigError, match="--target-tokenizer needs --tokenizer"):
        prepare(_prepare_args(tmp_path / "a", src_file, tgt_file, "--target-tokenizer", tokenizer))
    other = tmp_path / "other.model"  # the same corpus's vocabulary of another size
    spm.SentencePieceTrainer.train(input=str(src_file), model_prefix=str(other.with_suffix("")), vocab_size=300,
                                   pad_id=0, unk_id=1, bos_id=2, eos_id=3, minloglevel=2)
    with pytest.raises(ConfigError, match=r"--target-tokenizer .*other.model has 300 ids and --tokenizer .* 600"):
        prepare(_prepare_args(tmp_path / "b", src_file, tgt_file, "--tokenizer", tokenizer,
                              "--target-tokenizer", str(other)))


@needs_multi30k
def test_kt_prepare_trains_a_byte_pair_vocabulary_on_request(tmp_path):
    """--vocab-type bpe (the paper's byte-pair encoding) gives sentencepiece's BPE model, unigram its unigram one;
    a config file's unknown type is refused by name."""
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    from training.config import check_settings, resolve_settings
    from training.errors import ConfigError
    from training.prepare import parse_args, prepare

    src, tgt = (write_lines(tmp_path / f"t.{lang}", multi30k_lines(f"train.{lang}", 300)) for lang in ("en", "de"))
    types = {}
    for vocab_type in ("bpe", "unigram"):
        out = tmp_path / vocab_type
        prepare(parse_args(["--out", str(out), "--train-files", str(src), str(tgt), "--vocab-size", "600",
                            "--vocab-type", vocab_type, "--shards", "2"]))
        proto = model_pb2.ModelProto()
        proto.ParseFromString((out / "tokenizer.model").read_bytes())
        types[vocab_type] = model_pb2.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type)
        assert json.loads((out / "manifest.json").read_text())["request"]["vocabulary"]["vocab_type"] == vocab_type
    assert types == {"bpe": "BPE", "unigram": "UNIGRAM"}
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"vocab_type": "wordpiece"}))
    with pytest.raises(ConfigError, match="vocab_type .* must be one of unigram, bpe, got 'wordpiece'"):
        check_settings(resolve_settings(["--config", str(config)]))
