"""A serving step's MoE dispatch and combine read from measured DeepEP tables: log-log along the tokens per rank and
the expert-parallel size.

aiconfigurator-core's `comm/sglang/<version>/wideep_deepep_{ll,normal}_perf.parquet` time DeepEP's kernels as
SGLang runs them on nodes of 8 GPUs (NVLink within a node, one RDMA NIC per GPU between nodes; ep = node_num x 8,
as the package's own loader reads them), per layer shape (hidden size, top-k, experts) and per `num_token`, the
tokens each rank dispatches, in microseconds:
- the low-latency kernels (`ll`), which SGLang runs in decode: `dispatch_avg_t_us` (the copies sent as FP8 with
  their scales: 128 tokens x top-8 x 7168 at EP 8 move 7.6 MB in 39.8 us, its 188.7 GB/s) and `combine_avg_t_us`
  (bf16, twice the bytes: 72.4 us);
- the normal kernels (`normal`), which SGLang runs in prefill: per phase a notify (the layout handshake) and a
  transmit, per number of SMs the kernel was given (4 to 24). A phase costs its notify plus its transmit, as the
  package's loader sums them, at the SM count that is fastest for its size: DeepEP's dispatch and combine configs
  (SGLang's --deepep-config) are tuned per size, each phase on its own.

Why it is read as it is:
- By tokens per rank, from the op's bytes over top-k copies of hidden x itemsize (`ExpertExchange.tokens`): the
  framework's time is its kernels', whose FP8 dispatch moves other bytes than the workload's bf16 op; under a
  routing skew the op's bytes are the busiest rank's, so the tokens are its effective load.
- Only for the layer shape measured (hidden size, top-k and experts alike; DeepSeek-V3's 7168, 8 and 256 in the
  multi-node collections): a shape the table lacks is priced by the network model, whose bytes follow the shape.
- Log-log between measured token counts, as dse.tables.nccl reads sizes (a latency floor, then time linear in the
  tokens, reproducing every row); below the smallest count the smallest row (the floor: 2 and 4 tokens lie within
  a few per cent at every EP); above the largest, or an EP size beyond the largest measured, the network model.
- Log-log in EP between two measured sizes (EP 24 between 16 and 32): the time at a fixed token count rises
  smoothly with the nodes the copies spread over (LL dispatch, 128 tokens: 39.8, 102.1, 143.0, 166.8 us at EP 8,
  16, 32, 64), unlike NCCL's algorithm switches between GPU counts within a node.
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from dse.tables.by_ep import across_ep
from dse.tables.nccl import SizeCurve
from dse.tables.source import DeepepTables, KernelTables, file_state, read_rows, table_file
from dse.workload import ExpertExchange

if TYPE_CHECKING:
    import pandas as pd

    from dse.system import AcceleratorSpec

FRAMEWORK = "sglang"
"""The framework folder of the tables (DeepepTables)."""
GPUS_PER_NODE = 8
"""The measured nodes' GPUs: a table row of node_num nodes is an EP group of node_num x 8."""
TABLES = {"low_latency": "wideep_deepep_ll_perf", "normal": "wideep_deepep_normal_perf"}
"""The table of each kernel family (ExpertExchange.kernel)."""
PHASES = ("dispatch", "combine")
SHAPE = ["hidden_size", "num_topk", "num_experts"]
FIELD = "system.accelerator.kernel_tables.deepep"
DEEPEP_TABLE = "deepep_table"
"""The source a timeline gives an all-to-all these tables priced."""
MICROSECOND = 1e-6

Key = tuple[str, int, int, int]
"""(phase, hidden, top_k, experts): one layer shape's phase."""


