"""Distributed training: MirroredStrategy on 2 logical CPUs vs 1 replica,
resume after SIGKILL, and a 2-worker MultiWorkerMirroredStrategy run, killed and resumed.

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
import textwrap
import time

import pytest

from conftest import MULTI30K, REPO, distributed_env, history_rows, needs_multi30k, start_workers, wait_all


# ---------------------------------------------------------------------------
# 1. Two replicas == one replica with the same global batch.

EQUIVALENCE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from training.distribute import split_cpu
    split_cpu(2)  # before TensorFlow initializes its devices
    import numpy as np
    import tensorflow as tf
    import keras
    import keras_transformer as kt
    from training.config import DEFAULTS
    from training.fit import build_and_compile

    V, STEPS, GLOBAL_BATCH = 50, 6, 8
    cfg = dict(DEFAULTS, preset="tiny", model={"dropout": 0.0}, warmup_steps=10)
    rng = np.random.default_rng(0)
    # Padded batches where both halves of every global batch (one half per
    # replica) hold the same number of real target tokens: lengths repeat per half.
    lengths = np.tile(rng.integers(3, 12, size=(STEPS, GLOBAL_BATCH // 2)), (1, 2))
    L = 12
    src = np.zeros((STEPS * GLOBAL_BATCH, L), "int32")
    tin = np.zeros_like(src); tout = np.zeros_like(src)
    for i, n in enumerate(lengths.reshape(-1)):
        s = rng.integers(4, V, size=L)
        t = rng.integers(4, V, size=n)
        src[i, :L - 1] = s[:L - 1]; src[i, L - 1] = 3
        tin[i, 0] = 2; tin[i, 1:n + 1] = t[: min(n, L - 1)][: L - 1]
        tout[i, :n] = t; tout[i, n] = 3 if n < L else tout[i, n - 1]
    ds = tf.data.Dataset.from_tensor_slices(((src, tin), tout)).batch(GLOBAL_BATCH)

    def run(devices, init, optimizer):
        strategy = tf.distribute.MirroredStrategy(devices)
        with strategy.scope():
            keras.utils.set_random_seed(1)
            opt = keras.optimizers.SGD(0.5) if optimizer == "sgd" else None  # None: the paper's Adam
            model = build_and_compile(cfg, V, opt)
            if init is not None:
                model.set_weights(init)
        start = [w.copy() for w in model.get_weights()]
        hist = model.fit(ds, epochs=STEPS, steps_per_epoch=1, verbose=0)
        return model, start, hist.history["loss"], strategy.num_replicas_in_sync

    loss_fn = kt.MaskedSparseCategoricalCrossentropy(label_smoothing=0.1)
    probe = next(iter(ds))
    results = {}
    init = None
    for optimizer in ("adam", "sgd"):
        m1, start, loss1, r1 = run(["/cpu:0"], init, optimizer)
        init = init or start
        m2, _, loss2, r2 = run(["/cpu:0", "/cpu:1"], init, optimizer)
        final = [float(loss_fn(probe[1], m((probe[0][0], probe[0][1]), training=False))) for m in (m1, m2)]
        wdiff = max(float(np.max(np.abs(a - b))) for a, b in zip(m1.get_weights(), m2.get_weights()))
        moved = max(float(np.max(np.abs(a - b))) for a, b in zip(m1.get_weights(), init))
        flat = lambda m: np.concatenate([w.reshape(-1) for w in m.get_weights()])
        wmean = float(np.mean(np.abs(flat(m1) - flat(m2))))
        wfrac = float(np.mean(np.abs(flat(m1) - flat(m2)) > 1e-5))
        results[optimizer] = dict(replicas=[r1, r2], loss1=loss1, loss2=loss2, final=final,
                                  weight_diff=wdiff, weight_mean_diff=wmean, weight_frac_differ=wfrac, weight_moved=moved)
    print("RESULT " + json.dumps(results))
    """
)


def test_two_replicas_match_one_replica():
    proc = subprocess.run([sys.executable, "-c", EQUIVALENCE_SCRIPT], cwd=REPO, env=distributed_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    results = json.loads(line[len("RESULT "):])
    print(json.dumps(results, indent=1))
    # Adam (the paper's optimizer, as trained) and SGD: Adam is nearly invariant
    # to the gradient's scale, SGD is not, so SGD also checks the 1/replicas scaling.
    for name, r in results.items():
        assert r["replicas"] == [1, 2]
        # Training moved the weights and lowered the loss, so equality below is not vacuous.
        assert r["weight_moved"] > 1e-3, name
        assert r["loss1"][-1] < r["loss1"][0] - 0.05, (name, r["loss1"])
        # Tolerance: the two runs differ only by float32 summation order (two
        # per-replica means whose gradients are summed after scaling by 1/2, versus
        # one mean over the same tokens: equal real-token counts per replica make
        # the maths identical), ~1e-7 relative. Losses: 1e-5 relative.
        for a, b in zip(r["loss1"], r["loss2"]):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (name, r["loss1"], r["loss2"])
        assert abs(r["final"][0] - r["final"][1]) <= 1e-5 * max(1.0, abs(r["final"][0])), name
    # SGD: every weight agrees to 1e-5. Adam (epsilon 1e-9) turns float noise in
    # near-zero gradients into full-size, sign-like steps for a few weights, so for
    # Adam at most 1% of the weights may differ by more than 1e-5.
    assert results["sgd"]["weight_diff"] < 1e-5, results["sgd"]
    assert results["adam"]["weight_frac_differ"] < 0.01, results["adam"]


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
            "--vocab-size", "500", "--tokens-per-batch", "400", "--max-length", "40",
            "--no-validation", "--verbose", "2", *extra]


