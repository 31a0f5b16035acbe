"""The calibration set against the model: which cases hold, and the `dse calibrate` table.

The bounds are what the model reaches today. The blog's runs and torchtitan's eager row are priced with eager
kernels (`workload.kernels: eager`), torchtitan's torch.compile row with fused ones; the blog's with fms's
real-valued RoPE and FSDP1's copies (flat gradient concatenated and divided before the reduce-scatter),
torchtitan's with FSDP2's (copy-in, copy-out at every gather, an fp32 reduce-scatter input). Every accelerator of
the set prices its GEMMs and collectives within a node from its measured kernel tables (the catalog default), with
the roofline beside them. The blog's rows are within 11% (A100: optimistic by 10% at 7B, where no recompute makes
the elementwise work weigh most, falling with size; H100: -1 to -11%), torchtitan's eager row within 10% and its
compiled row within 15% (the model credits torch.compile's fusion with more than was measured). Peak memory of
both torchtitan rows is within 4% (the compiled row keeps only what its backward reads). The
collective rows are nccl-tests bus bandwidths on the catalog's networks, priced by a cost model that prices a
collective alone (dse.interfaces.CollectiveCostModel); one that does not still gets its end-to-end rows.
"""

import json

import pytest
from helpers import installed_plugin, run_cli

from dse import plugins
from dse.cli.main import main
from dse.interfaces import CollectiveCostModel
from dse.point import calibration
from dse.point.calibration import CASES, COLLECTIVE_CASES, HELD_OUT, Case, Row, errors, run, run_collectives


@pytest.fixture(scope="module")
def rows():
    return {row.case.name: row for row in run(plugins.generator("symbolic"), plugins.cost_model("analytical"))}


def test_every_case_is_priced_with_its_measurement(rows):
    assert len(rows) == len(CASES) == 10
    assert {row.case.tokens_per_s_per_gpu for row in rows.values()} >= {3700, 1800, 700, 370, 7500, 800, 5762, 6667}


def _case(name: str) -> Case:
    (case,) = [c for c in CASES if c.name == name]
    return case


@pytest.mark.parametrize("case", [c.name for c in CASES])
def test_cases_within_their_bounds(rows, case):
    bound = 0.15 if "torch.compile" in case else 0.10 if "llama3.1" in case else 0.11
    assert abs(rows[case].throughput_error) < bound


def test_the_blogs_a100_7b_without_recompute_is_the_most_optimistic_a100_row(rows):
    a100 = {name: row.throughput_error for name, row in rows.items() if "A100" in name}
    assert max(a100, key=a100.__getitem__) == "llama2-7b A100x128 FSDP, AC none"
    assert 0 < a100["llama2-7b A100x128 FSDP, AC none"] < 0.11


def test_every_case_is_priced_by_the_tables_with_the_roofline_beside_them(rows):
    """Every accelerator of the set has kernel tables; the roofline's figure is a second, independent pricing (the
    roofline's GEMM share is the tables' large-GEMM rate, so the two stay within a few percent of each other)."""
    for row in rows.values():
        assert row.roofline_tokens_per_s_per_gpu is not None and row.roofline_error is not None
        assert row.roofline_tokens_per_s_per_gpu != row.tokens_per_s_per_gpu
        assert row.roofline_tokens_per_s_per_gpu == pytest.approx(row.tokens_per_s_per_gpu, rel=0.05), row.case.name


def test_each_case_runs_its_software_fsdp_and_rope():
    """fms-fsdp (the blog) wrapped fms's LLaMA in FSDP1 with bf16 reduction; torchtitan used FSDP2 with its
    default fp32 reduction and Meta's complex RoPE."""
    for case in CASES:
        blog = case.source.startswith("IBM")
        parallel = case.point["parallel"]
        assert (parallel["fsdp"], parallel["fsdp_reduce_dtype"]) == (("fsdp1", "bf16") if blog else ("fsdp2", "fp32"))
        model = case.point["model"]
        rope = model.get("rope_impl", "complex") if isinstance(model, dict) else "complex"
        assert rope == ("real" if blog else "complex")


