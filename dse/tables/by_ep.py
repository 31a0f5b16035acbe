"""Measured MoE tables (DeepEP's all-to-alls, the fused MoE kernels) give a curve of time against tokens for each
expert-parallel size they ran at; a size between two measured ones is read log-log between them, as the time of
an all-to-all or a MoE layer grows as a power of the group's size between powers of two."""

from bisect import bisect_left
from collections.abc import Callable, Mapping
from math import log

from dse.tables.nccl import SizeCurve


def across_ep(by_ep: Mapping[int, SizeCurve], ep: int, read: Callable[[SizeCurve], float | None]) -> float | None:
    """`read` of the curve measured at `ep` GPUs, or log-log between the two measured sizes around it; None below
    the smallest or above the largest size measured, or where `read` gives None."""
    sizes = sorted(by_ep)
    i = bisect_left(sizes, ep)
    if i < len(sizes) and sizes[i] == ep:
        return read(by_ep[ep])
    if i == 0 or i == len(sizes):
        return None
    e0, e1 = sizes[i - 1], sizes[i]
    t0, t1 = read(by_ep[e0]), read(by_ep[e1])
    if t0 is None or t1 is None:
        return None
    return t0 * (t1 / t0) ** (log(ep / e0) / log(e1 / e0))
