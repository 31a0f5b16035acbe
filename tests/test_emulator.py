"""The emulator contract with small fake emulators: what dse hands over, what it reads back, every failure."""

import importlib.metadata
import importlib.util
import json
import math
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import pytest
from conftest import patience
from pydantic import ValidationError

from dse.point import chakra
from dse.system import SystemSpec
from generators.symbolic import SymbolicGenerator
from simulators.analytical import AnalyticalCostModel
from simulators.emulator import EmulatorCostModel, EmulatorError
from simulators.emulator.contract import write_inputs
from simulators.emulator.plan import load_plan
from tests.helpers import make_point

ROOT = Path(__file__).resolve().parents[1]
LOOP = {"topology": "ring", "npus": 4, "bandwidth_GBps": 1.0, "latency_ns": 100_000}


@pytest.fixture(scope="module")
def case():
    point = make_point("tiny-llama", system={"name": "loop4", "accelerator": "h100-sxm", "network": [LOOP]}, tp=2, dp=2)
    return SymbolicGenerator().generate(point), point.system


def fake(code: str, **options) -> EmulatorCostModel:
    """An emulator that is a Python snippet; sys.argv[1] is the run folder unless options say otherwise."""
    return EmulatorCostModel(EmulatorCostModel.Options(command=[sys.executable, "-c", code], **options))


def test_the_folder_holds_the_contract_and_per_rank_metrics_become_class_results(case, tmp_path):
    workload, system = case
    code = """
import json, sys, pathlib
folder = pathlib.Path(sys.argv[1])
info = json.loads((folder / "workload.json").read_text())
system = json.loads((folder / "system.json").read_text())
groups = json.loads((folder / "trace.comm_groups.json").read_text())
traces = sorted(p.name for p in folder.glob("trace.*.et"))
ranks = [{"rank": r, "end_s": 1.0 + r, "compute_s": 0.5, "comm_s": 0.1 * r, "exposed_comm_s": 0.05 * r}
         for r in range(info["world"])]
print("emulator log line")
print(json.dumps({"step_time_s": 4.0, "ranks": ranks, "seen": [info, system["name"], groups, traces]}))
"""
    model = fake(code, keep_runs=str(tmp_path))
    result = model.simulate(workload, system)
    assert result.step_time_s == 4.0
    assert sum(c.ranks for c in result.classes) == 4
    assert len(result.classes) == len(workload.programs)
    assert result.comm_time_s == pytest.approx(0.1 * (0 + 1 + 2 + 3) / 4)
    assert result.exposed_comm_time_s == pytest.approx(0.05 * 6 / 4)
    assert result.compute_time_s == pytest.approx(0.5)
    # No memory measured: the analytical memory model's peak, not a made-up one.
    assert result.peak_memory_bytes == AnalyticalCostModel().simulate(workload, system).peak_memory_bytes > 0
    (kept,) = tmp_path.iterdir()
    info = json.loads((kept / "workload.json").read_text())
    assert info == {
        "point_key": workload.point_key,
        "world": 4,
        "layout": [list(axis) for axis in workload.layout.axes],
        "tokens": workload.tokens,
        "dtype": workload.dtype,
    }
    assert SystemSpec.model_validate_json((kept / "system.json").read_text()) == system
    assert sorted(p.name for p in kept.glob("trace.*.et")) == [f"trace.{r}.et" for r in range(4)]


def test_step_level_metrics_from_a_file_named_in_the_options(case):
    workload, system = case
    code = """
import json, sys, pathlib
pathlib.Path(sys.argv[2], "out.json").write_text(json.dumps({"step_time_s": 2.5, "comm_time_s": 1.0,
    "peak_memory_bytes": 123.0}))
print("not json, and not read")
"""
    model = fake(code, args=["--into", "{folder}"], metrics="out.json")
    assert model.argv(Path("/x"))[-2:] == ["--into", "/x"]
    result = model.simulate(workload, system)
    assert (result.step_time_s, result.comm_time_s, result.peak_memory_bytes) == (2.5, 1.0, 123.0)
    assert math.isnan(result.exposed_comm_time_s)  # not measured, not zero


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        ("print('hello'); print('garbage {')", "stdout does not end with a JSON object: 'garbage {'"),
        ("print('[1, 2]')", "stdout holds list JSON, not an object with step_time_s"),
        ("print('{\"comm_time_s\": 1}')", "stdout's JSON has no step_time_s (keys: comm_time_s)"),
        ("print('{\"step_time_s\": -1}')", "stdout's JSON has a bad step_time_s"),
        ("print('{\"step_time_s\": NaN}')", "stdout's JSON has step_time_s = nan; every figure must be finite"),
        ("pass", "stdout is empty"),
        (
            "import sys; print('a', file=sys.stderr); print('boom: no route', file=sys.stderr); sys.exit(3)",
            "exited 3; stderr: a | boom: no route",
        ),
    ],
)
def test_bad_output_is_a_one_line_error(case, code, reason):
    workload, system = case
    with pytest.raises(EmulatorError) as error:
        fake(code).simulate(workload, system)
    assert reason in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("step", ["0", "0.0", "-0.001", "true"])
