"""`dse ui`: the MLflow UI over a study's local store, as one process group that stops whole.

`mlflow ui` runs uvicorn's worker processes and a job runner with its own consumers, and forwards SIGTERM to
uvicorn alone. Stopped the way `make` stops its recipe (SIGTERM to its child), it left 13 processes and ~2 GiB
running a minute later, some of them spinning. So `dse ui` starts the server in a process group of its own and,
on SIGTERM, SIGINT (Ctrl-C) or SIGHUP, or when the server exits by itself, stops the whole group: SIGTERM, then
SIGKILL for whatever is left after a grace period.
"""

import argparse
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from dse import browse, tracking
from dse.errors import DseError

DEMO_OUT = Path("runs/quickstart")
"""The output folder `make ui` serves (the Makefile's DEMO_OUT)."""
PORT = 5000
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
GRACE_S = 10.0
"""How long the server's processes get to exit on SIGTERM before SIGKILL."""
SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
"""The job runner serves GenAI features (judges, issue detection) that a study never uses: eight processes and
~0.7 GiB less. The user's environment wins."""


def add_parser(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    ui = commands.add_parser(
        "ui",
        help="serve the MLflow UI over a study's local store",
        description="Start the MLflow UI over OUT_DIR/mlflow.db (the store `dse run` writes without "
        "--tracking-uri) and print each study's link: its trials in a table with the objectives as columns. "
        "Ctrl-C or SIGTERM stops the server and every process it started.",
    )
    ui.add_argument(
        "out", type=Path, nargs="?", default=DEMO_OUT, metavar="OUT_DIR", help=f"a study's output folder ({DEMO_OUT})"
    )
    ui.add_argument("--port", type=int, default=PORT, help=f"port to serve on (default: {PORT})")
    ui.add_argument("--host", default="127.0.0.1", help="interface to serve on (default: 127.0.0.1, this machine)")


def start_command(out: Path) -> str:
    """The command that serves the UI over `out`'s local store."""
    command = f"dse ui {shlex.quote(str(out))}"
    return f"make ui, or {command}" if out.resolve() == DEMO_OUT.resolve() else command


def browse_lines(uri: str, experiment_id: str, parent_id: str, out: Path) -> list[str]:
    """What `dse run` prints to lead to a study in the MLflow UI: its runs table and its parent run, on the
    tracking server or on the UI that `dse ui` serves over the local store (with the command that starts it)."""
    if not parent_id:
        return []
    if uri.startswith(("http:", "https:")):
        base, start = uri, None
    elif uri == tracking.default_tracking_uri(out):
        base, start = browse.LOCAL_UI, start_command(out)
    elif uri.startswith("sqlite:"):
        base, start = browse.LOCAL_UI, f"mlflow ui --backend-store-uri {uri}"
    else:
        return []
    lines = [
        f"browse        {browse.experiment_url(base, experiment_id, browse.view_id(parent_id))}",
        f"study run     {browse.run_url(base, experiment_id, parent_id)}  (Pareto plots and tables under Artifacts)",
    ]
    if start:
        lines.append(f"start the UI  {start}")
    return lines


def main(args: argparse.Namespace, console: Console) -> int:
    store = args.out / "mlflow.db"
    if not store.is_file():
        raise DseError(f"{store}: no MLflow store here; run `dse run STUDY.yaml --out {args.out}` first")
    _check_port(args.host, args.port)
    uri = tracking.default_tracking_uri(args.out)
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    base = f"http://{host}:{args.port}"
    console.print(f"MLflow UI     {base} over {store} (Ctrl-C stops it)", soft_wrap=True)
    for name, experiment_id, view in _studies(uri):
        console.print(f"study {name}  {browse.experiment_url(base, experiment_id, view)}", soft_wrap=True)
    command = [sys.executable, "-m", "mlflow", "ui", "--host", args.host, "--port", str(args.port)]
    command += ["--workers", "1", "--backend-store-uri", uri]
    return serve(command, {**SERVER_ENV, **os.environ})


def _check_port(host: str, port: int) -> None:
    """Fail in one line before the server starts, rather than after its start-up logs."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            reason = f"cannot serve on {host}:{port} ({exc.strerror})"
            raise DseError(f"--port {port}: {reason}; stop what serves it or pass another --port") from None


def _studies(uri: str) -> list[tuple[str, str, str]]:
    """(name, experiment id, latest view) of each study in the store, i.e. each experiment with a dse view."""
    from mlflow import MlflowClient

    logging.getLogger("alembic").setLevel(logging.ERROR)
    found = [(e.name, e.experiment_id, browse.latest_view(e.tags)) for e in MlflowClient(uri).search_experiments()]
    return sorted((name, experiment_id, view) for name, experiment_id, view in found if view)


def serve(command: list[str], env: dict[str, str]) -> int:
    """Run `command` in a process group of its own until it exits or this process is asked to stop; either way
    no process of the group outlives the call. Returns the command's exit code, 0 when asked to stop."""
    requested: list[int] = []
    process: subprocess.Popen[bytes] | None = None

    def stop(signum: int, frame: object) -> None:
        requested.append(signum)
        if process is not None:  # a second signal does not wait for the grace period
            _signal_group(process.pid, signal.SIGKILL if len(requested) > 1 else signal.SIGTERM)

    previous = {number: signal.signal(number, stop) for number in STOP_SIGNALS}
    try:
        process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, process_group=0)
        if requested:  # a signal that came while the server was starting
            _signal_group(process.pid, signal.SIGTERM)
        code = process.wait()
    finally:
        if process is not None:
            _stop_group(process.pid)
        for number, handler in previous.items():
            signal.signal(number, handler)
    return 0 if requested else code


def _signal_group(group: int, number: int) -> bool:
    """Send a signal to a process group; False when no process is left in it."""
    try:
        os.killpg(group, number)
    except ProcessLookupError:
        return False
    return True


def _stop_group(group: int) -> None:
    if not _signal_group(group, signal.SIGTERM):
        return
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline:
        if not _signal_group(group, 0):
            return
        time.sleep(0.1)
    _signal_group(group, signal.SIGKILL)
