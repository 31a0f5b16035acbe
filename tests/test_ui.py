"""`dse ui` and `make ui`: the MLflow UI over a study's local store stops whole, with real processes.

One test starts the real server through the real Makefile target (~15 s, ~0.5 GiB); the others stop a process
group of shell `sleep`s, which shows the same mechanics (a group, orphans, a process that ignores SIGTERM) in
well under a second each.
"""

import re
import signal
import socket
import subprocess
import sys
import textwrap

import psutil
import pytest
from conftest import ROOT, free_port, patience, wait_until

SERVE = textwrap.dedent(
    """
    import os, sys
    from dse.cli.procgroup import serve
    sys.exit(serve(sys.argv[1:], dict(os.environ)))
    """
)
"""A `dse ui` without the server: dse.cli.procgroup.serve() running the command given, in a process of its own to
signal."""


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    """The processes still running (a zombie has exited; only its parent has not reaped it yet)."""
    out = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                out.append(process)
        except psutil.NoSuchProcess:
            continue
    return out


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def start_serve(*command: str) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """serve(command) in a child process, once the command's processes are all up (`sleep`s counted)."""
    harness = subprocess.Popen([sys.executable, "-c", SERVE, *command], cwd=ROOT)
    wanted = command[-1].count("sleep ")
    wait_until(lambda: sum(p.name() == "sleep" for p in descendants(harness.pid)) == wanted, "the sleeps")
    return harness, descendants(harness.pid)


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_ends_the_whole_group_orphans_included(stop):
    harness, started = start_serve("sh", "-c", "sleep 300 & sleep 300 & wait")
    assert len(started) == 3, "sh and its two sleeps"
    harness.send_signal(stop)
    assert harness.wait(timeout=patience(10)) == 0, "a requested stop is a clean exit"
    assert alive(started) == []


def test_a_second_signal_kills_what_ignores_sigterm(tmp_path):
    """A shell that notes the group's SIGTERM and goes on; the second signal is sent once the first has been acted
    on (two signals sent before the server runs its handler would count as one)."""
    noted = tmp_path / "sigterm"
    harness, started = start_serve("sh", "-c", f"trap 'echo > {noted}' TERM; while :; do sleep 300 & wait; done")
    shell = next(p for p in started if p.name() == "sh")
    harness.send_signal(signal.SIGINT)
    wait_until(noted.exists, "the group's SIGTERM")
    assert shell in alive(started), "outliving SIGTERM, within the grace period"
    group = [*started, *descendants(shell.pid)]
    harness.send_signal(signal.SIGINT)
    assert harness.wait(timeout=patience(10)) == 0
    assert alive(group) == []


def test_what_the_server_leaves_behind_when_it_exits_is_stopped_too(tmp_path):
    pid_file = tmp_path / "orphan.pid"
    command = ["sh", "-c", f"sleep 300 & echo $! > {pid_file}; exit 3"]
    harness = subprocess.Popen([sys.executable, "-c", SERVE, *command], cwd=ROOT)
    assert harness.wait(timeout=patience(20)) == 3, "the server's own exit code"
    orphan = int(pid_file.read_text())
    assert not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE


def test_dse_ui_without_a_store_or_with_a_busy_port_says_so_in_one_line(tmp_path):
    def dse_ui(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "dse.cli", "ui", *args]
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=patience(60))

    missing = dse_ui(str(tmp_path))
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert missing.stderr.strip() == (
        f"error: {tmp_path / 'mlflow.db'}: no MLflow store here; run `dse run STUDY.yaml --out {tmp_path}` first"
    )
    (tmp_path / "mlflow.db").touch()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        taken = dse_ui(str(tmp_path), "--port", str(port))
    assert taken.returncode == 2 and len(taken.stderr.strip().splitlines()) == 1
    assert taken.stderr.startswith(f"error: --port {port}: cannot serve on 127.0.0.1:{port}")


def test_sigterm_to_make_ui_stops_every_process_it_started(tmp_path):
    """The reported case: `make ui` stopped with SIGTERM (as a service manager or `kill` does) left the MLflow
    server's workers running. Through the real Makefile target, with the real server over a real study's store."""
    out = tmp_path / "study"
    run = subprocess.run(
        [sys.executable, "-m", "dse.cli", "run", str(ROOT / "studies" / "small.yaml"), "--inline", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=patience(300),
    )
    assert run.returncode == 0, run.stderr
    # The target runs $(BIN)/dse; this one runs the dse of this checkout with the interpreter running the tests.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dse").write_text(f'#!/bin/sh\nexec {sys.executable} -m dse.cli "$@"\n')
    (bin_dir / "dse").chmod(0o755)
    port = free_port()
    log = tmp_path / "make-ui.log"
    command = ["make", "-C", str(ROOT), "ui", f"BIN={bin_dir}", "STAMP=", f"DEMO_OUT={out}", f"UI_PORT={port}"]
    with log.open("wb") as sink:
        make = subprocess.Popen(command, stdout=sink, stderr=sink, start_new_session=True)
    started: list[psutil.Process] = []
    try:
        wait_until(lambda: "study small  " in log.read_text(), "the MLflow UI and the study's link", timeout=180)
        link = re.search(r"^study small  (\S+)$", log.read_text(), flags=re.M)
        assert link and link.group(1).startswith(f"http://127.0.0.1:{port}/#/experiments/1/runs?"), log.read_text()
        started = descendants(make.pid)
        assert len(started) >= 3, "dse ui, the mlflow command and its server"

        make.send_signal(signal.SIGTERM)
        make.wait(timeout=patience(60))
        assert alive(started) == [], f"left running: {[p.cmdline() for p in alive(started)]}"
        assert "Traceback" not in log.read_text()
    finally:
        if make.poll() is None:
            started = started or descendants(make.pid)
            make.kill()
            make.wait()
        for process in alive(started):
            process.kill()
