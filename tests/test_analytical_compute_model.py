"""Size-dependent GEMM efficiency, measured tables before the roofline, the overlap slowdown, the runtime
reserve, and `dse evaluate --trace`."""

import json

import numpy as np
import pytest

from dse.cli.main import main
from dse.compute import ComputeModel, compute_time
from dse.errors import SpecError
from dse.fields import GiB
from dse.system import AcceleratorSpec, NetworkDim, SystemSpec
from dse.workload import Block, Call, Op, OpKind, Program, RankLayout, Tensor, TensorKind, Workload
from simulators.analytical import AnalyticalCostModel, to_chrome_trace

BASE = dict(
    name="unit",
    peak_tflops={"bf16": 1000.0},
    hbm_GiB=80,
    hbm_bandwidth_GBps=3000,
    compute_efficiency={"gemm": 0.8, "elementwise": 0.5},
    memory_efficiency=1.0,
    kernel_launch_us=0.0,
)


def accelerator(**extra) -> AcceleratorSpec:
    return AcceleratorSpec(**(BASE | extra))


def gemm(flops: float) -> Op:
    return Op("mm", OpKind.COMPUTE, "gemm", flops=flops)


def test_small_gemms_lose_efficiency_large_ones_do_not():
    acc = accelerator(gemm_half_efficiency_gflop=2.0)
    peak = 1000e12 * 0.8
    # At f_half the GEMM runs at half the category efficiency: twice its large-GEMM time.
    assert compute_time(gemm(2e9), acc, "bf16") == pytest.approx(2 * 2e9 / peak, rel=1e-12)
    large = compute_time(gemm(2e12), acc, "bf16")
    assert large == pytest.approx(2e12 / peak * (1 + 1e-3), rel=1e-12)


def test_size_dependence_only_touches_gemms():
    acc = accelerator(gemm_half_efficiency_gflop=2.0)
    op = Op("add", OpKind.COMPUTE, "elementwise", flops=1e9)
    assert compute_time(op, acc, "bf16") == pytest.approx(1e9 / (1000e12 * 0.5), rel=1e-12)


def _table(tmp_path, rows: str):
    path = tmp_path / "kernels.csv"
    path.write_text("category,dtype,flops,bytes,time_us\n" + rows)
    return path


def test_measured_table_is_interpolated_log_log_and_used_first(tmp_path):
    path = _table(tmp_path, "gemm,bf16,1e9,0,10\ngemm,bf16,1e11,0,1000\nelementwise,bf16,0,1e6,3\n")
    model = ComputeModel(accelerator(measured_table=str(path)), "bf16")
    # Halfway in log FLOPs between (1e9, 10 us) and (1e11, 1000 us): 100 us.
    assert model.price(gemm(1e10)) == (pytest.approx(100e-6, rel=1e-12), "table")
    assert model.price(Op("add", OpKind.COMPUTE, "elementwise", bytes=1e6)) == (pytest.approx(3e-6), "table")
    # Outside the measured range: the roofline, and it says so.
    seconds, source = model.price(gemm(1e12))
    assert source == "roofline"
    assert seconds == pytest.approx(1e12 / 800e12, rel=1e-12)


def test_a_malformed_table_names_the_line(tmp_path):
    path = _table(tmp_path, "gemm,bf16,many,0,10\n")
    with pytest.raises(SpecError, match="line 2"):
        ComputeModel(accelerator(measured_table=str(path)), "bf16")
    with pytest.raises(SpecError, match="measured_table"):
        ComputeModel(accelerator(measured_table=str(tmp_path / "missing.csv")), "bf16")


def _overlapped(acc: AcceleratorSpec, tensors=()) -> Workload:
    """10 ms of GEMM beside a 4 ms all-reduce on two ranks (1 GB/s, no latency)."""
    ops = (gemm(10e-3 * 800e12), Op("ar", OpKind.COLLECTIVE, "all_reduce", comm_bytes=4e6, axis="dp"))
    program = Program(0, "all", tensors=list(tensors))
    program.add(Call(0))
    layout = RankLayout((("dp", 2),))
    return Workload("unit", layout, [Block("b", ops)], [program], np.zeros(2, int), 1, 1.0)


def _system(acc: AcceleratorSpec) -> SystemSpec:
    return SystemSpec(
        name="unit", accelerator=acc, network=[NetworkDim(topology="ring", npus=2, bandwidth_GBps=1, latency_ns=0)]
    )


def test_overlap_slowdown_stretches_overlapped_compute():
    plain = AnalyticalCostModel().simulate(_overlapped(accelerator()), _system(accelerator()))
    assert plain.step_time_s == pytest.approx(10e-3, rel=1e-12)
    assert plain.overlap_ratio == pytest.approx(1.0)
    slow = accelerator(overlap_slowdown=0.25)
    slowed = AnalyticalCostModel().simulate(_overlapped(slow), _system(slow))
    # 4 ms of the compute ran beside the all-reduce: 25% of it is added.
    assert slowed.step_time_s == pytest.approx(10e-3 + 0.25 * 4e-3, rel=1e-12)


def test_runtime_reserve_and_fragmentation_appear_in_the_breakdown():
    acc = accelerator(runtime_reserve_GiB=1.5, fragmentation=0.1)
    tensors = [Tensor("w", TensorKind.PARAMETER, 10 * GiB)]
    result = AnalyticalCostModel().simulate(_overlapped(acc, tensors), _system(acc))
    held = result.classes[0].memory_at_peak
    assert held["reserve"] == 1.5 * GiB
    assert held["fragmentation"] == pytest.approx(1.0 * GiB)
    assert result.peak_memory_bytes == pytest.approx(12.5 * GiB)


def test_timeline_events_say_what_priced_each_op():
    acc = accelerator()
    result = AnalyticalCostModel(timeline=True).simulate(_overlapped(acc), _system(acc))
    by_name = {e.name: e.source for e in result.timeline}
    assert by_name == {"mm": "roofline", "ar": ""}
    events = [e for e in to_chrome_trace(result)["traceEvents"] if e["ph"] == "X"]
    assert {e["name"]: e.get("args") for e in events} == {"mm": {"priced_by": "roofline"}, "ar": None}


def test_dse_evaluate_writes_a_trace(tmp_path, capsys):
    point = tmp_path / "point.yaml"
    point.write_text(
        "model: tiny-llama\nworkload: {seq_len: 256, global_batch: 8}\nparallel: {tp: 2, pp: 2, dp: 2}\n"
        "system: tiny-ring\n"
    )
    trace = tmp_path / "trace.json"
    assert main(["evaluate", str(point), "--json", "--trace", str(trace)]) == 0
    metrics = json.loads(capsys.readouterr().out)
    events = json.loads(trace.read_text())["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in complete} == {0, 1}
    # The timeline is the schedule before the overlap slowdown (h100-sxm: 0.14 of the overlapped time).
    end = max(e["ts"] + e["dur"] for e in complete) * 1e-6
    assert end <= metrics["step_time_s"] <= end + 0.14 * metrics["comm_time_s"] + 1e-12
