"""GEMMs priced from aiconfigurator-core's measured per-shape tables (README: Measured kernel tables).

What is pinned: every measured row is reproduced exactly; rows held out of the table are predicted from the rest
(the figures are printed: `pytest -s tests/test_gemm_tables.py`); a lookup between measured points never leaves the
range of its cell's corners; beyond the largest size a GEMM is the largest one run back to back; below the
smallest the roofline prices it and says so; a hypothetical accelerator keeps the measured share of its roofline;
the catalog H100 prices from its tables by default (one line naming the fix without the package) and a study can
search kernel_source like any field.
"""

import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import ROOT
from helpers import held_out_errors, hold_out, make_point, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

from dse.compute import GEMM_TABLE, OUTSIDE_TABLE, ROOFLINE, ComputeModel
from dse.point.points import expand
from dse.search.decoding import decode
from dse.search.space import load_study
from dse.system import AcceleratorSpec
from dse.tables.gemm import GemmGrid, gemm_grid
from dse.tables.source import KernelTables, table_file
from dse.workload import Op, OpKind
from dse.workload import expand as expand_program
from generators.symbolic import SymbolicGenerator
from simulators.analytical import AnalyticalCostModel
from simulators.astrasim import AstraSimCostModel, AstraSimOptions

pytest.importorskip("aiconfigurator_core")

H100 = KernelTables(
    system="h100_sxm", framework="trtllm", version="1.3.0rc20", peak_tflops={"bf16": 989.4}, hbm_bandwidth_GBps=3350
)
FIELD = "system.accelerator.kernel_tables"


def rows(tables: KernelTables) -> "pd.DataFrame":  # noqa: F821
    table = pq.read_table(table_file(tables, "gemm", "gemm_perf", FIELD)).to_pandas()
    table = table[table["gemm_dtype"] == "bfloat16"]
    return table.groupby(["m", "n", "k"], as_index=False)["latency"].median()


def gemm(m: float, n: float, k: float, batch: float = 1.0) -> Op:
    """A bf16 GEMM op of this shape: FLOPs 2mnk, bytes its three matrices."""
    flops = 2.0 * batch * m * n * k
    return Op(
        "gemm", OpKind.COMPUTE, "gemm", flops=flops, bytes=2.0 * batch * (m * k + k * n + m * n), gemm=(batch, m, n, k)
    )


def h100(**changes) -> AcceleratorSpec:
    """The catalog's H100 SXM, priced from H100 tables unless `changes` say otherwise."""
    entry = expand({"system": {"base": "tiny-ring"}})["system"]["accelerator"]
    tables = {"kernel_source": "tables", "kernel_tables": H100.model_dump()} if changes.pop("tables", True) else {}
    return AcceleratorSpec.model_validate({**entry, **tables, **changes})


def test_every_measured_row_is_reproduced_exactly():
    measured = rows(H100)
    grid = gemm_grid(table_file(H100, "gemm", "gemm_perf", FIELD), "bfloat16")
    found = grid.lookup(measured["m"].to_numpy(), measured["n"].to_numpy(), measured["k"].to_numpy())
    assert np.array_equal(found, measured["latency"].to_numpy() * 1e-3)
    # The figures: n = k = 8192 reaches 73%, 83% and 79% of the 989.4 TFLOP/s peak at m = 1024, 4096, 8192.
    shares = [2 * m * 8192**2 / grid.seconds_of(m, 8192, 8192) / 989.4e12 for m in (1024, 4096, 8192)]
    assert [round(s, 2) for s in shares] == [0.73, 0.83, 0.79]


@pytest.mark.parametrize(
    "system, framework, version", [("h100_sxm", "trtllm", "1.3.0rc20"), ("a100_sxm", "trtllm", "1.0.0")]
)
def test_held_out_rows_are_predicted_from_the_rest(system, framework, version):
    tables = H100.model_copy(update={"system": system, "framework": framework, "version": version})
    kept, out = hold_out(rows(tables))
    grid = GemmGrid.from_rows(kept["m"], kept["n"], kept["k"], kept["latency"].to_numpy() * 1e-3)
    predicted = grid.lookup(out["m"].to_numpy(), out["n"].to_numpy(), out["k"].to_numpy())
    label = f"{system} {framework} {version}"
    median, p90, worst = held_out_errors(label, predicted, out["latency"].to_numpy() * 1e-3)
    # The bounds are today's figures with a little room: the median is interpolation, the tail the tables' own
    # steps between cuBLAS algorithms (a row 1.6x its neighbours along every axis) that no interpolation foresees.
    assert median < 0.03 and p90 < 0.16 and worst < 1.0


