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


NEEDS_A_MODULE = '''
import pytest

pytest.importorskip("no_such_module_for_the_ci_skips_test")


def test_uses_it():
    pass
'''


@pytest.mark.parametrize("ci, code, summary", [("true", 2, "1 error"), ("", 0, "1 passed, 1 skipped")])
def test_a_module_that_skips_as_it_is_collected_fails_under_ci_only(tmp_path, ci, code, summary):
    """A module-level `pytest.importorskip` skips the module at collection, where no test report sees it: under
    CI that is a collection error, which fails the run."""
    (tmp_path / "test_needs_a_module.py").write_text(NEEDS_A_MODULE)
    (tmp_path / "test_other.py").write_text("def test_passes():\n    pass\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "tests"), "CI": ci}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "ci_skips", "-p", "no:cacheprovider",
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    last = done.stdout.strip().splitlines()[-1]
    assert (done.returncode, last.split(" in ")[0].strip("! ")) == (code, summary), done.stdout
    if ci:
        assert ("skipped under CI at collection: could not import 'no_such_module_for_the_ci_skips_test'"
                in done.stdout), done.stdout


def test_every_expected_skip_says_why():
    assert EXPECTED_SKIPS and all(pattern and len(why) > 20 for pattern, why in EXPECTED_SKIPS)
