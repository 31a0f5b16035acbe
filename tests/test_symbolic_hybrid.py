"""Per-layer strategies: layers that use the tp ranks as more data-parallel ranks beside tensor-parallel ones."""

from collections import Counter

import pytest
from helpers import make_point

from dse.errors import DseError
from dse.point.feasibility import infeasibility
from dse.workload import OpKind, expand
from generators.symbolic import SymbolicGenerator, count_parameters
from simulators.analytical import AnalyticalCostModel

GEN = SymbolicGenerator()
S, MB, TP = 256, 2, 2


def point(strategies=("tp", "dp"), micro_batch=MB, **kw):
    parallel = dict(tp=TP, dp=4, layer_strategies=strategies) | kw
    return make_point("tiny-llama", seq_len=S, global_batch=16, micro_batch=micro_batch, **parallel)


def collectives(workload, name: str, axis: str = "tp") -> list[tuple[str, float]]:
    block = next(b for b in workload.blocks if b.name == name)
    return [(op.category, op.comm_bytes) for op in block.ops if op.kind is OpKind.COLLECTIVE and op.axis == axis]


def activation_bytes(p) -> float:
    return MB * S * p.model.hidden * 2


def test_the_matcher_inserts_the_transitions_between_strategies():
    """tp -> dp: the duplicated residual is sliced along the batch (no communication), and the backward
    all-gathers the input gradient; dp -> tp: the batch shards are all-gathered, and the backward slices."""
    p = point()
    w = GEN.generate(p)
    full = activation_bytes(p)
    assert collectives(w, "layer.dp.from_tp.forward") == []
    assert collectives(w, "layer.dp.from_tp.backward") == [("all_gather", full)]
    into_tp = collectives(w, "layer.from_dp.forward")
    assert into_tp[0] == ("all_gather", full)
    assert into_tp[1:] == collectives(w, "layer.forward")  # then the tp layer's own all-reduces
    tp_backward = collectives(w, "layer.backward")
    # the backward slices its input gradient; it gathers the saved input shard again (as under SP)
    assert collectives(w, "layer.from_dp.backward") == [*tp_backward, ("all_gather", full)]


def test_with_sequence_parallelism_the_transition_is_an_all_to_all_of_the_shard():
    p = point(sp=True)
    w = GEN.generate(p)
    shard = activation_bytes(p) / TP
    assert collectives(w, "layer.dp.from_tp.forward") == [("all_to_all", shard)]
    assert collectives(w, "layer.dp.from_tp.backward") == [("all_to_all", shard)]
    assert collectives(w, "layer.from_dp.forward")[0] == ("all_to_all", shard)


def test_each_layer_kind_and_strategy_pair_is_traced_once():
    p = point()
    w = GEN.generate(p)
    forwards = Counter(
        w.blocks[c.block].name for c in w.programs[0].calls if w.blocks[c.block].name.endswith("forward")
    )
    per_mb = {name: n // p.micro_batches for name, n in forwards.items() if name.startswith("layer")}
    # 4 layers: tp (after the embedding), dp, tp, dp
    assert per_mb == {"layer.forward": 1, "layer.dp.from_tp.forward": 2, "layer.from_dp.forward": 1}
    all_dp = GEN.generate(point(("dp",)))
    names = {b.name for b in all_dp.blocks if b.name.startswith("layer") and b.name.endswith("forward")}
    assert names == {"layer.dp.from_tp.forward", "layer.dp.forward"}
    assert collectives(all_dp, "layer.dp.forward") == collectives(all_dp, "layer.dp.backward") == []


def test_gradient_sync_per_strategy():
    """A tp layer reduces its 1/tp shard of the matrices (and the whole norms) over dp; a dp layer holds every
    weight and reduces the whole layer over tp and over dp."""
    p = point()
    m = p.model
    attention = 2 * m.hidden * m.heads * m.d_head + 2 * m.hidden * m.n_kv_heads * m.d_head
    matrices = attention + 3 * m.hidden * m.ffn
    norms = 2 * m.hidden
    w = GEN.generate(p)
    assert collectives(w, "layer.grad_sync", "dp") == [("all_reduce", 2 * (matrices / TP + norms))]
    assert collectives(w, "layer.grad_sync", "tp") == []
    whole = 2 * (matrices + norms)
    assert collectives(w, "layer.dp.from_tp.grad_sync", "dp") == [("all_reduce", whole)]
    assert collectives(w, "layer.dp.from_tp.grad_sync", "tp") == [("all_reduce", whole)]


def test_parameters_and_matmul_flops_equal_the_homogeneous_case():
    """A dp layer runs 1/tp of the batch through whole weights, a tp layer the whole batch through 1/tp of them:
    the same GEMM and attention FLOPs per rank. Norms and elementwise work, duplicated on tp ranks without SP,
    shrink by tp in a dp layer."""
    hybrid, homogeneous = point(), point(())
    assert count_parameters(hybrid) == count_parameters(homogeneous)

    def flops(p, categories):
        w = GEN.generate(p)
        return sum(f.op.flops for f in expand(w, w.programs[0]) if f.op.category in categories)

    assert flops(hybrid, ("gemm", "attention")) == pytest.approx(flops(homogeneous, ("gemm", "attention")))
    w = GEN.generate(hybrid)
    norm = {b.name: sum(op.flops for op in b.ops if op.category == "norm") for b in w.blocks}
    assert norm["layer.dp.from_tp.forward"] == pytest.approx(norm["layer.forward"] / TP)


def test_a_hybrid_pipeline_runs_and_the_fast_path_agrees():
    p = point(pp=2, dp=2)
    w = GEN.generate(p)
    fast = AnalyticalCostModel().simulate(w, p.system)
    exact = AnalyticalCostModel(exact=True).simulate(w, p.system)
    assert fast.step_time_s == pytest.approx(exact.step_time_s, rel=1e-2)


@pytest.mark.parametrize(
    ("strategies", "sp", "share"),
    [(("tp", "dp"), False, 1 / TP), (("dp", "tp"), False, 1), (("tp", "dp"), True, 1 / TP)],
)
def test_pipeline_transfers_carry_the_activation_as_the_stage_s_last_layer_lays_it_out(strategies, sp, share):
    """Two layers per stage: the boundary follows layer 1. A dp layer leaves its batch shard on each tp rank
    (1/tp of the activation), a tp layer the whole activation, or its sequence shard under SP."""
    w = GEN.generate(point(strategies, pp=2, dp=2, sp=sp))
    sizes = {
        (op.kind, op.comm_bytes)
        for b in w.blocks
        for op in b.ops
        if op.kind in (OpKind.SEND, OpKind.RECV) and op.axis == "pp"
    }
    expected = activation_bytes(point()) * (1 / TP if sp else share)
    assert sizes == {(OpKind.SEND, expected), (OpKind.RECV, expected)}


def test_bad_combinations_are_named_in_one_line():
    assert "micro_batch=1 is not a multiple of parallel.tp=2" in infeasibility(point(micro_batch=1))
    decode = point(overrides={"workload.mode": "decode"})
    assert "training only" in infeasibility(decode)
    with pytest.raises(DseError, match="layer_strategies"):
        point(("tp", "fsdp"))
