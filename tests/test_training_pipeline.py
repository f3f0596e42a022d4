"""Tokenizer round trip, special ids, and the bucketed tf.data batches."""

import collections
import unicodedata

import numpy as np
import pytest
import sentencepiece as spm
import tensorflow as tf

from conftest import MULTI30K, needs_multi30k
from common.tokenizer import encode_source, make_tokenizer
from keras_transformer.text import END_ID as EOS_ID
from keras_transformer.text import PAD_ID, UNK_ID, read_tokenizer_proto
from keras_transformer.text import START_ID as BOS_ID
from keras_transformer.text import lowercases, train_sentencepiece, vocab_size_of
from training.pipeline import bucket_batch_sizes, bucket_boundaries, make_batches

pytestmark = needs_multi30k


def _lines(name, n=None):
    lines = (MULTI30K / name).read_text(encoding="utf-8").split("\n")[:-1]
    return lines[:n] if n else lines


@pytest.fixture(scope="module")
def corpus():
    return _lines("train.en", 3000), _lines("train.de", 3000)


@pytest.fixture(scope="module")
def proto(corpus):
    return train_sentencepiece(corpus[0] + corpus[1], vocab_size=1000)


def test_special_ids_and_vocab(proto, tmp_path):
    sp = spm.SentencePieceProcessor(model_proto=proto)
    assert (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) == (PAD_ID, UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2, 3)
    assert vocab_size_of(proto) == 1000
    # Joint vocabulary: pieces from both languages.
    assert sp.piece_to_id("▁Ein") != UNK_ID and sp.piece_to_id("▁A") != UNK_ID
    # Read back byte for byte; a missing file is a clear error.
    (tmp_path / "tokenizer.model").write_bytes(proto)
    assert read_tokenizer_proto(tmp_path / "tokenizer.model") == proto
    with pytest.raises(FileNotFoundError, match="missing.model"):
        read_tokenizer_proto(tmp_path / "missing.model")


def test_tokenizer_round_trip(proto):
    tok = make_tokenizer(proto)
    # Held-out sentences (validation), both languages, cased; plus characters the
    # vocabulary never saw (byte fallback keeps them reversible).
    # "Ordinary text": NFKC-normal with single spaces (sentencepiece's nmt_nfkc
    # normalization maps e.g. a no-break space to a space, and squeezes spaces).
    texts = _lines("val.en", 300) + _lines("val.de", 300) + ["Žluťoučký kůň — 42 € „quoted“ ÄÖÜß"]
    ordinary = [t for t in texts if unicodedata.normalize("NFKC", t) == t and "  " not in t and t == t.strip()]
    assert len(ordinary) >= 0.98 * len(texts)
    texts = ordinary
    ids = tok.tokenize(texts)
    assert ids.dtype == tf.int32
    assert not tf.reduce_any(tf.equal(ids.flat_values, UNK_ID))
    back = [b.decode("utf-8") for b in tok.detokenize(ids).numpy()]
    assert back == texts
    # Same ids as the sentencepiece package itself (no bos/eos added by the tokenizer).
    sp = spm.SentencePieceProcessor(model_proto=proto)
    assert ids[0].numpy().tolist() == sp.encode(texts[0])
    # Works inside a tf.function graph (as in tf.data and an exported model).
    f = tf.function(lambda s: tok.detokenize(tok.tokenize(s)))
    assert f(tf.constant(texts[:5])).numpy().tolist() == [t.encode() for t in texts[:5]]


def test_a_case_folding_vocabulary_reads_any_case_and_writes_lowercase(proto, corpus):
    folding = train_sentencepiece(corpus[0] + corpus[1], vocab_size=1000, lowercase=True)
    assert lowercases(folding) and not lowercases(proto)
    sp = spm.SentencePieceProcessor(model_proto=folding)
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if not sp.is_control(i) and not sp.is_byte(i)]
    assert all(piece == piece.lower() for piece in pieces)  # trained on case-folded text
    texts = ["A Dog runs through the Park.", "EIN HUND LÄUFT DURCH DEN PARK."]
    # tensorflow-text applies the model's normaliser, as the sentencepiece package does: in tf.data and in an export.
    tok = make_tokenizer(folding)
    f = tf.function(lambda s: (tok.tokenize(s), tok.detokenize(tok.tokenize(s))))
    ids, back = f(tf.constant(texts))
    assert ids.to_list() == sp.encode(texts) == sp.encode([t.lower() for t in texts])
    assert [b.decode() for b in back.numpy()] == [t.lower() for t in texts]
    # The cased vocabulary keeps the case.
    assert make_tokenizer(proto).detokenize(make_tokenizer(proto).tokenize(texts)).numpy().tolist() == [
        t.encode() for t in texts]