def test_blog_runs_and_torchtitan_eager_row_are_eager_the_compile_row_fused():
    for case in CASES:
        compiled = "torch.compile" in case.name
        assert case.point["workload"]["kernels"] == ("fused" if compiled else "eager")


def test_torchtitan_compile_speedup_follows_from_the_kernels_alone(rows):
    """The two torchtitan rows differ only in kernels; the model's eager/compile throughput ratio is within 7% of
    the measured one (5,762 / 6,667)."""
    eager = rows["llama3.1-8b H100x8 FSDP, AC selective, eager"]
    compiled = rows["llama3.1-8b H100x8 FSDP, AC selective, torch.compile"]
    assert {k: v for k, v in _case(eager.case.name).point.items() if k != "workload"} == {
        k: v for k, v in _case(compiled.case.name).point.items() if k != "workload"
    }
    measured = eager.case.tokens_per_s_per_gpu / compiled.case.tokens_per_s_per_gpu
    assert eager.tokens_per_s_per_gpu / compiled.tokens_per_s_per_gpu == pytest.approx(measured, rel=0.07)


def test_torchtitan_peak_memory_within_four_percent(rows):
    measured = [row for row in rows.values() if row.case.peak_memory_GiB is not None]
    assert len(measured) == 2
    assert all(abs(row.memory_error) < 0.04 for row in measured)


def test_mean_error_under_seven_percent(rows):
    figures = errors(list(rows.values()))
    assert sum(figures) / len(figures) < 0.07


def test_errors_lists_throughput_and_memory(rows):
    figures = errors(list(rows.values()))
    assert len(figures) == 12
    assert all(f >= 0 for f in figures)


def test_the_collective_rows_reproduce_nccl_tests():
    """A row that set a catalog efficiency reproduces its figure within 1% (the catalog keeps two digits). The row
    that only checks the model, two nodes of eight A100s with 4x200G InfiniBand each, is within 5%: their NICs
    bound NCCL's rings at 8 x 12.5 x 0.9 = 90 GB/s where 86 was measured (a hierarchical decomposition read 100)."""
    analytical = plugins.cost_model("analytical")
    assert isinstance(analytical, CollectiveCostModel)
    rows = run_collectives(analytical)
    assert len(rows) == len(COLLECTIVE_CASES) == 5
    for row in rows:
        assert abs(row.error) < (0.01 if row.case.sets else 0.05), row.case.name
    (check,) = [row for row in rows if row.case.sets is None]
    assert check.bus_GBps == pytest.approx(90, rel=1e-3)


@pytest.fixture(scope="module")
def calibrated() -> dict:
    """`dse calibrate --json`'s tables, once: pricing the held-out Megatron rows (with the roofline beside them) is
    most of the command's half minute, so their bounds are checked on the command's own rows instead of a second
    pricing."""
    code, out, err = run_cli("calibrate", "--json")
    assert code == 0, err
    return json.loads(out)


def test_dse_calibrate_prints_the_table(calibrated, capsys, monkeypatch):
    tables = calibrated
    assert [row["case"] for row in tables["collectives"]] == [c.name for c in COLLECTIVE_CASES]
    table = tables["training"]
    assert [row["case"] for row in table] == [c.name for c in CASES]
    assert [row["case"] for row in tables["held_out"]] == [c.name for c in HELD_OUT]
    first = table[0]
    assert first["throughput_error"] == pytest.approx(
        first["tokens_per_s_per_gpu"] / first["measured_tokens_per_s_per_gpu"] - 1
    )
    assert first["roofline_throughput_error"] == pytest.approx(
        first["roofline_tokens_per_s_per_gpu"] / first["measured_tokens_per_s_per_gpu"] - 1
    )
    monkeypatch.setattr(calibration, "CASES", CASES[:1])  # the text of the same rows: one case of each table
    monkeypatch.setattr(calibration, "HELD_OUT", HELD_OUT[:1])
    assert main(["calibrate"]) == 0
    out = capsys.readouterr().out + capsys.readouterr().err
    assert CASES[0].name in out and HELD_OUT[0].name in out and CASES[1].name not in out
    assert "mean |error|" in out
    assert "checking figure(s)" in out
    assert "held out (sets nothing)" in out
    assert "whose accelerator has kernel tables" in out and "roofline" in out


