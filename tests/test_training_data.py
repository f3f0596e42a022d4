"""Data sources and bad input: Multi30k TFDS builder, parallel files, clear errors."""

import logging
import threading
from pathlib import Path

import numpy as np
import pytest

from conftest import MULTI30K, needs_multi30k
from training.data import DataSpec, load_text_pairs
from training.errors import DataError, DataNotFoundError, LineCountMismatchError
from training.multi30k import Multi30k, builder_lock, check_multi30k_dir, prepare_multi30k, resolve_multi30k_dir
from training.text_files import read_parallel_files


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


@needs_multi30k
def test_multi30k_tfds_builder_reads_local_files(tfds_dir):
    spec = DataSpec(dataset="multi30k", source_lang="en", target_lang="de", data_dir=str(MULTI30K),
                    tfds_data_dir=tfds_dir)
    import tensorflow as tf

    counts = {split: int(load_text_pairs(spec, split).reduce(0, lambda n, _: n + 1))
              for split in ("train", "validation", "test_2016_flickr")}
    assert counts == {"train": 29000, "validation": 1014, "test_2016_flickr": 1000}
    # Same text as the files, in the requested direction (en -> de); the TAB inside
    # train.de line 7366 survives.
    en = (MULTI30K / "test_2016_flickr.en").read_text(encoding="utf-8").splitlines()
    de = (MULTI30K / "test_2016_flickr.de").read_text(encoding="utf-8").splitlines()
    pairs = [(s.decode(), t.decode()) for s, t in load_text_pairs(spec, "test").as_numpy_iterator()]
    assert pairs == list(zip(en, de))  # same text, same order as the files
    got = dict(pairs)
    with_tab = load_text_pairs(spec, "train").filter(lambda s, t: tf.strings.regex_full_match(t, "(?s).*\t.*"))
    tab_line = (MULTI30K / "train.de").read_text(encoding="utf-8").split("\n")[7365]
    assert "\t" in tab_line and [t.decode() for _, t in with_tab.as_numpy_iterator()] == [tab_line]
    # The reverse direction and another pair come from the same builder.
    rev = DataSpec(dataset="multi30k", source_lang="de", target_lang="en", data_dir=str(MULTI30K),
                   tfds_data_dir=tfds_dir)
    first_rev = next(load_text_pairs(rev, "test").as_numpy_iterator())
    assert got[first_rev[1].decode()] == first_rev[0].decode()
    fr = DataSpec(dataset="multi30k", source_lang="en", target_lang="fr", data_dir=str(MULTI30K),
                  tfds_data_dir=tfds_dir)
    assert sum(1 for _ in load_text_pairs(fr, "validation", max_examples=10)) == 10


@needs_multi30k
def test_two_runs_preparing_multi30k_at_once_take_turns(tmp_path, caplog):
    """Two kt-train runs started together on a fresh machine: the second waits for the first's dataset
    (without the lock, both wrote the same incomplete directory and one failed with TFDS' NotFoundError)."""
    held = Multi30k(config="de-en", data_dir=str(tmp_path))
    done = []
    second = threading.Thread(target=lambda: done.append(prepare_multi30k(
        "en", "de", data_dir=str(MULTI30K), tfds_data_dir=str(tmp_path))), daemon=True)
    with caplog.at_level(logging.WARNING, logger="training.multi30k"), builder_lock(held):  # the first run
        second.start()
        second.join(timeout=5)
        assert second.is_alive() and not done, "the second run did not wait for the first"
        assert not Path(held.data_dir).exists()
    second.join(timeout=300)
    assert done and done[0].info.splits["train"].num_examples == 29000
    assert "Waiting for another process that is preparing multi30k/de-en" in caplog.text


@needs_multi30k
def test_multi30k_dir_from_environment_variable(monkeypatch):
    monkeypatch.setenv("KT_MULTI30K_DIR", str(MULTI30K))
    assert resolve_multi30k_dir(None) == MULTI30K
    assert resolve_multi30k_dir(str(MULTI30K)) == MULTI30K


