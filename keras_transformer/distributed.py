"""Training under `tf.distribute` (TensorFlow only): N replicas compute the update that one replica computes.

`UpdateStep` is a `model.train_step` that takes one update from the gradient summed over every replica and
every accumulated batch, in fairseq's order, on any number of devices and workers: each replica adds up its
batches' gradients, the sum is all-reduced once per update, then checked for overflow (loss scaling), divided
by the update's real target tokens, clipped, and applied.

`kt.Transformer` trains with it by default on TensorFlow, on one device and under any strategy
(`Transformer.compile` and `make_train_function`, through `use_update_step`); a model of your own installs it
with `UpdateStep.install(model)` (README.md, "Train in your own script on several GPUs").

Why not Keras' own step (3.15) under tf.distribute: it clips each replica's gradient before the all-reduce (so
the clip norm depends on the replica count), `LossScaleOptimizer` takes "finite" from replica 0 before the
all-reduce (an overflow on another replica is applied, and the weights turn to NaN), and its gradient
accumulation puts the optimizer's merge_call inside a replica-context `ops.cond`, which tf.distribute refuses.

The loss of an update is the mean over its real target tokens: each batch's per-token losses are summed on
each replica, and the gradient of that sum, summed over the replicas and batches of the update, is divided by
their total real target tokens (sample weights, if any, weigh each token). A mean of per-batch (or
per-replica) means would weigh a short batch's tokens more.

This module imports TensorFlow; `import keras_transformer` does not import it (`kt.UpdateStep` loads it when
first used).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_transformer.keras_internals import (apply_summed_gradients, build_fit_state_now, loss_tracker,
                                              no_step_without_data, rank1_step_logs)

SUM = tf.distribute.ReduceOp.SUM
# What a loss must offer for the summed update: `token_sum_and_count(y_true, y_pred, sample_weight)` ->
# (summed loss, count it is a mean over), as the library's masked losses do.
TOKEN_LOSS_METHOD = "token_sum_and_count"


def inner_optimizer(optimizer):
    """The optimizer that updates the weights: `optimizer`, or the one a `LossScaleOptimizer` wraps."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


def take_over_accumulation(optimizer, accumulate=None) -> int:
    """Batches per update: `accumulate`, or the optimizer's `gradient_accumulation_steps`, which this sets to None
    (the update step accumulates, over every replica, and the optimizer applies each summed update once).
    Must run before the optimizer is built (its own accumulators are made in `build`)."""
    if accumulate is not None and int(accumulate) < 1:
        raise ValueError(f"accumulate must be 1 or more, got {accumulate!r}")
    optimizer = inner_optimizer(optimizer)
    own = optimizer.gradient_accumulation_steps
    if own and accumulate is not None and int(accumulate) != int(own):
        raise ValueError(f"accumulate={accumulate} and the optimizer's gradient_accumulation_steps={own} disagree; "
                         f"give one of them")
    if own:
        if optimizer.built:
            raise ValueError(
                "the optimizer accumulates gradients itself (gradient_accumulation_steps="
                f"{own}) and is already built, so its accumulators exist: compile the model with a new optimizer "
                "(its gradient_accumulation_steps is taken over by the update step), or give the step accumulate=")
        optimizer.gradient_accumulation_steps = None
    return int(own or accumulate or 1)


def check_variables_in_scope(model) -> None:
    """Raises a ValueError naming the fix when `model`'s variables were made outside the strategy it trains under
    (Keras 3.15 then fails in its distributed update with a bare AssertionError)."""
    strategy = model.distribute_strategy
    if strategy is tf.distribute.get_strategy() and not tf.distribute.has_strategy():
        return  # the default strategy: one device, nothing to mirror
    outside = [v.path for v in model.variables
               if not strategy.extended.variable_created_in_scope(getattr(v, "value", v))]
    if outside:
        raise ValueError(
            f"{len(outside)} of the model's variables (first: {outside[0]!r}) were created outside the "
            f"{type(strategy).__name__} it trains under, so they are not mirrored on its replicas. Create the "
            "model and compile it inside the strategy's scope:\n"
            "    with strategy.scope():\n"
            "        model = kt.Transformer(...)\n"
            "        model.compile(...)")


