"""Helpers of the backend-agnostic tests (tests/portable/): numpy and keras.ops only.

They run on every Keras backend, each in its own virtualenv (`make test` runs all three):

    KERAS_BACKEND=jax .venv-jax/bin/python -m pytest tests/portable -q
    KERAS_BACKEND=torch .venv-torch/bin/python -m pytest tests/portable -q
    .venv/bin/python -m pytest tests -q        # TensorFlow: the whole suite, this folder included

Neither these helpers nor the tests import tensorflow, jax or torch at module level: a helper imports the
backend it needs inside its own branch, and test_no_tensorflow.py, run last, checks that no TensorFlow module
was loaded on JAX or PyTorch. The shared fixtures (`tiny_model`, `trained_lm`, `seeded`) and data helpers are
in tests/conftest.py.
"""

from pathlib import Path

import keras

BACKEND = keras.backend.backend()
to_numpy = keras.ops.convert_to_numpy  # any backend's tensor (or a numpy array) -> numpy array


def jit(fn):
    """`fn` compiled the way its backend compiles a function: `jax.jit` on JAX, `tf.function` on TensorFlow; on
    PyTorch it runs eagerly, as it is."""
    if BACKEND == "jax":
        import jax

        return jax.jit(fn)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.function(fn)
    return fn


def gradients(fn, inputs, variables=()):
    """`fn(*inputs)` (a scalar) and its gradients with respect to each of `inputs` (float arrays) and then each of
    `variables` (Keras variables that `fn` reads), through the backend's automatic differentiation.

    Returns (value, [gradient, ...]) as numpy arrays, gradients in the order inputs + variables.
    """
    inputs = [keras.ops.convert_to_tensor(x) for x in inputs]
    variables = list(variables)
    if BACKEND == "jax":
        import jax

        def pure(input_values, variable_values):
            with keras.StatelessScope(state_mapping=list(zip(variables, variable_values, strict=True))):
                return fn(*input_values)

        value, (input_grads, variable_grads) = jax.value_and_grad(pure, argnums=(0, 1))(
            inputs, [v.value for v in variables]
        )
        grads = [*input_grads, *variable_grads]
    elif BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            tape.watch(inputs)
            value = fn(*inputs)
        grads = tape.gradient(value, inputs + variables)
    elif BACKEND == "torch":
        import torch

        inputs = [x.detach().requires_grad_(True) for x in inputs]
        value = fn(*inputs)
        grads = torch.autograd.grad(value, inputs + [v.value for v in variables])
    else:
        raise NotImplementedError(f"gradients() on the {BACKEND} backend")
    return to_numpy(value), [to_numpy(g) for g in grads]


_LAST = Path(__file__).with_name("test_no_tensorflow.py")


def pytest_collection_modifyitems(items):
    """test_no_tensorflow.py runs last, once every other test has imported what it imports."""
    items.sort(key=lambda item: item.path == _LAST)  # a stable sort: the others keep their order
