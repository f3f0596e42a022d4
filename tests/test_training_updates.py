"""N replicas train the model that one replica trains: kt-train's update (`keras_transformer.distributed.UpdateStep`) sums the
gradient over replicas and accumulated batches before it checks for overflow, clips and applies it.

tests/replica_updates.py trains the same 3 updates with 1 replica, 2 logical CPU replicas (MirroredStrategy) and
2 workers (MultiWorkerMirroredStrategy on 127.0.0.1); these tests compare what each wrote. Its linear cases train a
model of one `Dense` layer, whose update these tests compute by hand (`hand_update`).
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, distributed_env, start_workers, two_batch_epochs_args, wait_all

PROGRAM = str(REPO / "tests" / "replica_updates.py")
CASES = ["clip", "accumulate", "clip+accumulate", "r-drop"]  # the own-script cases are apart
CLIP, LEARNING_RATE = 0.05, 0.5  # as in replica_updates.py
# replica_updates.py's linear cases (its LINEAR_CASES), and their loss's label smoothing (the library loss's default)
LINEAR_CASES = ["scaled-overflow", "scaled-clip", "scaled-own-clip", "unequal-tokens", "unequal-tokens+accumulate"]
LABEL_SMOOTHING = 0.1


def run_program(out):
    """Runs every case of tests/replica_updates.py on 1 replica, 2 replicas and 2 workers at
    once, writing into the folder `out`: {"1": one replica, "2": two replicas, "workers": two workers}, each
    program's results."""
    procs = {mode: subprocess.Popen([sys.executable, PROGRAM, str(out / f"{mode}.json"), mode], cwd=REPO,
                                    env=distributed_env(), stdout=subprocess.DEVNULL,
                                    stderr=open(out / f"{mode}.log", "w"))
             for mode in ("1", "2")}
    workers = start_workers([sys.executable, PROGRAM, str(out / "workers.json"), "workers"],
                            [out / f"worker-{i}.log" for i in range(2)])
    for mode, proc in procs.items():
        proc.wait(timeout=1200)
        assert proc.returncode == 0, (out / f"{mode}.log").read_text()[-3000:]
    wait_all(workers, timeout=1200)
    for i, (proc, _) in enumerate(workers):
        assert proc.returncode == 0, (out / f"worker-{i}.log").read_text()[-3000:]
    return {mode: json.loads((out / f"{mode}.json").read_text()) for mode in ("1", "2", "workers")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case's results on each replica count (`run_program`): one set of processes for them all."""
    return run_program(tmp_path_factory.mktemp("replica-updates"))


def assert_same_weights(expected, actual, what, rtol=1e-5):
    """Every tracked weight within `rtol` of the largest in its variable (float32: the summation order differs)."""
    for path, value in expected.items():
        value, other = np.asarray(value), np.asarray(actual[path])
        scale = np.max(np.abs(value))
        assert np.max(np.abs(value - other)) <= rtol * scale, (what, path, float(np.max(np.abs(value - other))))


@pytest.mark.parametrize("replicas", ["2", "workers"])
@pytest.mark.parametrize("case", CASES)
def test_n_replicas_make_the_updates_of_one(runs, case, replicas):
    one, many = runs["1"][case], runs[replicas][case]
    assert (one["replicas"], many["replicas"]) == (1, 2)
    assert [u["step"] for u in one["updates"]] == [u["step"] for u in many["updates"]] == [1, 2, 3]
    for i, (a, b) in enumerate(zip(one["updates"], many["updates"])):
        # Not vacuous: each update moved the weights by far more than the tolerance.
        moved = max(np.max(np.abs(np.asarray(a["weights"][p]) - np.asarray(one["start"][p]))) for p in a["weights"])
        assert moved > 1e-3
        assert_same_weights(a["weights"], b["weights"], f"{case}, update {i + 1}")
        assert b["norm"] == pytest.approx(a["norm"], rel=1e-4)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)


