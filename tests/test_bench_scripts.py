"""Every script in bench/ still starts: its `--help` exits 0 and prints a usage line.

Nothing else runs the benchmarks in CI, and they import training/ and export/ internals, so a renamed function
would otherwise break them unseen. The scripts are found by globbing bench/*.py and bench/*.sh, so a new one is
covered without editing this file. Each runs in its own interpreter (the repository on PYTHONPATH, as the
benchmarks run it); the `--help` runs go in parallel, a few at a time, and each test reads its script's result.
A shell script is also syntax-checked (`bash -n`). A script must offer `--help` (argparse, or its own) before it
is run here, so a script that would start work on any argument is never run.
"""

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import REPO, distributed_env

SCRIPTS = sorted([*(REPO / "bench").glob("*.py"), *(REPO / "bench").glob("*.sh")])
# A --help imports TensorFlow in most scripts: a few seconds alone, longer on 2 busy cores beside the suite.
TIMEOUT = 300
# Interpreters at once: the imports are CPU-bound, so more than this gains nothing (on 2 cores, 4 at once took
# as long as all at once), and each holds several hundred MB.
PARALLEL = 2 * (os.cpu_count() or 1)
USAGE = re.compile(r"^usage:", re.MULTILINE | re.IGNORECASE)


def _commands(script):
    """The commands that check `script`: its `--help` (after `bash -n` for a shell script)."""
    if script.suffix == ".sh":
        return [["bash", "-n", str(script)], ["bash", str(script), "--help"]]
    return [[sys.executable, str(script), "--help"]]


def _run(script):
    """(exit status, stdout + stderr) of `script`'s checks, stopping at the first that fails."""
    text = script.read_text(encoding="utf-8")
    if "--help" not in text and "ArgumentParser" not in text:
        return None, "no --help: give it an argparse --help (or a -h/--help that prints a usage line and exits 0)"
    output = ""
    for command in _commands(script):
        try:
            proc = subprocess.run(command, cwd=REPO, env=distributed_env(), capture_output=True, text=True,
                                  timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            return None, f"{' '.join(command[1:])}: no answer in {TIMEOUT} s"
        output += proc.stdout + proc.stderr
        if proc.returncode != 0:
            return proc.returncode, output
    return 0, output


@pytest.fixture(scope="module")
def help_runs():
    """{script: (exit status, output)} of every bench script's `--help`, run in parallel."""
    with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        return dict(zip(SCRIPTS, pool.map(_run, SCRIPTS)))


def test_bench_has_scripts():
    assert any(s.suffix == ".py" for s in SCRIPTS), "the glob found no bench/*.py"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bench_script_help(script, help_runs):
    """`bench/SCRIPT --help` exits 0 with a usage line: the script imports, and parses its arguments."""
    status, output = help_runs[script]
    assert status == 0, f"bench/{script.name} --help: exit {status}\n{output[-4000:]}"
    assert USAGE.search(output), f"bench/{script.name} --help printed no usage line:\n{output[-2000:]}"


def test_the_ctranslate2_converter_refuses_a_key_size_apart_from_the_value_size_and_marians_options():
    """CTranslate2's heads are d_model / num_heads wide for queries, keys and values alike: a model with another
    `key_dim` is refused by name before any conversion (ctranslate2 need not be installed), as are an activation
    other than ReLU and a bias on the output projection (the converter writes neither); the paper's passes."""
    import keras_transformer as kt

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))  # bench/ is no installed package
    from bench.ctranslate2_side_by_side import transformer_spec_of

    model = kt.Transformer.from_preset("tiny", vocab_size=20, key_dim=3)
    with pytest.raises(ValueError, match=r"key_dim=3 \(d_k apart from d_model // num_heads = 8\) is not converted"):
        transformer_spec_of(model, ["<pad>"] * 20, 16)
    for marian, named in ((dict(activation="silu"), "activation='silu' or"),
                          (dict(output_bias=True), "output_bias=True")):
        with pytest.raises(ValueError, match=f"{named}.* is not converted"):
            transformer_spec_of(kt.Transformer.from_preset("tiny", vocab_size=20, **marian), ["<pad>"] * 20, 16)
    paper = kt.Transformer.from_preset("tiny", vocab_size=20, key_dim=8)  # d_model // num_heads, given
    paper.build()
    try:
        transformer_spec_of(paper, [f"piece{i}" for i in range(20)], 16)
    except ImportError:  # past the check: the converter's own import (ctranslate2 is not in the project's venv)
        pass
