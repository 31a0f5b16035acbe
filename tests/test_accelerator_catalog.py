"""The accelerator catalog: every entry loads, the Blackwell entries price GEMMs from their measured tables, a
tiered memory prices a memory-bound kernel by the tiers holding the working set, and every new entry evaluates."""

import pandas as pd
import pyarrow.parquet as pq
import pytest
from helpers import make_point

from dse import catalog, plugins
from dse.compute import GEMM_TABLE, ROOFLINE, ComputeModel
from dse.errors import SpecError
from dse.fields import GiB
from dse.point.evaluate import evaluate
from dse.search.space import load_study
from dse.system import AcceleratorSpec
from dse.tables.source import LATENCY_UNIT_S, table_file
from dse.workload import Op, OpKind

BLACKWELL = ("b200", "b300", "gb200", "gb300")
NEW = (*BLACKWELL, "mi300x", "mi325x", "tpu-v5p", "sn40l", "v100", "tpu-v4", "sn30", "wse-2")
RING = [
    {"topology": "ring", "npus": 4, "bandwidth_GBps": 100, "latency_ns": 1000},
    {"topology": "switch", "npus": 2, "bandwidth_GBps": 25, "latency_ns": 5000},
]


def accelerator(name: str, **fields: object) -> AcceleratorSpec:
    return AcceleratorSpec.model_validate({**catalog.entry("accelerators", name), **fields})


@pytest.mark.parametrize("name", catalog.names("accelerators"))
def test_every_entry_validates_names_its_sources_and_orders_its_peaks(name):
    spec = accelerator(name)
    assert spec.sources
    peaks = [spec.peak_tflops[d] for d in ("fp4", "fp8", "bf16", "fp32") if d in spec.peak_tflops]
    assert peaks == sorted(peaks, reverse=True)  # narrower types run at least as fast


@pytest.mark.parametrize("name", BLACKWELL)
def test_a_large_bf16_gemm_is_priced_from_the_blackwell_tables(name):
    spec = accelerator(name)
    assert spec.kernel_tables is not None
    size = 8192
    op = Op("gemm", OpKind.COMPUTE, "gemm", flops=2.0 * size**3, bytes=3.0 * size**2 * 2, gemm=(1, size, size, size))
    seconds, source = ComputeModel(spec, "bf16").price(op)
    assert source == GEMM_TABLE
    # The table's own row, read straight from the parquet file, at the device's sustained share of its clock.
    path = table_file(spec.kernel_tables, "gemm", "gemm_perf", "test")
    rows = pq.read_table(path, columns=["gemm_dtype", "m", "n", "k", "latency"]).to_pandas()
    row = rows[(rows.gemm_dtype == "bfloat16") & (rows.m == size) & (rows.n == size) & (rows.k == size)]
    measured = float(pd.Series(row.latency).median()) * LATENCY_UNIT_S
    assert seconds == pytest.approx(measured / spec.kernel_tables.sustained_share, rel=1e-9)
    # ... and the catalog's roofline share is that same figure (the entry's comment): within its rounding.
    rate = op.flops / seconds / spec.peak_flops("bf16")
    assert spec.compute_efficiency["gemm"] == pytest.approx(rate, abs=0.006)


def tiered(**memory: object) -> AcceleratorSpec:
    return AcceleratorSpec(
        name="tiered",
        peak_tflops={"bf16": 100.0},
        hbm_GiB=10.0,
        hbm_bandwidth_GBps=1000.0,
        compute_efficiency={"elementwise": 1.0},
        memory_efficiency=1.0,
        kernel_launch_us=0.0,
        **memory,
    )


