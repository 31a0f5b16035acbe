"""Roofline time of one compute kernel.

A kernel is bound either by its arithmetic or by its HBM traffic, whichever takes longer at the share of peak
that kernels of its category reach in practice, plus a fixed launch cost, at the peak of the workload's dtype.
"""

from dse.errors import SpecError
from dse.spec import AcceleratorSpec
from dse.workload import Op


def compute_time(op: Op, accelerator: AcceleratorSpec, dtype: str) -> float:
    """Seconds one compute op takes; an op that neither computes nor moves bytes is free (no kernel runs)."""
    if op.flops == 0 and op.bytes == 0:
        return 0.0
    math = 0.0
    if op.flops:
        efficiency = accelerator.compute_efficiency.get(op.category)
        if efficiency is None:
            raise SpecError(
                f"accelerator '{accelerator.name}' has no compute_efficiency.{op.category} (needed by op "
                f"'{op.name}'); add it to the accelerator's catalog entry"
            )
        math = op.flops * op.density / (accelerator.peak_flops(dtype) * efficiency)
    memory = op.bytes / (accelerator.hbm_bandwidth * accelerator.memory_efficiency)
    return max(math, memory) + accelerator.kernel_launch_us * 1e-6
