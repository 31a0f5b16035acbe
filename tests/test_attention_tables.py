"""Fused attention priced from aiconfigurator-core's measured attention tables (README: Measured kernel tables).

What is pinned: every measured cell is reproduced exactly; rows held out of a table are predicted from the rest (the
figures are printed: `pytest -s tests/test_attention_tables.py`); a reading between measured values lies between
them; beyond the longest length a call keeps the longest's rate and beyond the most heads it runs back to back; a
call the tables did not time goes to the existing path and says so; a backward is its forward times the kernel's
published backward/forward ratio; a hypothetical accelerator keeps the measured share of its roofline; a replayed
trace gives each point its own heads; ASTRA-sim sees the durations the analytical model prices; a collection
without attention tables is refused in one line.
"""

from itertools import pairwise

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml
from helpers import held_out_errors, hold_out, make_point, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

from dse.compute import ATTENTION_TABLE, FRAMEWORK_KERNEL, GEMM_TABLE, KERNEL_TABLE, OUTSIDE_TABLE, ComputeModel
from dse.errors import SpecError
from dse.point.points import expand
from dse.system import AcceleratorSpec
from dse.tables.attention import LENGTH_POWER, AttentionGrid, attention_grid
from dse.tables.source import KernelTables, table_file
from dse.workload import AttentionShape, Op, OpKind
from dse.workload import expand as expand_program
from generators.symbolic import SymbolicGenerator
from simulators.astrasim import AstraSimCostModel, AstraSimOptions

pytest.importorskip("aiconfigurator_core")

H100 = KernelTables(
    system="h100_sxm", framework="trtllm", version="1.3.0rc20", peak_tflops={"bf16": 989.4}, hbm_bandwidth_GBps=3350
)
A100 = H100.model_copy(update={"system": "a100_sxm", "version": "1.0.0", "peak_tflops": {"bf16": 312.0}})
FIELD = "system.accelerator.kernel_tables"
CONTEXT, GENERATION = "context_attention_perf", "generation_attention_perf"
AXES = ["head_dim", "ratio", "length", "work"]


def rows(tables: KernelTables, table: str) -> pd.DataFrame:
    """The table's full-attention bf16 rows (TensorRT-LLM's one kernel lane) with the grid's axes and seconds."""
    found = pq.read_table(table_file(tables, "attention", table, FIELD)).to_pandas()
    found = found[(found.window_size == 0) & (found.attn_dtype == "bfloat16") & (found.kv_cache_dtype == "bfloat16")]
    assert set(found.kernel_source) == {"torch_flow"}
    return found.assign(
        head_dim=found.head_dim.astype(float),
        ratio=found.num_heads / found.num_key_value_heads,
        length=(found.isl + found.step).astype(float),
        work=(found.batch_size * found.num_heads).astype(float),
        seconds=found.latency * 1e-3,
    )


def cells(found: pd.DataFrame) -> pd.DataFrame:
    return found.groupby(AXES, as_index=False)["seconds"].median()


def read(grid: AttentionGrid, at: pd.DataFrame) -> np.ndarray:
    return np.array([grid.seconds_of(*cell) for cell in at[AXES].itertuples(index=False)], dtype=float)


def accelerator(base: str = "h100-sxm", tables: KernelTables | None = H100, **changes) -> AcceleratorSpec:
    """The catalog's accelerator, priced from these tables (None: the roofline)."""
    entry = expand({"system": {"base": "tiny-ring", "accelerator": {"base": base}}})["system"]["accelerator"]
    measured = {"kernel_source": "roofline"}
    if tables is not None:
        measured = {"kernel_source": "tables", "kernel_tables": tables.model_dump()}
    return AcceleratorSpec.model_validate({**entry, **measured, **changes})


