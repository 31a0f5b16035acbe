"""Tied embeddings across pipeline stages: the first stage's table and the last stage's head exchange gradients."""

import pytest
from helpers import make_point
from test_chakra import p2p_ends

from dse.point import chakra
from dse.workload import OpKind
from generators.symbolic import SymbolicGenerator

GEN = SymbolicGenerator()


def tied_calls(workload) -> list[tuple[int, list[tuple[OpKind, int, float]]]]:
    return [
        (program.rank_class, [(op.kind, op.peer, op.comm_bytes) for op in workload.blocks[call.block].ops])
        for program in workload.programs
        for call in program.calls
        if workload.blocks[call.block].name == "tied_grad_sync"
    ]


@pytest.mark.parametrize("pp", [2, 4])
def test_the_end_stages_exchange_the_tied_weights_gradient_once_per_step(pp):
    point = make_point("tiny-gpt", seq_len=256, global_batch=16, tp=2, pp=pp, dp=4 // pp, zero=1)
    m = point.model
    table = m.vocab * m.hidden // 2 * 2  # vocab x hidden split over tp=2, bf16 gradients, before ZeRO shards them
    last = pp - 1
    assert tied_calls(GEN.generate(point)) == [
        (0, [(OpKind.SEND, last, table), (OpKind.RECV, last, table)]),
        (last, [(OpKind.SEND, -last, table), (OpKind.RECV, -last, table)]),
    ]


def test_no_exchange_without_pipeline_stages_untied_weights_or_backward():
    assert not tied_calls(GEN.generate(make_point("tiny-gpt", tp=2, dp=4)))
    assert not tied_calls(GEN.generate(make_point("tiny-llama", tp=2, pp=2, dp=2)))
    prefill = make_point("tiny-gpt", tp=2, pp=2, dp=2, overrides={"workload.mode": "prefill"})
    assert not tied_calls(GEN.generate(prefill))


def test_the_exchange_pairs_up_in_chakra_traces(tmp_path):
    point = make_point("tiny-gpt", seq_len=256, global_batch=16, tp=2, pp=2, dp=2)
    sends, recvs = p2p_ends(chakra.export(GEN.generate(point), tmp_path, [d.npus for d in point.system.network]))
    assert sends == recvs
    table = point.model.vocab * point.model.hidden
    tied = {(src, dst) for (src, dst, _, size) in sends if size == table}
    assert tied == {(r, r + 4) for r in range(4)} | {(r + 4, r) for r in range(4)}  # stage 0 <-> stage 1
