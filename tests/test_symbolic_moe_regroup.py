"""Megatron's permutation 2 in the symbolic MoE layer: in training, with more than one local expert, the slots
that arrive grouped by source rank (the all-to-all over ep, the sequence-parallel gather over tp) are copied into
expert order before the experts and back after them (`sort_chunks_by_idxs`), a kernel each way in forward and
again in backward; the gathered slots are not kept but gathered and regrouped again in backward, and the partial
sums of the experts' output and of the slots' gradient pass through the copies to the one reduce-scatter each."""

import pytest
from helpers import make_point

from dse.workload import Collective, OpKind
from generators.symbolic.generator import _Builder

SEQ, TOP_K, H = 128, 2, 256
SLOTS_BYTES = SEQ * TOP_K * H * 2
"""tiny-moe's routed copies of one sequence, bf16: every tp rank's slots once gathered (8 experts, one micro-batch)."""


def moe_blocks(**parallel) -> dict[str, list]:
    point = make_point("tiny-moe", seq_len=SEQ, global_batch=4, **parallel)
    builder = _Builder(point)
    workload = builder.build()
    return {b.name: list(b.ops) for b in workload.blocks if b.name.startswith("layer.attn.moe.")}


def test_gathered_slots_are_sorted_by_expert_and_back():
    blocks = moe_blocks(tp=2, sp=True, dp=2)
    forward, backward = blocks["layer.attn.moe.forward"], blocks["layer.attn.moe.backward"]
    copies = {op.name: op.bytes for op in forward if op.name in ("experts.sort", "experts.unsort")}
    assert copies == {"experts.sort": 2 * SLOTS_BYTES, "experts.unsort": 2 * SLOTS_BYTES}  # read and written
    again = [op.name for op in backward if "sort" in op.name and op.kind is OpKind.COMPUTE]
    assert sorted(again) == ["experts.sort.backward", "experts.sort.regather", "experts.unsort.backward"]
    # the experts' partial sums reach the reduce-scatter, the slots' gradient its own: no all-reduce over tp
    assert not [op for op in forward + backward if op.category == Collective.ALL_REDUCE and op.axis == "tp"]


@pytest.mark.parametrize(
    "parallel",
    [{"tp": 1, "dp": 2}, {"tp": 2, "sp": False, "dp": 2}, {"tp": 1, "dp": 8, "ep": 8}],
    ids=["no-exchange", "tp-without-sp", "one-expert-a-rank"],
)
def test_no_regrouping_where_megatron_has_none(parallel):
    """Nothing arrives by source rank without ep or an SP gather; one local expert needs no sorting."""
    blocks = moe_blocks(**parallel)
    assert not [op for ops in blocks.values() for op in ops if "sort" in op.name]