def test_a_zero_negative_or_boolean_step_time_is_a_contract_violation(case, step):
    """An emulator that measured no time (or says `true`) breaks the contract: the trial fails with the reason."""
    workload, system = case
    with pytest.raises(EmulatorError, match=r"stdout's JSON has a bad step_time_s: Input should be") as error:
        fake(f"print('{{\"step_time_s\": {step}}}')").simulate(workload, system)
    assert f"(got {step.replace('true', 'True')})" in str(error.value)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a container's init to reap it is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_timeout_kills_the_emulator_and_its_children(case, tmp_path):
    """A shell as the emulator: it starts its child and says so in milliseconds, well within the 2 s timeout under
    test even on a loaded machine (a Python emulator's start alone took seconds there)."""
    workload, system = case
    pids = tmp_path / "pids"
    script = f'sleep 60 & echo "$$ $!" > {pids}; echo started >&2; sleep 60'
    emulator = EmulatorCostModel(EmulatorCostModel.Options(command=["/bin/sh", "-c", script], timeout_s=2))
    start = time.monotonic()
    with pytest.raises(EmulatorError, match=r"ran past its timeout of 2 s and was killed; stderr: started"):
        emulator.simulate(workload, system)
    assert time.monotonic() - start < patience(20)
    for pid in map(int, pids.read_text().split()):
        deadline = time.monotonic() + patience(5)  # SIGKILL is delivered asynchronously: a moment later when loaded
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), f"process {pid} outlived the trial"


def test_missing_and_non_executable_commands(case, tmp_path, monkeypatch):
    workload, system = case
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its run folders, not another test's running beside it
    missing = EmulatorCostModel(EmulatorCostModel.Options(command=[str(tmp_path / "no-such-emulator")]))
    with pytest.raises(EmulatorError, match=r"no-such-emulator' not found; set cost_model_options\.command"):
        missing.simulate(workload, system)
    script = tmp_path / "emu.sh"
    script.write_text("#!/bin/sh\necho '{\"step_time_s\": 1}'\n")
    plain = EmulatorCostModel(EmulatorCostModel.Options(command=[str(script)]))
    with pytest.raises(EmulatorError, match=r"emu\.sh' is not executable"):
        plain.simulate(workload, system)
    script.chmod(0o755)
    assert plain.simulate(workload, system).step_time_s == 1.0
    assert not list(tmp_path.glob("dse-emulator-*"))  # run folders gone


def test_options_are_checked():
    with pytest.raises(ValidationError, match="extra"):
        EmulatorCostModel.Options(comand=["x"])
    with pytest.raises(ValidationError, match="plain file name"):
        EmulatorCostModel.Options(metrics="../out.json")
    with pytest.raises(ValidationError):
        EmulatorCostModel.Options(timeout_s=0)


def test_registered_as_the_emulator_cost_model_whose_default_is_the_replay():
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["dse.simulators"]
    loaded = importlib.metadata.EntryPoint("emulator", entry["emulator"], "dse.simulators").load()
    assert loaded is EmulatorCostModel and loaded.name == "emulator"
    assert loaded().argv(Path("/run")) == [sys.executable, "-m", "simulators.emulator.replay", "/run"]


def test_the_replay_plan_reads_whole_buffers_durations_groups_and_scales_sizes(case, tmp_path):
    workload, system = case
    write_inputs(tmp_path, workload, system)
    plan, half = load_plan(tmp_path), load_plan(tmp_path, scale=0.5)
    ir = chakra.read(tmp_path)
    assert plan.groups == {int(k): v for k, v in json.loads((tmp_path / "trace.comm_groups.json").read_text()).items()}
    for rank, steps in enumerate(plan.ranks):
        ops = ir.blocks[rank].ops
        assert [s.nbytes for s in steps if s.kind != "compute"] == [round(o.comm_bytes) for o in ops if o.is_comm]
        assert all(rank in plan.groups[s.group] for s in steps if s.kind == "collective")
        assert all(d < i for i, s in enumerate(steps) for d in s.deps)
    durations = [
        n.duration_micros for n in chakra.read_nodes(tmp_path / "trace.0.et")[1] if n.type == chakra.pb.COMP_NODE
    ]
    assert sum(durations) > 0
    assert sum(s.seconds for s in plan.ranks[0]) == pytest.approx(sum(durations) * 1e-6)
    assert [h.nbytes for h in half.ranks[0]] == [
        max(1, round(s.nbytes * 0.5)) if s.nbytes else 0 for s in plan.ranks[0]
    ]


def test_without_torch_choosing_the_replay_says_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    with pytest.raises(EmulatorError, match=r"^the gloo replay needs torch: pip install 'dse-orchestrator\[fx\]'"):
        EmulatorCostModel()
    EmulatorCostModel(EmulatorCostModel.Options(command=["my-emulator"]))  # a command of the user's needs no torch