GRID = gemm_grid(table_file(H100, "gemm", "gemm_perf", FIELD), "bfloat16")


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.floats(1, 32768), st.floats(32, 65536), st.floats(32, 65536))
def test_a_lookup_lies_between_its_cells_corners(m, n, k):
    """Monotone interpolation: no overshoot between measured points."""
    corners = []
    for lm in _around(GRID.axes[0], m):
        for ln in _around(GRID.axes[1], n):
            for lk in _around(GRID.axes[2], k):
                corners.append(np.exp(GRID.log_seconds[lm, ln, lk]))
    found = GRID.seconds_of(m, n, k)
    assert min(corners) * (1 - 1e-9) <= found <= max(corners) * (1 + 1e-9)


def _around(axis: np.ndarray, size: float) -> tuple[int, int]:
    i = min(max(int(np.searchsorted(axis, np.log(size), side="right")) - 1, 0), len(axis) - 2)
    return i, i + 1


def test_beyond_the_table_a_gemm_is_the_largest_run_back_to_back_and_below_it_the_roofline_prices():
    model = ComputeModel(h100(), "bf16")
    largest, twice = model.price(gemm(32768, 8192, 8192)), model.price(gemm(65536, 8192, 8192))
    assert largest[1] == twice[1] == GEMM_TABLE
    assert twice[0] == pytest.approx(2 * largest[0], rel=1e-12)
    assert model.price(gemm(4096, 8192, 2 * 65536))[0] == pytest.approx(2 * model.price(gemm(4096, 8192, 65536))[0])
    seconds, source = model.price(gemm(4096, 16, 8192))  # n below the table's 32
    assert (
        source == OUTSIDE_TABLE and seconds == ComputeModel(h100(tables=False), "bf16").price(gemm(4096, 16, 8192))[0]
    )
    assert model.price(gemm(4096, 8192, 8192))[1] == GEMM_TABLE
    assert ComputeModel(h100(), "fp32").price(gemm(4096, 8192, 8192))[1] == OUTSIDE_TABLE  # no fp32 tables
    assert ComputeModel(h100(tables=False), "bf16").price(gemm(4096, 8192, 8192))[1] == ROOFLINE


def test_a_hypothetical_accelerator_keeps_the_measured_share_of_its_roofline():
    measured = ComputeModel(h100(), "bf16")
    half_peak = ComputeModel(h100(peak_tflops={"bf16": 494.7}), "bf16")
    half_clock = ComputeModel(h100(clock_share=0.5), "bf16")
    big, small = gemm(8192, 8192, 8192), gemm(16, 8192, 8192)  # compute-bound; HBM-bound (decode-sized)
    assert measured.price(big)[0] == GRID.seconds_of(8192, 8192, 8192)
    assert half_peak.price(big)[0] == pytest.approx(2 * measured.price(big)[0], rel=1e-12)
    assert half_clock.price(big)[0] == pytest.approx(2 * measured.price(big)[0], rel=1e-12)
    assert half_peak.price(small)[0] == measured.price(small)[0]  # its roofline is its bytes: the peak is not used
    sustained = ComputeModel(h100(kernel_tables={**H100.model_dump(), "sustained_share": 0.5}), "bf16")
    assert sustained.price(big)[0] == pytest.approx(2 * measured.price(big)[0], rel=1e-12)
    assert sustained.price(small)[0] == measured.price(small)[0]  # the clock does not move HBM bytes
    double_hbm = ComputeModel(h100(hbm_bandwidth_GBps=6700), "bf16")
    assert double_hbm.price(small)[0] == pytest.approx(measured.price(small)[0] / 2, rel=1e-12)


def test_kernel_tables_that_are_not_there_are_refused_in_one_line(tmp_path):
    point = {
        "model": "tiny-llama",
        "workload": {"mode": "train", "seq_len": 256, "global_batch": 8},
        "parallel": {"dp": 8},
        "system": {"base": "tiny-ring", "accelerator": {"base": "h100-sxm", "kernel_source": "tables"}},
    }
    cases = {
        "system: h999": ("field 'system.accelerator.kernel_tables.system'", "use one of a100_sxm"),
        "version: '9.9'": ("has no gemm_perf for h100_sxm under trtllm 9.9", "trtllm 1.3.0rc20"),
        "version: 9.9": ("kernel_tables.version'", "write the version in quotes"),
        "kernel_tables: null": ("kernel_source: tables needs kernel_tables", "use kernel_source: roofline"),
    }
    for change, fragments in cases.items():
        tables = yaml.safe_dump(H100.model_dump(), default_flow_style=True).strip()
        accelerator = dict(point["system"]["accelerator"])
        key, value = change.split(": ")
        if key == "kernel_tables":
            accelerator["kernel_tables"] = None
        else:
            accelerator["kernel_tables"] = {**yaml.safe_load(tables), key: yaml.safe_load(value)}
        path = tmp_path / "point.yaml"
        path.write_text(yaml.safe_dump({**point, "system": {**point["system"], "accelerator": accelerator}}))
        code, out, err = run_cli("evaluate", str(path))
        assert code == 2 and out == "" and len(err.splitlines()) == 1, (change, err)
        assert all(fragment in err for fragment in fragments), (change, err)


