"""A revisit (a workload priced again on a system whose InfiniBand differs) replays what its first drive resolved
(`call_layout.Drive`, `plans.Planner.replay`): it hands the plans whose dimensions did not change again, finds
the others afresh, and reads the plans' numbering, rows and layout kept; its tables and schedules are a fresh
scheduler's, array by array."""

import numpy as np
import pytest

from dse.system import SystemSpec
from generators.symbolic import SymbolicGenerator
from simulators.analytical import call_layout, plans
from simulators.analytical.compiled_engine import CompiledScheduler
from simulators.analytical.plans import Planner
from simulators.analytical.steady import schedule_steady
from tests.helpers import make_point
from tests.test_analytical_fastpath import CASES
from tests.test_plans_across_systems import _empty

UNFILLED = ("compute_knots", "comm_starts", "comm_ends")
"""Tables the kernel fills only as far as it lays busy intervals out (compared through the schedules)."""


def _other_infiniband(system: SystemSpec) -> SystemSpec:
    """The system with its outer dimension (between nodes) slower: plans whose groups stay in a node keep their
    seconds, the others (a stage's sends, groups across nodes) change."""
    network = list(system.network)
    network[-1] = network[-1].model_copy(update={"bandwidth_GBps": network[-1].bandwidth_GBps / 1.7})
    return system.model_copy(update={"network": network})


def _forget() -> None:
    _empty()
    call_layout.JOINED.clear()
    plans._LOGS.clear()


@pytest.fixture
def replays(monkeypatch) -> list[bool]:
    """What each `Planner.replay` call gave."""
    out: list[bool] = []
    replay = Planner.replay

    def recorded(self, resolved):
        out.append(replay(self, resolved))
        return out[-1]

    monkeypatch.setattr(Planner, "replay", recorded)
    return out


@pytest.mark.parametrize("case", ["tp2-pp4-1f1b-zero1", "tp4-pp2-zero2-selective", "pp8-gpipe-full", "interleaved"])
def test_a_revisit_replays_its_first_drive_and_drives_as_a_fresh_scheduler(case, replays):
    point = make_point(**CASES[case])
    workload = SymbolicGenerator().generate(point)
    other = _other_infiniband(point.system)
    _forget()
    fresh = CompiledScheduler(workload, other)
    want = fresh.drive()
    _forget()
    first = CompiledScheduler(workload, point.system).drive()
    assert replays == []
    revisit = CompiledScheduler(workload, other)
    got = revisit.drive()
    assert replays == [True]
    changed = want.o_seconds != first.o_seconds
    assert changed.any() and not changed.all(), case  # some plans' seconds changed, some did not
    for field in want._fields:
        a, b = getattr(want, field), getattr(got, field)
        if isinstance(a, np.ndarray):
            if field not in UNFILLED:
                assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), (case, field)
        else:
            assert a == b, (case, field)
    back = CompiledScheduler(workload, point.system).drive()  # replays the revisit's plans, on the first system
    assert replays == [True, True]
    for field in ("o_seconds", "o_mark_offset", "p_category_seconds", "call_start", "call_end", "category_time"):
        assert getattr(back, field).tobytes() == getattr(first, field).tobytes(), (case, field)
    assert revisit._plan_places == fresh._plan_places
    assert [p.seconds.tobytes() for p in revisit._planner.handed] == [
        p.seconds.tobytes() for p in fresh._planner.handed
    ]
    assert len({id(p) for p in revisit._planner.handed}) == len(revisit._planner.handed)  # one object a place
    for x, y in zip(fresh.schedules(want), revisit.schedules(got), strict=True):
        assert (x.end_s, x.compute_s, x.comm_s, x.exposed_comm_s) == (y.end_s, y.compute_s, y.comm_s, y.exposed_comm_s)
        assert x.time_by_category == y.time_by_category
        assert x.busy is not None and y.busy is not None and x.busy.totals == y.busy.totals
        for name in ("knots", "done", "comm_starts", "comm_ends", "hidden"):
            assert getattr(x.busy, name).tobytes() == getattr(y.busy, name).tobytes(), (case, name)
        assert x.transfers is not None and y.transfers is not None and x.transfers.rows() == y.transfers.rows()


def test_a_steady_revisit_and_its_longer_form_replay_as_fresh_ones(replays):
    """The steady check's longer form shares its shorter form's planner (`CompiledScheduler.for_programs`): both
    drives replay, and the step is the one priced afresh."""
    point = make_point(tp=2, pp=4, dp=2, zero=1, sp=True, global_batch=64, system=CASES["interleaved"]["system"])
    workload = SymbolicGenerator().generate(point)
    other = _other_infiniband(point.system)
    _forget()
    want = schedule_steady(workload, other)
    _forget()
    schedule_steady(workload, point.system)
    got = schedule_steady(workload, other)
    assert want is not None and got is not None
    assert replays and all(replays)
    for x, y in zip(want.schedules, got.schedules, strict=True):
        assert (x.end_s, x.compute_s, x.comm_s, x.exposed_comm_s) == (y.end_s, y.compute_s, y.comm_s, y.exposed_comm_s)
        assert x.time_by_category == y.time_by_category