def attention(queries, keys, head_dim=128, batch=1, heads=32, kv_heads=8, backward=False, causal=None) -> Op:
    """A fused attention op as the generators make it: FLOPs 4 b n q k d with the mask's half executed, a backward
    2.5 times its forward's executed FLOPs; bytes its q, k, v and output."""
    causal = queries > 1 if causal is None else causal
    flops, density = 4.0 * batch * heads * queries * keys * head_dim, 0.5 if causal else 1.0
    if backward:
        flops, density = 2 * flops, density * 1.25
    nbytes = 2.0 * batch * head_dim * (2 * heads * queries + 2 * kv_heads * keys)
    shape = AttentionShape(queries, keys, head_dim, causal, backward, batch, heads, kv_heads)
    return Op("attention", OpKind.COMPUTE, "attention", flops=flops, bytes=nbytes, density=density, attention=shape)


H100_MODEL = ComputeModel(accelerator(), "bf16", attention_kernel=FRAMEWORK_KERNEL)


@pytest.mark.parametrize("table", [CONTEXT, GENERATION])
def test_every_measured_cell_is_reproduced_exactly(table):
    """A cell is (head dim, ratio, length, batch x heads); the rows that split one batch x heads differently (1 x 32
    and 4 x 8 heads) share it, and it keeps their median."""
    measured = cells(rows(H100, table))
    grid = attention_grid(table_file(H100, "attention", table, FIELD), table, "bfloat16")
    assert np.array_equal(read(grid, measured), measured["seconds"].to_numpy())


def test_the_h100_prefill_kernel_runs_between_flashattention_2_and_3():
    """The FlashAttention papers' benchmark (16k tokens of 16 heads of 128, causal): TensorRT-LLM's Hopper kernel
    reaches 124, 399 and 530 TFLOP/s at 512, 4096 and 16384 tokens, where FlashAttention-2 reaches 191, 319 and 335
    and FlashAttention-3 292, 579 and 616 (h100-sxm.yaml's attention_kernels): slower than both at short sequences
    (the call also applies RoPE and writes the KV cache), between the two at long ones."""
    rates = []
    for length in (512, 4096, 16384):
        op = attention(length, length, batch=16384 // length, heads=16, kv_heads=16)
        seconds, source = H100_MODEL.price(op)
        assert source == ATTENTION_TABLE
        rates.append(round(op.flops * op.density / seconds / 1e12))
    assert rates == [124, 399, 530]


@pytest.mark.parametrize("tables", [H100, A100], ids=["h100", "a100"])
@pytest.mark.parametrize("table", [CONTEXT, GENERATION])
def test_held_out_rows_are_predicted_from_the_rest(tables, table):
    kept, out = hold_out(rows(tables, table))
    grid = AttentionGrid.from_rows(*(kept[axis].to_numpy() for axis in [*AXES, "seconds"]), LENGTH_POWER[table])
    label = f"{tables.system} {tables.framework} {tables.version} {table}"
    median, p90, worst = held_out_errors(label, read(grid, out), out["seconds"].to_numpy())
    # Today's figures with a little room: the median is interpolation; the tail is rows at the grid's ragged edge
    # read from one neighbour, and the tables' own steps between neighbouring shapes (a decode kernel's choice).
    assert median < 0.02 and p90 < 0.08 and worst < 1.0


H100_CELLS = cells(rows(H100, CONTEXT))
H100_GRID = attention_grid(table_file(H100, "attention", CONTEXT, FIELD), CONTEXT, "bfloat16")


def neighbours(axis: str) -> list[tuple[tuple[float, ...], float, float]]:
    """Measured cells next to each other along `axis` (no value of the axis measured between them under the axes
    nested above it): (the lower cell, the upper one's value of the axis, the upper one's seconds)."""
    depth = AXES.index(axis)
    pairs = []
    for _, level in H100_CELLS.groupby(AXES[:depth]) if depth else [((), H100_CELLS)]:
        values = np.sort(level[axis].unique())
        upper = dict(pairwise(values))
        seconds = {tuple(cell[:-1]): cell[-1] for cell in level[[*AXES, "seconds"]].itertuples(index=False)}
        for cell in seconds:
            if cell[depth] in upper and (above := (*cell[:depth], upper[cell[depth]], *cell[depth + 1 :])) in seconds:
                pairs.append((cell, above[depth], seconds[above]))
    return pairs


PAIRS = {axis: neighbours(axis) for axis in AXES}


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.sampled_from(AXES), st.integers(0, 10**6), st.floats(0.01, 0.99))
def test_a_reading_between_two_measured_cells_lies_between_them(axis, pick, share):
    """Monotone interpolation along each axis: no overshoot between neighbouring measured cells."""
    cell, upper, above = PAIRS[axis][pick % len(PAIRS[axis])]
    depth = AXES.index(axis)
    between = float(np.exp(np.log(cell[depth]) + share * (np.log(upper) - np.log(cell[depth]))))
    found = H100_GRID.seconds_of(*cell[:depth], between, *cell[depth + 1 :])
    below = H100_GRID.seconds_of(*cell)
    assert min(below, above) * (1 - 1e-12) <= found <= max(below, above) * (1 + 1e-12)


