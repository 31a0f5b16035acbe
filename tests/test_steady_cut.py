"""The steady cut: a steady form's busy seconds measured without the spare periods of its checked stretch
(`steady._cuts`, `ordered_busy`) and those periods added back as windows, against the whole measurement.

Each stage's figures must be the whole timeline's within the documented bound (spare periods * 3 * TOLERANCE_S,
and rounding), intervals must really be left out, and leaving the periods out without adding them back must
fail that bound. The window check must read the cut timeline as the whole one, to the bit.
"""

from dataclasses import replace

import numpy as np
import pytest

from generators.symbolic import SymbolicGenerator
from simulators.analytical import steady
from simulators.analytical.compiled_engine import CompiledScheduler
from simulators.analytical.ordered_busy import ordered_busy
from simulators.analytical.steady import TOLERANCE_S, schedule_steady
from simulators.analytical.steady_reads import reads
from tests.helpers import make_point

ROUNDING = 1e-12
"""Relative slack for rounding on top of the bound."""


def _system(nodes: int) -> dict:
    return {"base": "dgx-h100", "network": {1: {"npus": nodes}}}


CASES = {
    "gpt3-pp8-sp": dict(model="gpt3-175b", system=_system(16), tp=4, pp=8, dp=4, sp=True, global_batch=256),
    "gpt3-pp8-nosp": dict(model="gpt3-175b", system=_system(16), tp=4, pp=8, dp=4, sp=False, global_batch=256),
    "llama-pp4-sp": dict(model="llama3-8b", system=_system(4), tp=2, pp=4, dp=4, sp=True, global_batch=128),
    "llama-pp4-nosp": dict(model="llama3-8b", system=_system(4), tp=2, pp=4, dp=4, sp=False, global_batch=128),
    "llama-pp4-interleaved": dict(
        model="llama3-8b",
        system=_system(4),
        tp=2,
        pp=4,
        dp=4,
        pp_schedule="interleaved",
        virtual_stages=2,
        global_batch=256,
    ),
}


def _point(case: str):
    kwargs = dict(CASES[case])
    return make_point(kwargs.pop("model"), kwargs.pop("system"), seq_len=2048, **kwargs)


def _measured(case: str):
    """The shorter form simulated, its stages' periods, its schedules measured whole and with the cuts, and its
    stages' windows (read on the cut timeline; on the whole one they must be the same to the bit)."""
    point = _point(case)
    workload = SymbolicGenerator().generate(point)
    form = workload.steady
    assert form is not None
    scheduler = CompiledScheduler(replace(workload, programs=form.programs, steady=None), point.system)
    run = steady._Simulated(scheduler, scheduler.drive())
    read = reads(workload.blocks, form.programs)
    found = steady._periods(form.programs, run.tables, form.period, read)
    assert found is not None, "the shorter form's timeline does not repeat"
    lo = steady._steady_starts(run.tables, found)
    cuts = steady._cuts(found, lo)
    assert cuts is not None, "no stage has spare periods"
    windows = steady._windows(scheduler.busy(run.tables, cuts), found, lo)
    whole_windows = steady._windows(scheduler.busy(run.tables), found, lo)
    assert windows is not None and whole_windows is not None
    assert np.array_equal(windows.view(np.int64), whole_windows.view(np.int64))  # to the bit
    return found, cuts, scheduler.schedules(run.tables), scheduler.schedules(run.tables, cuts), windows


