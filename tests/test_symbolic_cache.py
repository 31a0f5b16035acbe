"""The generator's workload cache: a system-only change reuses the workload, and the price is the fresh one."""

from helpers import make_point

from dse import plugins
from dse.evaluate import evaluate
from dse.executor import PluginEvaluation
from generators.symbolic.generator import SymbolicGenerator

DGX = {"base": "dgx-h100", "network": {1: {"npus": 2}}}
FAST_LINKS = {"base": "dgx-h100", "network": {0: {"bandwidth_GBps": 900}, 1: {"npus": 2}}}


def test_a_system_only_change_reuses_the_workload_and_prices_it_like_a_fresh_one():
    base = make_point("llama3-8b", DGX, seq_len=2048, global_batch=32, tp=4, pp=2, dp=2, sp=True, zero=1)
    faster = make_point("llama3-8b", FAST_LINKS, seq_len=2048, global_batch=32, tp=4, pp=2, dp=2, sp=True, zero=1)
    other = make_point("llama3-8b", DGX, seq_len=2048, global_batch=32, tp=4, pp=2, dp=2, sp=True, zero=2)
    assert base.key != faster.key and base.workload_key == faster.workload_key != other.workload_key

    generator, cost_model = SymbolicGenerator(), plugins.cost_model("analytical")
    first = evaluate(base, generator, cost_model)
    reused = evaluate(faster, generator, cost_model)
    assert reused.workload.blocks is first.workload.blocks, "the system-only change did not regenerate"
    assert (first.workload.point_key, reused.workload.point_key) == (base.key, faster.key)
    assert evaluate(other, generator, cost_model).workload.blocks is not first.workload.blocks

    fresh = evaluate(faster, SymbolicGenerator(), cost_model)
    assert reused.metrics == fresh.metrics
    assert reused.metrics["step_time_s"] < first.metrics["step_time_s"], "faster NVLink must show in the price"


def test_points_of_one_affinity_share_their_stages_schedule_skeletons():
    """The affinity a study's executor routes by names exactly what the skeleton cache keys on: points equal in
    it reuse one call shape per stage (another tp, another recompute), and a point that differs does not."""
    shape = dict(seq_len=2048, global_batch=32, pp=2, dp=2, sp=True, zero=1)
    tp4 = make_point("llama3-8b", DGX, tp=4, recompute="none", **shape)
    tp2 = make_point("llama3-8b", DGX, tp=2, recompute="full", **shape)
    more_micro_batches = make_point("llama3-8b", DGX, tp=4, **{**shape, "global_batch": 64})
    evaluation = PluginEvaluation("symbolic", "analytical")
    assert evaluation.affinity(tp4) == evaluation.affinity(tp2) != evaluation.affinity(more_micro_batches)

    generator = SymbolicGenerator()
    shapes = [[p.shape for p in generator.generate(point).programs] for point in (tp4, tp2, more_micro_batches)]
    assert all(a is b for a, b in zip(shapes[0], shapes[1], strict=True))
    assert not any(a is b for a, b in zip(shapes[0], shapes[2], strict=True))