class UpdateStep:
    """`model.train_step`: the gradient summed over every replica and `accumulate` batches, then one update.

    On TensorFlow `kt.Transformer` trains with one by default (compiled with one of the library's masked losses),
    on one device and under any `tf.distribute` strategy. For a model of your own (a classifier or a language
    model built from the library's layers), install one after `compile`, inside the strategy's scope.

    What it computes, on any number of replicas and workers, is what one replica computes on the same batches:

    - the loss of an update is the mean over its real target tokens (the loss's `token_sum_and_count`), not a
      mean of per-replica or per-batch means;
    - the optimizer's own clipping (`global_clipnorm`, `clipnorm`, `clipvalue`) and `global_clipnorm=` here
      apply to that summed, unscaled gradient (Keras' own step clips each replica's share);
    - gradient accumulation (`accumulate`, or the optimizer's `gradient_accumulation_steps`, taken over) works
      on any device count; `optimizer.iterations` counts updates, and so does the learning-rate schedule;
    - under `mixed_float16` (Keras wraps the optimizer in a `LossScaleOptimizer`), an update with a non-finite
      gradient on any replica or in any of its batches is skipped on every replica and halves the loss scale;
      `dynamic_growth_steps` finite updates in a row double it, as Keras' own does.

    `evaluate` counts the loss the same way (`evaluate_step`). Batches accumulated towards an update that has
    not been applied yet are not in a checkpoint: `pending()` says how many there are.

    Args:
        model: a compiled, built Keras model whose loss has `token_sum_and_count(y_true, y_pred,
            sample_weight) -> (sum, count)` (the library's `MaskedSparseCategoricalCrossentropy` and
            `MaskedRDropCrossentropy`).
        accumulate: batches per update (fairseq's `--update-freq`), on every replica. None: the optimizer's
            `gradient_accumulation_steps` (set to None on the optimizer, which then applies each summed
            update once), else 1.
        global_clipnorm: clip the update's gradient (the mean over its tokens) to this global L2 norm; None:
            only the optimizer's own clipping, if it has any.

    Shapes: the model's batches are `(x, y)` or `(x, y, sample_weight)`, as `model.fit` takes them; the loss
    reduces `y` and the model's output to a sum and a count (scalars).

    Example:

    ```python
    strategy = tf.distribute.MirroredStrategy()
    with strategy.scope():
        model = my_language_model()  # built from kt.DecoderLayer, say
        model.compile(optimizer=kt.paper_adam(512, global_clipnorm=1.0),
                      loss=kt.MaskedSparseCategoricalCrossentropy())
        model.build((None, None))
        kt.UpdateStep.install(model)
    model.fit(dataset)
    ```
    """

    def __init__(self, model, *, accumulate: int | None = None, global_clipnorm: float | None = None):
        loss = getattr(model, "loss", None)
        if not hasattr(loss, TOKEN_LOSS_METHOD):
            raise ValueError(
                f"UpdateStep needs a loss with {TOKEN_LOSS_METHOD}(y_true, y_pred, sample_weight) -> (sum, count), "
                f"as the library's kt.MaskedSparseCategoricalCrossentropy has; the model's is {loss!r}")
        if not model.built:
            raise ValueError("UpdateStep needs a built model (its variables made): call it on a batch, or "
                             "model.build(...), inside the strategy's scope first")
        check_variables_in_scope(model)
        self.model, self.loss = model, loss
        self.accumulate = take_over_accumulation(model.optimizer, accumulate)
        self.global_clipnorm = global_clipnorm
        optimizer = model.optimizer
        if not optimizer.built:
            with model.distribute_strategy.scope():
                optimizer.build(model.trainable_variables)
        self.loss_scaler = optimizer if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else None
        self.optimizer = inner_optimizer(optimizer)
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

            with model.distribute_strategy.scope():
                self.state = {
                    "gradients": [local(tf.zeros(v.shape, "float32"), f"accumulated_{i}")
                                  for i, v in enumerate(self.variables)] if self.accumulate > 1 else [],
                    "batches": local(0, "accumulated_batches"),
                    "tokens": local(0.0, "accumulated_tokens"),
                    "nonfinite": local(0.0, "nonfinite_batches"),
                }

    @classmethod
    def install(cls, model, **kwargs) -> "UpdateStep":
        """Makes `model.fit` train with an `UpdateStep(model, **kwargs)` and `evaluate` count its loss as the step
        does (`evaluate_step`), under the model's strategy (`keras_transformer.keras_internals`:
        `rank1_step_logs` under MultiWorkerMirroredStrategy, `no_step_without_data`); returns the step.
        Installing again (after a new `compile`) replaces the previous step."""
        for name in ("train_step", "test_step"):
            model.__dict__.pop(name, None)  # a previous install's
        step = cls(model, **kwargs)
        model.train_step = step
        model.test_step = step.evaluate_step
        if isinstance(model.distribute_strategy, tf.distribute.MultiWorkerMirroredStrategy):
            rank1_step_logs(model)
        no_step_without_data(model)  # else each epoch's end counts an update that no batch made
        model.train_function = model.test_function = None  # made again, with this step
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
        # Weighted by the batch's global tokens, however the tracker's copies are combined across replicas. A batch
        # that overflowed on any replica (its update skipped) is left out: its loss would make the epoch's mean
        # NaN, and `keras.callbacks.TerminateOnNaN` would stop a run that loss scaling has just saved.
        batch_finite = tf.equal(total[2], 0.0)
        loss_tracker(self.model).update_state(
            tf.where(batch_finite, tf.math.divide_no_nan(total[0], total[1]), 0.0),
            sample_weight=tf.where(batch_finite, total[1], 0.0))

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