def test_a_kernel_whose_working_set_spills_into_ddr_takes_the_tier_weighted_time():
    spec = tiered(
        memory_tiers=[
            {"name": "sram", "GiB": 1.0, "bandwidth_GBps": 10000.0},
            {"name": "ddr", "GiB": 100.0, "bandwidth_GBps": 100.0},
        ]
    )
    op = Op("add", OpKind.COMPUTE, "elementwise", bytes=1e9)
    # 31 GiB: 1 in SRAM, 10 in HBM, 20 spill into DDR; each byte costs the tiers' time in those shares.
    seconds, source = ComputeModel(spec, "bf16", working_set=31 * GiB).price(op)
    assert source == ROOFLINE
    assert seconds == pytest.approx(1e9 * (1 / 31 / 1e13 + 10 / 31 / 1e12 + 20 / 31 / 1e11), rel=1e-12)
    # Within the fast tiers nothing reaches DDR; without tiers every byte is HBM's.
    fast, _ = ComputeModel(spec, "bf16", working_set=5 * GiB).price(op)
    assert fast == pytest.approx(1e9 * (1 / 5 / 1e13 + 4 / 5 / 1e12), rel=1e-12)
    assert ComputeModel(tiered(), "bf16", working_set=31 * GiB).price(op)[0] == pytest.approx(1e-3, rel=1e-12)
    assert spec.memory_bytes == 111 * GiB


def test_tiers_must_be_listed_fastest_first_and_not_named_hbm():
    with pytest.raises(ValueError, match="fastest first"):
        tiered(
            memory_tiers=[
                {"name": "ddr", "GiB": 1.0, "bandwidth_GBps": 100.0},
                {"name": "sram", "GiB": 1.0, "bandwidth_GBps": 1e4},
            ]
        )
    with pytest.raises(ValueError, match="not 'hbm'"):
        tiered(memory_tiers=[{"name": "hbm", "GiB": 1.0, "bandwidth_GBps": 100.0}])


def on(name: str) -> dict[str, object]:
    return {"name": f"{name} ring", "accelerator": name, "network": RING}


@pytest.mark.parametrize("name", NEW)
def test_a_point_on_each_new_accelerator_evaluates(name):
    dtype = {"model.dtype": "fp16"} if name == "v100" else {}  # Volta has no bf16
    point = make_point(system=on(name), overrides=dtype, global_batch=8, dp=8)
    result = evaluate(point, plugins.generator("symbolic"), plugins.cost_model("analytical"))
    assert result.metrics["step_time_s"] > 0 and result.metrics["fits_memory"]


def test_the_dataflow_chips_ddr_counts_toward_capacity_and_slows_what_spills():
    """Two SN40L-class chips with 1 MiB of SRAM (tiny-llama's working set fits the real 520 MB), one with its HBM
    shrunk so that the working set spills into DDR: it fits (the tiers' total is its capacity) and runs slower."""
    tiers = [
        {"name": "sram", "GiB": 2**-10, "bandwidth_GBps": 62500.0},
        {"name": "ddr", "GiB": 1397, "bandwidth_GBps": 100.0},
    ]
    roomy = make_point(system=on("sn40l"), overrides={"system.accelerator.memory_tiers": tiers}, global_batch=8, dp=8)
    small = {"system.accelerator.memory_tiers": tiers, "system.accelerator.hbm_GiB": 0.01}
    spilled = make_point(system=on("sn40l"), overrides=small, global_batch=8, dp=8)
    model, cost = plugins.generator("symbolic"), plugins.cost_model("analytical")
    fast, slow = evaluate(roomy, model, cost), evaluate(spilled, model, cost)
    assert slow.metrics["peak_memory_bytes"] > 0.01 * GiB and slow.metrics["fits_memory"]
    assert slow.metrics["step_time_s"] > fast.metrics["step_time_s"]


def test_hbm_cannot_be_feasibility_only_on_a_tiered_accelerator(tmp_path):
    """With memory tiers, HBM's size places the working set, so one evaluation cannot stand for every size."""
    study = tmp_path / "study.yaml"
    study.write_text(
        "name: t\nobjectives: {step_time: minimize}\nconstraints: [fits_memory]\ntrials: 2\nworkers: 1\nbase:\n"
        "  model: tiny-llama\n  workload: {seq_len: 512, global_batch: 16}\n"
        "  system: {base: tiny-ring, accelerator: sn40l}\n  parallel: {dp: 8}\n"
        "space:\n  system.accelerator.hbm_GiB: {choices: [16, 64], feasibility_only: true}\n"
    )
    with pytest.raises(SpecError, match="accelerator 'sn40l' has memory_tiers, where HBM's size decides"):
        load_study(study)