def test_encode_source_appends_eos_and_truncates(proto):
    tok = make_tokenizer(proto)
    src = encode_source(tok, tf.constant(["A dog runs.", "Two men are playing soccer on a big green field."]), 6)
    rows = src.to_list()
    assert all(r[-1] == EOS_ID and EOS_ID not in r[:-1] and BOS_ID not in r for r in rows)
    assert len(rows[1]) == 6


def test_bucket_sizes_follow_budget():
    bounds = bucket_boundaries(100)
    assert bounds == sorted(bounds) and bounds[-1] <= 100
    sizes = bucket_batch_sizes(bounds, 100, 2000, num_replicas=2)
    longest = [b - 1 for b in bounds] + [100]
    assert all(s * n <= 2000 and s % 2 == 0 for s, n in zip(sizes, longest))
    assert sizes == sorted(sizes, reverse=True)
    with pytest.raises(ValueError, match="tokens_per_batch"):
        bucket_batch_sizes(bounds, 100, 150, num_replicas=2)


def _epoch_of_pieces(ds, sp):
    """{target text: (source pieces, target pieces)} of one pass over make_batches' output."""
    out = {}
    for (source, _), target_out in ds:
        for s, to in zip(source.numpy(), target_out.numpy()):
            s, to = s[s != PAD_ID][:-1].tolist(), to[to != PAD_ID][:-1].tolist()  # without the end id
            out[sp.decode(to)] = (s, to)
    return out


def test_subword_sampling_varies_the_pieces_not_the_text(proto, corpus):
    """kt-train --subword-sampling (Kudo, 2018): each epoch segments a training sentence anew, into pieces
    that still spell the same sentence on both sides; without it, every epoch gets the same, best, pieces."""
    sp = spm.SentencePieceProcessor(model_proto=proto)
    src_text, tgt_text = corpus[0][:300], corpus[1][:300]
    pairs = tf.data.Dataset.from_tensor_slices((src_text, tgt_text))
    best = {sp.decode(sp.encode(t)): (sp.encode(s), sp.encode(t)) for s, t in zip(src_text, tgt_text)}

    plain = make_batches(pairs, make_tokenizer(proto), max_sentence_length=128, tokens_per_batch=2000, shuffle=False)
    assert _epoch_of_pieces(plain, sp) == _epoch_of_pieces(plain, sp) == best

    sampled = make_batches(pairs, make_tokenizer(proto, sampling_alpha=0.2), max_sentence_length=128,
                           tokens_per_batch=4000, shuffle=False)
    first, second = _epoch_of_pieces(sampled, sp), _epoch_of_pieces(sampled, sp)
    assert first.keys() == second.keys() == best.keys()
    for epoch in (first, second):
        for target, (s, t) in epoch.items():
            source, _ = best[target]
            assert sp.decode(s) == sp.decode(source) and sp.decode(t) == target
    changed = sum(first[k] != best[k] for k in best)
    assert changed > 0.5 * len(best), changed
    assert sum(first[k] != second[k] for k in best) > 0.5 * len(best)
    with pytest.raises(ValueError, match="sampling_alpha must be positive"):
        make_tokenizer(proto, sampling_alpha=-0.1)


