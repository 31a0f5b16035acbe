"""Session-wide fixtures: a local Ray, a multi-node Ray cluster, an MLflow server, PostgreSQL and Redis.

Each is real and costly to start (Ray 10-18 s on a 2-core machine, an MLflow server ~2 GiB), so each starts once
per session, only if a test asks for it. In-process studies reuse the local Ray (the executor never shuts down a
Ray it did not start) and `dse run` subprocesses join it with --address.

Chromium, PostgreSQL and Redis are system packages that only `.ci/run` installs; where one is missing its tests
skip (`skip_without`), and the session's summary names those tests and the one command that installs what they
need.
"""

import contextlib
import glob
import json
import logging
import math
import os
import re
import secrets
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


SLOW = "DSE_TEST_SLOW"
"""How many times slower than an idle 2-core machine this one may be (a number >= 1): every budget a test waits
with is multiplied by it, or by the load per core if that is larger (README, `make test`)."""


def slowness() -> float:
    """The factor budgets are multiplied by now: DSE_TEST_SLOW, or the last minute's load average per core when
    larger (a test that waits on a condition keeps its meaning; only its ceiling grows), and at least 1."""
    declared = os.environ.get(SLOW) or "1"
    try:
        factor = float(declared)
    except ValueError:
        factor = math.nan
    if not 1 <= factor < math.inf:
        raise pytest.UsageError(
            f"{SLOW}={declared}: must be a number of at least 1 (how many times slower than an idle machine)"
        )
    return max(factor, os.getloadavg()[0] / (os.cpu_count() or 1))


def patience(seconds: float) -> float:
    """A budget that guards against a hang (a wait's ceiling, a subprocess timeout) as long as this machine, at its
    present load, needs it: `seconds` are for an idle machine. Never for a timeout that is the behaviour under
    test."""
    return seconds * slowness()


SLOW_IMPORT = "rfc3987_syntax"
"""An optional dependency of jsonschema's format checkers (jsonschema[format-nongpl], which mlc-chakra brings in
through HolisticTraceAnalysis and jupyterlab) that builds an Earley parser of RFC 3987 when imported: 2.3-2.8 s of
CPU in every process that imports Ray (Ray imports jsonschema), against 0.9 s for the rest of `import ray`. On 2
cores that is most of what a Ray actor, a `dse run` driver on Ray, a `ray start` node's dozen processes or a Ray
Client server take to start, hundreds of times a session (python-jsonschema/jsonschema#1428). Only jsonschema's
`iri` and `iri-reference` formats use it, which neither dse nor Ray validates."""


def _without_slow_import(stubs: Path) -> None:
    """Make SLOW_IMPORT unimportable in this process and in every process the tests start (they inherit PYTHONPATH:
    subprocesses, Ray's workers and nodes, multiprocessing's children), by a package of that name in `stubs` whose
    import raises ImportError, which jsonschema takes as the package not being installed."""
    package = stubs / SLOW_IMPORT
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"raise ImportError('{SLOW_IMPORT} is left out of the tests (conftest.py)')\n")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(stubs), os.environ.get("PYTHONPATH")]))
    sys.modules.setdefault(SLOW_IMPORT, None)  # type: ignore[arg-type]  # None in sys.modules: ImportError


