"""A serving step's routed experts read from the measured fused-MoE table: log-log along the tokens the expert-parallel
group routes, and along the EP size between two measured ones.

aiconfigurator-core's `moe/<framework>/<version>/moe_perf.parquet` times the framework's fused MoE kernel on one
GPU (TensorRT-LLM's `create_moe(...).forward`, SGLang's fused Triton MoE) per layer shape (hidden_size, inter_size
unsplit, num_experts, topk), weight dtype (moe_dtype), split (moe_tp_size: the experts' width over TP; moe_ep_size:
the experts over EP, the GPU holding num_experts / ep of them) and routing (distribution), in milliseconds. Its
`num_tokens` are the tokens that enter the MoE layer of the EP group: the collector feeds num_tokens tokens routed
over all the experts, and the GPU runs the copies that reach its own (num_tokens x topk / ep when balanced); the
package's own MoE op queries it at the tokens per attention-DP rank times the attention-DP size. The time covers the
routing of those tokens, the gate/up GEMM, the activation, the down GEMM and the weighted sum of each token's
copies on the GPU (the collector passes reduce_results=False): no all-to-all, no all-reduce.

Why it is read as it is:
- It prices the ops of the block's routed experts together (`ExpertCompute.prefix`: the GEMMs and the
  activation), which the framework runs as that one kernel; each op keeps its own share of the total, as the ops'
  own prices split it (`MOE_TABLE` in the timeline). Only serving steps: the table has no backward.
- By tokens, from the gate GEMM's rows (`ExpertCompute.tokens`): the rank's token copies times ep over top_k, the
  table's num_tokens under balanced routing. Under a routing skew (workload.routing) the copies are the busiest
  rank's, so the tokens are its effective load, read on the 'balanced' rows: the package states no skew for its
  power_law rows (a Zipf exponent, not a busiest-rank share), so they are not read.
- Only for the layer shape and split measured (hidden, width, experts, top_k and TP alike): a shape the table lacks
  (DeepSeek-V3 with 288 experts, say) is priced by its ops (the GEMM table or the roofline).
- bf16 reads bfloat16 rows, fp8 the per-tensor fp8 rows, else the block-scaled ones (`DTYPES`): the collections
  time DeepSeek's shapes in its own 128-wide block-scaled fp8 only, with the same FP8 tensor-core math and weight
  bytes (plus a scale per 128 x 128 block).
- Log-log between measured token counts (dse.tables.nccl.SizeCurve: a latency floor below the smallest, the
  largest ones run back to back above it, every row reproduced); log-log in EP between two measured sizes (EP 24
  between 16 and 32: at a fixed token count the time falls as a power of the experts each GPU holds, 0.365, 0.199,
  0.116 ms at EP 8, 16, 32 for DeepSeek-V3 at 128 tokens). An EP size outside the measured ones is left to the ops.
"""

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from dse.tables.by_ep import across_ep
from dse.tables.nccl import SizeCurve
from dse.tables.scale import DeviceScale
from dse.tables.source import LATENCY_UNIT_S, KernelTables, data_root, file_state, read_rows
from dse.workload import ExpertCompute, Op

if TYPE_CHECKING:
    import pandas as pd

    from dse.system import AcceleratorSpec

MOE_TABLE = "moe_table"
"""The source a timeline gives the routed-expert ops this table priced."""
DTYPES = {"bf16": ("bfloat16",), "fp8": ("fp8", "fp8_block")}
"""dse's dtypes and the table's names for them, in the order they are read; another dtype is left to the ops."""
BALANCED = "balanced"
FIELD = "system.accelerator.kernel_tables"
COLUMNS = ["moe_dtype", "hidden_size", "inter_size", "num_experts", "topk", "moe_tp_size", "moe_ep_size"]
COLUMNS_READ = [*COLUMNS, "distribution", "num_tokens", "latency"]

Key = tuple[str, int, int, int, int, int]
"""(moe_dtype, hidden, width, experts, top_k, tp): one layer shape's split in one dtype."""