def test_beyond_the_table_a_call_keeps_the_largest_rate_and_beside_it_the_existing_path_prices():
    """Twice the longest prefill (16384) takes 4 times as long, twice the longest KV read (131072) twice; twice the
    most heads timed at 16k tokens (8 x 32) run back to back. Head dims outside 64-256 (tiny-llama's 32, MLA's
    absorbed 544), a non-causal call of several queries, a call without its heads and a dtype the tables did not
    time are priced as without the tables, and say so."""
    price = H100_MODEL.price
    longest, twice = price(attention(16384, 16384)), price(attention(32768, 32768))
    assert longest[1] == twice[1] == ATTENTION_TABLE and twice[0] == pytest.approx(4 * longest[0], rel=1e-12)
    longest, twice = price(attention(1, 131072)), price(attention(1, 2 * 131072))
    assert longest[1] == twice[1] == ATTENTION_TABLE and twice[0] == pytest.approx(2 * longest[0], rel=1e-12)
    most = price(attention(16384, 16384, batch=8))
    assert price(attention(16384, 16384, batch=16))[0] == pytest.approx(2 * most[0], rel=1e-12)
    headless = attention(4096, 4096)
    shape = headless.attention[:5]  # the sizes and flags, without the batch and heads
    outside = [
        attention(4096, 4096, head_dim=32),
        attention(1, 4096, head_dim=544, heads=16, kv_heads=1),
        attention(512, 256, causal=False),
        Op("a", OpKind.COMPUTE, "attention", flops=headless.flops, density=0.5, attention=AttentionShape(*shape)),
    ]
    without = ComputeModel(accelerator(tables=None, attention_kernels=None), "bf16")  # the flat share
    for op in outside:
        assert price(op) == (without.price(op)[0], OUTSIDE_TABLE)
    fp32 = ComputeModel(accelerator(), "fp32", attention_kernel=FRAMEWORK_KERNEL)
    assert fp32.price(attention(4096, 4096))[1] == OUTSIDE_TABLE


def test_only_the_frameworks_own_kernel_is_read_from_the_tables(tmp_path):
    """The tables time serving kernels: a training step's FlashAttention (auto, fa2, ...) keeps its published
    tables even with kernel_source: tables, a backward is never read from them, and the framework kernel needs the
    tables and a serving mode."""
    forward, backward = attention(4096, 4096), attention(4096, 4096, backward=True)
    flash = ComputeModel(accelerator(), "bf16")
    assert flash.price(forward)[1] == KERNEL_TABLE and flash.price(backward)[1] == KERNEL_TABLE
    assert H100_MODEL.price(backward)[1] == OUTSIDE_TABLE
    with pytest.raises(SpecError, match=r"^field 'workload\.attention_kernel': framework is .*kernel_source: tables"):
        ComputeModel(accelerator(tables=None), "bf16", attention_kernel=FRAMEWORK_KERNEL)
    point = {
        "model": "tiny-llama",
        "workload": {"seq_len": 256, "global_batch": 8, "attention_kernel": "framework"},
        "parallel": {"dp": 8},
        "system": {"base": "tiny-ring"},
    }
    path = tmp_path / "point.yaml"
    path.write_text(yaml.safe_dump(point))
    code, _, err = run_cli("evaluate", str(path))
    assert code == 2 and "attention_kernel: framework is a serving framework's kernel" in err, err


