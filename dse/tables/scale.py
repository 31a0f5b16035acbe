"""A measured kernel time carried from the device the tables timed to the accelerator a point prices."""

from typing import TYPE_CHECKING

from dse.errors import SpecError
from dse.tables.source import KernelTables

if TYPE_CHECKING:
    from dse.system import AcceleratorSpec
    from dse.workload import Op


class DeviceScale:
    """A measured kernel time carried to this accelerator.

    A table times its device. On an accelerator that differs from it (a study sweeping the peak or the HBM
    bandwidth, a power cap's clock_share, the clock the device sustains under load: sustained_share) a kernel keeps
    the measured share of its roofline: its time is scaled by
    its roofline time on this accelerator over that on the measured device, so the tables' shape effects (waves,
    tiles, the latency floor of small kernels) carry over and only the rates change."""

    def __init__(self, tables: KernelTables, accelerator: "AcceleratorSpec", dtype: str, field: str) -> None:
        if dtype not in tables.peak_tflops:
            raise SpecError(
                f"field '{field}.peak_tflops' has no {dtype}: the measured device's peak is what a {dtype} kernel's "
                "time is scaled against; add it"
            )
        self._device = (tables.peak_tflops[dtype] * 1e12, tables.hbm_bandwidth_GBps * 1e9)  # type: ignore[index]
        peak = accelerator.peak_flops(dtype) * accelerator.clock_share * tables.sustained_share
        self._here = (peak, accelerator.hbm_bandwidth)

    def __call__(self, seconds: float, op: "Op") -> float:
        """The op's measured seconds on this accelerator."""
        if self._here == self._device:
            return seconds
        flops, nbytes = op.flops * op.density, op.bytes
        here = max(flops / self._here[0], nbytes / self._here[1])
        device = max(flops / self._device[0], nbytes / self._device[1])
        return seconds * here / device if device > 0 else seconds
