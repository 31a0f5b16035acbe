"""The emulator contract's two edges: the folder dse hands an emulator, and the metrics JSON it hands back.

Kept apart from running the command (`run.py`) and from building a SimResult (`cost_model.py`) so that an
emulator written in Python (the replay) can read its inputs and write its metrics with the same definitions.
"""

import json
import math
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveFloat, ValidationError

from dse.errors import DseError
from dse.point import chakra
from dse.system import SystemSpec
from dse.workload import Workload

SYSTEM_FILE = "system.json"
WORKLOAD_FILE = "workload.json"
TRACE_PREFIX = "trace"
"""Traces are `<folder>/trace.<rank>.et`, the groups `<folder>/trace.comm_groups.json`."""


class EmulatorError(DseError):
    """An emulator that could not run or whose output is not the contract's: the trial fails with this reason."""


class RankMetrics(BaseModel):
    """One rank's measured step, seconds from the step's common start."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    rank: int = Field(ge=0)
    end_s: NonNegativeFloat
    compute_s: NonNegativeFloat = 0.0
    comm_s: NonNegativeFloat = 0.0
    exposed_comm_s: NonNegativeFloat = 0.0
    node: str = ""
    """Where the rank ran (a host name, a Ray node id), if the emulator says."""


class Metrics(BaseModel):
    """What an emulator reports. Only the step time is required; a figure left out is not measured (its SimResult
    field is NaN, or for peak memory the analytical memory model's), never a made-up zero. Extra keys are kept
    for the emulator's own use and ignored here."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    step_time_s: PositiveFloat
    """A step takes time: zero (or less) is an emulator that measured nothing, and refused."""
    comm_time_s: NonNegativeFloat | None = None
    exposed_comm_time_s: NonNegativeFloat | None = None
    compute_time_s: NonNegativeFloat | None = None
    peak_memory_bytes: NonNegativeFloat | None = None
    ranks: list[RankMetrics] | None = None

    def line(self) -> str:
        """The metrics as the one JSON line an emulator prints last."""
        return json.dumps(self.model_dump(exclude_none=True), separators=(",", ":"))


class WorkloadInfo(BaseModel):
    """`workload.json`: what of the workload the traces do not say plainly."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    point_key: str
    world: int
    layout: list[tuple[str, int]]
    tokens: int
    dtype: str


def write_inputs(folder: Path, workload: Workload, system: SystemSpec) -> None:
    """Everything an emulator reads: traces, communicator groups, system.json, workload.json."""
    folder.mkdir(parents=True, exist_ok=True)
    chakra.export(
        workload, folder, [dim.npus for dim in system.network], prefix=TRACE_PREFIX, accelerator=system.accelerator
    )
    (folder / SYSTEM_FILE).write_text(system.model_dump_json(indent=1) + "\n")
    info = WorkloadInfo(
        point_key=workload.point_key,
        world=workload.layout.world,
        layout=list(workload.layout.axes),
        tokens=workload.tokens,
        dtype=workload.dtype,
    )
    (folder / WORKLOAD_FILE).write_text(info.model_dump_json(indent=1) + "\n")


def parse_metrics(text: str, source: str) -> Metrics:
    """The metrics in `text` (the last non-empty line of stdout, or a whole file); `source` names where it came
    from in the error."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise EmulatorError(f"{source} is empty; an emulator must end with a JSON object holding step_time_s")
    body = lines[-1] if source == "stdout" else text
    try:
        raw = json.loads(body)
    except json.JSONDecodeError:
        raise EmulatorError(f"{source} does not end with a JSON object: {_clip(lines[-1])!r}") from None
    if not isinstance(raw, dict):
        raise EmulatorError(f"{source} holds {type(raw).__name__} JSON, not an object with step_time_s")
    if "step_time_s" not in raw:
        raise EmulatorError(f"{source}'s JSON has no step_time_s (keys: {', '.join(sorted(raw)) or 'none'})")
    for key, value in raw.items():  # json.loads reads NaN and Infinity, which pydantic would name less clearly
        if isinstance(value, float) and not math.isfinite(value):
            raise EmulatorError(f"{source}'s JSON has {key} = {value}; every figure must be finite")
    try:
        return Metrics.model_validate(raw)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise EmulatorError(f"{source}'s JSON has a bad {where}: {first['msg']} (got {first['input']!r})") from None


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
