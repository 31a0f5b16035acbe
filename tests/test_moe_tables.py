"""A serving step's routed experts priced from aiconfigurator-core's fused-MoE table (dse/tables/moe.py), and a
batched GEMM's weights read in full where no MoE table prices it (dse/tables/gemm.py).

What is pinned, against the rows of TensorRT-LLM 1.3.0rc20's H200 collection (DeepSeek-V3's 7168 / 2048 / 256
experts / top-8, which it times in block-scaled fp8): a measured row is returned exactly; between two token counts
and between two EP sizes the log-log interpolation; a decode step's routed experts sum to the row at the EP group's
tokens, so they scale with the experts each rank holds; a shape, dtype or mode the table lacks keeps its ops'
prices, and a batched GEMM among those is never below the table's one-row GEMM over all its weights.
"""

from functools import cache
from math import log

import pandas as pd
import pytest
from helpers import make_point

from dse.tables.gemm import DTYPES as GEMM_DTYPES
from dse.tables.gemm import MeasuredGemms, gemm_grid
from dse.tables.moe import MOE_TABLE, MeasuredMoe, moe_file
from dse.tables.source import table_file
from generators.symbolic import SymbolicGenerator
from simulators.analytical import AnalyticalCostModel
from simulators.analytical.batch import price_many
from simulators.analytical.pricing import BlockPricer

pytest.importorskip("aiconfigurator_core")

HIDDEN, WIDTH, EXPERTS, TOP_K = 7168, 2048, 256, 8
KEY = ("fp8_block", HIDDEN, WIDTH, EXPERTS, TOP_K, 1)
MS = 1e-3
GEN = SymbolicGenerator()


def point(ep: int = 16, seqs: int = 1, mode: str = "decode", dtype: str = "fp8", experts: int = EXPERTS):
    """tiny-moe at DeepSeek-V3's MoE shape, `seqs` sequences per rank, EP over all the GPUs of DGX H200 nodes."""
    moe = {"experts": experts, "top_k": TOP_K, "expert_ffn": WIDTH}
    over = {"model.hidden": HIDDEN, "model.moe": moe, "model.dtype": dtype, "workload.mode": mode}
    over["system.network.1.npus"] = ep // 8
    return make_point("tiny-moe", "dgx-h200", 128, seqs * ep, seqs, over, dp=ep, ep=ep)


@cache
def shape_rows() -> pd.DataFrame:
    """The balanced rows of KEY's shape and split, read from the parquet on their own."""
    rows = pd.read_parquet(moe_file(point().system.accelerator.kernel_tables))  # type: ignore[arg-type]
    names = ["moe_dtype", "hidden_size", "inter_size", "num_experts", "topk", "moe_tp_size"]
    mask = (rows[names] == pd.Series(dict(zip(names, KEY, strict=True)))).all(axis=1)
    return rows[mask & (rows["distribution"] == "balanced")]


def row(tokens: int, ep: int) -> float:
    """The row's seconds at `tokens` over `ep` GPUs."""
    rows = shape_rows()
    (latency,) = rows.loc[(rows["moe_ep_size"] == ep) & (rows["num_tokens"] == tokens), "latency"]
    return float(latency) * MS


@pytest.fixture(scope="module")
def table() -> MeasuredMoe:
    measured = MeasuredMoe.of(point().system.accelerator, "fp8")
    assert measured is not None
    return measured


def test_a_measured_row_is_returned_exactly(table):
    """128 tokens at EP 8: 0.365 ms (the parquet's row); one token is the smallest row (the floor)."""
    assert table.table.seconds(KEY, 8, 128.0) == row(128, 8)
    assert row(128, 8) == pytest.approx(0.365 * MS, abs=0.001 * MS)
    assert table.table.seconds(KEY, 8, 0.5) == row(1, 8)


def test_between_rows_log_log_in_tokens_and_in_ep(table):
    """112 tokens between the 96- and 128-token rows at EP 8; EP 12 between EP 8 and 16 at 128 tokens; EP 512,
    beyond the largest measured (256), is not in the table."""
    tokens = row(96, 8) * (row(128, 8) / row(96, 8)) ** (log(112 / 96) / log(128 / 96))
    assert table.table.seconds(KEY, 8, 112.0) == pytest.approx(tokens, rel=1e-12)
    ep = row(128, 8) * (row(128, 16) / row(128, 8)) ** (log(12 / 8) / log(16 / 8))
    assert table.table.seconds(KEY, 12, 128.0) == pytest.approx(ep, rel=1e-12)
    assert table.table.seconds(KEY, 512, 128.0) is None