def pytest_configure(config: pytest.Config) -> None:
    slowness()  # a bad DSE_TEST_SLOW is refused before any test runs
    stubs = Path(tempfile.mkdtemp(prefix="dse-test-stubs-"))
    config.add_cleanup(partial(shutil.rmtree, stubs, ignore_errors=True))
    _without_slow_import(stubs)
    os.environ["DSE_FX_CACHE"] = "off"  # captures are not kept between test runs (test_fx_speed.py sets its own)
    # The tests read tables as a pipe gets them (dse.cli.main.PIPED_WIDTH), which an exported terminal size would
    # narrow: pytest-xdist's workers run with COLUMNS=80.
    for variable in ("COLUMNS", "LINES"):
        os.environ.pop(variable, None)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """pytest-timeout's limit on the test (its own mark, else pyproject's `timeout`), scaled by `patience` when the
    test starts: a session fixture started for it (a Ray cluster) counts against it too."""
    if item.config.pluginmanager.hasplugin("timeout"):
        mark = item.get_closest_marker("timeout")
        limit = (
            mark.args[0] if mark and mark.args else item.config.getoption("timeout") or item.config.getini("timeout")
        )
        if limit and float(limit) > 0:
            item.add_marker(pytest.mark.timeout(patience(float(limit))), append=False)
    yield


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
    os.environ.update(ray_start_budgets())  # the settable waits of the processes ray.init starts
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
            break
        except Exception as exc:  # Ray's fixed 30 s for its raylet to register, missed on a loaded machine
            ray.shutdown()
            if attempt == RAY_START_ATTEMPTS or "timed out during startup" not in str(exc):
                raise
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(ready: Callable[[], bool], what: str, timeout: float = 60.0, poll: float = 0.2) -> None:
    """Poll `ready` until it holds; `timeout` is an idle machine's ceiling, stretched by `patience`."""
    ceiling = patience(timeout)
    deadline = time.monotonic() + ceiling
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{what} not ready after {ceiling:.0f} s ({timeout:g} s x {ceiling / timeout:.1f} for load)"
            )
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
    wait = ["-w", "-t", str(round(patience(60)))]
    run([*as_user, pg_ctl, "-D", str(data), "-o", options, "-l", str(root / "log"), *wait, "start"])
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
    process.wait(timeout=patience(20))


@dataclass
class RayCluster:
    address: str
    jobs_address: str
    """The dashboard's job server, for `ray job submit --address`."""
    client_address: str
    """The head's Ray Client server, for a driver outside the cluster (`dse run --address ray://...`)."""
    nodes: int
    env: dict[str, str]
    """The environment a client of the cluster needs (its auth mode and token)."""


RAY_START_ATTEMPTS = 3
"""How many times a node's `ray start` is tried. Some of Ray's own startup waits are fixed (the raylet gives its
dashboard agent 15 s to report its port, the node then has 30 s to register), and on a loaded machine the agent,
a Python process among a dozen starting at once, can miss them: `ray start` then gives up and exits."""
RAY_NICE = -10
"""The niceness of the cluster's processes where the tests run as root (as CI does): a real cluster's nodes are
machines of their own, and with it the agent gets most of a core beside busy loops of the same session."""


def ray_start_budgets() -> dict[str, str]:
    """Ray's startup waits that can be set, stretched by `patience`: beside four busy loops the head's dashboard
    (ten Python processes) took over its 60 s to come up."""
    return {
        "RAY_DASHBOARD_STARTUP_TIMEOUT_S": str(round(patience(60))),
        "RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT": str(round(patience(30))),
        "RAY_agent_register_timeout_ms": str(round(patience(30) * 1000)),
        "RAY_worker_register_timeout_seconds": str(round(patience(60))),
        # The head's Ray Client proxy gives a client's server 30 s to come up, or the client is told
        # "Initialization failure from server".
        "RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S": str(round(patience(120))),
    }


class RayStartExited(RuntimeError):
    """A `ray start` exited before its node was up."""