# ---------------------------------------------------------------------------
# 2. SIGKILL mid-epoch, restart, resume from the backup, finish the planned epochs.


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


@needs_multi30k
@pytest.mark.parametrize("max_updates", [None, 75])
def test_sigkill_mid_epoch_then_resume(tmp_path, max_updates):
    """Killed in epoch 2, the same command resumes from the backup and ends where an uninterrupted run
    ends: after the planned epochs, or at update 75 (in the middle of epoch 3) with --max-updates 75."""
    src, tgt = _small_corpus(tmp_path)
    model_dir = tmp_path / "run"
    epochs, steps = 3, 30
    limit = ["--max-updates", str(max_updates)] if max_updates else []
    cmd = _train_cmd(model_dir, src, tgt, "--epochs", str(epochs), "--steps-per-epoch", str(steps),
                     "--backup-every", "5", *limit)
    meta_path = model_dir / "backup" / "training_metadata.json"
    log1 = open(tmp_path / "run1.log", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=distributed_env(), stdout=log1, stderr=subprocess.STDOUT)
    try:
        _wait_for_mid_epoch_2(meta_path, [proc], 180, tmp_path / "run1.log")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
        log1.close()
    assert proc.returncode == -signal.SIGKILL
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
    # Keras restarts the interrupted epoch from its first batch, with the optimizer's step count of the backup.
    if max_updates:  # ... and stops at the same update as an uninterrupted run, in whichever epoch that falls
        last_epoch = killed_at["epoch"] + math.ceil((max_updates - killed_at["step"]) / steps)
        assert summary["optimizer_steps"] == max_updates and summary["stopped_by_max_updates"]
    else:  # ... and runs the planned epochs
        last_epoch = epochs
        assert summary["optimizer_steps"] == killed_at["step"] + (epochs - killed_at["epoch"]) * steps
        assert not summary["stopped_by_max_updates"]
    # Only the remaining epochs ran, starting with the interrupted one.
    assert summary["epochs_run"] == list(range(killed_at["epoch"] + 1, last_epoch + 1))
    # Every epoch is in the history (first run + resumed run), none lost.
    assert sorted(int(row["epoch"]) for row in history_rows(model_dir)) == list(range(last_epoch))
    assert (model_dir / "model.keras").exists()
    assert not (model_dir / "backup").exists()  # removed after a finished run
    assert sorted(p.name for p in (model_dir / "checkpoints").iterdir()) == [
        f"epoch-{e:03d}.weights.h5" for e in range(1, last_epoch + 1)]


# ---------------------------------------------------------------------------
# 3. MultiWorkerMirroredStrategy: two local worker processes.


@needs_multi30k
@pytest.mark.parametrize("lag", ["whole", "cut"])
def test_two_workers_killed_mid_epoch_resume_with_no_epoch_lost(tmp_path, lag):
    """MultiWorkerMirroredStrategy on 127.0.0.1: worker 2 is SIGKILLed mid-epoch (the chief, blocked in a
    collective, is stopped too, as a job scheduler would), then both start again with the same command.
    Worker 2 died one backup behind the chief, its newest pair whole or cut in two; both resume from the
    backup both have (not each its own, which deadlocked them), and every planned epoch is trained: two
    replicas, the same loss logged on both workers (it is averaged over them), model.keras written by the
    chief."""
    src, tgt = _small_corpus(tmp_path, n=300)
    model_dir = tmp_path / "mw"
    epochs, steps = 3, 20

    cmd = _train_cmd(model_dir, src, tgt, "--epochs", str(epochs), "--steps-per-epoch", str(steps),
                     "--backup-every", "5")

    def start(run):
        return start_workers(cmd, [tmp_path / f"run{run}-worker{i}.log" for i in range(2)])

    procs = start(1)
    try:
        _wait_for_mid_epoch_2(model_dir / "backup" / "training_metadata.json", [p for p, _ in procs], 300,
                              tmp_path / "run1-worker0.log")
        os.kill(procs[1][0].pid, signal.SIGKILL)
        time.sleep(2)
        os.kill(procs[0][0].pid, signal.SIGKILL)
    finally:
        wait_all(procs, 30)

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

    procs = start(2)
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
    # The interrupted epoch runs again from its start, continuing the optimizer's step count (as on one process).
    assert summaries[0]["epochs_run"] == list(range(epoch, epochs + 1))
    assert summaries[0]["optimizer_steps"] == summaries[1]["optimizer_steps"] == step + (epochs - epoch + 1) * steps
    # Every planned epoch is in the history, none lost (the interrupted one appears twice: it ran again).
    assert sorted({int(row["epoch"]) for row in history_rows(model_dir)}) == list(range(epochs))
    assert (model_dir / "model.keras").exists()
