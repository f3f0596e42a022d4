"""Resuming in the middle of an epoch: a run killed after a `--backup-every` backup goes on with the batches an
uninterrupted run trains on next (each epoch's order drawn from the seed and the epoch alone; the stream skips
the batches the restored updates trained on, and fit runs only what was left of the epoch), so each pair of the
epoch is trained on once, the run makes the updates an uninterrupted one makes, and ends with its weights; and
every backup is taken at an update's boundary, an epoch's end with batches accumulated included."""

import collections
import json

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import history_rows, multi30k_lines, needs_multi30k, write_lines
from keras_transformer.text import PAD_ID
from training import fit as fit_module
from training import prepared_corpus
from training.callbacks import ResumableBackup, accumulated_batches, optimizer_updates
from training.config import TrainSettings, resolve_settings
from training.prepare import build_parser, prepare
from training.prepared_corpus import open_prepared, stream_batches, worker_shards

pytestmark = needs_multi30k

PAIRS = 250


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    """Multi30k's first PAIRS pairs, prepared into 3 shards."""
    d = tmp_path_factory.mktemp("resume")
    src, tgt = (write_lines(d / f"c.{lang}", multi30k_lines(f"train.{lang}", PAIRS)) for lang in ("en", "de"))
    prepare(build_parser().parse_args(["--out", str(d / "out"), "--train-files", str(src), str(tgt),
                                       "--vocab-size", "500", "--shards", "3"]))
    return d / "out"


def _sources(batches):
    """Each batch's source rows, without their padding: a batch's identity."""
    return [tuple(tuple(int(x) for x in row if x != PAD_ID) for row in s) for (s, _), _ in batches]


def test_a_stream_that_skips_goes_on_with_the_batches_of_one_that_does_not(corpus_dir):
    """Every skip, within a pool, at a pool's end, past whole passes: the batches after it, in the same order.
    Pools of about 60 pairs (several a pass) and a shard shared with another worker (one pair in 2 read)."""
    corpus = open_prepared(corpus_dir)
    parts = worker_shards(3, 0, 2)  # shard 0 whole and one pair in 2 of shard 2
    assert [p.step for p in parts] == [1, 2]
    kwargs = dict(max_sentence_length=40, tokens_per_replica=300, seed=5, pool_pairs=60, epochs=3)
    whole = _sources(stream_batches(corpus, parts, **kwargs))
    first_pass = sum(1 for _ in stream_batches(corpus, parts, **{**kwargs, "epochs": 1}))
    assert len(whole) > 2 * first_pass > 10
    for skip in range(len(whole)):
        assert _sources(stream_batches(corpus, parts, skip=skip, **kwargs)) == whole[skip:], skip

    # Whole pools are passed over without reading their pairs: skipping the first pass loads no shard for it.
    loads = []
    real_load = corpus.load_shard
    corpus.load_shard = lambda index: loads.append(index) or real_load(index)
    list(stream_batches(corpus, parts, skip=first_pass, **{**kwargs, "epochs": 2}))
    counted = len(loads)
    loads.clear()
    list(stream_batches(corpus, parts, **{**kwargs, "epochs": 1}))
    assert counted == len(loads) > 0


class Killed(Exception):
    """What the test raises in place of a SIGKILL."""


def _args(corpus_dir, model_dir):
    return ["--prepared", str(corpus_dir), "--preset", "tiny", "--dropout", "0", "--tokens-per-batch", "320",
            "--max-sentence-length", "40", "--grad-accum", "2", "--backup-every", "2", "--warmup-steps", "10",
            "--epochs", "2", "--no-validation", "--verbose", "0", "--model-dir", str(model_dir)]


def _recorded_run(monkeypatch, settings, kill_in_epoch_2=False):
    """kt-train's `train(settings)`, recording the stream's batches: returns (its summary or None if killed, the
    batches its fit trained on, in order, the stream's skip, the steps fit ran). With `kill_in_epoch_2`, raises
    `Killed` half-way through epoch 2 at a batch accumulated towards an update after the newest backup's."""
    started = []  # (skip, batches yielded) of each stream started in fit
    in_fit = [False]
    real_stream = prepared_corpus.stream_batches

    def recorded_stream(*args, **kwargs):
        yielded = []
        if in_fit[0]:
            started.append((kwargs.get("skip", 0), yielded))
        for batch in real_stream(*args, **kwargs):
            yielded.append(batch)
            yield batch

    monkeypatch.setattr(prepared_corpus, "stream_batches", recorded_stream)
    steps = [0]
    real_make_callbacks = fit_module.make_callbacks

    def make_callbacks(*args, **kwargs):
        made = real_make_callbacks(*args, **kwargs)
        backup = made.backup

        def on_train_batch_end(batch, logs=None):
            steps[0] += 1
            model = backup.model
            if (kill_in_epoch_2 and backup.current_epoch == 1 and batch >= backup.params["steps"] // 2
                    and accumulated_batches(model) and optimizer_updates(model) > backup.saved_at_update):
                raise Killed()

        def on_train_begin(logs=None):
            in_fit[0] = True

        # Before the epoch cut, which goes last.
        made.all.insert(-1, keras.callbacks.LambdaCallback(on_train_begin=on_train_begin,
                                                           on_train_batch_end=on_train_batch_end))
        return made

    monkeypatch.setattr(fit_module, "make_callbacks", make_callbacks)
    summary = None
    try:
        summary = fit_module.train(settings)
    except Killed:
        pass
    finally:
        monkeypatch.undo()
    assert len(started) == 1, [skip for skip, _ in started]  # one stream for the whole fit, the cut epoch's too
    skip, yielded = started[0]
    return summary, _sources(yielded[:steps[0]]), skip, steps[0]


