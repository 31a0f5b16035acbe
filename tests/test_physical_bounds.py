"""Physical bounds (README: Point files): no table or field makes a kernel faster than its accelerator's peak FLOP/s
or HBM bandwidth, or a link faster than its bandwidth. A table row beyond them is refused when the point loads, in
one line naming the field, the row and the peak; an op is never priced below its own FLOPs at peak or bytes at the
bandwidth; and every share of a peak rate is at most 1."""

import pytest
import yaml
from annotated_types import Le, Lt
from conftest import ROOT
from helpers import UNIT_ACCELERATOR, run_cli
from pydantic import ValidationError

from dse import catalog
from dse.compute import ComputeModel
from dse.system import AcceleratorSpec, NetworkDim
from dse.workload import AttentionShape, Op, OpKind

POINT = {
    "model": "tiny-llama",
    "workload": {"seq_len": 256, "global_batch": 16},
    "parallel": {"dp": 8},
    "system": {"base": "tiny-ring"},
}
HEADER = "category,dtype,flops,bytes,time_us\n"


def refused(tmp_path, accelerator: dict, *fragments: str) -> None:
    """`dse evaluate` of POINT with the accelerator overrides: exit 2, one line naming the file and each fragment."""
    path = tmp_path / "point.yaml"
    path.write_text(yaml.safe_dump({**POINT, "system": {"base": "tiny-ring", "accelerator": accelerator}}))
    code, out, err = run_cli("evaluate", str(path), "--json")
    assert (code, out) == (2, ""), err
    assert err.count("\n") == 1 and err.startswith(f"error: {path}: "), err
    for fragment in fragments:
        assert fragment in err, err


def test_an_attention_kernel_table_faster_than_the_peak_is_refused(tmp_path):
    # 3350 for 335 TFLOP/s: the slip that gave an MFU of 15
    rows = {"fwd": {11: [128, 16384, 3350]}}
    refused(
        tmp_path,
        {"attention_kernels": {"fa2": {"causal": rows}}},
        "field 'system.accelerator': attention_kernels.fa2.causal.fwd: row [128, 16384, 3350.0] gives 3350 TFLOP/s",
        "above the peak they were measured at (attention_kernels.measured_peak_tflops) of 989.4",
    )


def test_an_attention_kernel_table_at_the_peak_is_accepted(tmp_path):
    path = tmp_path / "point.yaml"
    rows = {"fwd": {11: [128, 16384, 989.4]}}
    point = {**POINT, "system": {"base": "tiny-ring", "accelerator": {"attention_kernels": {"fa2": {"causal": rows}}}}}
    path.write_text(yaml.safe_dump(point))
    code, _, err = run_cli("evaluate", str(path), "--json")
    assert code == 0, err


def test_attention_kernel_tables_without_a_bf16_or_fp16_peak_are_refused():
    fp32_only = catalog.entry("accelerators", "h100-sxm") | {"peak_tflops": {"fp32": 66.9}}
    with pytest.raises(ValidationError, match=r"attention_kernels would be ignored.*add peak_tflops\.bf16"):
        AcceleratorSpec.model_validate(fp32_only)


def test_a_measured_table_row_faster_than_the_peak_flops_is_refused(tmp_path):
    # 1e12 FLOPs in 1 us is 10^6 TFLOP/s: a time in seconds where microseconds belong
    (tmp_path / "kernels.csv").write_text(HEADER + "gemm,bf16,1e9,0,10\ngemm,bf16,1e12,0,1\n")
    refused(
        tmp_path,
        {"measured_table": "kernels.csv"},
        f"field 'system.accelerator.measured_table': {tmp_path / 'kernels.csv'}: line 3: 1e+12 FLOPs in 1 us",
        "1e+06 TFLOP/s, above the peak_tflops.bf16 of 989.4 of accelerator 'h100-sxm'",
    )


def test_a_measured_table_row_faster_than_the_hbm_bandwidth_is_refused(tmp_path):
    (tmp_path / "kernels.csv").write_text(HEADER + "elementwise,bf16,0,1e9,1\n")
    refused(
        tmp_path,
        {"measured_table": "kernels.csv"},
        "line 2: 1e+09 bytes in 1 us is 1e+06 GB/s, above the hbm_bandwidth_GBps of 3350",
    )


