"""On a machine without Chromium, PostgreSQL or Redis (only `.ci/run` installs them) their tests skip, and the
session's summary says which did not run and the one command that installs what they need.

A real pytest session in a folder of its own, with this suite's conftest and a PATH without the binaries."""

import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, patience

TESTS = """
import shutil

from conftest import skip_without


def test_in_a_browser():
    if shutil.which("chromium") is None:
        skip_without("chromium", "chromium")


def test_redis_journal(redis_url):
    assert redis_url


def test_redis_again(redis_url):
    assert redis_url


def test_plain():
    assert True
"""


def session(folder: Path, *args: str) -> subprocess.CompletedProcess:
    shutil.copy(ROOT / "tests" / "conftest.py", folder / "conftest.py")
    (folder / "test_services.py").write_text(TESTS)
    env = {"PATH": str(Path(sys.executable).parent), "HOME": str(folder)}  # no chromium, no redis-server
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=patience(120))


def test_the_summary_names_the_skipped_real_service_tests_and_the_install_command(tmp_path):
    result = session(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = result.stdout[result.stdout.index("3 real-service tests did not run") :]
    assert "chromium is not installed, so these did not run:\n  test_services.py::test_in_a_browser\n" in summary
    assert (
        "redis-server is not installed, so these did not run:\n"
        "  test_services.py::test_redis_journal\n  test_services.py::test_redis_again\n"
    ) in summary
    assert "apt-get update && " in summary
    assert "apt-get install -y chromium redis-server\n" in summary, "only what is missing, in one command"
    assert "test_plain" not in summary and "postgresql" not in summary
    assert "1 passed, 3 skipped" in result.stdout


def test_no_summary_when_every_test_ran(tmp_path):
    result = session(tmp_path, "-k", "plain")
    assert result.returncode == 0 and "1 passed" in result.stdout
    assert "real-service" not in result.stdout
