"""Session-wide fixtures: a local Ray, a multi-node Ray cluster, an MLflow server, PostgreSQL and Redis.

Each is real and costly to start (Ray 10-18 s on a 2-core machine, an MLflow server ~2 GiB), so each starts once
per session, only if a test asks for it. In-process studies reuse the local Ray (the executor never shuts down a
Ray it did not start) and `dse run` subprocesses join it with --address.

Chromium, PostgreSQL and Redis are system packages that only `.ci/run` installs; where one is missing its tests
skip (`skip_without`), and the session's summary names those tests and the one command that installs what they
need.
"""

import glob
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import NoReturn

import pytest

ROOT = Path(__file__).resolve().parent.parent
MISSING_SERVICE = "real service missing"
"""How the skip reason of a test whose system package is not installed begins (the summary looks for it)."""


def skip_without(package: str, what: str) -> NoReturn:
    """Skip the test: `what` (the binaries of apt package `package`, as .ci/run installs them) is not installed."""
    pytest.skip(f"{MISSING_SERVICE}: {what} not installed (apt package {package})")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say plainly which real-service tests did not run, and the one command that installs what they need."""
    missing: dict[str, list[str]] = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
        if found := re.search(rf"{MISSING_SERVICE}: .*\(apt package (\S+)\)", reason):
            missing.setdefault(found[1], []).append(report.nodeid)
    if not missing:
        return
    count = sum(len(tests) for tests in missing.values())
    terminalreporter.section(f"{count} real-service tests did not run", sep="=", yellow=True, bold=True)
    for package, tests in sorted(missing.items()):
        terminalreporter.line(f"{package} is not installed, so these did not run:")
        for test in tests:
            terminalreporter.line(f"  {test}")
    sudo = "" if os.geteuid() == 0 else "sudo "
    packages = " ".join(sorted(missing))
    terminalreporter.line("to run them, install what they need (as .ci/run does) and run `make test` again:")
    terminalreporter.line(f"  {sudo}apt-get update && {sudo}apt-get install -y {packages}", bold=True)


ASTRA_SIM_DEFAULT = Path(__file__).resolve().parents[2] / "shared/astra-sim/AstraSim_Analytical_Congestion_Unaware"
"""Where ../shared/astra-sim keeps the prebuilt binary beside a checkout in /work (CI sets ASTRA_SIM_BIN)."""


@pytest.fixture(scope="session")
def binary() -> Path:
    """The real ASTRA-sim binary: $ASTRA_SIM_BIN, else ../shared/astra-sim's; the test skips where neither runs."""
    path = Path(os.environ.get("ASTRA_SIM_BIN") or ASTRA_SIM_DEFAULT)
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.skip(f"ASTRA-sim binary not found at {path}: set ASTRA_SIM_BIN to ASTRA-sim's analytical binary")
    return path


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    import ray

    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(ready: Callable[[], bool], what: str, timeout: float = 60.0, poll: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout:.0f} s")
        time.sleep(poll)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


class MlflowServer:
    """A real `mlflow server` on loopback over a sqlite store; a test may stop it (an outage) and start it again
    on the same port and store. ~2 GiB resident, so one per session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        command = [
            str(Path(sys.executable).parent / "mlflow"),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{self.root / 'mlflow.db'}",
            "--artifacts-destination",
            str(self.root / "artifacts"),
        ]
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        log = (self.root / "server.log").open("ab")
        self.process = subprocess.Popen(command, stdout=log, stderr=log, env=env, start_new_session=True)
        wait_until(lambda: _answers(f"{self.uri}/health"), "mlflow server", timeout=90)

    def stop(self) -> None:
        """Stop the server and every process it started (its own process group)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process = None


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    yield server
    server.stop()


