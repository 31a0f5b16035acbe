"""ZeRO 0 and ZeRO 1/2 traces differ only in their gradient syncs (all-reduce or reduce-scatter), so one walk
records both sides on one tape (`tracing.ZeroSibling`, `Recording.other`): a point of the other side replays that
recording, and its workload equals, number for number, a plain trace's. The weights' unsharded sizes come with
the recording (`Modules.weights`), and the model states sized from them equal the plain trace's."""

import pytest
from helpers import make_point
from test_symbolic_recording import _contents, _recordings, _traced_plainly

from dse.modelstats import layer_kinds
from generators.symbolic import SymbolicGenerator, recording
from generators.symbolic.blocks import layer_keys
from generators.symbolic.graph import Tracer
from generators.symbolic.optimizer import weight_elements
from generators.symbolic.tracing import ModuleTracer

SYSTEM = {"base": "dgx-h100", "network": {1: {"npus": 8}}}


LAYOUTS = [
    ("llama3-8b", dict(tp=2, dp=4, sp=True, recompute="selective")),
    ("gpt3-175b", dict(tp=2, dp=2, pp=2, recompute="full")),
    ("tiny-gpt", dict(tp=2, dp=4, cp=2, cp_algorithm="ring")),
    ("mixtral-8x7b", dict(tp=2, dp=8, ep=2, sp=True)),
]


@pytest.mark.parametrize(("model", "layout"), LAYOUTS)
@pytest.mark.parametrize(("recorded", "replayed"), [(0, 1), (1, 0), (2, 0), (0, 2)])
def test_the_other_zero_side_replays_the_recording(model, layout, recorded, replayed, monkeypatch):
    first = make_point(model, SYSTEM, 1024, 64, 1, zero=recorded, **layout)
    later = make_point(model, SYSTEM, 2048, 64 * 2, 2, zero=replayed, **layout)
    recording._RECORDINGS.clear()
    SymbolicGenerator().generate(first)
    kept = _recordings()
    workload = SymbolicGenerator().generate(later)
    assert _recordings() == kept, "the other side of ZeRO's split was traced anew"
    assert _contents(workload) == _traced_plainly(later, monkeypatch)
    # and the recorded side still replays to its own workload
    again = make_point(model, SYSTEM, 2048, 64 * 2, 2, zero=recorded, **layout)
    assert _contents(SymbolicGenerator().generate(again)) == _traced_plainly(again, monkeypatch)
    assert _recordings() == kept


def test_zero_3_and_inference_keep_to_their_own_recordings(monkeypatch):
    """ZeRO 3 traces differently (weight gathers, FSDP's copies): no side of a ZeRO 0 recording. An inference
    trace syncs no gradients, so ZeRO below 3 does not change it."""
    recording._RECORDINGS.clear()
    SymbolicGenerator().generate(make_point("llama3-8b", SYSTEM, 1024, 64, 1, tp=2, dp=4, zero=0))
    kept = _recordings()
    point = make_point("llama3-8b", SYSTEM, 1024, 64, 1, tp=2, dp=4, zero=3)
    assert _contents(SymbolicGenerator().generate(point)) == _traced_plainly(point, monkeypatch)
    assert len(_recordings() - kept) == 1
    decode = {"workload.mode": "decode"}
    recording._RECORDINGS.clear()
    SymbolicGenerator().generate(make_point("llama3-8b", SYSTEM, 1024, 64, 1, decode, tp=2, dp=4, zero=0))
    kept = _recordings()
    point = make_point("llama3-8b", SYSTEM, 2048, 64, 1, decode, tp=2, dp=4, zero=1)
    assert _contents(SymbolicGenerator().generate(point)) == _traced_plainly(point, monkeypatch)
    assert _recordings() == kept


def test_recorded_weight_sizes_are_those_of_the_plain_sizes():
    """`Modules.weights` of a replay: each weight's unsharded elements as `weight_elements` finds them with the point's
    own sizes, number types included."""
    recording._RECORDINGS.clear()
    layout = dict(tp=2, dp=8, ep=2, zero=1)
    SymbolicGenerator().generate(make_point("mixtral-8x7b", SYSTEM, 1024, 64, 1, **layout))
    point = make_point("mixtral-8x7b", SYSTEM, 4096, 64 * 4, 2, **layout)
    tracing = ModuleTracer(point)
    modules = tracing.modules(layer_keys(layer_kinds(point.model), point.parallel))
    tracer: Tracer = tracing.tracer
    params = [w for t in (*modules.layers.values(), modules.embedding, modules.head) for w in t.params]
    assert params and {id(w) for w in params} == set(modules.weights)
    experts = 0
    for w in params:
        elems, expert = weight_elements(tracer, w)
        assert modules.weights[id(w)] == (elems, expert) and type(modules.weights[id(w)][0]) is type(elems)
        experts += expert
    assert experts > 0
