"""The one use of private TensorFlow API in the library (written for TensorFlow 2.21)."""

import tensorflow as tf
from tensorflow.python.ops import control_flow_util


def in_xla_context():
    """True while tracing inside `tf.function(jit_compile=True)` (TensorFlow has no public test for it).

    XLA needs every shape fixed at compile time, so the decoding cache is then
    a fixed buffer written in place; outside XLA it grows step by step.
    """
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