def _binary(name: str, pattern: str) -> str | None:
    found = shutil.which(name) or sorted(glob.glob(pattern))
    return found if isinstance(found, str) else (found[-1] if found else None)


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A PostgreSQL server of its own: initdb into a temporary folder, pg_ctl start on a loopback port.

    PostgreSQL refuses to run as root, so as root the folder is handed to the `postgres` user and the server
    runs as that user."""
    initdb = _binary("initdb", "/usr/lib/postgresql/*/bin/initdb")
    if initdb is None:
        skip_without("postgresql", "PostgreSQL (initdb, pg_ctl)")
    pg_ctl = str(Path(initdb).parent / "pg_ctl")
    root = Path(tempfile.mkdtemp(prefix="dse-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    data, port = root / "data", free_port()
    run = partial(subprocess.run, check=True, capture_output=True)
    run([*as_user, initdb, "-D", str(data), "-U", "dse", "--auth=trust", "-E", "UTF8"])
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
    run([*as_user, pg_ctl, "-D", str(data), "-o", options, "-l", str(root / "log"), "-w", "start"])
    yield f"postgresql://dse@127.0.0.1:{port}/postgres"
    run([*as_user, pg_ctl, "-D", str(data), "-m", "immediate", "stop"])
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    server = shutil.which("redis-server")
    if server is None:
        skip_without("redis-server", "redis-server")
    port = free_port()
    process = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    import redis

    def ping() -> bool:
        try:
            return bool(redis.Redis(port=port).ping())
        except redis.ConnectionError:
            return False

    wait_until(ping, "redis-server")
    yield f"redis://127.0.0.1:{port}/0"
    process.terminate()
    process.wait(timeout=20)


@dataclass
class RayCluster:
    address: str
    jobs_address: str
    """The dashboard's job server, for `ray job submit --address`."""
    client_address: str
    """The head's Ray Client server, for a driver outside the cluster (`dse run --address ray://...`)."""
    nodes: int
    env: dict[str, str]
    """The environment a client of the cluster needs (its auth mode)."""


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayCluster]:
    """A multi-node Ray cluster on this machine: a head and one more raylet, one CPU each, on loopback.

    Each `ray start --block` keeps its node's processes as children and takes them down when terminated (never
    `ray stop`, which stops every Ray on the machine). The cluster's own temp dir keeps it out of the
    `ray_current_cluster` file that a bare ray.init() elsewhere on the machine would join."""
    ray_bin = str(Path(sys.executable).parent / "ray")
    # Every node and client of the cluster authenticates with the machine's token (~/.ray/auth_token), as a
    # local `ray start` cluster does by default; a worker node started without the mode set is refused.
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    # The head's Ray Client proxy gives a client's server 30 s to come up; on 2 busy cores that is not always
    # enough, and the client is told "Initialization failure from server".
    env["RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S"] = "120"
    temp = tempfile.mkdtemp(prefix="dse-ray-")
    port = free_port()
    address = f"127.0.0.1:{port}"
    common = ["--block", "--num-cpus", "1", "--node-ip-address", "127.0.0.1", "--disable-usage-stats"]
    dashboard = free_port()  # the job server lives in the dashboard: `ray job submit` needs it
    head = [ray_bin, "start", "--head", "--port", str(port), "--temp-dir", temp, "--include-dashboard", "true"]
    client = free_port()
    head += [
        "--dashboard-host",
        "127.0.0.1",
        "--dashboard-port",
        str(dashboard),
        "--ray-client-server-port",
        str(client),
    ]
    starts = [head, [ray_bin, "start", "--address", address]]
    probe = f"import ray; ray.init(address='{address}'); print(sum(n['Alive'] for n in ray.nodes()))"

    def joined() -> bool:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
        return out.stdout.strip() == str(len(starts))

    processes: list[subprocess.Popen] = []
    try:
        for command in starts:
            agent = ["--dashboard-agent-listen-port", str(free_port())]
            log = open(Path(temp) / f"start-{len(processes)}.log", "wb")  # noqa: SIM115 - lives with the process
            processes.append(subprocess.Popen([*command, *common, *agent], stdout=log, stderr=log, env=env))
            if not processes[1:]:
                wait_until(lambda: Path(temp, "ray_current_cluster").exists(), "Ray head", timeout=90)
        wait_until(joined, "the Ray cluster's second node", timeout=120)
        yield RayCluster(address, f"http://127.0.0.1:{dashboard}", f"ray://127.0.0.1:{client}", len(starts), env)
    finally:
        for process in reversed(processes):
            process.terminate()
            process.wait(timeout=60)
        shutil.rmtree(temp, ignore_errors=True)
