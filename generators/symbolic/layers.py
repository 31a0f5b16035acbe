"""What a point's layers are traced as and which of them each pipeline stage holds (`LayerLayout`), worked out once
per model and pipeline split and shared by the points that keep them.

A study's points mostly share their model and their pipeline's depth while their tp, micro-batch, recompute, sp and
ZeRO vary, and none of those changes which layers are alike or where the stages split them. Worked out per point,
a walk over every layer (its key, the stages' layers by chunk, the layer kinds each stage holds, their runs) was
about a fifth of a generation that replays a recording and reuses the stages' skeletons."""

from collections.abc import Hashable
from dataclasses import dataclass
from typing import NamedTuple

from dse.lru import MIB, ByteBoundedLru
from dse.modelstats import layer_kinds
from dse.spec import DesignPoint
from generators.symbolic.blocks import LayerKey, layer_keys
from generators.symbolic.schedule import Placement
from generators.symbolic.skeleton import runs


class StageLayers(NamedTuple):
    """The layers one pipeline stage holds."""

    layers: dict[int, list[int]]
    """Per model chunk, the layers (never changed by those who read them: every point of the layout shares it)."""
    first: bool
    """Whether the stage holds the first virtual stage (the embedding)."""
    last: bool
    """Whether it holds the last (the head)."""
    kinds: tuple[LayerKey, ...]
    """Its layers' keys, chunk by chunk in order."""
    alike: int
    """The first stage alike in `first`, `last` and `kinds`: what its model states follow from."""


@dataclass(frozen=True, slots=True, eq=False)
class LayerLayout:
    """A point's layers as the generator reads them (`layer_layout`)."""

    keys: tuple[LayerKey, ...]
    """Per layer, what it is traced for (`layer_keys`)."""
    runs: tuple[tuple[object, int], ...]
    """`keys` as runs of equal keys (`skeleton.runs`)."""
    vstage_starts: tuple[int, ...]
    """Virtual stage v runs layers [vstage_starts[v], vstage_starts[v + 1])."""
    stages: tuple[StageLayers, ...]

    @staticmethod
    def of(point: DesignPoint) -> "LayerLayout":
        p, m = point.parallel, point.model
        keys = tuple(layer_keys(layer_kinds(m), p))
        placement = Placement.of(point)
        # Virtual stage v (chunk c of stage s, `Placement.holder`) runs layers [starts[v], starts[v + 1]); a
        # stage's layers split evenly over its chunks, the first chunks taking one more where they do not divide
        # (uneven stages).
        per_stage = p.stage_layers(m.layers)
        starts = [0]
        for v in range(p.pp * placement.chunks):
            stage, chunk = placement.holder(v)
            count = per_stage[stage]
            starts.append(starts[-1] + count // placement.chunks + (chunk < count % placement.chunks))
        last = p.pp * placement.chunks - 1
        stages: list[StageLayers] = []
        alike: dict[tuple, int] = {}
        for stage in range(p.pp):
            vstages = [placement.vstage(stage, c) for c in range(placement.chunks)]
            layers = {c: list(range(starts[v], starts[v + 1])) for c, v in enumerate(vstages)}
            kinds = tuple([keys[i] for c in layers for i in layers[c]])
            ends = placement.holder(0)[0] == stage, placement.holder(last)[0] == stage
            stages.append(StageLayers(layers, *ends, kinds, alike.setdefault((*ends, kinds), stage)))
        return LayerLayout(keys, runs(list(keys)), tuple(starts), tuple(stages))


LAYOUT_CACHE_BYTES = 4 * MIB
"""About 200 layouts of a 96-layer model: many studies' models and pipeline splits."""
LAYOUT_BYTES_PER_LAYER = 200
"""A layout's bytes per layer, estimated: a key (a tuple of three, ~70 B) and its place in a stage's list and kinds
(~20 B), rounded up for the stages' dictionaries and lists."""
_LAYOUTS: ByteBoundedLru[Hashable, LayerLayout] = ByteBoundedLru(
    "layer_layouts", LAYOUT_CACHE_BYTES, lambda layout: LAYOUT_BYTES_PER_LAYER * max(len(layout.keys), 1)
)
"""Per process (an evaluator actor keeps it across trials), least recently used out first."""


def layer_layout(point: DesignPoint) -> LayerLayout:
    """The point's layer layout, shared with every earlier point of the same model, layer strategies and pipeline
    split (what `LayerLayout.of` reads)."""
    p = point.parallel
    key = (
        point.model,
        p.layer_strategies,
        p.pp,
        p.pp_schedule,
        p.virtual_stages,
        p.first_stage_layers,
        p.last_stage_layers,
    )
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = LayerLayout.of(point)
        _LAYOUTS.put(key, layout)
    return layout