def _weights(path):
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, item: out.__setitem__(name, item[()]) if isinstance(item, h5py.Dataset) else None)
    return out


def test_a_run_killed_mid_epoch_resumes_with_the_batches_and_weights_of_one_never_killed(corpus_dir, tmp_path,
                                                                                       monkeypatch, capsys):
    """2 epochs, 2 batches per update, a backup every 2 updates; killed half-way through epoch 2 after its newest
    backup (an update and a batch accumulated lost), then resumed: the resumed run goes on with epoch 2's
    batches after the backup's, so epoch 2 trains on every pair once, and the run ends at the uninterrupted
    run's update count, with its weights (no dropout) and its epoch checkpoints."""
    never, trained, _, _ = _recorded_run(monkeypatch, resolve_settings(_args(corpus_dir, tmp_path / "never")))
    epoch = sum(1 for _ in stream_batches(open_prepared(corpus_dir), list(range(3)), max_sentence_length=40,
                                          tokens_per_replica=320, seed=1234, epochs=1))
    assert never["epochs_run"] == [1, 2] and len(trained) == 2 * epoch and epoch % 2  # odd: an update spans epochs
    assert never["optimizer_steps"] == len(trained) // 2

    run = tmp_path / "killed"
    settings = resolve_settings(_args(corpus_dir, run))
    killed, before, _, ran = _recorded_run(monkeypatch, settings, kill_in_epoch_2=True)
    assert killed is None and not (run / "model.keras").exists()
    meta = json.loads((run / "backup" / "training_metadata.json").read_text())
    killed_at = ran - epoch - 1  # epoch 2's batch (0-based) the kill came after
    assert meta["epoch"] == 1 and 0 < meta["batch"] <= killed_at - 3  # then an update and a batch, lost
    restored = 2 * meta["step"]  # the batches the backup's updates trained on
    assert restored == epoch + meta["batch"] + 1
    capsys.readouterr()

    summary, after, skip, _ = _recorded_run(monkeypatch, settings)
    seen = before[:restored] + after
    # Each pair of the epoch once, epoch 2's as epoch 1's, in the uninterrupted run's order.
    corpus_rows = collections.Counter(row for batch in _sources(stream_batches(
        open_prepared(corpus_dir), list(range(3)), max_sentence_length=40, tokens_per_replica=320, seed=0, epochs=1))
        for row in batch)
    assert max(corpus_rows.values()) == 1
    for e in (0, 1):
        assert collections.Counter(row for batch in seen[e * epoch:(e + 1) * epoch] for row in batch) == corpus_rows
    assert seen == trained
    assert summary["optimizer_steps"] == never["optimizer_steps"] and summary["epochs_run"] == [2]
    assert [row["epoch"] for row in history_rows(run)] == ["0", "1"]
    assert skip == restored
    left = epoch - meta["batch"] - 1
    assert (f"optimizer step {meta['step']}; epoch 2 goes on with the {left} of its {epoch} batches left"
            in capsys.readouterr().out)
    for name in ("checkpoints/epoch-001.weights.h5", "checkpoints/epoch-002.weights.h5"):
        ours, theirs = _weights(run / name), _weights(tmp_path / "never" / name)
        assert ours.keys() == theirs.keys() and ours
        for key in ours:
            np.testing.assert_array_equal(ours[key], theirs[key], err_msg=f"{name}: {key}")


def test_an_epoch_end_with_a_batch_accumulated_is_backed_up_after_the_next_update(tmp_path):
    """7 batches an epoch, 2 per update: epoch 1 ends with a batch accumulated, which a backup would not hold,
    so its backup is taken after the next update (epoch 2's first batch); epoch 2 ends at an update's boundary
    and is backed up there."""
    rows = np.random.default_rng(0).integers(4, 40, size=(7 * 2, 6)).astype("int32")
    data = tf.data.Dataset.from_tensor_slices(((rows, rows), rows)).batch(2).repeat()

    class Recorded(ResumableBackup):
        saves = []

        def save_backup(self):
            self.saves.append((int(self.model.optimizer.iterations.numpy()), accumulated_batches(self.model),
                               self.current_epoch, self.last_batch_seen))
            super().save_backup()

    keras.utils.set_random_seed(0)
    model = fit_module.build_and_compile(TrainSettings(preset="tiny", warmup_steps=10, grad_accum=2), 40)
    model.fit(data, epochs=2, steps_per_epoch=7, verbose=0, shuffle=False,
              callbacks=[Recorded(tmp_path / "backup", save_freq="epoch")])
    assert Recorded.saves == [(4, 0, 1, 0), (7, 0, 2, 0)]
