"""EmulatorCostModel: a workload priced by an external emulator through the folder-and-metrics contract."""

import importlib.util
import math
import os
import shutil
import sys
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from dse.interfaces import ClassResult, SimResult
from dse.options import Argument, CommandPart, Folder, TimeoutSeconds
from dse.system import SystemSpec
from dse.workload import Workload
from simulators.analytical import AnalyticalCostModel
from simulators.emulator.contract import EmulatorError, Metrics, RankMetrics, write_inputs
from simulators.emulator.run import FOLDER_PLACEHOLDER, command_line, run_emulator, unrunnable
from simulators.external import run_folder

SOURCE_ROOT = Path(__file__).resolve().parents[2]
"""Where this installation's `simulators` package lives: the default command's child imports the replay from it
whatever its working directory."""
REPLAY = ("-m", "simulators.emulator.replay")


class Options(BaseModel):
    """`cost_model_options` of `cost_model: emulator`: strict as a point file is (no quoted numbers, no booleans
    for numbers, the timeout finite and bounded); keep_runs a folder, metrics a file name inside the run folder.
    Whether the command runs here is the cost model's pre-flight."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    command: list[CommandPart] | None = Field(
        None,
        min_length=1,
        description="the emulator's argument list (no shell); '{folder}' in an argument is replaced by the run "
        "folder, else the folder is appended; unset: dse's gloo replay with this Python",
    )
    args: list[Argument] = Field(
        default_factory=list, description="more arguments after command (e.g. ['--scale', '0.1'])"
    )
    timeout_s: TimeoutSeconds = Field(600.0, description="seconds before the emulator's group is killed")
    metrics: str = Field("stdout", description="'stdout' (its last line) or a file name inside the run folder")
    keep_runs: Folder | None = Field(None, description="folder to keep each run's folder in; unset: deleted")

    @field_validator("metrics")
    @classmethod
    def _inside_folder(cls, value: str) -> str:
        if value != "stdout" and (value in ("", ".", "..") or "\0" in value or Path(value).name != value):
            raise ValueError("must be 'stdout' or a plain file name inside the run folder (no '/')")
        return value


class EmulatorCostModel:
    """Prices a workload by running an emulator on its Chakra traces and reading back its measured step.

    Slow (an emulator runs the step, often for real) and opaque (no per-op timeline): meant as a refining model
    for a study's best points, or for a study of a few points. See the package docstring for the contract."""

    name = "emulator"
    Options = Options

    def __init__(self, options: Options | None = None) -> None:
        self.options = options or Options()
        if self.options.command is None and importlib.util.find_spec("torch") is None:
            raise EmulatorError(
                "the gloo replay needs torch: pip install 'dse-orchestrator[fx]' (make test installs it)"
            )

    def preflight(self) -> None:
        """The command resolves to a program this process can start (dse.interfaces.PreflightCostModel): a missing
        or non-executable one would fail every evaluation. The default replay's torch is checked on creation, and a
        program inside the run folder ('{folder}/...') exists only once the run does."""
        command = self.options.command
        if command is None or FOLDER_PLACEHOLDER in command[0]:
            return
        if problem := unrunnable(command[0]):
            raise EmulatorError(f"field 'cost_model_options.command': {problem}")

    def argv(self, folder: Path) -> list[str]:
        command = self.options.command or [sys.executable, *REPLAY]
        return command_line(command, self.options.args, folder)

    def simulate(self, workload: Workload, system: SystemSpec) -> SimResult:
        folder = run_folder(self.options.keep_runs, workload.point_key, "emulator")
        try:
            write_inputs(folder, workload, system)
            metrics = run_emulator(
                self.argv(folder), folder, self.options.timeout_s, self.options.metrics, env=self._env()
            )
        finally:
            if self.options.keep_runs is None:
                shutil.rmtree(folder, ignore_errors=True)
        return to_result(metrics, workload, system)

    def _env(self) -> dict[str, str] | None:
        """The default replay gets this installation's source root on PYTHONPATH; a user's command the plain
        environment."""
        if self.options.command is not None:
            return None
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SOURCE_ROOT), env.get("PYTHONPATH", "")) if p)
        return env


def to_result(metrics: Metrics, workload: Workload, system: SystemSpec) -> SimResult:
    """One ClassResult per rank class: the mean of its ranks' measured figures where the emulator gave per-rank
    ones, else the step's. Peak memory is the emulator's, or where it measured none the analytical memory model's
    for the class (an emulator on CPUs cannot see device memory), never invented."""
    by_rank = {r.rank: r for r in metrics.ranks or []}
    memory = None if metrics.peak_memory_bytes is not None else AnalyticalCostModel().simulate(workload, system)
    classes = []
    for index, program in enumerate(workload.programs):
        ranks = [int(r) for r in workload.ranks_of(index)]
        measured = [by_rank[r] for r in ranks if r in by_rank]
        if measured:
            end, compute, comm, exposed = (
                _mean(measured, field) for field in ("end_s", "compute_s", "comm_s", "exposed_comm_s")
            )
        else:
            end = metrics.step_time_s
            compute = _or_nan(metrics.compute_time_s)
            comm = _or_nan(metrics.comm_time_s)
            exposed = _or_nan(metrics.exposed_comm_time_s)
        if memory is None:
            peak, at_peak = float(metrics.peak_memory_bytes or 0.0), {}
        else:
            peak, at_peak = memory.classes[index].peak_memory_bytes, dict(memory.classes[index].memory_at_peak)
        classes.append(ClassResult(program.name, len(ranks), end, compute, comm, exposed, peak, at_peak, {}))
    return SimResult(metrics.step_time_s, classes)


def _mean(ranks: list[RankMetrics], field: str) -> float:
    return float(np.mean([getattr(r, field) for r in ranks]))


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value
