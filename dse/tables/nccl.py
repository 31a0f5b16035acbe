"""A collective's latency within one node read from a measured NCCL table: log-log interpolation along the size.

aiconfigurator-core's `comm/nccl/<version>/nccl_perf.parquet` holds nccl-tests runs on one node of a system
(collector/collect_nccl.py: `<op>_perf -b S -e S -t <GPUs> -d <dtype> -a 1 -c 0`, the out-of-place time averaged
over the ranks, in milliseconds): all-reduce, all-gather, reduce-scatter and all-to-all on 2, 4 and 8 GPUs, buffers
of 512 B to 512 MiB doubling. Its `message_size` is the nccl-tests buffer in *elements*: the collector divides the
byte size it ran by the element size (2 for half, 1 for int8), and the package's own `query_nccl` takes "element
number". The buffer is the whole one nccl-tests counts (an all-gather's output, a reduce-scatter's input), which is
dse's convention for a collective's bytes (`Op.comm_bytes`), so a row of half elements is 2 x message_size bytes.

Why it is read as it is:
- By bytes, from the half rows, whatever the workload's dtype: moving data, NCCL's time is its bytes (at equal bytes
  the int8 and half rows of an all-gather or an all-to-all differ by under 3% once bandwidth rules), and the half
  rows' reductions are floating-point sums, as a training run's are, which NVLink SHARP (NCCL's NVLS) reduces in the
  switch; int8 sums it does not (8 H100s reduce 512 MiB of int8 27% slower than of half), and no dse collective
  reduces int8.
- Log-log between measured sizes: a collective's time is flat at its latency floor for small buffers and linear in
  the buffer once bandwidth rules, power laws that interpolating log(time) linearly in log(size) follows without a
  fitted curve; it is monotone between two rows and reproduces every row exactly.
- Below the smallest size (512 B) the smallest row's time: the table is flat there (the first five rows, 512 B to
  8 KiB, lie within a few per cent of each other), the launch and handshake a smaller buffer pays as well.
- Beyond the largest size (512 MiB) the last measured doubling's marginal cost carries on: time = the largest row's
  + the extra bytes at the rate the last doubling streamed them. Once bandwidth rules, time is affine in the size
  (a fixed cost, then the bytes at the bus bandwidth), and the marginal rate is that bandwidth without the fixed
  cost. Extended to nccl-tests' 8 GiB, 8 A100s' all-reduce reaches 229 GB/s of bus bandwidth, where nccl-tests
  measures ~230 (../shared/calibration.md); running the largest one back to back would give 222.
- A group size the table did not run (3, 5, 6 or 7 GPUs; 8 in the GB200 and GB300 tables), or a collective it has
  no rows of (broadcast), is not read: the network model prices it. NCCL's algorithms and channel counts change
  with the GPU count, and 4 and 8 are not two points of one curve to interpolate between.
"""

from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from math import log
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dse.errors import SpecError
from dse.tables.source import LATENCY_UNIT_S, KernelTables, NcclTables, file_state, medians, read_columns, table_file
from dse.workload import Collective

if TYPE_CHECKING:
    from dse.system import AcceleratorSpec

OPS = {
    Collective.ALL_REDUCE: "all_reduce",
    Collective.ALL_GATHER: "all_gather",
    Collective.REDUCE_SCATTER: "reduce_scatter",
    Collective.ALL_TO_ALL: "alltoall",
}
"""dse's collectives and the table's names for them; every collection must have all four."""
DTYPE, ELEMENT_BYTES = "half", 2
"""The rows read (see the module's docstring) and the bytes of one of their elements."""
FIELD = "system.accelerator.kernel_tables"
NCCL_TABLE = "nccl_table"
"""The source a timeline gives a collective these tables priced."""


@dataclass(frozen=True)
class SizeCurve:
    """One collective's time along the buffer size, for one GPU count."""

    sizes: tuple[float, ...]
    """bytes, ascending, at least two."""
    seconds: tuple[float, ...]
    """seconds at each size as measured (the median of repeated rows)."""

    def at(self, size: float) -> float:
        """Seconds of a buffer of `size` bytes (see the module's docstring)."""
        sizes, seconds = self.sizes, self.seconds
        i = bisect_left(sizes, size)
        if i < len(sizes) and sizes[i] == size:
            return seconds[i]
        if i == 0:
            return seconds[0]
        if i == len(sizes):
            marginal = (seconds[-1] - seconds[-2]) / (sizes[-1] - sizes[-2])
            if marginal <= 0:  # a noisy last doubling that got faster: the largest one run back to back
                marginal = seconds[-1] / sizes[-1]
            return seconds[-1] + (size - sizes[-1]) * marginal
        (s0, s1), (t0, t1) = sizes[i - 1 : i + 1], seconds[i - 1 : i + 1]
        return t0 * (t1 / t0) ** (log(size / s0) / log(s1 / s0))