@pytest.mark.parametrize("replicas", ["1", "2", "workers"])
@pytest.mark.parametrize("case", ["clip", "clip+accumulate"])
def test_the_clip_applies_to_the_summed_gradient(runs, case, replicas):
    """With SGD the update is the learning rate times the clipped gradient: its norm is exactly lr * clip on
    every replica count, and without the clip it would have been larger."""
    norms = [u["norm"] for u in runs[replicas][case]["updates"]]
    assert norms == pytest.approx([LEARNING_RATE * CLIP] * 3, rel=1e-4)
    unclipped = "accumulate" if case == "clip+accumulate" else None
    if unclipped:
        assert min(u["norm"] for u in runs[replicas][unclipped]["updates"]) > 10 * LEARNING_RATE * CLIP


@pytest.mark.parametrize("case", CASES)
def test_the_validation_loss_is_the_mean_over_every_real_target_token_on_any_replica_count(runs, case):
    """evaluate() counts the loss as an update does: over every real target token of the batches (of unequal
    token counts), whatever the replicas, not as a mean of per-replica or per-batch means. (Its "loss" is
    Keras' loss tracker's result, which `keras_transformer.keras_internals.loss_tracker` hands the step.)"""
    definition = runs["1"][case]["definition"]["loss"]
    for replicas in ("1", "2", "workers"):
        assert runs[replicas][case]["evaluated"] == pytest.approx(definition, rel=1e-5), replicas


def test_the_update_is_the_mean_over_its_real_target_tokens(runs):
    """fairseq's normalisation: the update's loss is the sum over all its tokens divided by their count, not a
    mean of the accumulated batches' means (which weighs a short batch's tokens more). The batches' token
    counts differ, so the two differ, and the update matches the first."""
    case = runs["1"]["accumulate"]
    definition = case["definition"]
    assert len(set(definition["token_counts"])) == len(definition["token_counts"])  # unequal batches
    first = case["updates"][0]["weights"]
    assert_same_weights(definition["by_tokens"], first, "by tokens")
    gap = max(np.max(np.abs(np.asarray(definition["by_batches"][p]) - np.asarray(first[p]))) for p in first)
    assert gap > 1e-4  # the mean of means is another update


@pytest.mark.parametrize("replicas", ["1", "2", "workers"])
def test_an_overflow_on_one_replica_skips_the_update_on_every_replica(runs, replicas):
    """mixed_float16: the first batch overflows on the second replica's share only. The update is skipped on
    every replica (the weights stay as they were, finite and the same on each), the loss scale halves; the
    next, finite batch is applied."""
    run = runs[replicas]["overflow"]
    skipped, applied = run["steps"]
    assert skipped["step"] == 0 and skipped["loss_scale"] == run["initial_scale"] / 2
    assert applied["step"] == 1 and applied["loss_scale"] == run["initial_scale"] / 2
    for copies, start in zip(skipped["replica_weights"], run["start"]):
        assert len(copies) == (2 if replicas == "2" else 1)
        for copy in copies:
            np.testing.assert_array_equal(copy, start)
    moved = 0.0
    for copies, start in zip(applied["replica_weights"], run["start"]):
        for copy in copies:
            assert np.isfinite(copy).all()
            np.testing.assert_array_equal(copy, copies[0])
        moved = max(moved, float(np.max(np.abs(np.asarray(copies[0]) - np.asarray(start)))))
    assert moved > 1e-3
    # float16 products, each replica's share summed apart: the update agrees with one replica's to float16's
    # precision (2^-11 relative), not float32's.
    assert_same_weights({"w": runs["1"]["overflow"]["steps"][1]["replica_weights"][0][0]},
                        {"w": applied["replica_weights"][0][0]}, "after the applied step", rtol=1e-3)


# ---------------------------------------------------------------------------
# A user's own script: kt.Transformer, compile in the scope with Keras' optimizer clipping and accumulating, fit.

OWN_CLIP = 0.05  # as replica_updates.OWN_SCRIPT's