def test_missing_data_directory_says_how_to_get_it(tmp_path, monkeypatch):
    missing = tmp_path / "nowhere"
    with pytest.raises(DataNotFoundError) as e:
        resolve_multi30k_dir(str(missing))
    msg = str(e.value)
    assert str(missing) in msg and "does not exist" in msg
    assert "github.com/multi30k/dataset" in msg and "--data-dir" in msg and "KT_MULTI30K_DIR" in msg
    monkeypatch.setenv("KT_MULTI30K_DIR", str(missing))
    with pytest.raises(DataNotFoundError, match="KT_MULTI30K_DIR"):
        resolve_multi30k_dir(None)


def test_incomplete_data_directory_lists_missing_files(tmp_path):
    (tmp_path / "train.en").write_text("a\n")
    with pytest.raises(DataNotFoundError) as e:
        check_multi30k_dir(tmp_path, ("en", "de"))
    msg = str(e.value)
    assert str(tmp_path / "train.de") in msg and str(tmp_path / "val.en") in msg
    assert str(tmp_path / "train.en") + "," not in msg  # present files are not listed


def test_mismatched_line_counts_name_both_files_and_counts(tmp_path):
    src, tgt = tmp_path / "a.en", tmp_path / "b.de"
    src.write_text("one\ntwo\nthree\n", encoding="utf-8")
    tgt.write_text("eins\nzwei\n", encoding="utf-8")
    with pytest.raises(LineCountMismatchError) as e:
        read_parallel_files(src, tgt)
    msg = str(e.value)
    assert str(src) in msg and str(tgt) in msg and "3 lines" in msg and "2 lines" in msg


