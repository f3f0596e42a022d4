"""tf.distribute setup: the default strategy on one device, MirroredStrategy over
GPUs or N logical CPU devices, MultiWorkerMirroredStrategy when TF_CONFIG is set.

Call `make_strategy` before anything else touches TensorFlow devices:
logical devices can only be configured before TF initializes them.
"""

from __future__ import annotations

import json
import logging
import os

import tensorflow as tf


log = logging.getLogger("training.distribute")


def tf_config() -> dict | None:
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return None
    cfg = json.loads(raw)
    return cfg if cfg.get("cluster") else None


def worker_info() -> tuple[bool, int, int]:
    """(is_chief, task_index, num_workers) from TF_CONFIG (single process: (True, 0, 1))."""
    cfg = tf_config()
    if cfg is None:
        return True, 0, 1
    cluster, task = cfg["cluster"], cfg.get("task", {})
    num_workers = len(cluster.get("worker", [])) + len(cluster.get("chief", []))
    ttype, index = task.get("type", "worker"), int(task.get("index", 0))
    if "chief" in cluster:
        return ttype == "chief", index, num_workers
    return ttype == "worker" and index == 0, index, num_workers


def input_pipeline() -> tuple[int, int]:
    """(this worker's input pipeline id, the number of pipelines) from TF_CONFIG, as
    `MultiWorkerMirroredStrategy` numbers them (`tf.distribute.InputContext.input_pipeline_id`): the chief 0 and
    worker i i + 1 when the cluster has a chief, worker i i when it has none (single process: (0, 1)).

    What a worker reads of a prepared corpus goes by it, at start-up and in its input pipeline alike: with a
    chief, `worker_info`'s task index is 0 on both the chief and worker 0.
    """
    cfg = tf_config()
    if cfg is None:
        return 0, 1
    cluster, task = cfg["cluster"], cfg.get("task", {})
    ttype, index = task.get("type", "worker"), int(task.get("index", 0))
    chiefs = len(cluster.get("chief", []))
    if ttype not in ("chief", "worker"):
        raise ValueError(f"TF_CONFIG's task type {ttype!r}: kt-train runs as a 'chief' or a 'worker' task")
    return (0 if ttype == "chief" else index + chiefs), len(cluster.get("worker", [])) + chiefs


def split_cpu(num_replicas: int) -> None:
    """Splits the (first) physical CPU into `num_replicas` logical devices."""
    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(num_replicas)])
    except RuntimeError as e:
        raise RuntimeError(
            f"--cpu-replicas {num_replicas}: TensorFlow devices were already initialized; logical "
            "CPU devices must be configured before any TensorFlow op runs.") from e


def device_kind(strategy) -> str:
    """"GPU" when `strategy`'s replicas on this worker run on GPUs, else "CPU" (TensorFlow's default strategy,
    which names no devices: "GPU" when TensorFlow sees one)."""
    try:
        devices = strategy.extended.worker_devices
    except RuntimeError:  # the default strategy
        return "GPU" if tf.config.list_logical_devices("GPU") else "CPU"
    return "GPU" if all(tf.DeviceSpec.from_string(d).device_type == "GPU" for d in devices) else "CPU"


def make_strategy(cpu_replicas: int = 1):
    """The distribution strategy for this process.

    - TF_CONFIG set: `MultiWorkerMirroredStrategy` (one replica per worker unless GPUs).
    - One device (one GPU or none, `cpu_replicas` 1): TensorFlow's default strategy.
    - More GPUs: `MirroredStrategy` over all of them.
    - CPU only, `cpu_replicas > 1`: `MirroredStrategy` over that many logical CPU devices.

    Gradient accumulation works under each (`keras_transformer.distributed.UpdateStep`).
    """
    if tf_config() is not None:
        if cpu_replicas > 1:
            split_cpu(cpu_replicas)
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        log.info("MultiWorkerMirroredStrategy: %d replicas in sync", strategy.num_replicas_in_sync)
        return strategy
    # physical, not logical: listing logical devices would initialize them before split_cpu
    if cpu_replicas <= 1 and len(tf.config.list_physical_devices("GPU")) <= 1:
        # One device: MirroredStrategy would add nothing but its MultiDeviceIterator,
        # whose deletion (Keras drops an iterator every epoch and every validation)
        # waits for a tf.data autotuning thread's next wake-up, up to a minute.
        log.info("One device: TensorFlow's default strategy")
        return tf.distribute.get_strategy()
    if cpu_replicas > 1:
        split_cpu(cpu_replicas)
    gpus = tf.config.list_logical_devices("GPU")
    if gpus:
        strategy = tf.distribute.MirroredStrategy()
    else:
        cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
        strategy = tf.distribute.MirroredStrategy(cpus[: max(1, cpu_replicas)])
    log.info("MirroredStrategy over %s", strategy.extended.worker_devices)
    return strategy
