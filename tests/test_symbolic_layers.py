"""A point's layer layout (`LayerLayout`): every layer once, on the stages and chunks its virtual stage says, and one
layout shared by the points of a model and pipeline split whatever their tp, micro-batch, recompute, sp and ZeRO."""

import pytest
from helpers import make_point

from dse.modelstats import layer_kinds
from generators.symbolic.blocks import layer_keys
from generators.symbolic.layers import layer_layout
from generators.symbolic.schedule import Placement

CASES = {
    "1f1b": dict(pp=4),
    "uneven": dict(pp=4, first_stage_layers=5, last_stage_layers=11),
    "interleaved": dict(pp=2, pp_schedule="interleaved", virtual_stages=3),
    "dualpipev": dict(pp=2, pp_schedule="dualpipev"),
    "strategies": dict(pp=2, layer_strategies=("tp", "tp", "dp")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_layer_is_on_the_stage_and_chunk_of_its_virtual_stage(case):
    point = make_point("llama3-8b", **CASES[case])
    layout, placement = layer_layout(point), Placement.of(point)
    p = point.parallel
    assert layout.keys == tuple(layer_keys(layer_kinds(point.model), p))
    assert sum(length for _, length in layout.runs) == len(layout.keys) == point.model.layers
    vstages = p.pp * placement.chunks
    held = {}
    for stage, (layers, first, last, kinds, alike) in enumerate(layout.stages):
        assert first == (placement.holder(0)[0] == stage) and last == (placement.holder(vstages - 1)[0] == stage)
        assert kinds == tuple(layout.keys[i] for chunk in layers.values() for i in chunk)
        assert layout.stages[alike][1:4] == (first, last, kinds) and alike <= stage
        assert sum(len(chunk) for chunk in layers.values()) == p.stage_layers(point.model.layers)[stage]
        for chunk, indices in layers.items():
            held[placement.vstage(stage, chunk)] = indices
    assert [i for v in range(vstages) for i in held[v]] == list(range(point.model.layers))
    assert [held[v][0] if held[v] else None for v in range(vstages)] == [
        layout.vstage_starts[v] if layout.vstage_starts[v] < layout.vstage_starts[v + 1] else None
        for v in range(vstages)
    ]


def test_points_alike_but_for_tp_microbatch_recompute_sp_and_zero_share_a_layout():
    base = layer_layout(make_point("llama3-8b", pp=4))
    others = [
        make_point("llama3-8b", pp=4, tp=2, sp=True),
        make_point("llama3-8b", micro_batch=2, pp=4, recompute="full"),
        make_point("llama3-8b", pp=4, dp=2, zero=1),
    ]
    assert all(layer_layout(point) is base for point in others)
    assert layer_layout(make_point("llama3-8b", pp=2)) is not base