def test_without_the_package_a_catalog_h100_is_refused_in_one_line_naming_both_fixes(tmp_path, monkeypatch):
    """The catalog's H100 prices from its kernel tables by default (kernel_source: auto); where aiconfigurator-core
    is not installed, that is one line naming the extra to install and the roofline as the other way."""
    point = {
        "model": "tiny-llama",
        "workload": {"mode": "train", "seq_len": 256, "global_batch": 8},
        "parallel": {"dp": 8},
        "system": {"base": "dgx-h100", "network": {1: {"npus": 1}}},
    }
    path = tmp_path / "point.yaml"
    path.write_text(yaml.safe_dump(point))
    monkeypatch.setitem(sys.modules, "aiconfigurator_core", None)  # `import aiconfigurator_core` raises ImportError
    code, out, err = run_cli("evaluate", str(path))
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert "need the package aiconfigurator-core" in err and "kernel_source: roofline" in err, err
    path.write_text(
        yaml.safe_dump({**point, "system": {**point["system"], "accelerator": {"kernel_source": "roofline"}}})
    )
    assert run_cli("evaluate", str(path))[0] == 0


def test_astrasim_prices_the_measured_gemms_as_the_analytical_model_does(binary):
    """The Chakra export's COMP durations come from the same compute model as the analytical cost model's: a
    rank's compute in ASTRA-sim is the model's prices of its kernels, tables on or off."""
    computed = {}
    for tables in (True, False):
        point = make_point("tiny-llama", global_batch=8, tp=2, dp=4)
        accelerator = h100(tables=tables)
        point = point.model_copy(update={"system": point.system.model_copy(update={"accelerator": accelerator})})
        workload = SymbolicGenerator().generate(point)
        model = ComputeModel(accelerator, workload.dtype, attention_kernel=workload.attention_kernel)
        flat = [f.op for f in expand_program(workload, workload.programs[0]) if f.op.kind is OpKind.COMPUTE]
        sources = {model.price(op)[1] for op in flat if op.category == "gemm"}  # tiny-llama's 32-wide heads: no table
        assert (GEMM_TABLE in sources) == tables and OUTSIDE_TABLE not in sources
        astrasim = AstraSimCostModel(AstraSimOptions(binary=binary)).simulate(workload, point.system)
        computed[tables] = sum(model.price(op)[0] for op in flat)
        assert astrasim.classes[0].compute_s == pytest.approx(computed[tables], abs=1e-6)  # whole microseconds
    assert computed[True] != pytest.approx(computed[False], rel=0.01)


def test_a_study_searches_the_kernel_source_as_a_field(tmp_path):
    """`kernel_source` is a parameter like any other: a study over {roofline, tables} decodes two points of
    different keys on the catalog H100, the tables pricing its GEMMs (whose roofline share is the tables' own
    large-GEMM rate, so the two step times stay within a few percent)."""
    study = yaml.safe_load((ROOT / "studies" / "quickstart.yaml").read_text())
    study["space"] = {"system.accelerator.kernel_source": {"choices": ["roofline", "tables"]}}
    study["base"]["parallel"] |= {"tp": 8, "pp": 1, "dp": 8}
    del study["derived"]
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    spec = load_study(path)
    points = {source: decode(spec, {"system.accelerator.kernel_source": source}) for source in ("roofline", "tables")}
    assert points["roofline"].key != points["tables"].key
    times = {}
    for source, point in points.items():
        workload = SymbolicGenerator().generate(point)
        model = ComputeModel(point.system.accelerator, workload.dtype, attention_kernel=workload.attention_kernel)
        gemms = [op for block in workload.blocks for op in block.ops if op.category == "gemm" and op.gemm is not None]
        assert {model.price(op)[1] for op in gemms} == ({ROOFLINE} if source == "roofline" else {GEMM_TABLE})
        times[source] = AnalyticalCostModel().simulate(workload, point.system).step_time_s
    assert times["tables"] != times["roofline"]
    assert times["tables"] == pytest.approx(times["roofline"], rel=0.05)
