"""kt-train's training step: one update from the gradient summed over every replica and every accumulated batch.

fairseq's order, on any number of devices and workers: each replica adds up its batches' gradients, the sum
is all-reduced once per update, then checked for overflow (loss scaling), divided by the update's real target
tokens, clipped to `global_clipnorm`, and applied. N replicas therefore compute the update that one replica
computes on the same batches (training/README.md, "Across devices").

Why not Keras' own (3.15) under tf.distribute: it clips each replica's gradient before the all-reduce (so the
clip norm depends on the replica count), `LossScaleOptimizer` takes "finite" from replica 0 before the
all-reduce (an overflow on another replica is applied, and the weights turn to NaN), and its gradient
accumulation puts the optimizer's merge_call inside a replica-context `ops.cond`, which tf.distribute refuses.

The loss of an update is the mean over its real target tokens: each batch's per-token losses are summed on
each replica, and the gradient of that sum, summed over the replicas and batches of the update, is divided by
their total real target tokens (sample weights, if any, weigh each token). A mean of per-batch (or
per-replica) means would weigh a short batch's tokens more.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_transformer.keras_internals import (apply_summed_gradients, loss_tracker, no_step_without_data,
                                              rank1_step_logs)

SUM = tf.distribute.ReduceOp.SUM


class UpdateStep:
    """`model.train_step` for kt-train: gradients summed over replicas and `accumulate` batches, then one update.

    Create it under the strategy's scope, after `model.compile` (and the optimizer's build), and install it
    with `install(model, ...)`. The model's compiled loss must have `token_sum_and_count` (the library's
    masked losses do). Under `mixed_float16` (Keras wraps the optimizer in a `LossScaleOptimizer`), an update
    with a non-finite gradient on any replica or in any of its batches is skipped on every replica and halves
    the loss scale; `dynamic_growth_steps` finite updates in a row double it, as Keras' own does.

    `optimizer.iterations` counts updates (an accumulated update counts once; a skipped one not at all), so
    the learning-rate schedule, `--max-updates` and backups count updates too. Batches accumulated towards an
    update that has not been applied yet are not in a backup: `pending()` says how many there are.

    Args:
        model: a compiled Keras model.
        accumulate: batches per update (fairseq's `--update-freq`), on every replica.
        global_clipnorm: clip the update's gradient (the mean over its tokens) to this global L2 norm; None:
            no clipping.
    """

    def __init__(self, model, *, accumulate: int = 1, global_clipnorm: float | None = None):
        if int(accumulate) < 1:
            raise ValueError(f"accumulate must be 1 or more, got {accumulate!r}")
        loss = getattr(model, "loss", None)
        if not hasattr(loss, "token_sum_and_count"):
            raise ValueError(f"UpdateStep needs a loss with token_sum_and_count (the library's masked losses); "
                             f"the model's is {loss!r}")
        self.model, self.loss = model, loss
        self.accumulate, self.global_clipnorm = int(accumulate), global_clipnorm
        optimizer = model.optimizer
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        self.loss_scaler = optimizer if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else None
        self.optimizer = optimizer.inner_optimizer if self.loss_scaler is not None else optimizer
        if self.optimizer.gradient_accumulation_steps:
            raise ValueError(f"the optimizer accumulates gradients itself (gradient_accumulation_steps="
                             f"{self.optimizer.gradient_accumulation_steps}); give UpdateStep accumulate= instead")
        apply_summed_gradients(self.optimizer)
        self.variables = list(model.trainable_variables)
        self.state = None
        if self.accumulate > 1 or self.loss_scaler is not None:
            # Per replica (ON_READ: each replica adds to its own copy): the gradients summed so far, and the
            # update's batches, real target tokens and non-finite batches (the last two all-reduced, the same
            # on every replica).
            def local(value, name):
                return tf.Variable(value, trainable=False, name=name,
                                   synchronization=tf.VariableSynchronization.ON_READ,
                                   aggregation=tf.VariableAggregation.SUM)

            self.state = {
                "gradients": [local(tf.zeros(v.shape, "float32"), f"accumulated_{i}")
                              for i, v in enumerate(self.variables)] if self.accumulate > 1 else [],
                "batches": local(0, "accumulated_batches"),
                "tokens": local(0.0, "accumulated_tokens"),
                "nonfinite": local(0.0, "nonfinite_batches"),
            }

    @classmethod
    def install(cls, model, **kwargs) -> "UpdateStep":
        """Makes `model.fit` train with an `UpdateStep(model, **kwargs)` (and `evaluate` count its loss as the
        step does, `evaluate_step`), and work under the current strategy
        as kt-train's fit does (`keras_transformer.keras_internals`: `rank1_step_logs` under
        MultiWorkerMirroredStrategy, `no_step_without_data`); returns the step."""
        step = cls(model, **kwargs)
        model.train_step = step
        model.test_step = step.evaluate_step
        if isinstance(tf.distribute.get_strategy(), tf.distribute.MultiWorkerMirroredStrategy):
            rank1_step_logs(model)
        no_step_without_data(model)  # else each epoch's end counts an update that no batch made
        return step

    def pending(self) -> int:
        """Batches accumulated towards the next update (0 at an update's boundary)."""
        if self.state is None:
            return 0
        batches = self.state["batches"]
        return int(getattr(batches, "values", (batches,))[0].numpy())  # the first replica's copy

    # -- one batch, in each replica's context ---------------------------------------------------------------

    def __call__(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = self.model(x, training=True)
            loss_sum, tokens = self.loss.token_sum_and_count(y, y_pred, sample_weight)
            mean = tf.math.divide_no_nan(loss_sum, tokens)
            if self.loss_scaler is not None:
                mean = mean * tf.cast(self.loss_scaler.dynamic_scale, mean.dtype)
        # The gradient of the replica's summed loss (times the loss scale), taken through its mean so that
        # float16 activations see the mean's magnitudes.
        grads = [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g) * tokens
                 for g, v in zip(tape.gradient(mean, self.variables), self.variables)]
        nonfinite = tf.constant(0.0)
        if self.loss_scaler is not None:
            nonfinite = 1.0 - tf.cast(tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads]),
                                      "float32")
        context = tf.distribute.get_replica_context()
        # One small all-reduce per batch: the global loss, real target tokens and non-finite replicas.
        total = context.all_reduce(SUM, tf.stack([loss_sum, tokens, nonfinite]))
        # Weighted by the batch's global tokens, however the tracker's copies are combined across replicas.
        loss_tracker(self.model).update_state(tf.math.divide_no_nan(total[0], total[1]), sample_weight=total[1])

        if self.state is None:  # one batch per update, no loss scaling: no condition, no state
            self._apply(grads, total[1])
        else:
            state = self.state
            updates = [a.assign_add(g) for a, g in zip(state["gradients"], grads)]
            updates += [state["tokens"].assign_add(total[1]), state["nonfinite"].assign_add(total[2])]
            with tf.control_dependencies(updates):
                batches = state["batches"].assign_add(1)
            with tf.control_dependencies([batches]):
                due = tf.greater_equal(state["batches"].read_value(), self.accumulate)
                tokens_total = state["tokens"].read_value()
                finite = tf.equal(state["nonfinite"].read_value(), 0.0)
            # The condition on the optimizer's update is taken in the cross-replica context, as Keras'
            # LossScaleOptimizer does: a replica-context tf.cond cannot hold the optimizer's merge_call. Every
            # replica holds the same `due` and `finite` (counts and all-reduced sums), so the first one's decide.
            context.merge_call(self._maybe_update, args=(None if self.accumulate > 1 else grads, due, finite,
                                                         tokens_total))
        return self.model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def evaluate_step(self, data):
        """`model.test_step`: the loss counted as the training step counts it, the mean over the real target
        tokens of every batch and replica (Keras' own weighs each replica's mean by its sentences)."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self.model(x, training=False)
        loss_sum, tokens = self.loss.token_sum_and_count(y, y_pred, sample_weight)
        total = tf.distribute.get_replica_context().all_reduce(SUM, tf.stack([loss_sum, tokens]))
        loss_tracker(self.model).update_state(tf.math.divide_no_nan(total[0], total[1]), sample_weight=total[1])
        return self.model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _apply(self, grads, tokens):
        """All-reduces `grads` (each replica's sum of token gradients, times the loss scale), divides by the
        update's `tokens` (and the scale), clips, and applies them. In a replica context."""
        grads = tf.distribute.get_replica_context().all_reduce(SUM, grads)
        divisor = tokens
        if self.loss_scaler is not None:
            divisor = divisor * tf.cast(self.loss_scaler.dynamic_scale, divisor.dtype)
        grads = [tf.math.divide_no_nan(g, divisor) for g in grads]
        if self.global_clipnorm is not None:
            grads, _ = tf.clip_by_global_norm(grads, self.global_clipnorm)
        self.optimizer.apply(grads, self.variables)

    def _apply_accumulated(self, tokens):
        self._apply([a.read_value() for a in self.state["gradients"]], tokens)

    def _reset(self):
        state = self.state
        for a in state["gradients"]:
            a.assign(tf.zeros_like(a))
        state["batches"].assign(0)
        state["tokens"].assign(0.0)
        state["nonfinite"].assign(0.0)

    # -- the update's condition, in the cross-replica context --------------------------------------------

    def _maybe_update(self, strategy, grads, due, finite, tokens):
        def first(value):
            return strategy.experimental_local_results(value)[0]

        def apply():
            if grads is None:
                strategy.extended.call_for_each_replica(self._apply_accumulated, args=(tokens,))
            else:
                strategy.extended.call_for_each_replica(self._apply, args=(grads, tokens))
            if self.loss_scaler is not None:
                self._count_finite_update()

        def update():
            if self.loss_scaler is None:
                apply()
            else:
                tf.cond(first(finite), apply, self._skip_update)
            strategy.extended.call_for_each_replica(self._reset)

        tf.cond(first(due), update, lambda: None)

    def _count_finite_update(self):
        scaler = self.loss_scaler

        def grow():
            scaler.step_counter.assign(0)
            scaler.dynamic_scale.assign(scaler.dynamic_scale * 2.0)

        def count():
            scaler.step_counter.assign_add(1)

        tf.cond(tf.equal(scaler.step_counter, scaler.dynamic_growth_steps - 1), grow, count)

    def _skip_update(self):
        self.loss_scaler.step_counter.assign(0)
        self.loss_scaler.dynamic_scale.assign(self.loss_scaler.dynamic_scale * 0.5)
