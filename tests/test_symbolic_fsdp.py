"""FSDP's buffer copies around the ZeRO-3 collectives (`parallel.fsdp`) against closed forms from PyTorch's code.

tiny-llama on 8 data-parallel ranks, bf16 weights over fp32 shards: one layer holds N = 4 h^2 - 2 h^2 / 2 (wq, wo
h x h; wk, wv h x h/2 for 4 of 8 heads) + 3 h f + 2 h elements, S = N / 8 per rank. FSDP1 (flat parameters,
torch 2.2): each all-gather reads a bf16 copy of the fp32 shard (4S + 2S); the gradient is the autograd
concatenation of the parameter gradients into the flat one (2N + 2N), divided in place by the predivide factor
4 (2N + 2N), reduce-scattered, the shard divided by the postdivide factor 2 (2S + 2S) and cast to fp32 (2S +
4S). FSDP2 (fully_shard): shard cast (4S + 2S) and copied into the all-gather input (2S + 2S); the gathered
buffer copied out into the parameters (2N + 2N) at each gather, forward and backward; gradients copied into the
reduce-scatter input (2N + 2N, or 2N + 4N cast to an fp32 reduce) and averaged by NCCL; a bf16 shard cast to
fp32 (2S + 4S).
"""

import pytest

from dse.workload import OpKind
from generators.symbolic.fsdp import divide_factors
from generators.symbolic.generator import _Builder
from tests.helpers import make_point

H, F, DP = 256, 688, 8
N = 2 * H * H + 2 * H * H // 2 + 3 * H * F + 2 * H
S = N // DP


def _layer(fsdp: str, reduce: str = "bf16"):
    point = make_point(global_batch=16, dp=DP, zero=3, fsdp=fsdp, fsdp_reduce_dtype=reduce, system="dgx-h100")
    builder = _Builder(point)
    builder.build()
    (traced,) = builder.layer_traces.values()
    return builder, traced


def _copies(builder, block: int | None, suffix: str) -> float:
    assert block is not None
    ops = builder.blocks[block].ops
    return sum(op.bytes for op in ops if op.kind is OpKind.COMPUTE and op.name.endswith(suffix))


def _comm(builder, block: int, category: str) -> float:
    return sum(op.comm_bytes for op in builder.blocks[block].ops if op.category == category)


@pytest.mark.parametrize(("world", "factors"), [(2, (2, 1)), (8, (4, 2)), (96, (16, 6)), (128, (16, 8))])
def test_fsdp1_divides_by_about_the_square_root_of_the_world_before_and_after(world, factors):
    """_get_gradient_predivide_factor: p doubles from 1 while p divides the world and world / p > p; the
    postdivide factor is world / p, so the two divisions together average the sum."""
    assert divide_factors(world) == factors
    assert factors[0] * factors[1] == world


def test_fsdp1_casts_shards_before_gathering_and_concatenates_and_divides_the_flat_gradient():
    builder, traced = _layer("fsdp1")
    for block in (traced.forward, traced.backward):
        assert _copies(builder, block, ".cast_shard") == 6 * S
        assert _copies(builder, block, ".copy_in") == 0
        assert _copies(builder, block, ".copy_out") == 0
    assert _copies(builder, traced.backward, ".flat_grad_cat") == 4 * N
    assert _copies(builder, traced.backward, ".predivide") == 4 * N
    assert _copies(builder, traced.backward, ".postdivide") == 4 * S
    assert _copies(builder, traced.backward, ".grad_to_fp32") == 6 * S
    assert _comm(builder, traced.backward, "reduce_scatter") == 2 * N


def test_fsdp2_copies_in_and_out_at_every_gather_and_into_the_reduce_scatter_buffer():
    builder, traced = _layer("fsdp2")
    for block in (traced.forward, traced.backward):
        assert _copies(builder, block, ".cast_shard") == 6 * S
        assert _copies(builder, block, "all_gather.copy_in") + _copies(builder, block, "regather.copy_in") == 4 * S
        assert _copies(builder, block, ".copy_out") == 4 * N
    assert _copies(builder, traced.backward, "reduce_scatter.copy_in") == 4 * N
    assert _copies(builder, traced.backward, "divide") == 0
    assert _copies(builder, traced.backward, ".grad_to_fp32") == 6 * S


def test_an_fp32_reduce_casts_into_the_reduce_scatter_buffer_and_sends_twice_the_bytes():
    builder, traced = _layer("fsdp2", "fp32")
    assert _copies(builder, traced.backward, "reduce_scatter.copy_in") == 6 * N
    assert _copies(builder, traced.backward, ".grad_to_fp32") == 0
    assert _comm(builder, traced.backward, "reduce_scatter") == 4 * N


def test_copies_wait_for_their_collective_only_where_the_compute_stream_does():
    """The gathered weights are ready after their copy-out; the gradient's copy-in precedes its reduce-scatter,
    while the shard's cast after it runs on the reduce-scatter stream (no dependency)."""
    builder, traced = _layer("fsdp2")
    forward = builder.blocks[traced.forward].ops
    gemms = [op for op in forward if op.category == "gemm"]
    assert gemms and all(any(forward[d].name.endswith(".copy_out") for d in op.deps) for op in gemms)
    backward = builder.blocks[traced.backward].ops
    for i, op in enumerate(backward):
        if op.category == "reduce_scatter":
            assert backward[op.deps[0]].name.endswith(".copy_in")
            assert backward[i + 1].name.endswith(".grad_to_fp32") and backward[i + 1].deps == ()
