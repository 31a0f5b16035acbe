"""ZeRO with context parallelism against closed forms: the cp ranks hold the same weights as the data-parallel
ranks, so ZeRO shards the model states over dp x cp and reduces, scatters and gathers them over that joint group,
as Megatron-LM's distributed optimizer (its data-parallel group with context parallelism) and torchtitan's FSDP
mesh (dp_shard x cp) do (`generators.symbolic.optimizer.SHARD_AXES`).

tiny-llama: Psi parameters, W = 2 Psi bytes of bf16 weights, V h of them the embedding table; global batch 8 over
dp 2 is 4 micro-batches.
"""

from collections import Counter

import pytest

from dse.point.chakra import CommGroups
from dse.workload import Collective
from generators.symbolic import SymbolicGenerator, count_parameters
from simulators.analytical import AnalyticalCostModel
from tests.helpers import make_point

V, H = 1024, 256
M = 4
"""Micro-batches per step at dp 2 (global batch 8)."""


def _comm(point, category: Collective) -> Counter:
    """Per axis, the bytes of the first rank's `category` collectives over one step."""
    workload = SymbolicGenerator().generate(point)
    totals: Counter = Counter()
    for call in workload.programs[0].calls:
        for op in workload.blocks[call.block].ops:
            if op.category == category:
                totals[op.axis] += op.comm_bytes
    return totals


@pytest.mark.parametrize(("zero", "per_parameter"), [(1, 4 + 12 / 4), (2, 2 + 14 / 4), (3, 16 / 4)])
def test_zero_shards_model_states_over_dp_times_cp(zero, per_parameter):
    """The ZeRO paper's bytes per parameter with N = dp x cp = 4 (test_analytical_memory_formulas), as at dp 4."""
    for parallel in ({"dp": 2, "cp": 2}, {"dp": 4}):
        point = make_point(global_batch=8, zero=zero, **parallel)
        result = AnalyticalCostModel().simulate(SymbolicGenerator().generate(point), point.system)
        held = result.classes[0].memory_at_peak
        states = held["parameter"] + held["gradient"] + held["optimizer_state"]
        assert states == pytest.approx(per_parameter * count_parameters(point), rel=1e-9), parallel


def test_zero3_gathers_and_reduce_scatters_each_weight_once_over_the_dp_x_cp_group():
    """Per micro-batch: every gradient reduce-scattered once (W bytes in), the weights gathered for forward and
    again for backward, all but the embedding table and the head, kept gathered from its forward (W each); one
    collective over the 4 ranks, none over cp alone but attention's: each layer gathers K and V of the whole
    sequence (256 tokens x 4 kv heads x 32) in forward and again in backward, and reduce-scatters their gradients."""
    point = make_point(global_batch=8, dp=2, cp=2, zero=3)
    w = 2 * count_parameters(point)
    kv = 2 * 256 * 4 * 32 * 2  # K and V, bf16
    gathers, scatters = _comm(point, Collective.ALL_GATHER), _comm(point, Collective.REDUCE_SCATTER)
    assert gathers == pytest.approx({"cp+dp": M * (2 * w - 2 * V * H - 2 * (V * H + H)), "cp": M * 4 * 2 * kv})
    assert scatters == pytest.approx({"cp+dp": M * w, "cp": M * 4 * kv})
    assert _comm(point, Collective.ALL_REDUCE) == {}


def test_zero0_all_reduces_the_gradients_once_a_step_over_dp_x_cp():
    point = make_point(global_batch=8, dp=2, cp=2)
    assert _comm(point, Collective.ALL_REDUCE) == pytest.approx({"cp+dp": 2 * count_parameters(point)})


def test_zero1_reduce_scatters_the_gradients_and_gathers_the_weights_once_a_step_over_dp_x_cp():
    point = make_point(global_batch=8, dp=2, cp=2, zero=1)
    w = 2 * count_parameters(point)
    assert _comm(point, Collective.REDUCE_SCATTER)["cp+dp"] == pytest.approx(w)
    assert _comm(point, Collective.ALL_GATHER)["cp+dp"] == pytest.approx(w)


def test_the_dp_x_cp_group_is_the_ranks_that_share_a_tensor_parallel_shard():
    """Ranks lie tp, cp, dp innermost first: with tp 2 a group is every second rank, in the analytical model's
    layout and in the process groups the Chakra export gives ASTRA-sim alike."""
    point = make_point(global_batch=8, tp=2, dp=2, cp=2, zero=3)
    workload = SymbolicGenerator().generate(point)
    axes = {op.axis for block in workload.blocks for op in block.ops if op.category == Collective.REDUCE_SCATTER}
    assert axes == {"cp", "cp+dp"}  # attention's K/V gradients over cp, the weights' over cp x dp
    assert [workload.layout.group(r, "cp+dp") for r in (0, 1)] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert sorted(CommGroups.of(workload.layout, ["cp+dp"]).members.values()) == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_hsdp_shards_over_dp_shard_times_cp_and_all_reduces_the_shard_over_the_replicas():
    """dp_shard 2 of dp 4 with cp 2: shard groups of 4 ranks (model states 16 Psi / 4), each micro-batch's
    gradients reduce-scattered in the group and the reduced shard (W / 4) all-reduced over the 2 replicas."""
    point = make_point(global_batch=8, dp=4, cp=2, zero=3, dp_shard=2)
    w = 2 * count_parameters(point)
    micro_batches = 2
    assert _comm(point, Collective.REDUCE_SCATTER)["cp+dp_shard"] == pytest.approx(micro_batches * w)
    assert _comm(point, Collective.ALL_REDUCE) == pytest.approx({"dp_rep": micro_batches * w / 4})
    result = AnalyticalCostModel().simulate(SymbolicGenerator().generate(point), point.system)
    held = result.classes[0].memory_at_peak
    states = held["parameter"] + held["gradient"] + held["optimizer_state"]
    assert states == pytest.approx(16 / 4 * w / 2, rel=1e-9)
