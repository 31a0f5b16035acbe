"""Seconds per op of a block as one rank class runs it.

Every call of a block costs the same, so the engine asks once per (block, class). Only communication depends
on the class: its process groups and peers are those of the class's representative rank, and a group's span is
cached per (axis, class) because the same groups recur in every layer. Ranks of one class whose groups
straddle the network differently (a layout misaligned with the dimensions) are all priced like the
representative.
"""

from dse.spec import SystemSpec
from dse.workload import OpKind, Workload
from simulators.analytical.compute import compute_time
from simulators.analytical.network import Span, collective_time, group_span, p2p_time


class BlockPricer:
    def __init__(self, workload: Workload, system: SystemSpec) -> None:
        self._workload = workload
        self._system = system
        self._dtype = workload.dtype
        self._compute: dict[int, list[float]] = {}
        self._spans: dict[tuple[str, int], Span] = {}

    def durations(self, block: int, rank_class: int) -> list[float]:
        """Seconds of each op of the block; a p2p op's figure is the transfer its own side would start."""
        compute = self._compute.get(block)
        if compute is None:
            accelerator = self._system.accelerator
            compute = [
                compute_time(op, accelerator, self._dtype) if op.kind is OpKind.COMPUTE else 0.0
                for op in self._workload.blocks[block].ops
            ]
            self._compute[block] = compute
        out = []
        for op, seconds in zip(self._workload.blocks[block].ops, compute, strict=True):
            if op.kind is OpKind.COLLECTIVE:
                seconds = collective_time(op.category, op.comm_bytes, self.span(op.axis, rank_class))
            elif op.is_comm:
                rank = self._workload.representative(rank_class)
                peer = self._workload.layout.peer(rank, op.axis, op.peer)
                seconds = p2p_time(op.comm_bytes, rank, peer, self._system.network)
            out.append(seconds)
        return out

    def span(self, axis: str, rank_class: int) -> Span:
        key = (axis, rank_class)
        span = self._spans.get(key)
        if span is None:
            group = self._workload.layout.group(self._workload.representative(rank_class), axis)
            span = self._spans[key] = group_span(group, self._system.network)
        return span
