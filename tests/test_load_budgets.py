"""The suite on a busy machine: every budget a test waits with stretches with DSE_TEST_SLOW or the load per core,
so a loaded machine makes the tests slower, not red."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT, SLOW, patience, slowness


def load_per_core() -> float:
    return os.getloadavg()[0] / (os.cpu_count() or 1)


def test_budgets_stretch_with_the_declared_slowness_or_the_load_whichever_is_larger(monkeypatch):
    monkeypatch.setenv(SLOW, "3")
    assert slowness() >= 3
    assert patience(10) == pytest.approx(10 * max(3, load_per_core()), rel=0.2)
    monkeypatch.delenv(SLOW)
    assert patience(10) >= 10, "never shorter than an idle machine's budget"


def test_pytests_own_limit_per_test_stretches_too(request):
    """pyproject's `timeout` (300 s) as this test's limit, times the slowness when it started."""
    limit = request.node.get_closest_marker("timeout").args[0]
    assert limit >= 300
    assert limit == pytest.approx(300 * slowness(), rel=0.5)


@pytest.mark.parametrize("declared", ["fast", "0.5", "inf"])
def test_a_slowness_that_is_not_a_number_of_at_least_one_is_refused_before_any_test_runs(declared):
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", __file__]
    result = subprocess.run(
        command, cwd=ROOT, env={**os.environ, SLOW: declared}, capture_output=True, text=True, timeout=patience(120)
    )
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert f"{SLOW}={declared}: must be a number of at least 1" in result.stderr