# -- kt.Transformer's defaults on TensorFlow (keras_transformer/model.py) --------------------------------------

def clips_or_accumulates(optimizer) -> list[str]:
    """The settings of `optimizer` that Keras' own step applies per replica under tf.distribute (wrong with more
    than one replica): its clipping, its gradient accumulation, its loss scaling."""
    inner = inner_optimizer(optimizer)
    found = [f"{name}={getattr(inner, name)}" for name in ("clipnorm", "global_clipnorm", "clipvalue",
                                                           "gradient_accumulation_steps")
             if getattr(inner, name, None)]
    if inner is not optimizer:
        found.append("loss scaling (LossScaleOptimizer, mixed_float16)")
    return found


def prepare_compiled(model, example_batch) -> int:
    """Called by `kt.Transformer.compile` on TensorFlow, before the optimizer is built.

    With a loss that has `token_sum_and_count`: takes over the optimizer's gradient accumulation
    (`take_over_accumulation`) and returns the batches per update. With another loss, refuses (with more than one
    replica) the optimizer settings that Keras' own step would apply per replica, and returns 1.

    Under a strategy, it then builds the model, the optimizer, and the compiled loss and metrics from
    `example_batch` (a small batch of int token ids) in the strategy's scope, in place of Keras' build from the
    first batch of `fit` (`keras_internals.build_fit_state_now`: Keras 3.15 averages that batch over the
    replicas first, turning token ids into floats, and fails when workers' batches differ in shape).
    """
    steps = 1
    if hasattr(model.loss, TOKEN_LOSS_METHOD):
        steps = take_over_accumulation(model.optimizer)
    else:
        replicas = model.distribute_strategy.num_replicas_in_sync
        settings = clips_or_accumulates(model.optimizer) if replicas > 1 else []
        if settings:
            raise ValueError(
                f"kt.Transformer on {replicas} replicas with {', '.join(settings)} and the loss {model.loss!r}: "
                "Keras' own training step would apply these to each replica's gradient, not to their sum. Compile "
                "with the library's loss, whose summed update applies them to the sum:\n"
                "    model.compile(optimizer=..., loss=kt.MaskedSparseCategoricalCrossentropy(), ...)")
    if tf.distribute.has_strategy():
        with model.distribute_strategy.scope():
            if not model.built:
                model.build()
            check_variables_in_scope(model)
            if not model.optimizer.built:
                model.optimizer.build(model.trainable_variables)
            build_fit_state_now(model, example_batch)
    return steps


def use_update_step(model, accumulate: int) -> UpdateStep | None:
    """Called by `kt.Transformer.make_train_function` and `make_test_function` on TensorFlow: builds the model in
    its strategy's scope and installs an `UpdateStep` (once per compile) when its loss has `token_sum_and_count`;
    checks that its variables are its strategy's either way. Returns the step, or None."""
    if not model.built:
        with model.distribute_strategy.scope():
            model.build()
    if not hasattr(model.loss, TOKEN_LOSS_METHOD):
        check_variables_in_scope(model)
        return None
    return UpdateStep.install(model, accumulate=accumulate)  # which checks the variables itself
