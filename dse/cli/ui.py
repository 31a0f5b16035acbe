"""`dse ui`: the MLflow UI over a study's local store, which stops whole, and the lines that lead to a study.

`mlflow ui` runs uvicorn's worker processes and a job runner with its own consumers, and forwards SIGTERM to
uvicorn alone. Stopped the way `make` stops its recipe (SIGTERM to its child), it left 13 processes and ~2 GiB
running a minute later, some of them spinning. So `dse ui` runs it as a process group that stops whole
(dse.cli.procgroup), with one worker and without the job runner.
"""

import argparse
import errno
import json
import os
import shlex
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path

from rich.console import Console

from dse.cli import procgroup
from dse.cli.arguments import DEMO_OUT
from dse.errors import DseError
from dse.results import browse, folders, sqlite_store, tracking

READY_S = 300.0
"""How long to wait for the server to answer before giving up on printing the studies' links."""
SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
"""The job runner serves GenAI features (judges, issue detection) that a study never uses: eight processes and
~0.7 GiB less. The user's environment wins."""


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
    store = folders.output_folder(args.out) / "mlflow.db"
    if not store.is_file():
        raise DseError(f"{store}: no MLflow store here; run `dse run STUDY.yaml --out {args.out}` first")
    sqlite_store.check(store)
    _check_port(args.host, args.port)
    uri = tracking.default_tracking_uri(args.out)
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    base = f"http://{host}:{args.port}"
    console.print(f"starting the MLflow UI on {base} over {store} (Ctrl-C stops it)", soft_wrap=True)
    threading.Thread(target=_announce, args=(base, console), name="announce", daemon=True).start()
    command = [sys.executable, "-m", "mlflow", "ui", "--host", args.host, "--port", str(args.port)]
    command += ["--workers", "1", "--backend-store-uri", uri]
    return procgroup.serve(command, {**SERVER_ENV, **os.environ})


def _check_port(host: str, port: int) -> None:
    """Fail in one line before the server starts, rather than after its start-up logs: a host that is no address
    of this machine, a port in use or one this user may not serve on."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except (socket.gaierror, UnicodeError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise DseError(
            f"--host {host}: not a name or address to serve on ({reason}); give an address of this machine, e.g. "
            "127.0.0.1, or 0.0.0.0 for every interface"
        ) from None
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            reason = f"cannot serve on {host}:{port} ({exc.strerror})"
            if exc.errno == errno.EADDRNOTAVAIL:
                raise DseError(f"--host {host}: {reason}; give an address of this machine, e.g. 127.0.0.1") from None
            fix = "ports below 1024 need root" if exc.errno == errno.EACCES else "stop what serves it"
            raise DseError(f"--port {port}: {reason}; {fix}, or pass another --port") from None


def _announce(base: str, console: Console) -> None:
    """Once the server answers (it takes ~15 s), print each study's link: the latest study run's trials view.

    Asked over the server's REST API, so that this process, which only waits, does not import MLflow (~0.2 GiB).
    """
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        try:
            request = urllib.request.Request(
                f"{base}/api/2.0/mlflow/experiments/search",
                data=json.dumps({"max_results": 1000}).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=10) as response:
                experiments = json.load(response).get("experiments", [])
            break
        except OSError:
            time.sleep(0.5)
    else:
        return
    console.print(f"MLflow UI     {base}", soft_wrap=True)
    for experiment in sorted(experiments, key=lambda e: e["name"]):
        view = browse.latest_view({tag["key"]: tag["value"] for tag in experiment.get("tags", [])})
        if view:
            url = browse.experiment_url(base, experiment["experiment_id"], view)
            console.print(f"study {experiment['name']}  {url}", soft_wrap=True)
