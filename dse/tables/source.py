"""Where measured kernel tables come from: the `aiconfigurator-core` package's per-system benchmark database.

The package (NVIDIA, Apache-2.0, an optional extra: `pip install 'dse-orchestrator[kernels]'`) ships per-shape
kernel latencies collected on real systems under a serving framework's kernels: `systems/data/<system>/<family>/
<framework>/<version>/<table>.parquet`, each folder with a `collection_meta.yaml` naming the framework and version.
dse reads those files where the package installed them and copies nothing. A table is named by its provenance
(`KernelTables`: system, framework, version) so that a result says which measurements priced it, and a catalog
entry pins one collection rather than "the newest", which would change figures when the package is upgraded.
"""

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import numpy as np
from pydantic import BeforeValidator, Field, StringConstraints

from dse.errors import SpecError
from dse.fields import Share, Spec, left_out_at_default

if TYPE_CHECKING:
    import pandas as pd

PACKAGE = "aiconfigurator-core"
MISSING = (
    f"measured kernel tables (system.accelerator.kernel_tables) need the package {PACKAGE}; install it (pip install "
    f"{PACKAGE}, or `make` installs it with the kernels extra), or set system.accelerator.kernel_source: roofline"
)
Token = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.+-]+$", min_length=1, max_length=64)]


def _quoted_version(value: object) -> object:
    if isinstance(value, int | float) and not isinstance(value, bool):
        raise ValueError(f"YAML read {value!r} as a number; write the version in quotes, as its folder is named")
    return value


Version = Annotated[Token, BeforeValidator(_quoted_version)]
Family = Literal["gemm", "attention", "comm"]
Bandwidth = Annotated[float, Field(gt=0, le=1e6)]


class NcclTables(Spec):
    """The collection's NCCL tables (nccl-tests on one node of the system: `comm/nccl/<version>/nccl_perf.parquet`)
    and the line rate of the node's interconnect they were measured over, which a first network dimension of another
    bandwidth (a hypothetical NVLink) is scaled against."""

    version: Version = Field(description="the NCCL version folder of the collection, e.g. 2.29.2")
    bandwidth_GBps: Bandwidth = Field(
        description="per-GPU, per-direction line rate of the measured node's interconnect (NVLink4 on H100 SXM: 450)"
    )


class DeepepTables(Spec):
    """The collection's DeepEP tables: SGLang's wide-EP benchmark of DeepEP's MoE dispatch and combine on 1 to 8
    nodes of 8 GPUs (`comm/sglang/<version>/wideep_deepep_{ll,normal}_perf.parquet`, dse.tables.deepep; SGLang is
    the one framework the package times DeepEP under), and the line rates of the nodes they were measured on, which
    a network of other rates is scaled against."""

    version: Version = Field(description="the SGLang version folder of the tables, e.g. 0.5.6.post2")
    scale_up_GBps: Bandwidth = Field(
        description="per-GPU, per-direction line rate within a measured node (NVLink4 on H100/H200 SXM: 450)"
    )
    scale_out_GBps: Bandwidth = Field(
        description="per-GPU, per-direction line rate between the measured nodes (a 400 Gb/s NIC per GPU: 50)"
    )


class KernelTables(Spec):
    """One collection of measured kernel tables and the device it was measured on (the figures a hypothetical
    accelerator's rates are scaled against when a study changes the peak or the bandwidth)."""

    system: Token = Field(description="the package's system folder, e.g. h100_sxm")
    framework: Token = Field(description="the framework whose kernels were timed: trtllm, vllm or sglang")
    version: Version = Field(description="the framework version the collection was made under, e.g. 1.3.0rc20")
    peak_tflops: dict[Literal["bf16", "fp8"], Annotated[float, Field(gt=0, le=1e6)]] = Field(
        description="dense peak TFLOP/s of the measured device per dtype"
    )
    hbm_bandwidth_GBps: Bandwidth = Field(description="HBM bandwidth of the measured device")
    sustained_share: Share = left_out_at_default(
        1.0,
        description="the share of the tables' FLOP rates the device sustains under continuous load at its power cap: "
        "the tables time millisecond bursts at locked maximum clocks, a training step runs for seconds at the cap",
    )
    nccl: NcclTables | None = left_out_at_default(
        None,
        description="the NCCL tables that price collectives within one node (the first network dimension, up to 8 "
        "GPUs); unset: the network model prices every collective",
    )

    deepep: DeepepTables | None = left_out_at_default(
        None,
        description="the DeepEP tables that price a serving step's MoE dispatch and combine over expert "
        "parallelism (low-latency kernels in decode, normal kernels in prefill); unset: the network model does",
    )

    def provenance(self) -> str:
        nccl = "" if self.nccl is None else f", nccl {self.nccl.version}"
        deepep = "" if self.deepep is None else f", deepep sglang {self.deepep.version}"
        fused = data_root() / self.system / "moe" / self.framework / self.version / "moe_perf.parquet"
        moe = ", moe" * fused.is_file()
        return f"{PACKAGE} {package_version()} {self.system} {self.framework} {self.version}{moe}{nccl}{deepep}"


