"""Building design points in tests without point files, and running the CLI in-process."""

import contextlib
import io
import textwrap
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from conftest import patience

from dse.cli.main import main
from dse.point.points import assign, build_point, expand
from dse.spec import DesignPoint
from dse.system import AcceleratorSpec, SystemSpec
from dse.workload import Workload
from simulators.analytical import steady
from simulators.analytical.compiled_engine import CompiledScheduler
from simulators.analytical.steady_reads import Reads, reads

UNIT_ACCELERATOR = AcceleratorSpec(
    name="unit",
    peak_tflops={"bf16": 1.0},
    hbm_GiB=80,
    hbm_bandwidth_GBps=1000,
    compute_efficiency={"gemm": 1.0, "norm": 1.0, "optimizer": 1.0},
    memory_efficiency=1.0,
    kernel_launch_us=0.0,
)
"""1 TFLOP/s at full efficiency and no launch cost: a GEMM of ms * 1e9 FLOPs takes ms milliseconds."""


def make_point(
    model: str = "tiny-llama",
    system: Any = "tiny-ring",
    seq_len: int = 256,
    global_batch: int = 8,
    micro_batch: int = 1,
    overrides: dict[str, Any] | None = None,
    **parallel: Any,
) -> DesignPoint:
    raw = expand(
        {
            "model": model,
            "workload": {"seq_len": seq_len, "global_batch": global_batch, "micro_batch": micro_batch},
            "parallel": parallel,
            "system": system,
        }
    )
    for path, value in (overrides or {}).items():
        assign(raw, path, value)
    return build_point(raw, "test point")


def run_cli(*argv: str) -> tuple[int, str, str]:
    """`dse ARGV` in this process: its exit code, stdout and stderr (argparse's usage errors exit through
    SystemExit, whose code is the exit code a user sees)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def process_running(pid: int) -> bool:
    """Whether a process still runs after up to 5 s, stretched by the machine's load (a killed child not yet
    reaped by init is a zombie: not running)."""
    deadline = time.monotonic() + patience(5)
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        if state in ("Z", "X"):
            return False
        time.sleep(0.05)
    return True


@contextlib.contextmanager
def installed_plugin(
    tmp_path: Path, monkeypatch: Any, name: str, entry_points: str, caches: list[Any], source: str = ""
) -> Iterator[None]:
    """A user's plugin as installed: a distribution `name` on sys.path whose entry_points.txt is `entry_points`,
    with the module `<name>.py` holding `source` when given. `caches` (the functools caches that read entry
    points) are cleared on the way in and out, so the plugin is found inside and forgotten after."""
    if source:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    info = tmp_path / f"{name}-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 0\n")
    (info / "entry_points.txt").write_text(entry_points)
    monkeypatch.syspath_prepend(str(tmp_path))
    for cache in caches:
        cache.cache_clear()
    try:
        yield
    finally:
        monkeypatch.undo()
        for cache in caches:
            cache.cache_clear()


HELD_OUT = 0.10
"""The share of a measured table's rows held out and predicted from the rest (seeded: the same rows every run)."""


def hold_out(measured: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the rows kept, the rows held out) of a measured table."""
    held = np.random.default_rng(0).random(len(measured)) < HELD_OUT
    return measured[~held], measured[held]


def held_out_errors(label: str, predicted: np.ndarray, measured: np.ndarray) -> tuple[float, float, float]:
    """(median, 90th percentile, max) relative error of held-out rows' predictions, printed for the record
    (`pytest -s`); a row that could not be predicted (NaN) fails."""
    error = np.abs(np.asarray(predicted) / np.asarray(measured) - 1)
    assert np.isfinite(error).all(), f"{label}: {np.isnan(error).sum()} held-out rows not predicted"
    median, p90, worst = float(np.median(error)), float(np.percentile(error, 90)), float(error.max())
    print(f"{label}: {len(error)} rows held out, error median {median:.1%}, 90th percentile {p90:.1%}, max {worst:.1%}")
    return median, p90, worst


def steady_runs(workload: Workload, system: SystemSpec) -> tuple[list, Reads, list | None]:
    """The workload's steady form driven on `system`: per stage its calls' (starts, ends), the form's `Reads`, and
    per stage what `steady._periods` finds at the form's period (None where a stage finds none)."""
    form = workload.steady
    assert form is not None
    scheduler = CompiledScheduler(replace(workload, programs=form.programs, steady=None), system)
    run = steady._Simulated(scheduler, scheduler.drive())
    read = reads(workload.blocks, form.programs)
    return run.times(), read, steady._periods(form.programs, run.tables, form.period, read)