def test_a_hypothetical_accelerator_keeps_the_measured_share_of_its_roofline():
    """A prefill is bound by its FLOPs: half the peak or half the clock doubles it; a decode by its KV bytes: twice
    the HBM bandwidth halves it."""
    prefill, decode = attention(8192, 8192), attention(1, 8192, batch=64)
    for changes in ({"peak_tflops": {"bf16": 494.7}}, {"clock_share": 0.5}):
        slower = ComputeModel(accelerator(**changes), "bf16", attention_kernel=FRAMEWORK_KERNEL)
        assert slower.price(prefill)[0] == pytest.approx(2 * H100_MODEL.price(prefill)[0], rel=1e-12)
    faster = ComputeModel(accelerator(hbm_bandwidth_GBps=6700), "bf16", attention_kernel=FRAMEWORK_KERNEL)
    assert faster.price(decode)[0] == pytest.approx(H100_MODEL.price(decode)[0] / 2, rel=1e-12)


def test_a_replayed_trace_gives_each_point_its_own_heads():
    """The heads are recorded numbers: a point of another tensor-parallel degree replays the trace on its own."""
    generator = SymbolicGenerator()
    for tp, dp in ((2, 4), (4, 2)):
        p = make_point("tiny-llama", global_batch=8, micro_batch=2, tp=tp, dp=dp)
        shapes = {op.attention for block in generator.generate(p).blocks for op in block.ops if op.attention}
        assert {(s.batch, s.heads, s.kv_heads) for s in shapes} == {(2, p.model.heads / tp, p.model.kv_heads / tp)}


def test_astrasim_prices_the_measured_attention_as_the_analytical_model_does(binary):
    """The Chakra export's COMP durations come from the same compute model: with head dim 64 (in the tables),
    tiny-llama's attention is priced from them, and ASTRA-sim's compute is the model's prices of the kernels."""
    serving = {"model.head_dim": 64, "workload.mode": "prefill", "workload.attention_kernel": "framework"}
    point = make_point("tiny-llama", global_batch=8, tp=2, dp=4, overrides=serving)
    point = point.model_copy(update={"system": point.system.model_copy(update={"accelerator": accelerator()})})
    workload = SymbolicGenerator().generate(point)
    model = ComputeModel(point.system.accelerator, workload.dtype, attention_kernel=workload.attention_kernel)
    flat = [f.op for f in expand_program(workload, workload.programs[0]) if f.op.kind is OpKind.COMPUTE]
    sources = {op.category: model.price(op)[1] for op in flat if op.category in ("gemm", "attention")}
    assert sources == {"gemm": GEMM_TABLE, "attention": ATTENTION_TABLE}
    astrasim = AstraSimCostModel(AstraSimOptions(binary=binary)).simulate(workload, point.system)
    assert astrasim.classes[0].compute_s == pytest.approx(sum(model.price(op)[0] for op in flat), abs=1e-6)


def test_a_collection_without_attention_tables_is_refused_in_one_line(tmp_path):
    """H100's SGLang 0.5.6.post2 collection timed GEMMs but no attention: the error names the collections that
    timed it."""
    tables = {**H100.model_dump(), "framework": "sglang", "version": "0.5.6.post2"}
    point = {
        "model": "tiny-llama",
        "workload": {"seq_len": 256, "global_batch": 8, "mode": "prefill", "attention_kernel": "framework"},
        "parallel": {"dp": 8},
        "system": {"base": "tiny-ring", "accelerator": {"kernel_source": "tables", "kernel_tables": tables}},
    }
    path = tmp_path / "point.yaml"
    path.write_text(yaml.safe_dump(point))
    code, out, err = run_cli("evaluate", str(path))
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert "has no context_attention_perf for h100_sxm under sglang 0.5.6.post2" in err and f"'{FIELD}'" in err
    assert err.rstrip().endswith(
        "use a framework and version that has it: sglang 0.5.14, trtllm 1.3.0rc20, vllm 0.24.0"
    )