LATENCY_UNIT_S = 1e-3
"""The package's tables give latencies in milliseconds."""


def file_state(path: Path) -> tuple[Path, int, int]:
    """A table file as a cache key: its path, size and modification time, so that a file the package replaced (an
    upgrade) is read anew while an unchanged one is read once per process."""
    stat = path.stat()
    return path, stat.st_size, stat.st_mtime_ns


def read_rows(path: Path, columns: list[str] | None = None, filters: list | None = None) -> "pd.DataFrame":
    """A table file's rows (those columns, rows passing pyarrow's filters). pyarrow and pandas are imported here, on
    the first such read, not with the modules: together about 0.3 CPU-s and 110 MiB that every process importing
    dse (a Ray worker, a CLI call, a sweep priced by the roofline alone) would otherwise pay."""
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=columns, filters=filters).to_pandas()


def read_columns(path: Path, columns: list[str]) -> dict[str, np.ndarray]:
    """A table file's columns as arrays, read without pandas: the GEMM and NCCL tables every catalog GPU prices by
    (the GPT-3 benchmark's points among them) are read in every process that prices one, and pyarrow imports pandas
    for its datasets (`pq.read_table`), its conversions to numpy (`to_numpy`) and its compute functions: 0.34 CPU-s
    and 124 MiB for a process's first read where this takes 0.13 s and 75 MiB. Hence pyarrow's file reader, numbers
    through DLPack (no copy, read-only; a column with nulls fails there) and text as Python strings."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.ParquetFile(path).read(columns=columns)
    out = {}
    for name in columns:
        column = table.column(name).combine_chunks()
        numeric = pa.types.is_integer(column.type) or pa.types.is_floating(column.type)
        out[name] = np.from_dlpack(column) if numeric else np.asarray(column.to_pylist())
    return out


def medians(keys: list[np.ndarray], values: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """The distinct keys (one array per key column, in sorted order) and the median of each one's values, as pandas'
    groupby median gives them without pandas (`read_columns`): NaN values left out (a key with none is left out),
    then the middle value, or (upper + lower) / 2 of the middle two."""
    timed = ~np.isnan(values)
    order = np.lexsort((values[timed], *(key[timed] for key in reversed(keys))))
    ordered, keys = values[timed][order], [key[timed][order] for key in keys]
    new = np.zeros(len(order), dtype=bool)
    new[:1] = True
    for key in keys:
        new[1:] |= key[1:] != key[:-1]
    first = np.flatnonzero(new)
    count = np.diff(first, append=len(order))
    lower, upper = ordered[first + (count - 1) // 2], ordered[first + count // 2]
    return [key[first] for key in keys], np.where(count % 2 == 1, upper, (upper + lower) / 2)


def package_version() -> str:
    try:
        return version(PACKAGE)
    except PackageNotFoundError:
        raise SpecError(MISSING) from None


def data_root() -> Path:
    """The package's systems/data folder (its files as installed; nothing is copied)."""
    try:
        import aiconfigurator_core as module
    except ImportError:
        raise SpecError(MISSING) from None
    return Path(module.__file__).parent / "systems" / "data"


def table_file(tables: KernelTables, family: Family, name: str, field: str) -> Path:
    """The parquet file of one table of the collection, or a one-line error naming the field and what exists."""
    system = data_root() / tables.system
    if not system.is_dir():
        known = sorted(p.name for p in data_root().iterdir() if any(p.glob("*/*/*/*.parquet")))
        raise SpecError(
            f"field '{field}.system': {PACKAGE} has no tables for {tables.system!r}; use one of {', '.join(known)}"
        )
    folder = system / family / tables.framework / tables.version
    path = folder / f"{name}.parquet"
    if not path.is_file():
        there = [
            f"{p.parent.name} {p.name}" for p in sorted((system / family).glob("*/*")) if (p / path.name).is_file()
        ]
        raise SpecError(
            f"field '{field}': {PACKAGE} {package_version()} has no {name} for {tables.system} under "
            f"{tables.framework} {tables.version}; use a framework and version that has it: "
            f"{', '.join(there) or 'none'}"
        )
    return path
