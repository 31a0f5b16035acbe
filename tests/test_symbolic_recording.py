"""Module traces recorded once per structure and replayed on other sizes (generators.symbolic.tape): the tape
replays exactly the arithmetic it recorded, a comparison is a guard, and a replayed workload equals, number for
number, the workload a plain trace of the same point gives."""

import operator
from math import prod

import pytest
from helpers import make_point

from dse import catalog
from generators.symbolic import SymbolicGenerator, recording
from generators.symbolic.tape import Tape, larger
from generators.symbolic.tracing import ModuleTracer

SYSTEM = {"base": "dgx-h100", "network": {1: {"npus": 8}}}


def test_a_replay_redoes_the_recorded_arithmetic_on_other_sizes():
    def formula(b, s, h, tp):
        local = b * s / tp
        return larger(2 * prod((local, h, h)), sum((local * h, 4096.0))) + (local // 2) % 3 - 1

    tape = Tape()
    leaves = {name: tape.leaf(name, value) for name, value in dict(b=2, s=1024, h=4096, tp=4).items()}
    recorded = formula(**leaves)
    assert recorded.value == formula(2, 1024, 4096, 4)
    for sizes in (dict(b=1, s=8192, h=8192, tp=8), dict(b=3, s=17, h=5, tp=2)):
        values = tape.replay(sizes)
        assert values is not None and values[recorded.slot] == formula(**sizes)


def test_a_comparison_made_on_sizes_is_a_guard_that_a_replay_checks():
    tape = Tape()
    s = tape.leaf("s", 2048)
    density = 0.5 if s > 1 else 1.0
    [(op, left, right, outcome)] = tape.guards
    assert density == 0.5 and (op, left, tape.values[right], outcome) == (operator.gt, s.slot, 1, True)
    assert tape.replay({"s": 4096}) is not None
    assert tape.replay({"s": 1}) is None, "a decode step (one token) must not replay a prefill's recording"


def test_a_size_made_a_plain_number_cannot_be_recorded():
    tape = Tape()
    with pytest.raises(TypeError, match="plain number"):
        float(tape.leaf("h", 4096) * 2)
    with pytest.raises(TypeError, match="plain number"):
        range(tape.leaf("cp", 2))


def _contents(workload) -> str:
    """Every number and name of a workload, with the numbers' types: its blocks, and its programs' calls and
    tensors (the model states among them)."""
    forms = [workload.programs] + ([workload.steady.programs] if workload.steady else [])
    programs = [[(p.calls, [tuple(t) for t in p.tensors]) for p in form] for form in forms]
    numbers = [(type(op.flops), type(op.comm_bytes)) for block in workload.blocks for op in block.ops]
    return repr((workload.blocks, programs, workload.model_flops, numbers))


def _recordings() -> set[int]:
    """The recordings the generator keeps, by identity: a point that adds none replayed one."""
    return {id(kept) for variants in recording._RECORDINGS.values() for kept in variants}


def _traced_plainly(point, monkeypatch) -> str:
    with monkeypatch.context() as patch:
        patch.setattr(ModuleTracer, "modules", ModuleTracer.trace_modules)
        return _contents(SymbolicGenerator().generate(point))


LAYOUTS = [
    # (recorded, replayed): the same axes split, other degrees, micro-batch sizes and sequence lengths (and ZeRO
    # stages 1 and 2, which reduce the same gradients)
    (
        dict(tp=2, dp=4, sp=True, zero=1, recompute="selective"),
        dict(tp=8, dp=2, sp=True, zero=2, recompute="selective"),
    ),
    (dict(tp=2, dp=4, pp=2, zero=3, recompute="full"), dict(tp=4, dp=16, pp=2, zero=3, recompute="full")),
    (dict(tp=2, dp=4, cp=2, cp_algorithm="ring"), dict(tp=4, dp=8, cp=2, cp_algorithm="ring")),
    (dict(tp=2, dp=8, ep=2, zero=2), dict(tp=4, dp=16, ep=4, zero=2)),
]


@pytest.mark.parametrize("model", catalog.names("models"))
def test_every_model_replays_the_workload_a_plain_trace_gives(model, monkeypatch):
    """For every catalog model: a point traced with recording sizes, then points of the same structure with
    other micro-batch sizes, sequence lengths and tp, dp and ep degrees, replayed from that recording; each
    replayed workload equals the plain trace's, every block, op, call and tensor size."""
    moe = catalog.entry("models", model).get("moe") is not None
    cases = replays = 0
    for recorded, replayed in LAYOUTS if moe else LAYOUTS[:3]:
        for mode in ("train", "decode"):
            overrides = {"workload.mode": mode}
            first = make_point(model, SYSTEM, 1024, 64, 1, overrides, **recorded)
            later = make_point(model, SYSTEM, 4096, 64 * 4, 2, overrides, **replayed)
            if mode == "decode" and first.parallel.cp > 1:
                continue
            cases += 1
            recording._RECORDINGS.clear()
            SymbolicGenerator().generate(first)
            recordings = _recordings()
            workload = SymbolicGenerator().generate(later)
            replays += _recordings() == recordings
            assert _contents(workload) == _traced_plainly(later, monkeypatch), (model, replayed, mode)
    assert replays == cases == (7 if moe else 5), "points of one structure must replay its recording, not trace anew"


def test_a_point_for_which_a_recorded_comparison_fails_is_traced_anew(monkeypatch):
    """FSDP1 divides gradients before and after its reduce-scatter by factors found from the group size: with
    dp 4 there is one predivide and no postdivide kernel, with dp 16 one of each, so a recording made with dp 4
    does not hold for dp 16. Both recordings are kept: points alternating between them replay."""
    recorded = make_point("llama3-8b", SYSTEM, 1024, 64, 1, tp=2, dp=4, zero=3, fsdp="fsdp1")
    other = make_point("llama3-8b", SYSTEM, 1024, 64, 1, tp=2, dp=16, zero=3, fsdp="fsdp1")
    recording._RECORDINGS.clear()
    SymbolicGenerator().generate(recorded)
    first = _recordings()
    workload = SymbolicGenerator().generate(other)
    assert len(_recordings() - first) == 1, "the recording was replayed for a point its comparisons do not hold for"
    names = {op.name.rsplit(".", 1)[-1] for block in workload.blocks for op in block.ops}
    assert {"predivide", "postdivide"} <= names
    assert _contents(workload) == _traced_plainly(other, monkeypatch)
    both = _recordings()
    for point in (recorded, other, make_point("llama3-8b", SYSTEM, 2048, 64, 1, tp=2, dp=4, zero=3, fsdp="fsdp1")):
        assert _contents(SymbolicGenerator().generate(point)) == _traced_plainly(point, monkeypatch)
    assert _recordings() == both and len(both) == 2


@pytest.mark.parametrize(
    ("recorded", "replayed"),
    [
        ("llama3-8b", "llama3-405b"),
        ("tiny-llama", "llama2-70b"),
        ("mixtral-8x7b", "mixtral-8x22b"),
        ("tiny-gpt", "gpt3-175b"),
        ("tiny-mamba", "mamba-2.8b"),
    ],
)
def test_members_of_a_model_family_replay_one_recording(recorded, replayed, monkeypatch):
    """A model family's members differ in widths, depth and head counts, which are sizes: a point of one member
    replays the recording of another's, and gives the workload a plain trace gives."""
    layout = dict(tp=2, dp=8, ep=2, zero=1) if "mixtral" in recorded else dict(tp=2, dp=4, sp=True)
    recording._RECORDINGS.clear()
    SymbolicGenerator().generate(make_point(recorded, SYSTEM, 1024, 64, 1, **layout))
    recordings = _recordings()
    point = make_point(replayed, SYSTEM, 2048, 64, 2, **layout)
    workload = SymbolicGenerator().generate(point)
    assert _recordings() == recordings
    assert _contents(workload) == _traced_plainly(point, monkeypatch)


def test_models_whose_structure_differs_are_traced_apart():
    """Grouped-query against full multi-head attention (an eager trace copies K/V per head only for GQA), a
    compressed query against a full-rank one (DeepSeek-V3 against V2-Lite): not one family's recording."""
    for first, second, kernels in (("llama3-8b", "llama2-7b", "eager"), ("deepseek-v2-lite", "deepseek-v3", "fused")):
        recording._RECORDINGS.clear()
        for model in (first, second):
            SymbolicGenerator().generate(
                make_point(model, SYSTEM, 1024, 64, 1, {"workload.kernels": kernels}, tp=2, dp=4)
            )
        assert len(_recordings()) == 2, (first, second)


def test_a_moe_recording_does_not_carry_its_slot_regrouping_to_another_ep(monkeypatch):
    """Whether a MoE layer regroups its slots by local expert is decided on the ep and tp degrees outside the
    tape (`experts.regroups_slots`): a recording made where it does (ep 2, four local experts) must not be
    replayed where it does not (ep 8, one local expert), which once added a sort to the second point's layers
    depending on which point a study generated first."""
    regrouped = make_point("mixtral-8x7b", SYSTEM, 1024, 64, 1, tp=2, dp=16, ep=2, sp=True)
    single = make_point("mixtral-8x7b", SYSTEM, 1024, 64, 1, tp=2, dp=16, ep=8, sp=True)
    recording._RECORDINGS.clear()
    SymbolicGenerator().generate(regrouped)
    workload = SymbolicGenerator().generate(single)
    names = {op.name.rsplit(".", 1)[-1] for block in workload.blocks for op in block.ops}
    assert "sort" not in names
    assert _contents(workload) == _traced_plainly(single, monkeypatch)
