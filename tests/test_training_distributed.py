"""Distributed training: resume after SIGKILL, and a 2-worker MultiWorkerMirroredStrategy run, killed and
resumed. That N replicas train what one replica trains: tests/test_training_updates.py.

Each case runs in subprocesses: logical CPU devices and multi-worker
strategies must be set up before TensorFlow initializes its devices.
"""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import MULTI30K, REPO, distributed_env, history_rows, needs_multi30k, start_workers, wait_all


# ---------------------------------------------------------------------------
# Shared: a small parallel corpus in tmp (first lines of Multi30k train).


def _small_corpus(tmp_path, n=600):
    src, tgt = tmp_path / "train.en", tmp_path / "train.de"
    for lang, out in (("en", src), ("de", tgt)):
        lines = (MULTI30K / f"train.{lang}").read_text(encoding="utf-8").split("\n")[:n]
        out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return src, tgt


def _train_cmd(model_dir, src, tgt, *extra):
    return [sys.executable, "-m", "training.train", "--preset", "tiny", "--train-files", str(src), str(tgt),
            "--source-lang", "en", "--target-lang", "de", "--model-dir", str(model_dir),
            "--vocab-size", "500", "--tokens-per-batch", "400", "--max-sentence-length", "40",
            "--no-validation", "--verbose", "2", *extra]


# ---------------------------------------------------------------------------
# 1. SIGKILL mid-epoch, restart, resume from the backup, finish the planned epochs.


# kt-train's line for a resume (training/callbacks.py, `ResumableBackup.on_train_begin`).
RESUMED = re.compile(r"\[kt-train\] resumed from backup(?P<previous> \(the previous one\))?: epoch (?P<epoch>\d+) "
                     r"\(backup taken after batch (?P<batch>\d+) of it\), optimizer step (?P<step>\d+)")


def _resumes(out):
    """Each resume kt-train logged in `out`: (epoch (1-based), batch, optimizer step, read from the previous pair)."""
    return [(int(m["epoch"]), int(m["batch"]), int(m["step"]), bool(m["previous"])) for m in RESUMED.finditer(out)]


