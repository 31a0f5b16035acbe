"""The fx generator on mixture-of-experts points (issue 22): the reference MoE block (generators/fx/models/moe.py)
captured under tensor, sequence and expert parallelism (generators/fx/moe_plan.py) agrees with the symbolic
generator's MoE figure by figure, and its all-to-alls are the captured graph's own, on the ep axis."""

import pytest

pytest.importorskip("torch")

import torch.distributed as dist
from helpers import make_point
from torch.distributed.distributed_c10d import _resolve_process_group

from dse.errors import SpecError
from dse.workload import Collective, OpKind
from generators.fx.capture import axis_of, fake_world, mesh_of
from generators.fx.compare import compare, figures
from generators.fx.factories import factory_name
from generators.fx.generator import FxGenerator
from generators.symbolic import SymbolicGenerator

SEQ, HIDDEN, TOP_K = 256, 256, 2
ROUTED = TOP_K * SEQ * HIDDEN * 2
"""Bytes of one micro-batch's routed token copies (top_k x s x h, bf16): an unsplit all-to-all's size."""

SHARED = {"base": "tiny-moe", "moe": {"shared_experts": 1}}
"""A shared expert beside the routed ones (DeepSeek's layout)."""
DENSE_FIRST = {"base": "tiny-moe", "moe": {"first_dense_layers": 1}}
"""A dense first layer before the MoE ones (DeepSeek's): a block of each kind captured."""
CASES = [
    ("tiny-moe", {}),
    ("tiny-moe", {"tp": 2, "sp": True, "dp": 2}),
    ("tiny-moe", {"tp": 2, "dp": 2}),
    ("tiny-moe", {"dp": 4, "ep": 2}),
    ("tiny-moe", {"tp": 2, "sp": True, "dp": 4, "ep": 2}),
    (SHARED, {"tp": 2, "sp": True, "dp": 2}),
    (SHARED, {"tp": 2, "dp": 4, "ep": 2}),
    (DENSE_FIRST, {"tp": 2, "sp": True, "dp": 4, "ep": 2}),
]


@pytest.fixture(scope="module")
def generator() -> FxGenerator:
    return FxGenerator()


def moe_point(model="tiny-moe", overrides=None, **parallel):
    return make_point(model, seq_len=SEQ, global_batch=8, overrides=overrides, **parallel)


def _case_id(case) -> str:
    model, shape = case
    name = {id(SHARED): "shared", id(DENSE_FIRST): "dense-first"}.get(id(model), model)
    return "-".join([name, *(f"{k}{v}" for k, v in shape.items())])


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_it_agrees_with_the_symbolic_moe(generator, case) -> None:
    """Parameters on a rank exactly (expert weights split over ep and their width over tp), GEMM FLOPs, bytes per
    collective kind (the all-to-alls included) and peak memory within the compare's tolerances; every figure of
    these shapes in fact agrees to 0.2 % (capacity factor 1 on balanced routing: the experts' GEMMs are
    symbolic's). Not the step time, which at these sizes kernel launches decide (benchmarks/fx_agreement.py checks
    it at real sizes)."""
    model, shape = case
    point = moe_point(model, **shape)
    rows = compare(figures(generator.generate(point), point), figures(SymbolicGenerator().generate(point), point))
    checked = [r for r in rows if r.tolerance is not None and r.figure != "step time s"]
    assert all(r.ok for r in checked), [r for r in checked if not r.ok]
    assert all(abs(r.difference) < 0.002 for r in checked)
    kinds = {r.figure for r in checked if r.figure.endswith(" bytes") and r.a > 0}
    if shape.get("ep", 1) > 1:
        assert "all_to_all bytes" in kinds


def test_the_all_to_alls_are_captured_on_the_ep_axis(generator) -> None:
    """EP2 with TP2 SP: per layer, one all-to-all over ep before the experts and one after, each way, each moving
    the routed copies of the rank's sequence shard (top_k x s/tp x h); the slots are all-gathered over tp after
    the first and reduce-scattered before the second (Megatron's token dispatcher with expert TP)."""
    workload = generator.generate(moe_point(tp=2, sp=True, dp=4, ep=2))
    for way in ("forward", "backward"):
        block = next(b for b in workload.blocks if b.name == f"layer.attn.moe.{way}")
        exchanges = [op for op in block.ops if op.category == Collective.ALL_TO_ALL]
        assert [op.name.rsplit(".", 1)[0] for op in exchanges] == [f"layer.{way}"] * 2  # the captured graph's
        assert {(op.axis, op.comm_bytes) for op in exchanges} == {("ep", ROUTED / 2)}
        tp = [op for op in block.ops if op.kind is OpKind.COLLECTIVE and op.axis == "tp"]
        assert {op.category for op in tp} == {Collective.ALL_GATHER, Collective.REDUCE_SCATTER}
        assert max(op.comm_bytes for op in tp) == ROUTED


def test_a_moe_model_takes_the_moe_factory_and_what_is_not_built_is_named(generator) -> None:
    assert factory_name(moe_point().model) == "moe"
    with pytest.raises(SpecError, match=r"field 'model\.fx_factory': the reference FX model has no latent attention"):
        generator.generate(make_point("tiny-deepseek", seq_len=SEQ))


def test_a_dense_factory_under_a_moe_spec_is_refused(generator) -> None:
    """A factory whose blocks hold no experts (a dense block for a MoE spec) contradicts the spec: one line naming
    the field and both values (the model is the truth), rather than a capture that leaves every expert on every
    rank and no all-to-all."""
    dense = moe_point(overrides={"model.fx_factory": "fx_tiny_llama:llama"}, dp=4, ep=2)
    with pytest.raises(SpecError, match=r"field 'model\.family': the spec says 'mixtral', .* 'a dense transformer'"):
        generator.generate(dense)


def test_the_capture_mesh_has_the_symbolic_ranks_groups() -> None:
    """tp2 ep2 dp4 (dp / ep = 2 replicas of each expert): rank 0's tp, ep and dp groups in the capture's mesh are
    those of the symbolic workload's rank layout, and `axis_of` names each by its ranks. The fake world outlives
    every mesh: a mesh equal to one made before a larger world's (DTensor's caches hand out the earlier one's
    process groups) still resolves its groups."""
    fake_world(4)
    before = mesh_of(2, 2, 1)["tp"]
    fake_world(8)
    mesh = mesh_of(2, 4, 2)
    layout = SymbolicGenerator().generate(moe_point(tp=2, dp=4, ep=2)).layout
    for axis in ("tp", "ep", "dp"):
        group = mesh[axis].get_group()
        assert dist.get_process_group_ranks(group) == layout.group(0, axis)
        assert axis_of(group.group_name, dp=4, tp=2, ep=2) == axis
    after = mesh_of(2, 2, 1)["tp"]
    assert after == before
    for tp in (before, after):
        assert dist.get_process_group_ranks(_resolve_process_group(tp.get_group().group_name)) == [0, 1]