@pytest.mark.parametrize("replicas", ["2", "workers"])
def test_own_script_fit_on_n_replicas_makes_the_updates_of_one(runs, replicas):
    """`kt.Transformer` compiled with `SGD(global_clipnorm=..., gradient_accumulation_steps=3)` and the library's
    loss, then `model.fit`, as a user writes it: 2 replicas (and 2 workers) make the updates of 1, clipped on
    the summed gradient (norm lr * clip on every replica count; Keras' own step clipped each replica's share,
    1.94x on 2 replicas), the logged and evaluated loss the mean over every real target token."""
    one, many = runs["1"]["own-script"], runs[replicas]["own-script"]
    assert (one["replicas"], many["replicas"], one["accumulate"]) == (1, 2, 3)
    assert [u["step"] for u in one["updates"]] == [u["step"] for u in many["updates"]] == [1, 2, 3]
    for i, (a, b) in enumerate(zip(one["updates"], many["updates"])):
        assert_same_weights(a["weights"], b["weights"], f"own script, update {i + 1}")
        assert a["norm"] == pytest.approx(LEARNING_RATE * OWN_CLIP, rel=1e-4)
        assert b["norm"] == pytest.approx(LEARNING_RATE * OWN_CLIP, rel=1e-4)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    for run in (one, many):
        assert run["evaluated"] == pytest.approx(one["definition"]["loss"], rel=1e-5)


@pytest.mark.parametrize("replicas", ["1", "2", "workers"])
def test_own_script_mixed_float16_skips_an_overflow_on_any_replica_everywhere(runs, replicas):
    """mixed_float16 in a user's script: the first batch overflows on the second replica's share only. The update
    is skipped on every replica (no update counted, the loss scale halved, the weights finite), and the next
    batches make the updates one replica makes. The run has `keras.callbacks.TerminateOnNaN`: the skipped batch's
    loss stays out of the logged mean, or the callback would have stopped it after the first batch."""
    run = runs[replicas]["own-script-overflow"]
    assert run["loss_scale"] == run["initial_scale"] / 2
    assert [u["step"] for u in run["updates"]] == [1, 2, 3]
    for update in run["updates"]:
        assert np.isfinite(update["loss"])  # the skipped batch's loss is not in the logged mean
        for value in update["weights"].values():
            assert np.isfinite(value).all()
    # float16 products, each replica's share summed apart: the first update agrees with one replica's to a few of
    # float16's ulps (2^-11 relative); SGD at 0.5 spreads the gap in later updates.
    one = runs["1"]["own-script-overflow"]["updates"][0]["weights"]
    assert_same_weights(one, run["updates"][0]["weights"], "own script, mixed_float16", rtol=5e-3)


# ---------------------------------------------------------------------------
# The update by hand: replica_updates.py's linear cases train one `Dense` layer (logits = features @ kernel + bias),
# float32, whose update is computed here from its definition; loss scaling is a `LossScaleOptimizer` around SGD.


def token_gradient(kernel, bias, batches):
    """The gradient (d kernel, d bias) of the mean over every real target token of `batches` ([(features [rows,
    length, F], labels [rows, length], 0 for padding)]) of the label-smoothed cross-entropy of the logits
    features @ kernel + bias, in float64. At a real token, d loss / d logits = softmax(logits) - the smoothed
    target distribution; padding adds nothing."""
    d_kernel, d_bias, tokens = np.zeros_like(kernel), np.zeros_like(bias), 0
    for features, labels in batches:
        logits = features @ kernel + bias
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        classes = kernel.shape[1]
        target = (1 - LABEL_SMOOTHING) * np.eye(classes)[labels] + LABEL_SMOOTHING / classes
        d_logits = (probs - target) * (labels != 0)[..., None]
        d_kernel += np.einsum("rlf,rlc->fc", features, d_logits)
        d_bias += d_logits.sum((0, 1))
        tokens += np.count_nonzero(labels)
    return d_kernel / tokens, d_bias / tokens


