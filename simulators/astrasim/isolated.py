"""One collective or one send alone on a system, as a workload ASTRA-sim runs: what nccl-tests measures, so that
`dse calibrate` checks ASTRA-sim's network against the published bus bandwidths as it checks the analytical model's
(dse.interfaces.CollectiveCostModel), and the tests compare the two models' collectives.

Every NPU of the system gets a trace (ASTRA-sim simulates them all, and refuses an empty one as a deadlock); those
outside the operation run one negligible kernel (a FLOP: a zero would stall ASTRA-sim's roofline), and the
operation's time is the latest end of the ranks in it (`operation_time`).
"""

from collections.abc import Sequence

import numpy as np

from dse.errors import DseError
from dse.interfaces import SimResult
from dse.workload import Block, Call, Collective, Op, OpKind, Program, RankLayout, Workload

IDLE, ACTIVE, RECEIVER = 0, 1, 2
"""Rank classes: outside the operation; in the collective or sending; receiving."""


IDLE_OP = Op("idle", OpKind.COMPUTE, "gemm", flops=1.0, bytes=1.0)


def _workload(name: str, layout: RankLayout, ops: list[Op], class_of: np.ndarray) -> Workload:
    blocks = [Block(op.name, (op,)) for op in (IDLE_OP, *ops)]
    programs = [Program(index, block.name, [Call(index)]) for index, block in enumerate(blocks)]
    return Workload(name, layout, blocks, programs, class_of, 0, 0.0)


def operation_time(result: SimResult) -> float:
    """The time of the operation of a workload made here: the latest end among the ranks that take part in it."""
    return max(c.end_s for c in result.classes[ACTIVE:])


def collective_workload(kind: Collective, size: float, ranks: Sequence[int], npus: int) -> Workload:
    """A step that is one collective of `size` bytes (nccl-tests convention) over `ranks`, which must be evenly
    spaced from 0 (0, s, 2s, ...: the form of every parallel axis's first group) within the system's NPUs."""
    members = sorted(ranks)
    stride = members[1] - members[0] if len(members) > 1 else 1
    if members[0] != 0 or members != list(range(0, stride * len(members), stride)) or npus % (stride * len(members)):
        raise DseError(
            f"ASTRA-sim prices a collective over NPUs evenly spaced from 0 that tile the system's {npus}; "
            f"got {members[:8]}{'...' if len(members) > 8 else ''}"
        )
    count = len(members)
    layout = RankLayout((("inner", stride), ("x", count), ("outer", npus // (stride * count))))
    op = Op(kind.value, OpKind.COLLECTIVE, kind.value, comm_bytes=size, axis="x")
    class_of = np.full(npus, IDLE)
    class_of[members] = ACTIVE
    return _workload(f"{kind}-{size:g}-{count}x{stride}-of-{npus}", layout, [op], class_of)


def send_workload(size: float, src: int, dst: int, npus: int) -> Workload:
    """A step that is one send of `size` bytes from NPU src to NPU dst."""
    layout = RankLayout((("x", npus),))
    send = Op("send", OpKind.SEND, "send", comm_bytes=size, axis="x", peer=dst - src)
    recv = Op("recv", OpKind.RECV, "recv", comm_bytes=size, axis="x", peer=src - dst)
    class_of = np.full(npus, IDLE)
    class_of[src], class_of[dst] = ACTIVE, RECEIVER
    return _workload(f"send-{size:g}-{src}-{dst}-of-{npus}", layout, [send, recv], class_of)
