"""TensorFlow's C++ start-up lines, kept out of a command's terminal.

Importing TensorFlow and probing for GPUs print lines such as "oneDNN custom
operations are on", "Could not find cuda drivers" and "failed call to cuInit"
from C++, before `TF_CPP_MIN_LOG_LEVEL` applies (TensorFlow 2.21 writes every
message logged before `absl::InitializeLog()` to stderr). The commands import
TensorFlow inside `quiet_native_logs()`, which sends file descriptor 2 to a
temporary file meanwhile and shows what it caught only if the import fails.

After the import, TensorFlow's C++ logging goes on, at every level: tf.data's
INFO and WARNING lines as a split is read, and an ERROR-level line from the
oneDNN graph rewrite ("oneDNN supports DT_INT64 only on platforms with
AVX-512. Falling back to the default Eigen-based implementation") the first
time a search runs. None of these is an error of the command's (a real one
raises, and the command prints it). `TF_CPP_MIN_LOG_LEVEL`, read once as
TensorFlow loads, hides them: the commands set it to 3 before the import,
unless `--verbose` or the user's own value says otherwise.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path

VERBOSE_HELP = "show TensorFlow's and absl's log lines (hidden by default)"
LOG_LEVEL_ENV = "TF_CPP_MIN_LOG_LEVEL"
# 3: TensorFlow's C++ logs nothing below FATAL. Read once, when TensorFlow loads.
QUIET_LOG_LEVEL = "3"


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
    command line has `--verbose`, and TensorFlow's C++ log lines stay hidden afterwards too
    (`TF_CPP_MIN_LOG_LEVEL`, unless the user set it). Imported as a library, nothing changes."""
    if module_name == "__main__" or Path(sys.argv[0]).name.startswith("kt-"):
        quiet = not wants_logs(sys.argv[1:])
        if quiet:
            os.environ.setdefault(LOG_LEVEL_ENV, QUIET_LOG_LEVEL)
        import_tensorflow_quietly(enabled=quiet)
