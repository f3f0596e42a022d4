"""How far below `greedy_decode`'s score can `beam_search`'s fall in mixed_bfloat16? (issue 42, item 6)

    KERAS_BACKEND=jax .venv-jax/bin/python bench/beam_vs_greedy_bf16.py
    KERAS_BACKEND=torch .venv-torch/bin/python bench/beam_vs_greedy_bf16.py
    .venv/bin/python bench/beam_vs_greedy_bf16.py                                # TensorFlow

Trains the test suite's copy-task model (`tests/conftest.py`, `copy_model`: tiny preset, one epoch), copies
its weights into a mixed_bfloat16 model, and decodes 128 copy-task sources with each search, compiled as the
backend compiles (`jax.jit`, `tf.function`; eager on PyTorch), for three source seeds. Prints, per policy and
seed, how many sentences beam search scored below greedy decoding, and the lowest difference, absolute and
relative to the greedy score. A measurement of the backend's kernels on this CPU, not a test: the test is
tests/portable/test_decoding.py, `test_beam_score_is_never_below_greedy`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests"), str(Path(__file__).resolve().parents[1])]
if os.environ.get("KERAS_BACKEND", "tensorflow") == "tensorflow":  # the other backends' virtualenvs have no TensorFlow
    from export.native_logs import quiet_import_for_commands

    quiet_import_for_commands(__name__)  # before keras: TensorFlow's C++ start-up lines are not this table's
import keras  # noqa: E402
import keras_transformer as kt  # noqa: E402
from conftest import copy_sources, copy_task  # noqa: E402
from keras_transformer.hardware import cpu_flags  # noqa: E402
from keras_transformer.text import END_ID, START_ID  # noqa: E402
from portable.conftest import jit  # noqa: E402


def main() -> int:
    keras.utils.set_random_seed(0)
    model = kt.Transformer.from_preset("tiny", vocab_size=16, dropout=0.0)
    model.compile(optimizer=kt.paper_adam(model.d_model, 100), loss=kt.MaskedSparseCategoricalCrossentropy())
    x, y = copy_task(np.random.default_rng(0), 2048)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx512_bf16", "amx", "avx512_vnni", "avx2")))
    print(f"backend {keras.backend.backend()}, CPU flags {' '.join(flags)}")
    for policy in ("float32", "mixed_bfloat16"):
        decoder = kt.Transformer.from_config({**model.get_config(), "dtype": policy})
        decoder.build()
        decoder.set_weights(model.get_weights())
        # Compiled once per policy: the three seeds' sources have one shape, so nothing is traced again.
        greedy_fn = jit(lambda s, decoder=decoder: kt.greedy_decode(decoder, s, START_ID, END_ID))
        beam_fn = jit(lambda s, decoder=decoder: kt.beam_search(decoder, s, START_ID, END_ID, beam_size=4))
        for seed in (3, 5, 7):
            source = copy_sources(seed, 128)
            _, greedy = greedy_fn(source)
            _, beam = beam_fn(source)
            greedy, beam = (keras.ops.convert_to_numpy(x) for x in (greedy, beam))
            below = beam - greedy
            print(f"{policy:15s} seed {seed}: {int((below < -1e-5).sum()):3d}/128 below greedy, lowest "
                  f"{below.min():+.4f} ({(below / np.abs(greedy)).min():+.2%} of the greedy score)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
