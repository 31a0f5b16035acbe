"""Boolean-mask routing (tests/fx_zoo_masked.py: each expert's tokens `x[mask]`, added back with `out[mask] += ...`)
captures under compile on meta at the fixed capacity (generators/fx/routing.py), as the `torch.where` loop of
tests/test_fx_moe_routing.py does: 4 experts, top_k 2, 2 x 64 tokens, so an expert's mask over the tokens selects
ceil(imbalance x 128 x 2 / 4) rows."""

import pytest

pytest.importorskip("torch")

import fx_zoo_masked
import torch
from test_fx_moe_routing import EXPERTS, HIDDEN, SKEW, WIDTH, expert_gemms, flops, zoo_point

from generators.fx.capture import capture_layer

MASKED = {"model.fx_factory": "fx_zoo_masked:factory"}


def indexed_rows(graph) -> set[int]:
    """The rows of the forward's boolean-mask index ops (the tokens' gathers, not the [tokens, hidden] input)."""
    index = torch.ops.aten.index.Tensor
    return {
        n.meta["val"].shape[0]
        for n in graph.graph.nodes
        if n.target is index and n.args[1][0].meta["val"].dtype == torch.bool
    }


@pytest.mark.parametrize(("routing", "capacity"), [({}, 64), ({"workload.routing": SKEW}, 96)])
def test_boolean_mask_routing_runs_each_expert_on_its_capacity(routing, capacity) -> None:
    """At tp 1: every expert's three GEMMs on `capacity` rows (1.5 x 64 under the skew), the mask's gathers of that
    many rows."""
    point = zoo_point(MASKED | routing)
    layer = capture_layer(fx_zoo_masked.factory, "masked", point.model, point.workload, 1, 1, False)
    gemms = expert_gemms(layer.forward)
    assert len(gemms) == EXPERTS * 3
    assert flops(gemms) == EXPERTS * 3 * 2 * capacity * HIDDEN * WIDTH
    assert indexed_rows(layer.forward) == {capacity}