@dataclass(frozen=True)
class NcclTable:
    """One collection's curves per (collective, GPU count)."""

    curves: dict[tuple[Collective, int], SizeCurve]

    @classmethod
    def from_rows(cls, rows: Mapping[str, np.ndarray]) -> "NcclTable":
        """The curves of rows (columns: arrays, or a DataFrame's) with op_name, num_gpus, message_size (bytes here)
        and latency (seconds here); repeated rows of one size give their median."""
        keys = [np.asarray(rows[name]) for name in ("op_name", "num_gpus", "message_size")]
        (names, gpus, sizes), seconds = medians([keys[0].astype(str), *keys[1:]], np.asarray(rows["latency"], float))
        kinds = {name: kind for kind, name in OPS.items()}
        curves = {}
        bounds = np.flatnonzero((names[1:] != names[:-1]) | (gpus[1:] != gpus[:-1])) + 1
        for run in np.split(np.arange(len(names)), bounds):  # one (collective, GPUs), its sizes ascending
            if len(run) > 1 and names[run[0]] in kinds:
                curve = SizeCurve(tuple(map(float, sizes[run])), tuple(map(float, seconds[run])))
                curves[kinds[names[run[0]]], int(gpus[run[0]])] = curve
        return cls(curves)

    def seconds(self, kind: Collective, gpus: int, size: float) -> float | None:
        """Seconds of the collective over `gpus` GPUs of the node, or None where the table has no curve for them."""
        curve = self.curves.get((kind, gpus))
        return None if curve is None else curve.at(size)


@lru_cache(maxsize=16)
def _table(path: Path, size: int, mtime_ns: int) -> NcclTable:
    """One file's table, read once per process per version of the file (its size and time)."""
    read = read_columns(path, ["op_name", "nccl_dtype", "num_gpus", "message_size", "latency"])
    table = NcclTable.from_rows(_in_bytes_and_seconds(read, read["nccl_dtype"] == DTYPE, read["op_name"]))
    if missing := [name for kind, name in OPS.items() if not any(k is kind for k, _ in table.curves)]:
        others = sorted(p.parent.name for p in path.parent.parent.glob(f"*/{path.name}") if p != path)
        raise SpecError(
            f"field '{FIELD}.nccl.version': {path} has no {DTYPE} {', '.join(missing)} rows; use another NCCL "
            f"version of the system: {', '.join(others) or 'none'}"
        )
    return table


def nccl_table(path: Path) -> NcclTable:
    """The file's table, cached by the file's state."""
    return _table(*file_state(path))


def node_tables(accelerator: "AcceleratorSpec") -> tuple[str, NcclTables] | None:
    """The system folder and NCCL tables that price the accelerator's collectives within a node, or None."""
    tables = accelerator.kernel_tables
    if not accelerator.reads_tables or tables is None or tables.nccl is None:
        return None
    return tables.system, tables.nccl


class MeasuredCollectives:
    """Prices the collectives of a group within one node from the node's NCCL tables (`seconds`, in the node as
    measured; the network model scales them to a first dimension of another bandwidth), and, for a step a serving
    framework runs, its all-reduces by the faster of NCCL and the framework's own all-reduce kernel where the
    collection timed it (`Workload.framework_allreduce`)."""

    def __init__(self, system: str, nccl: NcclTables, framework: KernelTables | None = None) -> None:
        collection = KernelTables.model_construct(system=system, framework="nccl", version=nccl.version)
        self.table = nccl_table(table_file(collection, "comm", "nccl_perf", FIELD))
        self.bandwidth_GBps = nccl.bandwidth_GBps
        """The measured node's line rate per GPU and direction."""
        self.framework = None if framework is None else framework_allreduce(framework)
        """The serving framework's all-reduce table, if asked for and collected."""

    @classmethod
    def of(cls, accelerator: "AcceleratorSpec", framework: bool = False) -> "MeasuredCollectives | None":
        """The accelerator's node tables (with `framework`, its kernel tables' framework's all-reduce too), or None
        when it prices nothing from them (the network model does)."""
        found = node_tables(accelerator)
        if found is None:
            return None
        return cls(*found, accelerator.kernel_tables if framework else None)

    def seconds(self, kind: Collective, gpus: int, size: float) -> float | None:
        """Seconds of a collective of `size` bytes over `gpus` GPUs of the measured node, or None where the table
        has no rows for it (a broadcast; 3, 5, 6 or 7 GPUs)."""
        nccl = self.table.seconds(kind, gpus, size)
        custom = None if self.framework is None else self.framework.curves.get((kind, gpus))
        if custom is None or size > custom.sizes[-1]:
            return nccl
        return custom.at(size) if nccl is None else min(nccl, custom.at(size))


CUSTOM_ALLREDUCE = "custom_allreduce_perf"
"""The serving framework's all-reduce table in a collection's comm/<framework>/<version>/ folder: its own kernels'
latency (milliseconds) by GPU count and message size in bf16 elements."""


def framework_allreduce(tables: KernelTables) -> NcclTable:
    """The collection's framework all-reduce curves (its all-reduce rows, read as the NCCL ones are); none where it
    has no table (a collection whose framework did not time one: then NCCL prices every all-reduce)."""
    try:
        path = table_file(tables, "comm", CUSTOM_ALLREDUCE, FIELD)
    except SpecError:
        return NcclTable({})
    return _framework_table(*file_state(path))


@lru_cache(maxsize=16)
def _framework_table(path: Path, size: int, mtime_ns: int) -> NcclTable:
    read = read_columns(path, ["allreduce_dtype", "num_gpus", "message_size", "latency"])
    names = np.full(len(read["num_gpus"]), OPS[Collective.ALL_REDUCE])
    return NcclTable.from_rows(_in_bytes_and_seconds(read, read["allreduce_dtype"] == "bfloat16", names))


def _in_bytes_and_seconds(read: dict[str, np.ndarray], rows: np.ndarray, names: np.ndarray) -> dict[str, np.ndarray]:
    """The rows picked (a mask) of a table's columns as `NcclTable.from_rows` takes them: the collective's name,
    its GPUs, its buffer in bytes and its seconds."""
    return {
        "op_name": names[rows],
        "num_gpus": read["num_gpus"][rows],
        "message_size": read["message_size"][rows] * ELEMENT_BYTES,
        "latency": read["latency"][rows] * LATENCY_UNIT_S,
    }