def hand_update(weights, batches, clip=None):
    """(kernel, bias) after one SGD step on `token_gradient`, clipped to the global L2 norm `clip` first."""
    kernel, bias = weights
    grads = token_gradient(kernel, bias, batches)
    if clip is not None:
        grads = [g * min(1.0, clip / global_norm(grads)) for g in grads]
    return kernel - LEARNING_RATE * grads[0], bias - LEARNING_RATE * grads[1]


def global_norm(arrays):
    return float(np.sqrt(sum(np.sum(np.square(a)) for a in arrays)))


def linear_batches(run):
    """A linear case's batches, as it trained on them: [(features, labels)] in float64."""
    return list(zip(np.asarray(run["features"], "float64"), np.asarray(run["labels"])))


def replica_copies(step):
    """Every replica's (kernel, bias) after a batch (`EachBatch`'s record)."""
    kernels, biases = step["replica_weights"]
    return [(np.asarray(k), np.asarray(b)) for k, b in zip(kernels, biases)]


def assert_update(expected, step, what, replicas):
    """Each replica's copy of the weights after `step` is `expected`, within 1e-5 of each variable's largest."""
    copies = replica_copies(step)
    assert len(copies) == (2 if replicas == "2" else 1)
    for copy in copies:
        assert_same_weights(dict(zip(("kernel", "bias"), expected)), dict(zip(("kernel", "bias"), copy)), what)


@pytest.mark.parametrize("replicas", ["1", "2", "workers"])
def test_an_overflow_in_the_second_batch_of_an_update_skips_the_whole_update(runs, replicas):
    """2 batches per update, loss scaling (`dynamic_growth_steps=2`): batch 4, the second of update 2, holds an
    infinite feature in replica 2's share. Update 2 is skipped on every replica, its finite first batch with it:
    the weights stay as update 1 left them, no update is counted, the scale halves and `LossScaleOptimizer`'s
    count of finite updates starts again, as Keras' own skip does (`_stateful_handle_non_finite_grads`); no batch
    is left pending. Two finite updates later the scale doubles again."""
    run = runs[replicas]["scaled-overflow"]
    steps, scale = run["steps"], run["scale"]
    # (optimizer step, batches pending, loss scale, finite updates counted) after each batch
    assert [(s["step"], s["pending"], s["loss_scale"], s["step_counter"]) for s in steps] == [
        (0, 1, scale, 0), (1, 0, scale, 1),
        (1, 1, scale, 1), (1, 0, scale / 2, 0),  # update 2: skipped
        (1, 1, scale / 2, 0), (2, 0, scale / 2, 1),
        (2, 1, scale / 2, 1), (3, 0, scale, 0)]
    start = [np.asarray(w) for w in run["start"]]
    for copy in replica_copies(steps[0]):  # a batch pending: nothing applied
        for value, before in zip(copy, start):
            np.testing.assert_array_equal(value, before)
    after_update_1 = replica_copies(steps[1])[0]
    assert_update(hand_update(start, linear_batches(run)[:2]), steps[1], "update 1", replicas)
    for step in steps[2:4]:  # the skipped update's batches leave every replica's weights as they were
        for copy in replica_copies(step):
            for value, before in zip(copy, after_update_1):
                np.testing.assert_array_equal(value, before)


@pytest.mark.parametrize("replicas", ["1", "2", "workers"])
def test_the_update_after_a_skipped_one_starts_afresh(runs, replicas):
    """After the skipped update 2 (its second batch overflowed), update 3 is the one a fresh run makes from the
    same weights on batches 5 and 6: the accumulated gradients, tokens and overflow count were reset, so nothing
    of batches 3 and 4 is left in it (batch 3's finite gradient would move it: checked apart). Update 4 too."""
    run = runs[replicas]["scaled-overflow"]
    steps, batches = run["steps"], linear_batches(run)
    weights = replica_copies(steps[3])[0]  # as update 1 left them
    expected = hand_update(weights, batches[4:6])
    assert_update(expected, steps[5], "update 3", replicas)
    with_leftover = hand_update(weights, [batches[2], *batches[4:6]])
    assert np.max(np.abs(with_leftover[0] - expected[0])) > 100 * 1e-5 * np.max(np.abs(expected[0]))
    assert_update(hand_update(replica_copies(steps[5])[0], batches[6:8]), steps[7], "update 4", replicas)


