"""Roofline kernel times."""

import pytest

from dse.compute import compute_time
from dse.errors import SpecError
from dse.system import AcceleratorSpec
from dse.workload import Op, OpKind

H100 = AcceleratorSpec(
    name="h100-like",
    peak_tflops={"bf16": 989.4, "fp8": 1978.9},
    hbm_GiB=80,
    hbm_bandwidth_GBps=3350,
    compute_efficiency={"gemm": 0.7, "attention": 0.42, "elementwise": 0.5},
    memory_efficiency=0.8,
    kernel_launch_us=4.0,
)
LAUNCH = 4e-6


def test_gemm_is_compute_bound():
    m = n = k = 8192
    op = Op("gemm", OpKind.COMPUTE, "gemm", flops=2 * m * n * k, bytes=2 * (m * k + k * n + m * n))
    expected = 2 * m * n * k / (989.4e12 * 0.7) + LAUNCH
    assert compute_time(op, H100, "bf16") == pytest.approx(expected, rel=1e-12)
    assert expected > op.bytes / (3350e9 * 0.8) + LAUNCH


def test_elementwise_is_memory_bound():
    op = Op("gelu", OpKind.COMPUTE, "elementwise", flops=8 * 2**26, bytes=4 * 2**26)
    assert compute_time(op, H100, "bf16") == pytest.approx(4 * 2**26 / (3350e9 * 0.8) + LAUNCH, rel=1e-12)


def test_density_scales_the_executed_flops():
    op = Op("attn", OpKind.COMPUTE, "attention", flops=1e15, bytes=1e6, density=0.5)
    assert compute_time(op, H100, "bf16") == pytest.approx(0.5e15 / (989.4e12 * 0.42) + LAUNCH, rel=1e-12)


def test_dtype_selects_the_peak():
    op = Op("gemm", OpKind.COMPUTE, "gemm", flops=1e15)
    assert compute_time(op, H100, "fp8") == pytest.approx(1e15 / (1978.9e12 * 0.7) + LAUNCH, rel=1e-12)


def test_empty_op_launches_nothing():
    assert compute_time(Op("view", OpKind.COMPUTE, "other"), H100, "bf16") == 0.0


def test_missing_efficiency_names_the_field():
    op = Op("rmsnorm", OpKind.COMPUTE, "norm", flops=1e9, bytes=1e6)
    with pytest.raises(SpecError, match=r"compute_efficiency\.norm"):
        compute_time(op, H100, "bf16")