@pytest.mark.parametrize(
    ("row", "fragment"),
    [
        ("gemmm,bf16,1e9,0,10", "category 'gemmm' prices no op; use one of gemm, attention"),
        ("gemm,bf61,1e9,0,10", "dtype 'bf61' prices no op; use one of fp32, bf16"),
        ("gemm,bf16,1e9,-5,10", "needs a positive, finite size (flops or bytes) and time_us"),
        ("gemm,bf16,inf,0,10", "needs a positive, finite size"),
    ],
    ids=["unknown-category", "unknown-dtype", "negative-bytes", "infinite-flops"],
)
def test_a_measured_table_row_that_prices_nothing_is_refused_naming_its_line(tmp_path, row, fragment):
    (tmp_path / "kernels.csv").write_text(HEADER + "gemm,bf16,1e9,0,10\n" + row + "\n")
    refused(tmp_path, {"measured_table": "kernels.csv"}, "line 3", fragment)


def test_a_relative_measured_table_is_the_point_files_folders(tmp_path, monkeypatch):
    """Not the working directory's: the same point evaluates alike from anywhere, and a missing table is refused
    at load with its resolved path, not found trial by trial."""
    folder = tmp_path / "points"
    folder.mkdir()
    (folder / "kernels.csv").write_text(HEADER + "gemm,bf16,1e3,0,0.001\ngemm,bf16,1e12,0,1e6\n")
    path = folder / "point.yaml"
    path.write_text(
        yaml.safe_dump({**POINT, "system": {"base": "tiny-ring", "accelerator": {"measured_table": "kernels.csv"}}})
    )
    results = []
    for where in (tmp_path, folder, ROOT):
        monkeypatch.chdir(where)
        code, out, err = run_cli("evaluate", str(path), "--json")
        assert code == 0, err
        results.append(out)
    assert results[0] == results[1] == results[2]
    (folder / "kernels.csv").unlink()
    code, _, err = run_cli("evaluate", str(path), "--json")
    assert code == 2 and f"{folder / 'kernels.csv'} is not a file" in err, err


def test_no_op_is_priced_below_its_flops_at_peak_or_its_bytes_at_the_bandwidth(tmp_path):
    """A table row holds one kernel's FLOPs: an op it prices that moves more bytes is not faster than its bytes
    at the HBM bandwidth (and a row within physics gives nothing faster than the peak)."""
    table = tmp_path / "kernels.csv"
    table.write_text(HEADER + "gemm,bf16,1e9,0,1000\ngemm,bf16,1e11,0,1e5\n")  # 1 TFLOP/s: at the peak
    model = ComputeModel(UNIT_ACCELERATOR.model_copy(update={"measured_table": str(table)}), "bf16")
    assert model.price(Op("mm", OpKind.COMPUTE, "gemm", flops=1e10)) == (pytest.approx(0.01), "table")
    # 1e10 FLOPs (10 ms by the table) moving 100 GB: 0.1 s at 1 TB/s
    seconds, source = model.price(Op("mm", OpKind.COMPUTE, "gemm", flops=1e10, bytes=1e11))
    assert (seconds, source) == (pytest.approx(0.1), "table")


def test_a_peak_below_the_tables_scales_them_from_the_peak_they_were_measured_at():
    """A planner's H100 at half its peak (a sweep over peak FLOP/s) keeps H100's measured attention tables, run at
    half their rate: the rows were measured at attention_kernels.measured_peak_tflops, and each row above the new
    peak would otherwise be refused or clipped at it. The same kernel at the measured peak prices as its row."""
    entry = catalog.entry("accelerators", "h100-sxm")
    h100 = AcceleratorSpec.model_validate(entry)
    half = AcceleratorSpec.model_validate(entry | {"peak_tflops": {**entry["peak_tflops"], "bf16": 494.7}})
    op = Op("attn", OpKind.COMPUTE, "attention", flops=1e12, attention=AttentionShape(4096, 4096, 128, True, False))
    launch = h100.kernel_launch_us * 1e-6
    full, source = ComputeModel(h100, "bf16", "fa3").price(op)
    assert (full - launch, source) == (pytest.approx(1e12 / 579e12), "kernel_table")  # fa3 fig. 5: 579 TFLOP/s
    slow, _ = ComputeModel(half, "bf16", "fa3").price(op)
    assert slow - launch == pytest.approx(2 * (full - launch))


def test_an_attention_kernel_derived_backward_never_beats_the_peak():
    """A backward left out under one mask is the other's times the forwards' ratio: tables within the peak whose
    ratio would carry it above (a causal forward faster than the non-causal one) are priced at the peak."""
    rows = [[128, 4096, 0.9]]
    table = {"causal": {"fwd": rows}, "noncausal": {"fwd": [[128, 4096, 0.3]], "bwd": rows}}
    accelerator = AcceleratorSpec.model_validate(UNIT_ACCELERATOR.model_dump() | {"attention_kernels": {"fa2": table}})
    shape = AttentionShape(4096, 4096, 128, True, True)
    op = Op("attn.bwd", OpKind.COMPUTE, "attention", flops=1e12, attention=shape)
    model = ComputeModel(accelerator, "bf16")  # attention_kernel auto: FlashAttention-2's table
    # by the ratio, 0.9 * 0.9 / 0.3 = 2.7 TFLOP/s; the peak is 1
    assert model.price(op) == (pytest.approx(1.0), "kernel_table")


