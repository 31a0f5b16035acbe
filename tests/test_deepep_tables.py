"""A serving step's MoE dispatch and combine priced from aiconfigurator-core's DeepEP tables (dse/tables/deepep.py).

What is pinned, against the rows of SGLang 0.5.6.post2's H200 collection: a measured row is returned exactly; between
two token counts and between two EP sizes the log-log interpolation; below the smallest token count the floor;
beyond the table (more tokens, more nodes, another hidden size, an EP group not 8 GPUs a node) the network model,
with its source label; decode steps read the low-latency table and prefill steps the normal one (at the SM count
fastest for the size); training steps keep the network model; other line rates scale the measured time.
"""

from math import log

import pyarrow.parquet as pq
import pytest
from helpers import make_point

from dse.tables.deepep import DEEPEP_TABLE, MeasuredExchange
from dse.tables.source import DeepepTables, KernelTables, table_file
from dse.workload import Collective, ExpertExchange
from generators.symbolic import SymbolicGenerator
from generators.symbolic.generator import COMBINE, DISPATCH
from simulators.analytical import AnalyticalCostModel
from simulators.analytical.batch import price_many
from simulators.analytical.network import collective_time, exchange_time
from simulators.analytical.pricing import BlockPricer

pytest.importorskip("aiconfigurator_core")

H200 = DeepepTables(version="0.5.6.post2", scale_up_GBps=450.0, scale_out_GBps=50.0)
HIDDEN, TOP_K, EXPERTS = 7168, 8, 256
US = 1e-6
GEN = SymbolicGenerator()


def exchange(hidden: int = HIDDEN) -> ExpertExchange:
    """A decode step's exchange of this hidden size, top-8 of 256 experts, bf16."""
    return ExpertExchange("low_latency", hidden, TOP_K, EXPERTS, hidden * 2.0, DISPATCH, COMBINE)


def size(tokens: float, hidden: int = HIDDEN) -> float:
    """The bf16 all-to-all bytes of `tokens` per rank, top-8."""
    return tokens * TOP_K * hidden * 2.0


@pytest.fixture(scope="module")
def tables() -> MeasuredExchange:
    return MeasuredExchange("h200_sxm", H200)


def test_a_measured_row_is_returned_exactly(tables):
    """LL at 2 nodes (EP 16), 128 tokens per rank: dispatch 102.10 us, combine 186.17 us (the parquet's row)."""
    assert tables.seconds(exchange(), DISPATCH, 2, size(128)) == pytest.approx(102.10 * US, rel=1e-12)
    assert tables.seconds(exchange(), COMBINE, 2, size(128)) == pytest.approx(186.17 * US, rel=1e-12)
    assert tables.seconds(exchange(), "wo.all_to_all", 2, size(128)) is None


def test_between_rows_log_log_in_tokens_and_in_ep(tables):
    """56 tokens between the 48- and 64-token rows at EP 16 (48.87, 58.07 us); EP 24 between EP 16 and EP 32 at 128
    tokens (102.10, 142.97 us)."""
    tokens = 48.87 * (58.07 / 48.87) ** (log(56 / 48) / log(64 / 48))
    assert tables.seconds(exchange(), DISPATCH, 2, size(56)) == pytest.approx(tokens * US, rel=1e-9)
    ep = 102.10 * (142.97 / 102.10) ** (log(24 / 16) / log(32 / 16))
    assert tables.seconds(exchange(), DISPATCH, 3, size(128)) == pytest.approx(ep * US, rel=1e-9)


def test_below_the_smallest_count_the_floor_beyond_the_table_none(tables):
    """One token at EP 16 is the smallest (2-token) row, 22.57 us; 257 tokens (the multi-node rows end at 256), 16
    nodes (EP 128), hidden 4096: not in the table."""
    assert tables.seconds(exchange(), DISPATCH, 2, size(1)) == pytest.approx(22.57 * US, rel=1e-12)
    assert tables.seconds(exchange(), DISPATCH, 2, size(257)) is None
    assert tables.seconds(exchange(), DISPATCH, 16, size(128)) is None
    assert tables.seconds(exchange(4096), DISPATCH, 2, size(128, 4096)) is None


def normal_row(nodes: int, tokens: int, phase: str) -> float:
    """The normal table's notify + transmit at its fastest SM count, read from the parquet on its own."""
    collection = KernelTables.model_construct(system="h200_sxm", framework="sglang", version=H200.version)
    rows = pq.read_table(table_file(collection, "comm", "wideep_deepep_normal_perf", "test")).to_pandas()
    rows = rows[(rows["node_num"] == nodes) & (rows["num_token"] == tokens) & (rows["hidden_size"] == HIDDEN)]
    return float((rows[f"{phase}_transmit_us"] + rows[f"{phase}_notify_us"]).min()) * US


