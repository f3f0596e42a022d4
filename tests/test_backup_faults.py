"""A cut or corrupt backup never gives a traceback nor a silent fresh start: kt-train falls back to the
previous backup, or says which files cannot be read and how to start fresh."""

import numpy as np
import pytest

import keras_transformer as kt
from training.callbacks import ResumableBackup
from training.errors import BackupError


def _model():
    model = kt.Transformer.from_preset("tiny", vocab_size=16, dropout=0.0)
    model.compile(optimizer=kt.paper_adam(model.d_model, 10), loss=kt.MaskedSparseCategoricalCrossentropy())
    model.build()
    model.optimizer.build(model.trainable_variables)
    return model


def _weights(model):
    return [np.array(w) for w in model.get_weights()]


def _backups(tmp_path):
    """Backups after epochs 1 and 2 (current and previous pair); the weights of each."""
    model = _model()
    backup = ResumableBackup(tmp_path / "backup")
    backup.set_model(model)
    saved = {}
    for epoch in (1, 2):
        for w in model.weights:
            w.assign(np.full(w.shape, float(epoch), w.dtype.name if hasattr(w.dtype, "name") else w.dtype))
        model.optimizer.iterations.assign(10 * epoch)  # each pair's metadata records its step
        backup.current_epoch = epoch
        backup.save_backup()
        saved[epoch] = _weights(model)
    return backup, saved


def _restore(tmp_path, capsys):
    model = _model()
    backup = ResumableBackup(tmp_path / "backup")
    backup.set_model(model)
    backup.on_train_begin()
    return backup, model, capsys.readouterr().out


def _cut_in_half(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_an_intact_backup_resumes_from_the_newest(tmp_path, capsys):
    _, saved = _backups(tmp_path)
    backup, model, out = _restore(tmp_path, capsys)
    assert backup.resumed["epoch"] == 2 and model._initial_epoch == 2 and "resumed from backup:" in out
    for ours, theirs in zip(_weights(model), saved[2]):
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("damage", ["weights cut in half", "metadata cut in half", "weights garbage"])
def test_a_damaged_backup_falls_back_to_the_previous_one(tmp_path, capsys, damage):
    original, saved = _backups(tmp_path)
    if damage == "weights cut in half":
        _cut_in_half(original.weights_path)
    elif damage == "metadata cut in half":
        _cut_in_half(original.metadata_path)
    else:
        original.weights_path.write_bytes(b"\0not an h5 file" * 100)
    backup, model, out = _restore(tmp_path, capsys)
    assert f"cannot read the backup {original.weights_path}" in out and "(the previous one)" in out
    assert backup.resumed["epoch"] == 1 and model._initial_epoch == 1
    for ours, theirs in zip(_weights(model), saved[1]):
        np.testing.assert_array_equal(ours, theirs)
    # The good pair is the current one again: the next backup moves it to "previous", not the damaged one.
    assert original.weights_path.read_bytes() == original.previous_paths[0][1].read_bytes()


def test_a_pair_cut_in_two_falls_back_to_the_previous_one(tmp_path, capsys):
    """A kill between a backup's two renames leaves the new weights (step 20) beside the old metadata (step 10):
    kt-train resumes from the previous pair, not from weights of one step with another's epoch and batch."""
    import shutil

    original, saved = _backups(tmp_path)
    # The current pair: the new weights, the old metadata.
    shutil.copyfile(original.previous_paths[1][1], original.metadata_path)
    backup, model, out = _restore(tmp_path, capsys)
    assert f"cannot read the backup {original.weights_path}" in out and "(the previous one)" in out
    assert backup.resumed["step"] == 10 and int(model.optimizer.iterations.numpy()) == 10
    for ours, theirs in zip(_weights(model), saved[1]):
        np.testing.assert_array_equal(ours, theirs)


def test_no_readable_backup_names_the_files_and_how_to_start_fresh(tmp_path, capsys):
    original, _ = _backups(tmp_path)
    _cut_in_half(original.weights_path)
    _cut_in_half(original.previous_paths[0][1])
    with pytest.raises(BackupError) as error:
        _restore(tmp_path, capsys)
    message = str(error.value)
    assert str(original.weights_path) in message and str(original.previous_paths[0][1]) in message
    assert f"delete {original.weights_path.parent}" in message


def test_a_disk_full_during_a_backup_leaves_the_last_backup_whole(tmp_path, capsys):
    """The write fails halfway (ENOSPC): the run stops with that error, and the backup it resumes from
    is the last whole one, not the half-written file."""
    original, saved = _backups(tmp_path)

    def fill_the_disk(filepath, **kwargs):
        with open(filepath, "wb") as f:
            f.write(b"\x89HDF\r\n" + b"\0" * 1000)
        raise OSError(28, "No space left on device", filepath)

    original.model.save_weights = fill_the_disk
    original.current_epoch = 3
    with pytest.raises(OSError, match="No space left"):
        original.save_backup()
    backup, model, _ = _restore(tmp_path, capsys)
    assert backup.resumed["epoch"] == 2
    for ours, theirs in zip(_weights(model), saved[2]):
        np.testing.assert_array_equal(ours, theirs)
