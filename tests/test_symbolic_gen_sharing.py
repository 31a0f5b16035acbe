"""Points that share structure with earlier ones (replayed blocks alike across ZeRO stages and recompute policies,
a step's stage skeletons taken as one, stages' optimizer steps and pipeline transfers alike across micro-batch sizes
and recompute policies) generate exactly the workload a cold generation makes."""

import pytest

from generators.symbolic import SymbolicGenerator, blocks, optimizer, recording, skeleton
from tests.helpers import make_point

DGX = {"base": "dgx-h100", "network": {1: {"npus": 2}}}
SHAPE = dict(tp=2, pp=4, dp=2, sp=True, global_batch=32, system=DGX)


def _cold() -> None:
    caches = (recording._RECORDINGS, recording._BLOCKS, skeleton._SKELETONS, skeleton._STEPS)
    for cache in (*caches, optimizer._STEPS, blocks._MADE):
        cache.clear()


def _form(workload) -> tuple:
    steady = workload.steady
    programs = steady.programs if steady is not None else workload.programs
    return (
        workload.blocks,
        [p.calls for p in programs],
        [[(t.name, t.kind, t.bytes, type(t.bytes), t.producer, t.consumer) for t in p.tensors] for p in programs],
        [[(type(op.flops), type(op.bytes)) for op in b.ops] for b in workload.blocks],
    )


@pytest.mark.parametrize(
    ("seen", "point"), [("zero", 0), ("recompute", "none"), ("micro_batch", 1), ("recompute", "selective")]
)
def test_a_point_after_one_of_its_structure_equals_a_cold_generation(seen, point):
    earlier = {"zero": dict(zero=1), "recompute": dict(recompute="full"), "micro_batch": dict(micro_batch=2)}[seen]
    target = make_point(**{**SHAPE, seen: point})
    _cold()
    cold = SymbolicGenerator().generate(target)
    _cold()
    SymbolicGenerator().generate(make_point(**{**SHAPE, **earlier}))
    warm = SymbolicGenerator().generate(target)
    assert _form(warm) == _form(cold)
    assert [p.calls for p in warm.programs] == [p.calls for p in cold.programs]


def test_replayed_blocks_and_step_skeletons_are_shared():
    _cold()
    SymbolicGenerator().generate(make_point(**{**SHAPE, "zero": 1}))
    blocks_hits, steps_hits = recording._BLOCKS.hits, skeleton._STEPS.hits
    SymbolicGenerator().generate(make_point(**{**SHAPE, "zero": 0}))
    assert recording._BLOCKS.hits > blocks_hits  # the forwards replay alike under either stage
    assert skeleton._STEPS.hits > steps_hits  # one lookup for the step's stages after the first


def test_optimizer_steps_and_pipeline_transfers_are_shared():
    _cold()
    first = SymbolicGenerator().generate(make_point(**{**SHAPE, "recompute": "full"}))
    steps_hits, made_hits = optimizer._STEPS.hits, blocks._MADE.hits
    later = SymbolicGenerator().generate(make_point(**{**SHAPE, "recompute": "none"}))
    assert optimizer._STEPS.hits > steps_hits  # the same weights on every stage, whatever is recomputed
    assert blocks._MADE.hits > made_hits  # the same activation bytes cross the stages
    kept = {id(b) for b in first.blocks if b.name in ("optimizer", "send_fwd", "recv_fwd")}
    assert kept and kept <= {id(b) for b in later.blocks}
