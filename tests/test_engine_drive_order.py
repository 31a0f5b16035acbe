"""A transfer's times do not depend on which of its sides the engine reaches first.

The engine advances programs in their order and parks a p2p side until its partner turns up, while its run goes on
issuing later calls. Two stages on one link: the sender sends 2 MB (2 ms) at once, then runs an 8 ms all-reduce
across the same link; the receiver computes 5 ms before its recv. Listed sender first, the send parks and the
all-reduce is issued before the transfer pairs; listed receiver first, the recv parks and the send pairs as it is
issued. Before the rule of `engine._reserve` the first order ran the all-reduce from 0 and stretched the transfer
to 4 ms behind it (sender done at 9 ms), the second queued the all-reduce behind the transfer (sender done at
15 ms). Now both reserve the link for the send from its side's ready time: all-reduce 2-10 ms, transfer 5-7 ms.
"""

import pytest
from test_analytical_engine import MS, gemm, system, workload

from dse.workload import BLOCK_INPUT, Block, Call, Op, OpKind, Program, RankLayout
from simulators.analytical import AnalyticalCostModel
from simulators.analytical.cost_model import BATCH_FROM
from simulators.analytical.engine import schedule

BLOCKS = [
    Block("send", (Op("send", OpKind.SEND, "send", comm_bytes=2e6, axis="pp", peer=1, deps=(BLOCK_INPUT,)),)),
    Block("recv", (Op("recv", OpKind.RECV, "recv", comm_bytes=2e6, axis="pp", peer=-1, deps=(BLOCK_INPUT,)),)),
    Block("reduce", (Op("reduce", OpKind.COLLECTIVE, "all_reduce", comm_bytes=8e6, axis="pp"),)),
    Block("work", (gemm("work", 5),)),
]


def _exchange(sender_first: bool):
    """Rank 0 sends to rank 1; the sender's program is listed (and driven) first or second."""
    sender = [Call(0, tag=1), Call(2)]
    receiver = [Call(3), Call(1, inputs=(0,), tag=1)]
    if sender_first:
        programs, class_of = [Program(0, "sender", sender), Program(1, "receiver", receiver)], [0, 1]
    else:
        programs, class_of = [Program(0, "receiver", receiver), Program(1, "sender", sender)], [1, 0]
    return workload(RankLayout((("pp", 2),)), BLOCKS, programs, class_of=class_of)


def _by_name(w, classes) -> dict[str, float]:
    """Each class's figures, keyed by its program's name (the two orders number the classes the other way)."""
    figures = {}
    for p, c in zip(w.programs, classes, strict=True):
        for field in ("end_s", "comm_s", "exposed_comm_s"):
            figures[f"{p.name}.{field}"] = getattr(c, field)
        for category, seconds in c.time_by_category.items():
            figures[f"{p.name}.{category}"] = seconds
    return figures


def test_the_interpreted_engine_times_a_transfer_alike_either_way_round():
    times = []
    for sender_first in (True, False):
        w = _exchange(sender_first)
        classes = schedule(w, system(2))
        sender = classes[0 if sender_first else 1]
        assert sender.call_start == pytest.approx([5 * MS, 2 * MS], rel=1e-12)
        assert sender.call_end == pytest.approx([7 * MS, 10 * MS], rel=1e-12)
        times.append(_by_name(w, classes))
    assert times[0] == times[1]


@pytest.mark.parametrize("systems", [1, BATCH_FROM])
def test_the_compiled_engine_and_the_batch_tape_time_a_transfer_alike_either_way_round(systems):
    times = []
    for sender_first in (True, False):
        w = _exchange(sender_first)
        result = AnalyticalCostModel().simulate_many(w, [system(2)] * systems)[0]
        assert result.step_time_s == pytest.approx(10 * MS, rel=1e-12)
        times.append(_by_name(w, result.classes))
    assert times[0] == pytest.approx(times[1], rel=1e-12)