def _read_meta(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _wait_for_mid_epoch_2(meta_path, procs, timeout: float, log):
    """Polls a run's backup metadata until a backup was taken mid-way through epoch 2, for the test to kill
    the run there. Fails naming the wait, not later on missing backups, if `timeout` seconds pass first (a
    loaded machine) or a process ends."""
    deadline = time.time() + timeout
    while all(p.poll() is None for p in procs):
        meta = _read_meta(meta_path)
        if meta and meta["epoch"] >= 1 and meta["batch"] > 0:
            return meta
        if time.time() > deadline:
            pytest.fail(f"no backup mid-way through epoch 2 within {timeout:.0f} s (the newest: {meta}); "
                        f"the log:\n" + log.read_text()[-3000:])
        time.sleep(0.05)
    pytest.fail("training ended before it could be killed:\n" + log.read_text()[-3000:])


def _run_and_kill_mid_epoch_2(cmd, meta_path, log_path):
    """Starts kt-train's `cmd`, SIGKILLs it once it has taken a backup mid-way through epoch 2, and checks it
    died of the kill (its output in `log_path`)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=distributed_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_for_mid_epoch_2(meta_path, [proc], 180, log_path)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == -signal.SIGKILL


@needs_multi30k
@pytest.mark.parametrize("max_updates", [None, 75])
def test_sigkill_mid_epoch_then_resume(tmp_path, max_updates):
    """Killed in epoch 2, the same command resumes from the backup, goes on with epoch 2 after the backup's
    batch, and ends where an uninterrupted run ends: after the planned epochs, or at update 75 (in the middle of
    epoch 3) with --max-updates 75."""
    src, tgt = _small_corpus(tmp_path)
    model_dir = tmp_path / "run"
    epochs, steps = 3, 30
    limit = ["--max-updates", str(max_updates)] if max_updates else []
    cmd = _train_cmd(model_dir, src, tgt, "--epochs", str(epochs), "--steps-per-epoch", str(steps),
                     "--backup-every", "5", *limit)
    meta_path = model_dir / "backup" / "training_metadata.json"
    _run_and_kill_mid_epoch_2(cmd, meta_path, tmp_path / "run1.log")
    assert not (model_dir / "model.keras").exists()  # it did not finish
    killed_at = _read_meta(meta_path)  # the backup the restart will find
    assert killed_at["epoch"] >= 1 and 0 < killed_at["batch"] < steps
    assert killed_at["step"] == killed_at["epoch"] * steps + killed_at["batch"] + 1

    proc2 = subprocess.run(cmd, cwd=REPO, env=distributed_env(), capture_output=True, text=True, timeout=600)
    out = proc2.stdout + proc2.stderr
    assert proc2.returncode == 0, out[-3000:]
    # Resumed from the mid-epoch backup: its epoch and optimizer step, not from zero. A kill between renaming
    # the new weights and the new metadata leaves a pair cut in two, which a resume refuses for the previous
    # pair: the same point as the metadata read above.
    resumes = _resumes(out)
    assert [r[:3] for r in resumes] == [(killed_at["epoch"] + 1, killed_at["batch"], killed_at["step"])], out[-3000:]
    summary = json.loads(out.split("[kt-train] done ")[1].splitlines()[0])
    # The interrupted epoch goes on after the backup's batch, with the optimizer's step count of the backup:
    # epochs end at the updates an uninterrupted run's end at.
    if max_updates:  # ... and the run stops at the same update as an uninterrupted run, in the epoch it falls in
        last_epoch = math.ceil(max_updates / steps)
        assert summary["optimizer_steps"] == max_updates and summary["stopped_by_max_updates"]
    else:  # ... and runs the planned epochs' updates, no more
        last_epoch = epochs
        assert summary["optimizer_steps"] == epochs * steps
        assert not summary["stopped_by_max_updates"]
    # Only the remaining epochs ran, starting with the interrupted one.
    assert summary["epochs_run"] == list(range(killed_at["epoch"] + 1, last_epoch + 1))
    # Every epoch is in the history (first run + resumed run), none lost.
    assert sorted(int(row["epoch"]) for row in history_rows(model_dir)) == list(range(last_epoch))
    assert (model_dir / "model.keras").exists()
    assert not (model_dir / "backup").exists()  # removed after a finished run
    assert sorted(p.name for p in (model_dir / "checkpoints").iterdir()) == [
        f"epoch-{e:03d}.weights.h5" for e in range(1, last_epoch + 1)]


@needs_multi30k
def test_a_run_by_updates_killed_mid_span_resumes_and_checkpoints_at_the_same_updates(tmp_path):
    """kt-train --checkpoint-every 30 --max-updates 75, killed between its checkpoints at updates 30 and 60
    (a backup every 5 updates): the same command resumes from the backup's update, writes its checkpoints at
    updates 60 and 75 (the end), not 30 updates after the resume, and stops at update 75."""
    src, tgt = _small_corpus(tmp_path)
    model_dir = tmp_path / "run"
    every = 30
    cmd = _train_cmd(model_dir, src, tgt, "--checkpoint-every", str(every), "--max-updates", "75",
                     "--backup-every", "5")
    meta_path = model_dir / "backup" / "training_metadata.json"
    _run_and_kill_mid_epoch_2(cmd, meta_path, tmp_path / "run1.log")
    killed_at = _read_meta(meta_path)
    assert killed_at["epoch"] == 1 and 0 < killed_at["batch"] < every - 1, killed_at  # between updates 30 and 60
    assert sorted(p.name for p in (model_dir / "checkpoints").iterdir()) == ["update-0000030.weights.h5"]

    proc2 = subprocess.run(cmd, cwd=REPO, env=distributed_env(), capture_output=True, text=True, timeout=600)
    out = proc2.stdout + proc2.stderr
    assert proc2.returncode == 0, out[-3000:]
    assert [r[2] for r in _resumes(out)] == [killed_at["step"]], out[-3000:]
    summary = json.loads(out.split("[kt-train] done ")[1].splitlines()[0])
    assert summary["optimizer_steps"] == 75 and summary["stopped_by_max_updates"]
    assert sorted(p.name for p in (model_dir / "checkpoints").iterdir()) == [
        f"update-{u:07d}.weights.h5" for u in (30, 60, 75)]


# ---------------------------------------------------------------------------
# 2. MultiWorkerMirroredStrategy: two local worker processes.


TWO_WORKER_EPOCHS, TWO_WORKER_STEPS = 3, 20


def _two_worker_cmd(run_dir, model_dir):
    src, tgt = run_dir / "train.en", run_dir / "train.de"
    return _train_cmd(model_dir, src, tgt, "--epochs", str(TWO_WORKER_EPOCHS), "--steps-per-epoch",
                      str(TWO_WORKER_STEPS), "--backup-every", "5")


@pytest.fixture(scope="module")
def two_workers_killed(tmp_path_factory):
    """A two-worker run killed mid-epoch 2 (worker 2 SIGKILLed, then the chief, blocked in a collective, as a
    job scheduler would stop it): its folder, holding the corpus and the run ("mw"). Each test resumes a copy."""
    root = tmp_path_factory.mktemp("two-workers")
    _small_corpus(root, n=300)
    procs = start_workers(_two_worker_cmd(root, root / "mw"), [root / f"run1-worker{i}.log" for i in range(2)])
    try:
        _wait_for_mid_epoch_2(root / "mw" / "backup" / "training_metadata.json", [p for p, _ in procs], 300,
                              root / "run1-worker0.log")
        os.kill(procs[1][0].pid, signal.SIGKILL)
        time.sleep(2)
        os.kill(procs[0][0].pid, signal.SIGKILL)
    finally:
        wait_all(procs, 30)
    return root


@needs_multi30k
@pytest.mark.parametrize("lag", ["whole", "cut"])
def test_two_workers_killed_mid_epoch_resume_with_no_epoch_lost(two_workers_killed, tmp_path, lag):
    """MultiWorkerMirroredStrategy on 127.0.0.1: worker 2 is SIGKILLed mid-epoch (the chief, blocked in a
    collective, is stopped too, as a job scheduler would), then both start again with the same command.
    Worker 2 died one backup behind the chief, its newest pair whole or cut in two; both resume from the
    backup both have (not each its own, which deadlocked them), and every planned epoch is trained: two
    replicas, the same loss logged on both workers (it is averaged over them), model.keras written by the
    chief."""
    epochs, steps = TWO_WORKER_EPOCHS, TWO_WORKER_STEPS
    model_dir = tmp_path / "mw"
    shutil.copytree(two_workers_killed / "mw", model_dir)
    cmd = _two_worker_cmd(two_workers_killed, model_dir)

    # Worker 2, killed between the chief's backup and its own, is one backup behind. The state it is left in
    # depends on the instant of the kill, so the test puts each in place from the chief's files (under
    # MultiWorkerMirroredStrategy every worker holds the same weights and optimizer state; the chief, blocked
    # in a collective, was not writing). "whole": its newest pair is the chief's previous one. "cut": killed
    # between renaming its new weights and its new metadata, so the chief's newest weights lie beside the
    # previous metadata, a pair a resume refuses for the previous one.
    chief, other = model_dir / "backup", model_dir / ".worker-1" / "backup"
    for name in ("latest.weights.h5", "training_metadata.json"):
        for target in (f"{name}.bkp", name):
            shutil.copyfile(chief / f"{name}.bkp", other / target)
    if lag == "cut":
        shutil.copyfile(chief / "latest.weights.h5", other / "latest.weights.h5")
    behind = _read_meta(other / "training_metadata.json")
    assert behind["step"] < _read_meta(chief / "training_metadata.json")["step"]

    procs = start_workers(cmd, [tmp_path / f"run2-worker{i}.log" for i in range(2)])
    wait_all(procs, 600)
    outs = [(tmp_path / f"run2-worker{i}.log").read_text() for i in range(2)]
    for (p, _), out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    resumes = [_resumes(out) for out in outs]
    assert [len(r) for r in resumes] == [1, 1], resumes
    # Both workers resume from the backup both have, the one the lagging worker has: the same epoch, batch
    # and step, whichever of its own pairs each read it from.
    chief_resume, other_resume = resumes[0][0], resumes[1][0]
    epoch, batch, step, _ = chief_resume
    assert other_resume[:3] == (epoch, batch, step) and step == behind["step"], resumes
    assert "another worker's newest backup is older than this worker's" in outs[0]
    if lag == "cut":
        assert "cannot read the backup" in outs[1] and other_resume[3], outs[1][-3000:]  # from the previous pair
    summaries = [json.loads(out.split("[kt-train] done ")[1].splitlines()[0]) for out in outs]
    for i, (out, summary) in enumerate(zip(outs, summaries)):
        assert f"MultiWorkerMirroredStrategy, worker {i + 1}/2" in out and summary["replicas"] == 2
    assert summaries[0]["final_loss"] == pytest.approx(summaries[1]["final_loss"], rel=1e-6)
    assert summaries[0]["epochs_run"] == summaries[1]["epochs_run"]
    # The interrupted epoch goes on after the backup's batch, continuing the optimizer's step count (as on one
    # process): the run makes the planned epochs' updates, no more.
    assert summaries[0]["epochs_run"] == list(range(epoch, epochs + 1))
    assert summaries[0]["optimizer_steps"] == summaries[1]["optimizer_steps"] == epochs * steps
    # Every planned epoch is in the history, none lost.
    assert sorted({int(row["epoch"]) for row in history_rows(model_dir)}) == list(range(epochs))
    assert (model_dir / "model.keras").exists()
