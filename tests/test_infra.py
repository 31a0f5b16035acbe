"""Every file in infra/ loads, and the fields that must agree with the CLI do: each `dse` command line parses with
the real argument parser and names study files that load, the nightly schedule is the same everywhere, the
nightly jobs log to the MLflow server the server unit starts, and the Ray versions and ports match."""

import configparser
import shlex
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import ray
import yaml
from conftest import ROOT

from dse.cli.main import _parser
from dse.search.space import load_study
from dse.search.storage import RDB_SCHEMES

INFRA = ROOT / "infra"
NIGHTLY_CRON = "30 1 * * *"


def parse_dse(args: list[str]):
    """The arguments as `dse` parses them; an unknown option or command fails the test instead of exiting."""
    try:
        return _parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"`dse {shlex.join(args)}` does not parse with the CLI")


def check_study_paths(args) -> None:
    """Study files and suites named relative to the checkout (the jobs run from its root) exist and load."""
    if args.command == "run":
        load_study(ROOT / args.study)
    elif args.command == "nightly":
        files = sorted((ROOT / args.suite).glob("*.yaml"))
        assert files, args.suite
        for path in files:
            load_study(path)


def after_dse(tokens: list[str]) -> list[str]:
    index = next(i for i, t in enumerate(tokens) if t == "dse" or t.endswith("/dse"))
    return tokens[index + 1 :]


def unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string((INFRA / "systemd" / name).read_text())
    return parser


def mlflow_server_uri() -> str:
    """The URI the MLflow server unit listens on, from its ExecStart as MLflow's own CLI parses it."""
    from mlflow.cli import server

    tokens = shlex.split(unit("mlflow.service")["Service"]["ExecStart"])
    assert tokens[0].endswith("/mlflow") and tokens[1] == "server"
    params = server.make_context("server", tokens[2:]).params
    assert urlsplit(params["backend_store_uri"]).scheme == "postgresql"
    return f"http://{params['host']}:{params['port']}"


def test_ray_cluster_launcher():
    config = yaml.safe_load((INFRA / "ray-cluster.yaml").read_text())
    head_start = " ".join(config["head_start_ray_commands"])
    worker_start = " ".join(config["worker_start_ray_commands"])
    port = head_start.split("--port=")[1].split()[0]
    assert f"--address=$RAY_HEAD_IP:{port}" in worker_start
    assert config["head_node_type"] in config["available_node_types"]
    assert config["available_node_types"]["head"]["resources"] == {"CPU": 0}, "the driver's node runs no evaluation"
    assert any("pip install" in c and "-e ~/dse" in c for c in config["setup_commands"]), "dse installed everywhere"
    assert config["file_mounts"] == {"/home/ubuntu/dse": "."}


def test_kuberay_rayjob_runs_one_study_against_shared_storage():
    job = yaml.safe_load((INFRA / "kubernetes" / "rayjob-study.yaml").read_text())
    assert job["kind"] == "RayJob" and job["apiVersion"] == "ray.io/v1"
    args = parse_dse(after_dse(shlex.split(job["spec"]["entrypoint"])))
    assert args.command == "run" and args.address == "auto"
    check_study_paths(args)
    assert urlsplit(args.storage).scheme in RDB_SCHEMES, "a rerun of the job resumes from the shared storage"
    assert args.tracking_uri.startswith("http://")
    assert job["spec"]["rayClusterSpec"]["rayVersion"] == ray.__version__
    assert job["spec"]["shutdownAfterJobFinishes"] is True


def test_nightly_cronjob():
    cron = yaml.safe_load((INFRA / "kubernetes" / "nightly-cronjob.yaml").read_text())
    assert cron["kind"] == "CronJob" and cron["spec"]["schedule"] == NIGHTLY_CRON
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    container = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    command = container["command"]
    assert command[:3] == ["ray", "job", "submit"] and "--" in command
    args = parse_dse(after_dse(command))
    assert args.command == "nightly" and args.address == "auto"
    check_study_paths(args)
    rayjob = yaml.safe_load((INFRA / "kubernetes" / "rayjob-study.yaml").read_text())
    study_args = parse_dse(after_dse(shlex.split(rayjob["spec"]["entrypoint"])))
    assert args.tracking_uri == study_args.tracking_uri, "studies and nights log to the same MLflow"
    assert {"name": "RAY_AUTH_MODE", "value": "token"} in container["env"]


def test_systemd_units_and_crontab_agree_with_the_cli_and_the_mlflow_server():
    uri = mlflow_server_uri()
    service = unit("dse-nightly.service")["Service"]
    tokens = shlex.split(service["ExecStart"])
    assert tokens[0] == "/opt/dse/.venv/bin/dse"
    args = parse_dse(tokens[1:])
    assert args.command == "nightly"
    check_study_paths(args)
    assert service["Environment"] == f"MLFLOW_TRACKING_URI={uri}"
    assert service["Type"] == "oneshot"

    timer = unit("dse-nightly.timer")
    assert timer["Timer"]["Unit"] == "dse-nightly.service"
    minute, hour = NIGHTLY_CRON.split()[:2]
    assert timer["Timer"]["OnCalendar"] == f"*-*-* {int(hour):02d}:{int(minute):02d}:00"
    assert timer["Install"]["WantedBy"] == "timers.target"

    lines = [line for line in (INFRA / "crontab").read_text().splitlines() if line and not line.startswith("#")]
    assert lines[0] == f"MLFLOW_TRACKING_URI={uri}"
    fields = lines[1].split(maxsplit=5)
    assert " ".join(fields[:5]) == NIGHTLY_CRON
    command = fields[5].split("&&")[1].split(">>")[0]
    cron_args = parse_dse(after_dse(shlex.split(command)))
    assert vars(cron_args) == vars(args), "cron and systemd run the same nightly command"


def test_every_infra_file_is_covered():
    files = {str(p.relative_to(INFRA)) for p in INFRA.rglob("*") if p.is_file()}
    assert files == {
        "ray-cluster.yaml",
        "kubernetes/rayjob-study.yaml",
        "kubernetes/nightly-cronjob.yaml",
        "systemd/dse-nightly.service",
        "systemd/dse-nightly.timer",
        "systemd/mlflow.service",
        "crontab",
    }
    assert Path(INFRA / "systemd" / "mlflow.service").read_text().count("ExecStart=") == 1
