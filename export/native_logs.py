"""TensorFlow's C++ start-up lines, kept out of a command's terminal.

Importing TensorFlow and probing for GPUs print lines such as "oneDNN custom
operations are on", "Could not find cuda drivers" and "failed call to cuInit"
from C++, before `TF_CPP_MIN_LOG_LEVEL` applies (TensorFlow 2.21 writes every
message logged before `absl::InitializeLog()` to stderr). The commands import
TensorFlow inside `quiet_native_logs()`, which sends file descriptor 2 to a
temporary file meanwhile and shows what it caught only if the import fails.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path

VERBOSE_HELP = "show TensorFlow's and absl's log lines (hidden by default)"


@contextlib.contextmanager
def quiet_native_logs(enabled=True):
    """Within the block, C++ (and Python) writes to stderr go to a temporary file; shown on an error."""
    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            caught.seek(0)
            sys.stderr.write(caught.read().decode("utf-8", "replace"))
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def wants_logs(argv) -> bool:
    """`--verbose` on a command line (with or without a value) asks for TensorFlow's and absl's log lines."""
    return any(a == "--verbose" or a.startswith("--verbose=") for a in argv)


def import_tensorflow_quietly(enabled=True):
    """Imports TensorFlow and probes its devices (where the CUDA lines come from) without their log lines."""
    with quiet_native_logs(enabled):
        import tensorflow as tf

        tf.config.list_physical_devices()
    return tf


def quiet_import_for_commands(module_name):
    """Called at the top of a command's module, before it imports TensorFlow: when the module runs as
    a command (`python -m ...` or a `kt-*` console script), TensorFlow is imported quietly unless the
    command line has `--verbose`. Imported as a library, nothing changes."""
    if module_name == "__main__" or Path(sys.argv[0]).name.startswith("kt-"):
        import_tensorflow_quietly(enabled=not wants_logs(sys.argv[1:]))