@pytest.mark.parametrize("replicas", ["1", "2", "workers"])
@pytest.mark.parametrize("case", ["scaled-clip", "scaled-own-clip"])
def test_the_clip_sees_the_unscaled_summed_gradient(runs, case, replicas):
    """A loss scale of 2^20 and a clip to global norm 0.05, on the update step (kt-train's --global-clipnorm; 2
    batches per update) or on the optimizer (`SGD(global_clipnorm=...)`, a user's own script): each update is SGD's
    step on the mean gradient over the update's real target tokens, clipped to 0.05. The clip bites (the gradient's
    norm is well above it); clipping the scaled gradient would have made the update 2^20 times too small."""
    run = runs[replicas][case]
    clip, accumulate, batches = run["step_clip"] or run["own_clip"], run["accumulate"], linear_batches(run)
    assert run["scale"] == 2.0 ** 20 and clip == CLIP
    weights = [np.asarray(w, "float64") for w in run["start"]]
    for update in range(run["updates"]):
        own = batches[update * accumulate:(update + 1) * accumulate]
        assert global_norm(token_gradient(*weights, own)) > 4 * clip
        step = run["steps"][(update + 1) * accumulate - 1]
        assert step["step"] == update + 1
        assert_update(hand_update(weights, own, clip), step, f"{case}, update {update + 1}", replicas)
        weights = replica_copies(step)[0]


@pytest.mark.parametrize("replicas", ["1", "2", "workers"])
@pytest.mark.parametrize("case", ["unequal-tokens", "unequal-tokens+accumulate"])
def test_replicas_of_unequal_token_counts_make_the_update_of_their_concatenated_batches(runs, case, replicas):
    """Each global batch's first half (replica 1's share on two replicas) holds 7 to 10 real target tokens a row,
    its second half 1 to 3. On any replica count, and with 2 batches per update, each update is SGD's step on the
    mean over every real target token of the update's batches, as one replica computes it on their rows
    concatenated; a mean of the halves' (replicas') means, which weighs a short half's tokens more, is far from
    it."""
    run = runs[replicas][case]
    accumulate, batches = run["accumulate"], linear_batches(run)
    assert accumulate == (2 if case.endswith("+accumulate") else 1)
    half = len(batches[0][1]) // 2
    for _, labels in batches:
        assert np.count_nonzero(labels[:half]) > 3 * np.count_nonzero(labels[half:])
    weights = [np.asarray(w, "float64") for w in run["start"]]
    for update in range(run["updates"]):
        own = batches[update * accumulate:(update + 1) * accumulate]
        expected = hand_update(weights, own)
        step = run["steps"][(update + 1) * accumulate - 1]
        assert step["step"] == update + 1
        assert_update(expected, step, f"{case}, update {update + 1}", replicas)
        # Not vacuous: the mean of the halves' means is another update.
        shares = [token_gradient(*weights, [(x[part], y[part])]) for x, y in own
                  for part in (slice(None, half), slice(half, None))]
        by_shares = weights[0] - LEARNING_RATE * np.mean([g[0] for g in shares], axis=0)
        assert np.max(np.abs(by_shares - expected[0])) > 100 * 1e-5 * np.max(np.abs(expected[0]))
        weights = replica_copies(step)[0]


# ---------------------------------------------------------------------------
# Updates, not batches: the step, the schedule, backups and --max-updates count updates.


