"""tests/ci_skips.py: under CI a skip for a missing tool fails; an expected skip, or any skip outside CI, does not."""

import subprocess
import sys

import pytest

from ci_skips import EXPECTED_SKIPS
from conftest import REPO

TESTS = '''
import pytest

def test_missing_tool():
    pytest.skip("No C++ compiler: g++ is not on PATH")

def test_expected():
    pytest.skip("tensorflow_model_server is not on PATH: TF Serving's model server binary is needed")

@pytest.mark.xfail(reason="a known failure")
def test_known():
    assert False

def test_passes():
    pass
'''


def run(tmp_path, ci):
    (tmp_path / "test_sample.py").write_text(TESTS)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "tests"), "CI": ci}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "ci_skips", "-p", "no:cacheprovider",
                           str(tmp_path / "test_sample.py")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    return done.returncode, done.stdout.strip().splitlines()[-1], done.stdout


@pytest.mark.parametrize("ci, code, summary", [
    ("true", 1, "1 failed, 1 passed, 1 skipped, 1 xfailed"),
    ("", 0, "1 passed, 2 skipped, 1 xfailed"),
])
def test_a_skip_for_a_missing_tool_fails_under_ci_only(tmp_path, ci, code, summary):
    returncode, last, out = run(tmp_path, ci)
    assert (returncode, last.split(" in ")[0]) == (code, summary), out
    if ci:
        assert "skipped under CI: No C++ compiler: g++ is not on PATH" in out
        assert "SKIPPED" in out and "tensorflow_model_server is not on PATH" in out  # -rs prints the reason


def test_every_expected_skip_says_why():
    assert EXPECTED_SKIPS and all(pattern and len(why) > 20 for pattern, why in EXPECTED_SKIPS)