def test_empty_lines_are_skipped_and_counted(tmp_path, caplog):
    src, tgt = tmp_path / "a.en", tmp_path / "b.de"
    src.write_text("one\n\nthree\nfour\n  \n", encoding="utf-8")
    tgt.write_text("eins\nzwei\n\nvier\nfünf\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="training.text_files"):
        s, t, stats = read_parallel_files(src, tgt)
    assert s == ["one", "four"] and t == ["eins", "vier"]
    assert (stats.lines, stats.kept, stats.empty_skipped) == (5, 2, 3)
    assert stats.empty_line_numbers == [2, 3, 5]
    assert "Skipped 3 empty line pair(s)" in caplog.text and str(src) in caplog.text


def test_lines_kept_verbatim(tmp_path):
    src, tgt = tmp_path / "a.en", tmp_path / "b.de"
    src.write_bytes("tab\tinside\r\nlast line no newline".encode())
    tgt.write_bytes("Tab\tdrin\nletzte Zeile".encode())
    s, t, _ = read_parallel_files(src, tgt)
    assert s == ["tab\tinside", "last line no newline"] and t == ["Tab\tdrin", "letzte Zeile"]


def test_missing_file_and_unknown_tfds_name(tmp_path):
    (tmp_path / "a.en").write_text("x\n")
    with pytest.raises(DataNotFoundError, match="b.de"):
        read_parallel_files(tmp_path / "a.en", tmp_path / "b.de")
    spec = DataSpec(dataset="no_such_dataset_xyz", tfds_data_dir=str(tmp_path))
    with pytest.raises(DataError, match="no_such_dataset_xyz"):
        load_text_pairs(spec, "train")


def test_files_dataset(tmp_path):
    src, tgt = tmp_path / "a.en", tmp_path / "b.de"
    src.write_text("one\ntwo\nthree\n", encoding="utf-8")
    tgt.write_text("eins\nzwei\ndrei\n", encoding="utf-8")
    spec = DataSpec(dataset="files", files={"train": (str(src), str(tgt))})
    pairs = [(s.decode(), t.decode()) for s, t in load_text_pairs(spec, "train", max_examples=2).as_numpy_iterator()]
    assert pairs == [("one", "eins"), ("two", "zwei")]
    with pytest.raises(DataError, match="validation"):
        load_text_pairs(spec, "validation")


def test_train_cli_reports_bad_data_clearly(tmp_path, capsys):
    """kt-train exits with status 2 and the clear message, no traceback."""
    from training.train import main

    src, tgt = tmp_path / "a.en", tmp_path / "b.de"
    src.write_text("one\ntwo\nthree\n", encoding="utf-8")
    tgt.write_text("eins\nzwei\n", encoding="utf-8")
    args = ["--preset", "tiny", "--model-dir", str(tmp_path / "run"), "--epochs", "1"]
    assert main(args + ["--train-files", str(src), str(tgt)]) == 2
    err = capsys.readouterr().err
    assert "kt-train: error:" in err and str(src) in err and "3 lines" in err and "2 lines" in err
    assert main(args + ["--data-dir", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "github.com/multi30k/dataset" in err
    assert main(args + ["--train-files", str(src), str(tgt), "--subword-sampling", "-0.2"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "kt-train: error: --subword-sampling (subword_sampling) must be positive (or 0 for off), got -0.2"


def test_tfds_translation_dataset_by_name(tmp_path):
    """Any TFDS translation dataset by name (here a toy builder registered by this test)."""
    import inspect

    import tensorflow_datasets as tfds
    from etils import epath

    class KtToyTranslate(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        @tfds.core.utils.classproperty
        @classmethod
        def code_path(cls):  # see training/multi30k.py: TFDS 4.9.10 needs importlib_resources otherwise
            return epath.Path(inspect.getfile(cls))

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.Translation(languages=("pt", "en")),
                                         disable_shuffling=True)

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(5), "validation": self._generate_examples(2)}

        def _generate_examples(self, n):
            for i in range(n):
                yield i, {"pt": f"frase {i}", "en": f"sentence {i}"}

    spec = DataSpec(dataset="kt_toy_translate", source_lang="pt", target_lang="en", tfds_data_dir=str(tmp_path))
    pairs = [(s.decode(), t.decode()) for s, t in load_text_pairs(spec, "train").as_numpy_iterator()]
    assert pairs == [(f"frase {i}", f"sentence {i}") for i in range(5)]
    assert len(list(load_text_pairs(spec, "validation"))) == 2
    bad = DataSpec(dataset="kt_toy_translate", source_lang="pt", target_lang="de", tfds_data_dir=str(tmp_path))
    with pytest.raises(DataError, match="languages"):
        load_text_pairs(bad, "train")


# ------------------------------------------------------------------ damaged corpora


def _pair_files(tmp_path, source: bytes, target: bytes):
    src, tgt = tmp_path / "a.en", tmp_path / "b.de"
    src.write_bytes(source)
    tgt.write_bytes(target)
    return src, tgt


def test_a_file_that_is_not_utf8_names_the_file_line_and_byte(tmp_path):
    src, tgt = _pair_files(tmp_path, "one\nMüller\nthree\n".encode("latin-1"), "eins\nMüller\ndrei\n".encode())
    with pytest.raises(DataError) as e:
        read_parallel_files(src, tgt)
    msg = str(e.value)
    assert f"{src}, line 2: not UTF-8 (byte 0xfc at byte 2 of the line)" in msg and "iconv" in msg
    assert "\n" not in msg


def test_utf16_and_nul_bytes_are_refused_by_name(tmp_path):
    src, tgt = _pair_files(tmp_path, "one\ntwo\n".encode("utf-16"), b"eins\nzwei\n")
    with pytest.raises(DataError, match=f"{src} is UTF-16"):
        read_parallel_files(src, tgt)
    src, tgt = _pair_files(tmp_path, b"one\ntwo\n", b"eins\nzw\x00ei\n")
    with pytest.raises(DataError, match=f"{tgt}, line 2: a NUL byte at byte 3 of the line"):
        read_parallel_files(src, tgt)


def test_gzip_files_are_read_with_the_same_errors_as_plain_ones(tmp_path):
    """A gzip-compressed side (WMT's corpora come so) reads as its text; its errors name the file and the
    decompressed line and byte; a file cut short is refused as such."""
    import gzip

    src, tgt = _pair_files(tmp_path, gzip.compress("one\ntwo\n".encode()), "eins\nzwei\n".encode())
    s, t, stats = read_parallel_files(src, tgt)
    assert (s, t, stats.kept) == (["one", "two"], ["eins", "zwei"], 2)
    src, tgt = _pair_files(tmp_path, b"one\nMuller\n", gzip.compress("eins\nMüller\n".encode("latin-1")))
    with pytest.raises(DataError, match=f"{tgt}, line 2: not UTF-8 \\(byte 0xfc at byte 2 of the line\\)"):
        read_parallel_files(src, tgt)
    src, tgt = _pair_files(tmp_path, gzip.compress(b"one\n" * 1000)[:20], b"eins\n" * 1000)
    with pytest.raises(DataError, match=f"{src}: a damaged or incomplete gzip file"):
        read_parallel_files(src, tgt)


@needs_multi30k
def test_the_vocabulary_is_trained_on_a_uniform_sample_of_the_whole_corpus(tmp_path):
    """A corpus whose second half differs from its first (every word reversed), and a sample smaller than
    either half: the vocabulary covers both halves alike (pieces per character within 15%), where one trained
    on the first lines of the same size, as kt-train did, covers the second half far worse."""
    import sentencepiece as spm
    import tensorflow as tf

    from conftest import multi30k_lines
    from keras_transformer.text import train_sentencepiece
    from training.config import TrainSettings, default
    from training.fit import get_tokenizer_proto

    english = multi30k_lines("train.en", 4000)
    reversed_words = [" ".join(word[::-1] for word in line.split()) for line in english[2000:]]
    corpus = english[:2000] + reversed_words
    pairs = tf.data.Dataset.from_tensor_slices((corpus, corpus))

    def gap(proto):  # pieces per character: second half / first half
        sp = spm.SentencePieceProcessor(model_proto=proto)
        per_char = [sum(len(sp.encode(line)) for line in lines) / sum(len(line) for line in lines)
                    for lines in (english[:200], reversed_words[-200:])]
        return per_char[1] / per_char[0]

    sampled, _ = get_tokenizer_proto(TrainSettings(vocab_size=400, vocab_sample=400), pairs, tmp_path, True)
    spm.set_random_generator_seed(default("seed"))
    first_lines = train_sentencepiece(corpus[:400], 400)
    assert 0.85 < gap(sampled) < 1.15
    assert gap(first_lines) > 1.3


def test_a_utf8_byte_order_mark_is_removed_and_reported(tmp_path, caplog):
    src, tgt = _pair_files(tmp_path, "\ufeffone\ntwo\n".encode(), b"eins\nzwei\n")
    with caplog.at_level(logging.WARNING, logger="training.text_files"):
        s, t, stats = read_parallel_files(src, tgt)
    assert s == ["one", "two"] and t == ["eins", "zwei"] and stats.byte_order_marks_removed == 1
    assert f"Removed the UTF-8 byte-order mark at the start of {src}" in caplog.text


def test_carriage_return_line_ends_are_named_in_the_count_error(tmp_path):
    src, tgt = _pair_files(tmp_path, b"one\rtwo\rthree\r", b"eins\nzwei\ndrei\n")
    with pytest.raises(LineCountMismatchError) as e:
        read_parallel_files(src, tgt)
    assert f"{src} has 2 carriage return(s) inside lines" in str(e.value) and "1 lines" in str(e.value)


def test_unicode_separators_inside_a_line_never_shift_the_pairs(tmp_path):
    """str.splitlines would end a line at each of these and shift every later pair."""
    inner = ["\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\t"]
    source = [f"line {i} {sep} more" for i, sep in enumerate(inner)] + ["last"]
    target = [f"Zeile {i}" for i in range(len(inner))] + ["letzte"]
    src, tgt = _pair_files(tmp_path, ("\n".join(source) + "\n").encode(), ("\n".join(target) + "\n").encode())
    s, t, stats = read_parallel_files(src, tgt)
    assert list(zip(s, t)) == list(zip(source, target)) and stats.kept == len(inner) + 1


def _correlated_corpus(n, seed=0):
    """`n` sentence pairs whose lengths vary together, as translations' do."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 30, size=n)
    source = [" ".join(["word"] * k) for k in lengths]
    target = [" ".join(["Wort"] * max(1, int(k * 1.2 + rng.integers(-2, 3)))) for k in lengths]
    return source, target


@pytest.mark.parametrize("side", ["source", "target"])
def test_pairs_shifted_by_a_lost_line_are_refused_where_the_shift_starts(tmp_path, side):
    source, target = _correlated_corpus(3000)
    lost = 1733  # 0-based: line 1734 of one file is lost, and a line added at the end keeps the counts equal
    if side == "source":
        source = source[:lost] + source[lost + 1:] + ["word"]
    else:
        target = target[:lost] + target[lost + 1:] + ["Wort"]
    src, tgt = _pair_files(tmp_path, ("\n".join(source) + "\n").encode(), ("\n".join(target) + "\n").encode())
    with pytest.raises(DataError) as e:
        read_parallel_files(src, tgt)
    msg = str(e.value)
    assert f"{src} / {tgt}: the pairs look shifted by one line from about line" in msg
    first = int(msg.split("from about line ")[1].split()[0])
    assert abs(first - (lost + 1)) <= 3, msg
    assert "--no-alignment-check" in msg
    s, _, _ = read_parallel_files(src, tgt, check_shift=False)  # the escape hatch the message names
    assert len(s) == 3000


def test_the_shift_check_streamed_a_chunk_at_a_time_finds_the_same_shift_in_bounded_memory(tmp_path):
    """kt-prepare checks corpora of 100M pairs as they stream: the check keeps two windows of lengths and a chunk,
    not the corpus's, and whatever the chunks finds the shift the whole corpus's check finds, raised at the end."""
    from training.text_files import ALIGNMENT_WINDOW, AlignmentCheck, iter_parallel_chunks

    source, target = _correlated_corpus(12_000, seed=3)
    lost = 9_321
    target = target[:lost] + target[lost + 1:] + ["Wort"]
    lengths = [np.asarray([len(line) for line in side]) for side in (source, target)]
    messages = set()
    for chunk in (7, 333, 1_000, 20_000):
        check = AlignmentCheck("s", "t")
        for i in range(0, len(source), chunk):
            check.add(lengths[0][i:i + chunk], lengths[1][i:i + chunk])
            assert len(check.src) <= 2 * ALIGNMENT_WINDOW + chunk
        with pytest.raises(DataError) as e:
            check.finish()
        messages.add(str(e.value))
    assert len(messages) == 1
    first = int(messages.pop().split("from about line ")[1].split()[0])
    assert abs(first - (lost + 1)) <= 3
    src, tgt = _pair_files(tmp_path, ("\n".join(source) + "\n").encode(), ("\n".join(target) + "\n").encode())
    with pytest.raises(DataError) as whole:
        read_parallel_files(src, tgt)
    chunks = iter_parallel_chunks(src, tgt, chunk_lines=250)
    with pytest.raises(DataError) as streamed:
        for _ in chunks:
            pass
    assert str(streamed.value) == str(whole.value)
    # A million aligned lines: the buffer stays at two windows and a chunk.
    check = AlignmentCheck("s", "t")
    rng = np.random.default_rng(0)
    for _ in range(50):
        k = rng.integers(2, 200, 20_000)
        check.add(k, k + rng.integers(0, 3, len(k)))
        assert len(check.src) <= 2 * ALIGNMENT_WINDOW + 20_000
    check.finish()


def test_aligned_pairs_pass_the_shift_check(tmp_path):
    source, target = _correlated_corpus(3000)
    src, tgt = _pair_files(tmp_path, ("\n".join(source) + "\n").encode(), ("\n".join(target) + "\n").encode())
    assert read_parallel_files(src, tgt)[2].kept == 3000


@needs_multi30k
def test_no_multi30k_pair_looks_shifted():
    """The shift check on the real corpus: every split and language pair passes it."""
    from itertools import combinations

    for split in ("train", "val", "test_2016_flickr"):
        for a, b in combinations(("en", "de", "fr", "cs"), 2):
            read_parallel_files(MULTI30K / f"{split}.{a}", MULTI30K / f"{split}.{b}")


def test_train_cli_names_a_damaged_file_in_one_line(tmp_path, capsys):
    from training.train import main

    src, tgt = _pair_files(tmp_path, "one\nMüller\n".encode("cp1252"), b"eins\nzwei\n")
    args = ["--preset", "tiny", "--model-dir", str(tmp_path / "run"), "--epochs", "1"]
    assert main(args + ["--train-files", str(src), str(tgt)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kt-train: error: {src}, line 2: not UTF-8") and err.count("\n") == 1
    assert "Traceback" not in err