def test_held_out_megatron_iteration_times(calibrated):
    """Korthikanti et al.'s table 5 sets nothing here; the bounds are what the model reaches today. Each
    tokens/s figure is the published iteration time turned into tokens (175B: 64 sequences of 2048 tokens on 64
    GPUs in 13.75 s is 149 per GPU). With the A100's NCCL tables pricing the TP collectives within a node (the GEMMs
    are fp16, which the tables do not time: the roofline prices them), the full-recompute rows are within 3% and the
    sequence-parallel + selective rows optimistic by up to 8% (Megatron's measured per-layer time barely falls with
    sequence parallelism, the model's falls by the elementwise work it divides); the mean is under 3% (the roofline
    alone: 4.5%, max 9.7%). The rows are `dse calibrate`'s (its model figures, the roofline's aside)."""
    cases = {case.name: case for case in HELD_OUT}
    rows = {
        row["case"]: Row(cases[row["case"]], row["tokens_per_s_per_gpu"], row["peak_memory_GiB"])
        for row in calibrated["held_out"]
    }
    assert list(rows) == list(cases)
    (sel175,) = [c for c in HELD_OUT if c.name.startswith("megatron 175B") and "selective" in c.name]
    assert sel175.tokens_per_s_per_gpu == pytest.approx(64 * 2048 / 13.75 / 64)
    for name, row in rows.items():
        bound = 0.03 if "full recompute" in name else 0.08
        assert abs(row.throughput_error) < bound, name
    assert sum(errors(list(rows.values()))) / len(rows) < 0.03


SIMULATE_ONLY = """
    from simulators.analytical import AnalyticalCostModel


    class SimulateOnly:
        \"\"\"A cost model with nothing but the CostModel contract (as an external simulator may start).\"\"\"

        name = "simulate-only"

        def simulate(self, workload, system):
            return AnalyticalCostModel().simulate(workload, system)
"""


@pytest.fixture
def simulate_only_plugin(tmp_path, monkeypatch):
    """A cost model installed as a user's plugin is: a distribution on sys.path declaring the entry point."""
    entry = "[dse.simulators]\nsimulate-only = simulate_only_plugin:SimulateOnly\n"
    with installed_plugin(tmp_path, monkeypatch, "simulate_only_plugin", entry, [plugins._registry], SIMULATE_ONLY):
        yield "simulate-only"


def test_calibrate_a_cost_model_that_prices_no_collective_alone(simulate_only_plugin, rows, capsys, monkeypatch):
    """Its end-to-end rows are priced (the same figures: it simulates as the analytical model does) and the
    nccl-tests rows are left out, saying so, instead of being priced by another model behind its back. (Two
    cases and one held-out case: what differs from the analytical model's run is the collectives.)"""
    model = plugins.cost_model(simulate_only_plugin)
    assert not isinstance(model, CollectiveCostModel)
    assert run_collectives(model) is None
    monkeypatch.setattr(calibration, "CASES", [CASES[0], CASES[-1]])
    monkeypatch.setattr(calibration, "HELD_OUT", HELD_OUT[:1])
    assert main(["calibrate", "--cost-model", simulate_only_plugin, "--json"]) == 0
    tables = json.loads(capsys.readouterr().out)
    assert tables["collectives"] is None
    assert {row["case"]: row["tokens_per_s_per_gpu"] for row in tables["training"]} == {
        case.name: rows[case.name].tokens_per_s_per_gpu for case in (CASES[0], CASES[-1])
    }
    assert main(["calibrate", "--cost-model", simulate_only_plugin]) == 0
    out = capsys.readouterr().out
    assert "held out (sets nothing)" in out
    assert "cost model 'simulate-only' does not price a collective alone" in out
    assert "nccl-tests bus bandwidth" not in out
