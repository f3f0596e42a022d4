"""Under CI (`CI=true`), a skipped test fails unless its reason is one this project expects to skip for.

A test that skips because a tool is missing (g++, tensorflow-serving-api, matplotlib, a backend's virtualenv,
Multi30k), or a test module that skips whole as it is collected (a module-level `pytest.importorskip`), would let
CI pass having tested nothing of what it needs; `.ci/run` installs those, so there such a skip is a failure
(of the test, or of the module's collection) that names the reason. `EXPECTED_SKIPS` is the one list of skips CI accepts: what cannot be
installed here, and the skips that are the test's design. `make test` prints every skip's reason (`-rs`).

Loaded by conftest.py (`pytest_plugins`); tests/test_ci_skips.py runs it on a test file of its own.
"""

import os
import re

import pytest

# (pattern of the skip reason, why CI accepts it)
EXPECTED_SKIPS = [
    (r"tensorflow_model_server is not on PATH",
     "TF Serving's model server binary cannot be installed on these machines (no package registry has it); "
     "its C++ loader is tested instead (tests/test_cpp_loader.py)"),
    (r"README\.md:\d+: not run: ",
     "a README block marked as not run (it downloads, trains for hours, or needs the server), by design"),
    (r"TensorFlow is the backend",
     "tests/portable/test_no_tensorflow.py checks the other backends; on TensorFlow there is nothing to check"),
]


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def expected(reason: str) -> bool:
    return any(re.search(pattern, reason) for pattern, _ in EXPECTED_SKIPS)


def skip_reason(report) -> str:
    """The reason pytest gives for a skipped report ("Skipped: " taken off)."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def fail_unexpected_skip(report, what):
    """Under CI, turns `report` (a skip) into a failure naming its reason, unless the reason is expected."""
    if not (in_ci() and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = skip_reason(report)
    if expected(reason):
        return
    report.outcome = "failed"
    report.longrepr = (f"skipped under CI{what}: {reason}\n.ci/run must install what this test needs; a skip that "
                       f"cannot be avoided goes on tests/ci_skips.py's EXPECTED_SKIPS, with why.")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test's skip: from `pytest.skip` or a skip mark, in its setup or its call."""
    outcome = yield
    fail_unexpected_skip(outcome.get_result(), "")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A whole module's skip as it is collected (a module-level `pytest.importorskip`, or `pytest.skip(...,
    allow_module_level=True)`): no test report ever shows it, so it is caught here, and fails as a collection
    error (the module's other tests never ran)."""
    outcome = yield
    fail_unexpected_skip(outcome.get_result(), " at collection")
