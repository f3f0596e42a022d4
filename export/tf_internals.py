"""Where export/ relies on TensorFlow internals (written for TensorFlow 2.21): the one module that imports
TensorFlow's private API (`tensorflow.python`), and the one kernel choice.

Two serve the speed of the served graph on CPU, so they live in `export/`, not in the portable library
(`keras_transformer/` computes with `keras.ops` on any backend): `export/search.py`'s `check_shapes` asks
`in_xla_context` whether a search with growing shapes is being traced under XLA (to name the mistake; the
shapes themselves are the caller's explicit `fixed_shapes`), and the one-position attention multiplies with
`eigen_batch_matmul`. The third, `registered_op_names`, lists the ops a process has registered, for
`export/graph_ops.py`'s check that TF Serving's model server has every op of an export. The fourth,
`merged_batch_sizes`, reads from TensorFlow's profiler the batches that request batching
(export/request_batching.py) ran, for its tests and bench/served_load.py. Check all four when TensorFlow is
upgraded.
"""

import tensorflow as tf
from tensorflow.python.ops import control_flow_util


def in_xla_context():
    """True while tracing inside `tf.function(jit_compile=True)` (TensorFlow has no public test for it).

    XLA needs every shape fixed at compile time: a search traced there must
    have been asked for fixed shapes.
    """
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def registered_op_names():
    """The names of every op registered in this process, sorted: core TensorFlow's, and those of what it has
    imported since (tensorflow-text's ops, once `tensorflow_text` is imported). TensorFlow has no public list of
    them: this reads the C API's (`TF_GetAllOpList`, through the private `pywrap_tf_session`)."""
    from tensorflow.core.framework import op_def_pb2
    from tensorflow.python.client import pywrap_tf_session

    ops = op_def_pb2.OpList()
    ops.ParseFromString(pywrap_tf_session.TF_GetBuffer(pywrap_tf_session.TF_GetAllOpList()))
    return sorted(op.name for op in ops.op)


def eigen_batch_matmul(x, y, adjoint_b=False):
    """`x @ y` (or `x @ y^T` with `adjoint_b`) in float32 on TensorFlow's own (Eigen) CPU kernel; batch axes broadcast.

    Both inputs are cast to float32; the product is float32. Why: TF 2.21's
    oneDNN graph pass rewrites the `BatchMatMulV2` that `tf.matmul` emits into
    `_MklBatchMatMulV2`, which pays a fixed cost per matrix: a decoding step's
    attention is some 100 one-row products per call, and those calls were a
    large share of a greedy step at 32 rows on a 2-core EPYC (avx512_bf16).
    The pass leaves float32 `BatchMatMulV3` to Eigen, which ran them several
    times faster there, and still faster counting the casts to float32
    (docs/design.md, "The one-position attention on Eigen").
    `BatchMatMulV3` is a core op, so the stock TF Serving binary runs it.
    """
    x, y = tf.cast(x, tf.float32), tf.cast(y, tf.float32)
    return tf.raw_ops.BatchMatMulV3(x=x, y=y, Tout=tf.float32, adj_x=False, adj_y=adjoint_b)


def merged_batch_sizes(call):
    """(`call()`, the size of each batch the BatchFunction ops of this process ran meanwhile, in the order they
    started): how concurrent requests were merged (export/request_batching.py).

    Read from TensorFlow's profiler, which TF 2.21's batching kernels tell of each batch they run: a "ProcessBatch"
    event with a "batch_size_before_padding" statistic, in the trace's XSpace proto (`tensorflow.tsl`, not
    TensorFlow's public API). A batch without that statistic counts with size 0. The profiler runs around `call`
    alone; one profile at a time per process.
    """
    import tempfile
    from pathlib import Path

    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        try:
            result = call()
        finally:
            tf.profiler.experimental.stop()
        batches = []  # (start in ps, size)
        for trace in Path(logdir).rglob("*.xplane.pb"):
            for plane in xplane_pb2.XSpace.FromString(trace.read_bytes()).planes:
                events = {i: m.name for i, m in plane.event_metadata.items()}
                stats = {i: m.name for i, m in plane.stat_metadata.items()}
                for line in plane.lines:
                    batches += [(line.timestamp_ns * 1000 + e.offset_ps,
                                 next((s.int64_value or s.uint64_value for s in e.stats
                                       if stats.get(s.metadata_id) == "batch_size_before_padding"), 0))
                                for e in line.events if events.get(e.metadata_id) == "ProcessBatch"]
    return result, [size for _, size in sorted(batches)]