FIGURES = ("compute_s", "comm_s", "exposed_comm_s")


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_cut_measures_each_stage_as_the_whole_timeline_within_its_bound(case):
    found, _, whole, cut, windows = _measured(case)
    assert sum(f[3] for f in found) > 0
    for (_, _, _, spare, _), w, c, window in zip(found, whole, cut, windows.tolist(), strict=True):
        bound = spare * 3 * TOLERANCE_S
        for name, seconds in zip(FIGURES, window, strict=True):
            expected = getattr(w, name)
            assert abs(getattr(c, name) + spare * seconds - expected) <= bound + ROUNDING * expected, name
        if spare:
            assert len(c.busy.knots) < len(w.busy.knots) and len(c.busy.comm_starts) < len(w.busy.comm_starts)
            # without the periods added back, the figures are off by far more than the bound
            assert abs(c.compute_s - w.compute_s) > bound + ROUNDING * w.compute_s
            assert abs(c.comm_s - w.comm_s) > bound + ROUNDING * w.comm_s
        else:
            assert (c.compute_s, c.comm_s, c.exposed_comm_s) == (w.compute_s, w.comm_s, w.exposed_comm_s)
        assert c.end_s == w.end_s


@pytest.mark.parametrize("case", ["gpt3-pp8-sp", "llama-pp4-interleaved"])
def test_what_is_left_out_is_every_interval_wholly_inside_the_cut(case):
    """`ordered_busy._inside` finds the intervals inside (a, b) by binary searches, relying on each stream's starts
    and ends rising as the engine records them: here every compute interval inside is left out, and only those."""
    _, cuts, whole, cut, _ = _measured(case)
    for (a, b), w, c in zip(cuts.tolist(), whole, cut, strict=True):
        starts, ends = w.busy.knots[0::2], w.busy.knots[1::2]
        inside = (a < starts) & (ends < b)
        assert np.all(np.diff(w.busy.knots) >= 0)
        assert len(c.busy.knots) == len(w.busy.knots) - 2 * int(inside.sum())


@pytest.mark.parametrize("case", ["gpt3-pp8-nosp", "llama-pp4-sp"])
def test_the_step_priced_with_the_cut_is_the_step_priced_without(case, monkeypatch):
    point = _point(case)
    workload = SymbolicGenerator().generate(point)
    found = schedule_steady(workload, point.system)
    spare = max(own[3] for own in _measured(case)[0])
    monkeypatch.setattr(steady, "spare_periods", lambda *_: 0)  # no spare periods: no cut, as before it
    whole = schedule_steady(workload, point.system)
    assert found is not None and whole is not None
    for c, w in zip(found.schedules, whole.schedules, strict=True):
        assert c.end_s == w.end_s and c.time_by_category == w.time_by_category
        for name in FIGURES:
            expected = getattr(w, name)
            assert abs(getattr(c, name) - expected) <= spare * 3 * TOLERANCE_S + ROUNDING * expected, name


@pytest.mark.parametrize("in_order", [True, False])
def test_a_periodic_timeline_cut_and_made_whole_by_hand(in_order):
    """Ten periods of 1 s (compute 0.1-0.6, communication 0.5-0.9 and 0.2-0.3): cut from 3 to 7, the seconds
    outside plus four windows are the whole timeline's; a stream out of order (left to `Busy.of`) alike."""
    period = np.arange(10.0)
    knots = np.ravel(np.column_stack((period + 0.1, period + 0.6)))
    starts = np.concatenate((period + 0.5, period + 0.2))
    ends = np.concatenate((period + 0.9, period + 0.3))
    if not in_order:
        starts[[0, 1]], ends[[0, 1]] = starts[[1, 0]], ends[[1, 0]]
    args = knots, np.array([[0, len(knots)]]), starts, ends, np.array([[0, 10, 20]])
    whole = ordered_busy(*args).busy(0)
    cut = ordered_busy(*args, np.array([[3.0, 7.0]])).busy(0)
    assert len(cut.knots) < len(whole.knots)
    window = whole.between(1.0, 2.0)
    for got, seconds, expected in zip(cut.totals, window, whole.totals, strict=True):
        assert got + 4 * seconds == pytest.approx(expected, rel=1e-12)
    assert cut.totals[0] == pytest.approx(whole.totals[0] - 4 * 0.5, rel=1e-12)