def routed(p) -> tuple[float, set[str], BlockPricer, int]:
    """One MoE layer's routed-expert ops: their seconds summed, their sources, the pricer and the block."""
    workload = GEN.generate(p)
    pricer = BlockPricer(workload, p.system)
    block = next(i for i, b in enumerate(workload.blocks) if b.name == "layer.attn.moe.forward")
    seconds = pricer.durations(block, 0)
    members = [i for i, op in enumerate(workload.blocks[block].ops) if op.name.startswith("experts.")]
    members = [i for i in members if workload.blocks[block].ops[i].category != "all_to_all"]
    return sum(seconds[i] for i in members), {pricer.sources[block][i] for i in members}, pricer, block


@pytest.mark.parametrize(("ep", "seqs"), [(8, 1), (32, 1), (8, 64), (32, 64)])
def test_a_decode_step_reads_the_row_of_its_ep_groups_tokens(ep, seqs):
    """Decode of `seqs` tokens per rank over EP `ep`: the EP group routes seqs x ep tokens; the routed experts (gate,
    up, SwiGLU, down, all memory-bound, so the measured device's time) sum to that row. At 64 tokens per rank they
    take 0.397 ms at EP 8 (32 experts a rank) against 0.145 at EP 32 (8 experts)."""
    seconds, sources, _, _ = routed(point(ep, seqs))
    assert sources == {MOE_TABLE}
    assert seconds == pytest.approx(row(seqs * ep, ep), rel=1e-12)


def test_outside_the_table_the_ops_keep_their_prices():
    """288 experts (no such shape), bf16 (the collection times DeepSeek-V3 in fp8 only) and a training step (no
    backward in the table, no ExpertCompute) are priced by their ops."""
    for p in (point(experts=288), point(dtype="bf16"), point(mode="train")):
        _, sources, _, _ = routed(p)
        assert MOE_TABLE not in sources
    assert GEN.generate(point(mode="train")).expert_compute is None


def test_a_batched_gemm_reads_all_its_weights():
    """DeepSeek-V3's 288 experts at EP 36, 14 tokens a rank: 8 experts of 14 rows. Its gate GEMM is the table's
    one-row GEMM of depth 8 x 7168 (all 8 experts' weights in one launch), not that of one GEMM of 112 rows, which
    reads one expert's; the router (batch 1) keeps the rows' time."""
    p = make_point(
        "tiny-moe",
        "dgx-h200",
        4096,
        14 * 36,
        14,
        {
            "model.hidden": HIDDEN,
            "model.moe": {"experts": 288, "top_k": TOP_K, "expert_ffn": WIDTH},
            "model.dtype": "fp8",
            "workload.mode": "decode",
            "system.network.0.npus": 4,
            "system.network.1.npus": 9,
        },
        dp=36,
        ep=36,
    )
    workload = GEN.generate(p)
    ops = {op.name: op for block in workload.blocks for op in block.ops}
    accelerator = p.system.accelerator
    tables = accelerator.kernel_tables
    assert tables is not None
    grid = gemm_grid(table_file(tables, "gemm", "gemm_perf", "test"), GEMM_DTYPES["fp8"])
    assert grid is not None
    gemms = MeasuredGemms(tables, accelerator, "fp8", "test")
    batch, m, n, k = ops["experts.w1"].gemm  # type: ignore[misc]
    assert batch == pytest.approx(8.0, rel=1e-5) and batch * m == pytest.approx(112.0)
    rows, weights = grid.seconds_of(batch * m, n, k), grid.seconds_of(1.0, n, batch * k)
    assert rows is not None and weights is not None
    assert weights > 2 * rows  # 43.0 against 20.4 us
    assert gemms.seconds(ops["experts.w1"]) == pytest.approx(weights, rel=1e-12)
    _, m, n, k = ops["router"].gemm  # type: ignore[misc]
    assert gemms.seconds(ops["router"]) == grid.seconds_of(m, n, k)


def test_the_batch_path_prices_the_table_as_the_per_point_path():
    """The batch of systems prices the routed experts as the per-point simulation does."""
    p = point(8, 64)
    workload = GEN.generate(p)
    (batch,) = price_many(workload, [p.system])
    assert batch.step_time_s == AnalyticalCostModel(exact=True).simulate(workload, p.system).step_time_s  # type: ignore[union-attr]