@dataclass(frozen=True)
class MoeTable:
    """Token curves per layer shape's split and EP size."""

    curves: dict[Key, dict[int, SizeCurve]]
    """Per (moe_dtype, hidden, width, experts, top_k, tp), per EP size: seconds along the EP group's tokens."""

    @classmethod
    def from_rows(cls, rows: "pd.DataFrame") -> "MoeTable":
        """The curves of balanced rows with the COLUMNS, num_tokens and latency (seconds here); repeated rows of one
        point give their median."""
        medians = rows.groupby([*COLUMNS, "num_tokens"])["latency"].median()
        curves: dict[Key, dict[int, SizeCurve]] = {}
        for (dtype, *shape, ep), curve in medians.groupby(level=list(range(len(COLUMNS)))):
            if len(curve) > 1:
                tokens = tuple(map(float, curve.index.get_level_values(-1)))
                key: Key = (str(dtype), *map(int, shape))  # type: ignore[assignment]
                curves.setdefault(key, {})[int(ep)] = SizeCurve(tokens, tuple(map(float, curve)))
        return cls(curves)

    def seconds(self, key: Key, ep: int, tokens: float) -> float | None:
        """Seconds of the fused MoE at `tokens` over `ep` GPUs, or None outside the table (see the module's
        docstring)."""
        by_ep = self.curves.get(key)
        return None if by_ep is None else across_ep(by_ep, ep, lambda curve: curve.at(tokens))


@lru_cache(maxsize=8)
def _table(path: Path, size: int, mtime_ns: int) -> MoeTable:
    """One file's table, read once per process per version of the file (its size and time)."""
    rows = read_rows(path, COLUMNS_READ)
    rows = rows[rows["distribution"] == BALANCED]
    return MoeTable.from_rows(rows.assign(latency=rows["latency"] * LATENCY_UNIT_S))


def moe_file(tables: KernelTables) -> Path | None:
    """The collection's fused-MoE table, or None where the package has none for its framework and version."""
    path = data_root() / tables.system / "moe" / tables.framework / tables.version / "moe_perf.parquet"
    return path if path.is_file() else None


class MeasuredMoe:
    """Prices a serving step's routed experts (`Workload.expert_compute`) from the collection's fused-MoE table; on
    an accelerator other than the measured device each op keeps the measured share of its roofline (`DeviceScale`).
    """

    def __init__(self, table: MoeTable, names: tuple[str, ...], scale: DeviceScale) -> None:
        self.table = table
        self.names = names
        """The table's names for the workload's dtype, in the order they are read."""
        self.scale = scale

    @classmethod
    def of(cls, accelerator: "AcceleratorSpec", dtype: str) -> "MeasuredMoe | None":
        """The accelerator's table for a workload of this dtype, or None where it has none."""
        tables = accelerator.kernel_tables
        if not accelerator.reads_tables or tables is None or dtype not in DTYPES or dtype not in tables.peak_tflops:
            return None
        path = moe_file(tables)
        if path is None:
            return None
        return cls(_table(*file_state(path)), DTYPES[dtype], DeviceScale(tables, accelerator, dtype, FIELD))

    def seconds(self, experts: ExpertCompute, gate: Op) -> float | None:
        """Seconds of the rank's routed experts, whose gate GEMM is `gate`, as measured, or None where the table
        does not have them (another shape, split, EP size or dtype)."""
        assert gate.gemm is not None
        batch, m, n, _ = gate.gemm
        tp = round(experts.width / n)
        if tp < 1 or abs(tp * n - experts.width) > 1e-6 * experts.width:
            return None  # a width not split evenly: no measured split
        tokens = experts.tokens(batch * m)
        for name in self.names:
            key = (name, experts.hidden, experts.width, experts.experts, experts.top_k, tp)
            if key in self.table.curves:
                return self.table.seconds(key, experts.ep, tokens)
        return None

    def split(self, seconds: float, ops: list[Op], own: list[float]) -> list[float]:
        """The block's measured seconds shared among its routed-expert ops in proportion to their own prices, each
        share carried to this accelerator by its own roofline."""
        total = sum(own)
        return [self.scale(seconds * t / total, op) for op, t in zip(ops, own, strict=True)]