def moe_point(mode: str, seq_len: int = 128, nodes: int = 2, **overrides):
    """tiny-moe at DeepSeek-V3's MoE shape (hidden 7168, 256 experts, top-8), one sequence per rank, EP over 8 GPUs
    of each of `nodes` DGX H200 nodes."""
    moe = {"model.hidden": HIDDEN, "model.moe": {"experts": EXPERTS, "top_k": TOP_K, "expert_ffn": 256}}
    over = moe | {"workload.mode": mode, "system.network.1.npus": nodes} | overrides
    ep = 8 * nodes
    return make_point("tiny-moe", "dgx-h200", seq_len, ep, 1, over, dp=ep, ep=ep)


def priced(point) -> dict[str, tuple[float, str]]:
    """Each all-to-all of the MoE block: seconds and source, as the per-point pricer gives them."""
    workload = GEN.generate(point)
    pricer = BlockPricer(workload, point.system)
    block = next(i for i, b in enumerate(workload.blocks) if b.name == "layer.attn.moe.forward")
    seconds = pricer.durations(block, 0)
    ops = workload.blocks[block].ops
    return {
        op.name: (seconds[i], pricer.source(block, i, 0)) for i, op in enumerate(ops) if op.category == "all_to_all"
    }


def test_decode_reads_the_low_latency_table_and_prefill_the_normal_one():
    """A decode step of one token per rank at EP 16: the LL rows' floor (2 tokens: 22.57 / 25.90 us); a prefill of
    128 tokens per rank: the normal rows at their best SM count."""
    decode = priced(moe_point("decode"))
    assert decode[DISPATCH] == (pytest.approx(22.57 * US, rel=1e-12), DEEPEP_TABLE)
    assert decode[COMBINE] == (pytest.approx(25.90 * US, rel=1e-12), DEEPEP_TABLE)
    prefill = priced(moe_point("prefill"))
    for op, phase in ((DISPATCH, "dispatch"), (COMBINE, "combine")):
        assert prefill[op] == (pytest.approx(normal_row(2, 128, phase), rel=1e-12), DEEPEP_TABLE)


def test_outside_the_table_and_in_training_the_network_model_prices_it():
    """A decode of 512 tokens per rank at EP 16, beyond the LL rows' 256: the network model's all-to-all of the
    op's bytes, source ''. A training step has no exchange: its all-to-alls are the model's."""
    point = moe_point("decode", **{"workload.micro_batch": 512, "workload.global_batch": 512 * 16})
    workload = GEN.generate(point)
    span = [(point.system.network[0], 8), (point.system.network[1], 2)]
    model = collective_time(Collective.ALL_TO_ALL, size(512), span)
    assert workload.expert_exchange is not None
    assert priced(point)[DISPATCH] == (pytest.approx(model, rel=1e-12), "")
    train = moe_point("train")
    assert GEN.generate(train).expert_exchange is None
    assert all(source == "" for _, source in priced(train).values())


def test_other_line_rates_scale_the_measured_time(tables):
    """Twice the NIC rate: the row times the model's all-to-all on the faster network over its time on the measured
    one; an EP group of 4 GPUs a node is not the measured layout."""
    point = moe_point("decode")
    dims = point.system.network
    measured = [(dims[0], 8), (dims[1], 2)]
    faster = [(dims[0], 8), (dims[1].model_copy(update={"bandwidth_GBps": 100.0}), 2)]
    bytes_ = size(128)
    ratio = collective_time("all_to_all", bytes_, faster) / collective_time("all_to_all", bytes_, measured)
    assert ratio < 0.6
    got = exchange_time(tables, exchange(), DISPATCH, bytes_, faster, (0, 1))
    assert got == pytest.approx(102.10 * US * ratio, rel=1e-12)
    assert exchange_time(tables, exchange(), DISPATCH, bytes_, measured, (0, 1)) == pytest.approx(102.10 * US)
    assert exchange_time(tables, exchange(), DISPATCH, bytes_, [(dims[0], 4), (dims[1], 4)], (0, 1)) is None


def test_the_batch_path_prices_the_tables_as_the_per_point_path():
    """Systems alike but for their DeepEP tables are priced apart in one batch, each as the per-point path does."""
    point = moe_point("decode")
    modelled = moe_point("decode", **{"system.accelerator.kernel_tables.deepep": None})
    workload = GEN.generate(point)
    batch = price_many(workload, [point.system, modelled.system])
    for one, system in zip(batch, (point.system, modelled.system), strict=True):
        assert one.step_time_s == AnalyticalCostModel(exact=True).simulate(workload, system).step_time_s  # type: ignore[union-attr]
    assert batch[0].step_time_s != batch[1].step_time_s  # type: ignore[union-attr]