@pytest.mark.filterwarnings("ignore:Your input ran out of data")
def test_backups_and_the_update_budget_count_updates_at_an_updates_boundary(tmp_path):
    """3 batches per update: a backup every 2 updates is taken after batches 6 and 12 (never with batches
    accumulated towards the next update, which it would not hold); --max-updates 3 stops after batch 9."""
    import keras
    import tensorflow as tf

    from training.callbacks import ResumableBackup, UpdateBudget, accumulated_batches
    from training.config import TrainSettings
    from training.fit import build_and_compile

    rng = np.random.default_rng(0)
    rows = rng.integers(4, 40, size=(14 * 4, 6)).astype("int32")
    data = tf.data.Dataset.from_tensor_slices(((rows, rows), rows)).batch(4)  # 14 batches

    class Recorded(ResumableBackup):
        saves = []

        def save_backup(self):
            self.saves.append((int(self.model.optimizer.iterations.numpy()), accumulated_batches(self.model),
                               self.last_batch_seen))
            super().save_backup()

    def model():
        keras.utils.set_random_seed(0)
        return build_and_compile(TrainSettings(preset="tiny", warmup_steps=10, grad_accum=3), 40)

    trained = model()
    trained.fit(data, epochs=1, verbose=0, shuffle=False, callbacks=[Recorded(tmp_path / "backup", save_freq=2)])
    assert Recorded.saves == [(2, 0, 5), (4, 0, 11)]  # after the 6th and 12th batches (0-based 5 and 11)
    assert int(trained.optimizer.iterations.numpy()) == 4 and accumulated_batches(trained) == 2

    stopped = model()
    seen = []
    stopped.fit(data, epochs=1, verbose=0, shuffle=False, callbacks=[
        UpdateBudget(3), keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(batch))])
    assert int(stopped.optimizer.iterations.numpy()) == 3 and seen == list(range(9))


def test_the_learning_rate_follows_the_updates():
    """The paper's schedule reads the optimizer's step, which an accumulated update moves once."""
    import keras
    import tensorflow as tf

    from training.config import TrainSettings
    from training.fit import build_and_compile

    rows = np.random.default_rng(1).integers(4, 40, size=(12, 6)).astype("int32")
    keras.utils.set_random_seed(0)
    model = build_and_compile(TrainSettings(preset="tiny", warmup_steps=10, grad_accum=4), 40)
    model.fit(tf.data.Dataset.from_tensor_slices(((rows, rows), rows)).batch(2), epochs=1, verbose=0, shuffle=False)
    assert int(model.optimizer.iterations.numpy()) == 1  # 6 batches: one update of 4, 2 batches pending
    schedule = model.optimizer.learning_rate  # evaluated at the optimizer's step
    assert float(schedule) == pytest.approx(32 ** -0.5 * 1 * 10 ** -1.5)


# ---------------------------------------------------------------------------
# The batch a user asked for.


@pytest.mark.parametrize("settings, replicas, plan", [
    # A global budget is split between the replicas: the update keeps its size on any number of them.
    ({"tokens_per_batch": 8000}, 2, (4000, 2, 1, 8000)),
    ({"tokens_per_batch": 8000, "grad_accum": 3}, 4, (2000, 4, 3, 24000)),
    # A per-replica budget wins: the batch on N replicas is N times it.
    ({"tokens_per_batch": 8000, "tokens_per_replica": 3000, "grad_accum": 2}, 2, (3000, 2, 2, 12000)),
])
def test_the_batch_plan(settings, replicas, plan):
    from training.config import TrainSettings, batch_plan

    got = batch_plan(TrainSettings(**settings), replicas)
    assert (got["tokens_per_replica"], got["replicas"], got["grad_accum"], got["tokens_per_update"]) == plan