@pytest.mark.parametrize("replicas", [1, 2])
def test_batches_budget_padding_and_ids(proto, corpus, replicas):
    tok = make_tokenizer(proto)
    src_text, tgt_text = corpus[0][:1500], corpus[1][:1500]
    budget, max_len = 600, 40
    pairs = tf.data.Dataset.from_tensor_slices((src_text, tgt_text))
    ds = make_batches(pairs, tok, max_sentence_length=max_len, tokens_per_batch=budget, num_replicas=replicas,
                      shuffle=True, seed=7)
    sp = spm.SentencePieceProcessor(model_proto=proto)
    expected = collections.Counter(
        sp.decode(sp.encode(t)) for s, t in zip(src_text, tgt_text)
        if len(sp.encode(s)) + 1 <= max_len and len(sp.encode(t)) + 1 <= max_len)
    got, sizes = collections.Counter(), set()
    for (source, target_in), target_out in ds:
        source, target_in, target_out = source.numpy(), target_in.numpy(), target_out.numpy()
        b = source.shape[0]
        sizes.add(b)
        # Token budget on each side, counting padding; equal share per replica.
        assert b * source.shape[1] <= budget and b * target_in.shape[1] <= budget
        assert b % replicas == 0
        assert source.shape[1] <= max_len and target_in.shape[1] <= max_len
        assert target_in.shape == target_out.shape
        for s, ti, to in zip(source, target_in, target_out):
            n_s, n_t = int((s != PAD_ID).sum()), int((to != PAD_ID).sum())
            # Real tokens first, then only padding.
            assert (s[:n_s] != PAD_ID).all() and (s[n_s:] == PAD_ID).all()
            assert (to[:n_t] != PAD_ID).all() and (to[n_t:] == PAD_ID).all()
            # source: pieces + eos; target_in: bos + pieces; target_out: pieces + eos.
            assert s[n_s - 1] == EOS_ID and EOS_ID not in s[: n_s - 1] and BOS_ID not in s
            assert ti[0] == BOS_ID and (ti[1:n_t] == to[: n_t - 1]).all() and (ti[n_t:] == PAD_ID).all()
            assert to[n_t - 1] == EOS_ID and EOS_ID not in to[: n_t - 1] and BOS_ID not in to
            got[sp.decode(to[: n_t - 1].tolist())] += 1
    # Several bucket sizes, and every kept pair (nothing but over-long ones dropped,
    # with 2 replicas at most one pair per bucket).
    assert len(sizes) > 2
    if replicas == 1:
        assert got == expected
    else:
        # A leftover batch is trimmed to an even size: at most one pair lost per bucket.
        assert not (got - expected)
        assert sum(expected.values()) - sum(got.values()) <= len(bucket_boundaries(max_len)) + 1


@pytest.mark.parametrize("max_sentence_length", [6, 8, 40])
def test_padded_to_bucket_boundaries_for_xla_at_any_max_length(proto, corpus, max_sentence_length):
    """--jit-compile pads every batch to its bucket's boundary; below 8 tokens there is no bucket boundary
    at all, which once raised IndexError. Every pair that fits max_sentence_length is kept, in few shapes."""
    tok, sp = make_tokenizer(proto), spm.SentencePieceProcessor(model_proto=proto)
    # The first one to four words of real sentences: pairs of every length around the limit.
    sources, targets = ([" ".join(line.split()[: 1 + i % 4]) for i, line in enumerate(side[:400])] for side in corpus)
    pairs = tf.data.Dataset.from_tensor_slices((sources, targets))
    batches = list(make_batches(pairs, tok, max_sentence_length=max_sentence_length, tokens_per_batch=8 * max_sentence_length, shuffle=False,
                                pad_to_bucket_boundary=True).as_numpy_iterator())
    fitting = sum(len(sp.encode(s)) + 1 <= max_sentence_length and len(sp.encode(t)) + 1 <= max_sentence_length
                  for s, t in zip(sources, targets))
    assert fitting > 0 and sum(len(target_out) for _, target_out in batches) == fitting
    widths = {source.shape[1] for (source, _), _ in batches}
    assert max(widths) <= max_sentence_length and len(widths) <= len(bucket_boundaries(max_sentence_length)) + 1


@pytest.mark.parametrize("replicas", [1, 2])
def test_r_drop_batches_hold_each_pair_twice_in_a_row(proto, corpus, replicas):
    """make_batches(copies=2), what kt-train --r-drop trains and validates on: the batches of copies=1 with every
    row repeated in place (rows 2i and 2i + 1), so that MaskedRDropCrossentropy pairs the same sentence."""
    tok = make_tokenizer(proto)
    pairs = tf.data.Dataset.from_tensor_slices((corpus[0][:600], corpus[1][:600]))
    common = dict(max_sentence_length=40, tokens_per_batch=600, num_replicas=replicas, shuffle=False)
    single = list(make_batches(pairs, tok, **common).as_numpy_iterator())
    double = list(make_batches(pairs, tok, copies=2, **common).as_numpy_iterator())
    assert len(double) == len(single) > 3
    for ((s1, ti1), to1), ((s2, ti2), to2) in zip(single, double, strict=True):
        for one, two in ((s1, s2), (ti1, ti2), (to1, to2)):
            np.testing.assert_array_equal(two, np.repeat(one, 2, axis=0))
        assert len(s2) % (2 * replicas) == 0  # each replica's contiguous share holds whole pairs
    with pytest.raises(ValueError, match="copies must be 1 or more"):
        make_batches(pairs, tok, copies=0)