class RayNodes:
    """The `ray start --block` processes of a cluster on this machine, each in a process group of its own: each
    keeps its node's processes as children and takes them down when terminated (never `ray stop`, which stops
    every Ray on the machine), and its group is killed after it, so a failed start leaves nothing behind.

    A process group, not a session: where the kernel schedules by session (autogroup, as here), a session of its
    own gave a node's dozen processes one session's share of the CPU, and its agents missed Ray's fixed waits
    under a load of 8 three times in a row; in the tests' session the cluster came up in about a minute."""

    def __init__(self, temp: str, env: dict[str, str]) -> None:
        self.temp = temp
        self.env = env
        self.processes: list[subprocess.Popen] = []

    def start(self, arguments: Callable[[], list[str]], ready: Callable[[], bool], what: str) -> None:
        """Start a node, `ray start ARGUMENTS` (made afresh for each attempt: new ports), and wait until `ready`;
        a `ray start` that gives up first is tried again, RAY_START_ATTEMPTS times in all."""
        ray_bin = str(Path(sys.executable).parent / "ray")
        common = ["--block", "--num-cpus", "1", "--node-ip-address", "127.0.0.1", "--disable-usage-stats"]
        for attempt in range(1, RAY_START_ATTEMPTS + 1):
            log = Path(self.temp, f"start-{len(self.processes)}-{attempt}.log")
            with log.open("wb") as sink:
                command = [ray_bin, "start", *arguments(), *common]
                if os.geteuid() == 0:
                    command = ["nice", "-n", str(RAY_NICE), *command]
                process = subprocess.Popen(command, stdout=sink, stderr=sink, env=self.env, process_group=0)
            self.processes.append(process)
            try:
                wait_until(self._up(ready, log), what, timeout=180, poll=1.0)
                return
            except RayStartExited:
                self.processes.pop()
                _kill_group(process)
                if attempt == RAY_START_ATTEMPTS:
                    raise

    def _up(self, ready: Callable[[], bool], log: Path) -> Callable[[], bool]:
        """`ready`, failing at once if a `ray start` has exited instead of waiting out the budget."""

        def check() -> bool:
            for process in self.processes:
                if process.poll() is None:
                    continue
                if process is not self.processes[-1]:
                    raise RuntimeError(f"the `ray start` of a node already up exited {process.returncode}")
                tail = log.read_text(errors="replace")[-3000:]
                raise RayStartExited(f"`ray start` exited {process.returncode}, its node not up:\n{tail}")
            return ready()

        return check

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.terminate()
            try:
                process.wait(timeout=patience(60))
            finally:
                _kill_group(process)


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL whatever is left in the process group that `process` leads."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayCluster]:
    """A multi-node Ray cluster on this machine: a head and one more raylet, one CPU each, on loopback.

    Ready when the head's dashboard lists every node alive: one HTTP request a second (a probe driver per poll
    was itself the slow part on a loaded machine), and the job server, in the dashboard, is then up too. The
    cluster's own temp dir keeps it out of the `ray_current_cluster` file that a bare ray.init() elsewhere on the
    machine would join."""
    # Every node and client of the cluster authenticates with a token of its own (a local `ray start` cluster
    # uses token auth by default; a worker node started without the mode set is refused), which also lets the
    # fixture ask the head's dashboard how many nodes are up.
    token = secrets.token_hex(32)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, **ray_start_budgets()}
    temp = tempfile.mkdtemp(prefix="dse-ray-")
    head: dict[str, int] = {}

    def head_arguments() -> list[str]:
        head.update(port=free_port(), dashboard=free_port(), client=free_port())
        return [
            *("--head", "--port", str(head["port"]), "--temp-dir", temp, "--include-dashboard", "true"),
            *("--dashboard-host", "127.0.0.1", "--dashboard-port", str(head["dashboard"])),
            *("--ray-client-server-port", str(head["client"]), *agent_ports()),
        ]

    def worker_arguments() -> list[str]:
        return ["--address", f"127.0.0.1:{head['port']}", *agent_ports()]

    def alive(count: int) -> Callable[[], bool]:
        def listed() -> bool:
            request = urllib.request.Request(
                f"http://127.0.0.1:{head['dashboard']}/api/v0/nodes?limit=100",
                headers={"Authorization": f"Bearer {token}"},
            )
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    nodes = json.load(response)["data"]["result"]["result"]
            except OSError:  # not listening yet, or not answering yet
                return False
            return sum(node["state"] == "ALIVE" for node in nodes) == count

        return listed

    nodes = RayNodes(temp, env)
    try:
        nodes.start(head_arguments, alive(1), "the Ray cluster's head")
        nodes.start(worker_arguments, alive(2), "the Ray cluster's second node")
        address = f"127.0.0.1:{head['port']}"
        yield RayCluster(address, f"http://127.0.0.1:{head['dashboard']}", f"ray://127.0.0.1:{head['client']}", 2, env)
    finally:
        nodes.stop()
        shutil.rmtree(temp, ignore_errors=True)


def agent_ports() -> list[str]:
    """Ports for a node's agents, given rather than reported: the raylet then does not wait for the runtime-env
    agent's port file (one of its fixed 15 s waits)."""
    return [
        *("--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port", str(free_port())),
        *("--metrics-export-port", str(free_port()), "--runtime-env-agent-port", str(free_port())),
    ]