SHARES = {
    (AcceleratorSpec, "compute_efficiency"),
    (AcceleratorSpec, "memory_efficiency"),
    (AcceleratorSpec, "fragmentation"),
    (AcceleratorSpec, "clock_share"),
    (NetworkDim, "efficiency"),
    (NetworkDim, "reduction_efficiency"),
}


def test_every_share_of_a_peak_rate_is_at_most_one():
    """Each field whose name says it is a share (an efficiency, a clock share, the fragmentation) is bounded by 1:
    above it a kernel or a link would beat its own peak."""
    named = {
        (spec, name)
        for spec in (AcceleratorSpec, NetworkDim)
        for name in spec.model_fields
        if any(word in name for word in ("efficiency", "share", "fragmentation"))
    }
    assert named - {(AcceleratorSpec, "gemm_half_efficiency_gflop")} == SHARES  # a size in GFLOP, not a share
    for spec, name in SHARES:
        assert any(isinstance(m, Le | Lt) for m in _metadata(spec, name)), name


def _metadata(spec, name: str) -> list:
    """The constraints of a field, through Optional and dict values (Share is Annotated[float, ..., Le(1)])."""
    field = spec.model_fields[name]
    found = list(field.metadata)
    stack = [field.annotation]
    while stack:
        annotation = stack.pop()
        found += list(getattr(annotation, "__metadata__", ()))
        stack += list(getattr(annotation, "__args__", ()))
    return found


@pytest.mark.parametrize(
    ("accelerator", "network", "fragment"),
    [
        (
            {"compute_efficiency": {"gemm": 1.2}},
            {},
            "field 'system.accelerator.compute_efficiency.gemm': must be at most 1",
        ),
        ({"memory_efficiency": 1.01}, {}, "field 'system.accelerator.memory_efficiency': must be at most 1"),
        ({"clock_share": 1.5}, {}, "field 'system.accelerator.clock_share': must be at most 1"),
        ({"fragmentation": 1.0}, {}, "field 'system.accelerator.fragmentation': must be below 1"),
        ({}, {0: {"efficiency": 1.5}}, "field 'system.network.0.efficiency': must be at most 1"),
        (
            {},
            {0: {"topology": "switch", "reduction_efficiency": 2.0}},
            "field 'system.network.0.reduction_efficiency': must be at most 1",
        ),
    ],
    ids=["compute-efficiency", "memory-efficiency", "clock-share", "fragmentation", "link-efficiency", "in-network"],
)
def test_a_share_above_one_is_refused(tmp_path, accelerator, network, fragment):
    path = tmp_path / "point.yaml"
    path.write_text(
        yaml.safe_dump({**POINT, "system": {"base": "tiny-ring", "accelerator": accelerator, "network": network}})
    )
    code, out, err = run_cli("evaluate", str(path), "--json")
    assert (code, out) == (2, "") and err.count("\n") == 1 and fragment in err, err


def test_a_relative_measured_table_in_a_study_is_the_study_files_folders(tmp_path, monkeypatch):
    """In base and among a parameter's choices alike: the study loads the same from any working directory, its
    saved copy names the table by its absolute path, and a missing or too-fast table is refused at load."""
    folder = tmp_path / "studies"
    folder.mkdir()
    (folder / "kernels.csv").write_text(HEADER + "gemm,bf16,1e3,0,0.001\n")
    (folder / "fast.csv").write_text(HEADER + "gemm,bf16,1e12,0,1e-3\n")
    study = {
        "name": "tables",
        "objectives": {"step_time": "minimize"},
        "trials": 2,
        "base": {**POINT, "system": {"base": "tiny-ring", "accelerator": {"measured_table": "kernels.csv"}}},
        "space": {"parallel.zero": {"choices": [0, 1]}},
    }
    path = folder / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    for where in (tmp_path, folder):
        monkeypatch.chdir(where)
        code, _, err = run_cli("check", str(path))
        assert code == 0, err
    searched = {**study, "space": {"system.accelerator.measured_table": {"choices": ["kernels.csv", "fast.csv"]}}}
    path.write_text(yaml.safe_dump(searched))
    code, out, err = run_cli("check", str(path))
    assert (code, out) == (2, ""), err
    assert str(folder / "fast.csv") in err and "peak" in err, err
    (folder / "kernels.csv").unlink()
    path.write_text(yaml.safe_dump(study))
    code, _, err = run_cli("check", str(path))
    assert code == 2 and f"{folder / 'kernels.csv'} is not a file" in err, err