def test_a_run_resumed_on_other_devices_keeps_its_tokens_per_update_or_says_how():
    from training.config import TrainSettings, batch_plan
    from training.errors import ConfigError

    cfg = TrainSettings(tokens_per_replica=3000, grad_accum=2)
    on_four = batch_plan(cfg, 4)
    assert on_four["tokens_per_update"] == 24000
    assert batch_plan(cfg, 8, on_four)["grad_accum"] == 1  # 8 x 1 x 3000
    assert batch_plan(cfg, 2, on_four)["grad_accum"] == 4  # 2 x 4 x 3000
    assert batch_plan(cfg, 1, on_four)["grad_accum"] == 8
    with pytest.raises(ConfigError, match=r"4 replica\(s\) x 2 batch\(es\) per update x 3,000 tokens = 24,000 "
                                          r"tokens per update; on 3 replicas.*--tokens-per-replica T --grad-accum N"):
        batch_plan(cfg, 3, on_four)
    # A global budget keeps the update's size by itself: the accumulation stays.
    glob = TrainSettings(tokens_per_batch=24000, grad_accum=2)
    assert batch_plan(glob, 2, batch_plan(glob, 4)) == batch_plan(glob, 2)


@pytest.mark.filterwarnings("ignore:Your input ran out of data")
def test_kt_train_accumulates_on_two_replicas_and_keeps_its_batch_plan_on_one(tmp_path):
    """kt-train --cpu-replicas 2 --grad-accum 2 (refused before, as Keras cannot accumulate under
    tf.distribute): it trains to --max-updates, counting updates, and prints and records its batch plan; continued
    on one replica, it accumulates twice as many batches to keep its tokens per update."""
    model_dir = tmp_path / "run"
    args = two_batch_epochs_args(tmp_path, model_dir)
    args[args.index("--steps-per-epoch") + 1] = "4"
    args += ["--cpu-replicas", "2", "--grad-accum", "2", "--tokens-per-replica", "200", "--max-updates", "3",
             "--epochs", "5"]
    done = subprocess.run([sys.executable, "-m", "training.train", *args], cwd=REPO, env=distributed_env(),
                          capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert ("batch plan: 2 replica(s) x 200 tokens per replica x 2 batch(es) per update = 800 tokens per "
            "update") in out
    summary = json.loads(out.split("[kt-train] done ")[1].splitlines()[0])
    assert summary["optimizer_steps"] == 3 and summary["stopped_by_max_updates"] and summary["replicas"] == 2
    assert summary["epochs_run"] == [1, 2]  # 4 batches (2 updates) an epoch: update 3 is in epoch 2
    recorded = json.loads((model_dir / "config.json").read_text())["batch_plan"]
    assert recorded == {"tokens_per_replica": 200, "replicas": 2, "grad_accum": 2, "tokens_per_update": 800}

    # Continued on one replica (a larger --max-updates): 4 batches per update keep its 800 tokens per update.
    args[args.index("--cpu-replicas") + 1], args[args.index("--max-updates") + 1] = "1", "4"
    done = subprocess.run([sys.executable, "-m", "training.train", *args], cwd=REPO, env=distributed_env(),
                          capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "resumed on 1 replica(s): 4 batches per update (not 2) keep the run's 800 tokens per update" in out
    assert json.loads(out.split("[kt-train] done ")[1].splitlines()[0])["optimizer_steps"] == 4
    recorded = json.loads((model_dir / "config.json").read_text())["batch_plan"]
    assert recorded == {"tokens_per_replica": 200, "replicas": 1, "grad_accum": 4, "tokens_per_update": 800}


# ---------------------------------------------------------------------------
# --jit-compile on more than one replica: refused before the run starts (Keras compiles the whole distributed step
# with XLA; on CPUs TensorFlow cannot, and on GPUs its XLA all-reduce is untested here).


@pytest.mark.parametrize("kind, replicas, refused", [
    ("CPU", 1, None), ("GPU", 1, None),
    ("CPU", 2, r"--jit-compile on 2 replicas on CPUs: TensorFlow cannot compile .* with XLA on CPUs .* Drop "
               r"--jit-compile, or train on one replica"),
    ("GPU", 2, r"--jit-compile on 2 GPU replicas: .*XLA's GPU all-reduce, a path no test of kt-train runs .* Drop "
               r"--jit-compile .*, or train on one GPU"),
    ("GPU", 8, r"--jit-compile on 8 GPU replicas"),
])
def test_jit_compile_is_refused_on_more_than_one_replica(kind, replicas, refused):
    from training.config import check_jit_compile
    from training.errors import ConfigError

    if refused is None:
        check_jit_compile(kind, replicas)
    else:
        with pytest.raises(ConfigError, match=refused):
            check_jit_compile(kind, replicas)


def test_kt_train_refuses_jit_compile_on_two_cpu_replicas_before_it_starts(tmp_path):
    """kt-train --cpu-replicas 2 --jit-compile stops with the refusal before it writes anything (it failed at the
    first update, in XLA: "Trying to access resource ... located in device CPU:1 from device CPU:0")."""
    model_dir = tmp_path / "run"
    args = two_batch_epochs_args(tmp_path, model_dir) + ["--cpu-replicas", "2", "--jit-compile", "--max-updates", "1"]
    done = subprocess.run([sys.executable, "-m", "training.train", *args], cwd=REPO, env=distributed_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, (done.stdout + done.stderr)[-3000:]
    assert "kt-train: error: --jit-compile on 2 replicas on CPUs" in done.stderr
    assert not model_dir.exists()


# ---------------------------------------------------------------------------
# What UpdateStep takes from Keras 3.15 (keras_transformer/keras_internals.py): should one of these fail after a Keras
# upgrade, the behaviour it names changed, and the adapter with it. (How Keras' apply all-reduces, which
# `apply_summed_gradients` turns off: tests/test_keras_internals.py.)


def test_the_update_step_refuses_fewer_than_one_batch_per_update():
    """accumulate=0 is refused, as it was before the step took the optimizer's own accumulation over (it would
    otherwise read as 1)."""
    import keras

    import keras_transformer as kt
    from keras_transformer.distributed import UpdateStep

    model = keras.Sequential([keras.Input((3, 4)), keras.layers.Dense(5)])
    model.compile(keras.optimizers.SGD(0.1), loss=kt.MaskedSparseCategoricalCrossentropy())
    for accumulate in (0, -2):
        with pytest.raises(ValueError, match=f"accumulate must be 1 or more, got {accumulate}"):
            UpdateStep(model, accumulate=accumulate)


@pytest.mark.filterwarnings("ignore:Your input ran out of data")
def test_the_loss_scale_grows_and_the_weights_move_as_with_keras_own_step():
    """mixed_float16 on one device, no overflow: `UpdateStep` updates `LossScaleOptimizer`'s scale as Keras' own
    step does (doubled after `dynamic_growth_steps` finite updates) and makes the same updates."""
    import keras
    import tensorflow as tf

    import keras_transformer as kt
    from keras_transformer.distributed import UpdateStep

    rng = np.random.default_rng(4)
    features = rng.normal(size=(5, 4, 6, 8)).astype("float32")
    labels = rng.integers(1, 20, size=(5, 4, 6)).astype("int32")
    data = tf.data.Dataset.from_tensor_slices((features, labels))
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        results = []
        for ours in (False, True):
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((6, 8)), keras.layers.Dense(20)])
            model.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), dynamic_growth_steps=2),
                          loss=kt.MaskedSparseCategoricalCrossentropy())
            if ours:
                UpdateStep.install(model)
            model.fit(data, verbose=0, shuffle=False)
            results.append((float(model.optimizer.dynamic_scale.numpy()), int(model.optimizer.iterations.numpy()),
                            model.get_weights()))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    (keras_scale, keras_steps, keras_weights), (scale, steps, weights) = results
    assert (scale, steps) == (keras_scale, keras_steps) == (2.0 ** 15 * 4, 5)
    for a, b in zip(weights, keras_weights):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)  # float16 products, another summation order