@dataclass(frozen=True)
class ExchangeTable:
    """One kernel family's token curves per layer shape's phase and EP size."""

    curves: dict[Key, dict[int, SizeCurve]]
    """Per (phase, hidden, top_k, experts), per EP size: seconds along the tokens per rank."""

    @classmethod
    def from_rows(cls, rows: "pd.DataFrame") -> "ExchangeTable":
        """The curves of rows with ep, the SHAPE columns, num_token and one seconds column per phase, each point the
        fastest of its rows (the normal kernels' best SM count)."""
        curves: dict[Key, dict[int, SizeCurve]] = {}
        for phase in PHASES:
            best = rows.groupby(["ep", *SHAPE, "num_token"])[phase].min()
            for (ep, hidden, top_k, experts), curve in best.groupby(level=[0, 1, 2, 3]):
                if len(curve) > 1:
                    tokens = tuple(map(float, curve.index.get_level_values(-1)))
                    key = (phase, int(hidden), int(top_k), int(experts))
                    curves.setdefault(key, {})[int(ep)] = SizeCurve(tokens, tuple(map(float, curve)))
        return cls(curves)

    def seconds(self, key: Key, ep: int, tokens: float) -> float | None:
        """Seconds of one phase at `tokens` per rank over `ep` GPUs, or None outside the table (see the module's
        docstring)."""
        by_ep = self.curves.get(key)
        return None if by_ep is None else across_ep(by_ep, ep, lambda curve: _within(curve, tokens))


def _within(curve: SizeCurve, tokens: float) -> float | None:
    """The curve's time up to its largest token count (its floor below the smallest), None beyond it."""
    return None if tokens > curve.sizes[-1] else curve.at(tokens)


def _low_latency(rows: "pd.DataFrame") -> "pd.DataFrame":
    return rows.assign(dispatch=rows["dispatch_avg_t_us"], combine=rows["combine_avg_t_us"])


def _normal(rows: "pd.DataFrame") -> "pd.DataFrame":
    return rows.assign(
        dispatch=rows["dispatch_transmit_us"] + rows["dispatch_notify_us"],
        combine=rows["combine_transmit_us"] + rows["combine_notify_us"],
    )


PHASE_TIMES: dict[str, Callable[["pd.DataFrame"], "pd.DataFrame"]] = {"low_latency": _low_latency, "normal": _normal}
"""Each table's microseconds per phase."""


@lru_cache(maxsize=16)
def _table(kernel: str, path: Path, size: int, mtime_ns: int) -> ExchangeTable:
    """One file's table, read once per process per version of the file (its size and time)."""
    rows = PHASE_TIMES[kernel](read_rows(path))
    rows = rows.assign(
        ep=rows["node_num"] * GPUS_PER_NODE,
        dispatch=rows["dispatch"] * MICROSECOND,
        combine=rows["combine"] * MICROSECOND,
    )
    return ExchangeTable.from_rows(rows)


def exchange_tables(accelerator: "AcceleratorSpec") -> tuple[str, DeepepTables] | None:
    """The system folder and DeepEP tables that price the accelerator's MoE all-to-alls, or None."""
    tables = accelerator.kernel_tables
    if not accelerator.reads_tables or tables is None or tables.deepep is None:
        return None
    return tables.system, tables.deepep


class MeasuredExchange:
    """Prices the MoE dispatch and combine of a serving step (`Workload.expert_exchange`) from the collection's
    DeepEP tables, in the network as measured (`seconds`; the network model scales them to other line rates)."""

    def __init__(self, system: str, deepep: DeepepTables) -> None:
        collection = KernelTables.model_construct(system=system, framework=FRAMEWORK, version=deepep.version)
        self.tables = {
            kernel: _table(kernel, *file_state(table_file(collection, "comm", name, FIELD)))
            for kernel, name in TABLES.items()
        }
        self.rates = (deepep.scale_up_GBps, deepep.scale_out_GBps)
        """The measured nodes' line rates per GPU and direction: within a node, between nodes."""

    @classmethod
    def of(cls, accelerator: "AcceleratorSpec") -> "MeasuredExchange | None":
        found = exchange_tables(accelerator)
        return None if found is None else cls(*found)

    def seconds(self, exchange: ExpertExchange, op: str, nodes: int, size: float) -> float | None:
        """Seconds of the exchange's op (its dispatch or combine) of `size` bytes over `nodes` measured nodes of
        GPUS_PER_NODE GPUs each, or None where the tables do not have it (another op, shape, EP or token count)."""
        phase = "dispatch" if op == exchange.dispatch else "combine" if op == exchange.combine else None
        if phase is None:
            return None
        key = (phase, exchange.hidden, exchange.top_k, exchange.experts)
        return self.tables[exchange.kernel].seconds(key, nodes * GPUS_PER_NODE, exchange.tokens(size))
