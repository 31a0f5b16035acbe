"""The batch path's steady cut (`batch_busy.Cut`): the busy totals of a steady form measured without the intervals
of k repeated periods and corrected by k windows equal a full measurement within the documented bound, k * 3 *
TOLERANCE_S per figure, on real GPT-3 and Llama points, on the shorter form (a longer form of 4p micro-batches
has no spare cycle to cut on systems that repeat every p); intervals really are left out, and the correction is
what makes the totals right. A system whose windows fail on the period it was cut by is measured again uncut
where a later period may pass."""

import random
from dataclasses import asdict
from itertools import pairwise

import numpy as np
import pytest

from generators.symbolic import SymbolicGenerator
from simulators.analytical import batch, batch_busy, batch_kernels, batch_steady
from simulators.analytical.batch import price_many
from simulators.analytical.steady import TOLERANCE_S, forms
from tests.helpers import make_point

GPT3 = {"base": "gpt3-175b", "flash_attention": False, "dropout": True}
NODES = {"base": "dgx-h100", "network": {1: {"npus": 8}}}
CASES = {
    "gpt3-tp8-pp4-sp-on": dict(model=GPT3, tp=8, pp=4, dp=2, sp=True, global_batch=64, seq_len=2048),
    "gpt3-tp8-pp8-sp-off": dict(model=GPT3, tp=8, pp=8, dp=1, sp=False, global_batch=64, seq_len=2048),
    "llama-tp2-pp4-interleaved": dict(
        model="llama3-8b", tp=2, pp=4, dp=2, pp_schedule="interleaved", virtual_stages=2, global_batch=96
    ),
}


LONGER = {"gpt3-tp8-pp8-sp-off"}
"""The cases whose systems go on to the longer form (7 of the 8: its sends queue on the slow links). It holds 4p
micro-batches and what the step has over a multiple of p, so a system that repeats every p (all 7 here) has no
spare cycle beside the warm-up, the two cycles its windows read and the drain: nothing of it is cut."""


def _systems(case: dict, count: int) -> list:
    rng = random.Random(7)
    return [
        make_point(
            **case,
            system=NODES,
            overrides={
                "system.accelerator.peak_tflops.bf16": rng.uniform(400, 2000),
                "system.accelerator.hbm_bandwidth_GBps": rng.uniform(2000, 8000),
                "system.network.0.bandwidth_GBps": rng.uniform(100, 900),
                "system.network.1.bandwidth_GBps": rng.uniform(25, 100),
            },
        ).system
        for _ in range(count)
    ]


@pytest.mark.parametrize("name", sorted(CASES))
def test_cut_totals_within_bound(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every cut measurement against the full one of the same chunk, on the systems whose windows pass the check
    (the others are priced again on a longer form)."""
    case = CASES[name]
    measured = batch_busy.BusyMany.of.__func__  # type: ignore[attr-defined]
    seen = {form: {"cut": 0, "needed": 0, "dropped": 0} for form in ("shorter", "longer")}

    def both(cls, values, durations, spans, moments, blocks, wanted=None, cut=None):
        full = measured(cls, values, durations, spans, moments, blocks, wanted, None)
        if cut is None:
            return full
        got = measured(cls, values, durations, spans, moments, blocks, wanted, cut)
        uncorrected = measured(cls, values, durations, spans, moments, blocks, wanted, _Uncorrected(cut))
        covered = _own(full.covered, cut.window)  # each system's moments M0, M0 + L and A
        assert np.array_equal(covered, _own(got.covered, cut.window))  # nothing before A is left out
        own = seen["longer" if len(moments) > 3 else "shorter"]  # the longer form tries several periods
        shown = np.ones(values.shape[1], dtype=bool) if wanted is None else wanted.copy()
        for q in range(3):
            shown &= np.abs((covered[1, q] - covered[0, q]) - (covered[2, q] - covered[1, q])) <= TOLERANCE_S
        bound = cut.repeats * 3 * TOLERANCE_S + 1e-12
        for a, b, c in zip(full.totals, got.totals, uncorrected.totals, strict=True):
            assert np.all(np.abs(a - b)[shown] <= bound[shown])
            own["needed"] += int(np.sum((np.abs(a - c) > bound)[shown & (cut.repeats > 0)]))
        own["cut"] += int(np.sum(cut.repeats[shown] > 0))
        own["dropped"] += _dropped(
            values, durations, spans, _own(np.array(moments), cut.window)[2], cut, blocks, wanted
        )
        return got

    monkeypatch.setattr(batch_busy.BusyMany, "of", classmethod(both))
    point = make_point(**case, system=NODES)
    price_many(SymbolicGenerator().generate(point), _systems(case, 8))
    assert seen["shorter"]["cut"] > 0
    assert seen["shorter"]["needed"] > 0
    assert seen["shorter"]["dropped"] > 0
    if name in LONGER:
        assert seen["longer"]["cut"] == 0 and seen["longer"]["dropped"] == 0


def test_a_system_whose_windows_fail_on_the_period_it_was_cut_by_is_measured_again_uncut(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The longer form's last period tried twice, so that a later period than the one each system is cut by can
    pass; each chunk's first `extend` reports every system cut on it as failing that period's windows, and each
    is measured again uncut: its figures are those of the same step priced with nothing cut anywhere, to the bit.
    Without the second measurement it would take the whole step."""
    case = CASES["gpt3-tp8-pp8-sp-off"]
    workload, systems = SymbolicGenerator().generate(make_point(**case, system=NODES)), _systems(case, 8)
    longer: set[int] = set()  # the systems priced on the longer form
    evaluate, extend, tried = batch._evaluate, batch.extend, set()

    def spy(evaluated, priced, timings, room, form=None, periods=()):
        if len(periods) > 1:
            longer.update(id(system) for system in priced)
        return evaluate(evaluated, priced, timings, room, form, periods)

    def failing_first(form, stages, periods):
        extensions, chosen = extend(form, stages, periods)
        if len(periods) > 1 and id(stages[0].call_start) not in tried:
            tried.add(id(stages[0].call_start))
            by = batch_steady.first_shown([stage.periods for stage in stages])
            chosen = np.where((by >= 0) & (by < len(periods) - 1), -1, chosen)
        return extensions, chosen

    def twice_the_last(form):
        for steady, periods in forms(form):
            yield steady, [*periods, periods[-1]] if len(periods) > 1 else periods

    monkeypatch.setattr(batch, "forms", twice_the_last)
    monkeypatch.setattr(batch, "_evaluate", spy)
    monkeypatch.setattr(batch, "extend", failing_first)
    priced = price_many(workload, systems)
    monkeypatch.setattr(batch, "extend", extend)
    monkeypatch.setattr(batch_steady, "_spare_each", lambda *args: np.zeros(args[0].shape[1]))
    uncut = price_many(workload, systems)
    assert tried and len(longer) == 7
    for system, got, expected in zip(systems, priced, uncut, strict=True):
        if id(system) in longer:
            assert asdict(got) == asdict(expected)


def _own(moments: np.ndarray, window: np.ndarray) -> np.ndarray:
    """Of moments (moments x ... x systems), each system's three from its own window on: 3 x ... x systems."""
    columns = np.arange(moments.shape[-1])
    return np.stack([moments[window + k, ..., columns].T for k in range(3)])


def _dropped(values, durations, spans, start, cut, blocks, wanted) -> int:
    """How many spans the kernel leaves out of the blocks (`batch_kernels._common` and `_kept`), checking that each
    lies inside [A, B] (start: A) on every wanted system of its block, as the correction needs."""
    chosen = np.ones(values.shape[1], dtype=bool) if wanted is None else wanted
    dropped = 0
    for lo, hi in pairwise(blocks.tolist()):
        first, last = batch_kernels._common(cut.calls, lo, hi, chosen)
        at = np.arange(lo, hi)[chosen[lo:hi]]
        for rows, calls in ((spans.compute, spans.compute_calls), (spans.comm, spans.comm_calls)):
            starts = np.flatnonzero((calls[0] >= first) & (calls[1] < last))
            ends = np.flatnonzero((calls[-2] >= first) & (calls[-1] < last))
            assert len(starts) == len(ends) == rows.shape[1] - batch_kernels._kept(rows, calls, first, last).shape[1]
            begun = values[rows[0, starts][:, None], at] - durations[rows[1, starts][:, None], at]
            assert np.all(begun >= start[at] - 1e-12)
            assert np.all(values[rows[2, ends][:, None], at] <= cut.end[at] + 1e-12)
            dropped += len(starts)
    return dropped


class _Uncorrected:
    """A cut whose totals are left uncorrected: its intervals are left out as the cut's are, but every k is 0 to
    the correction (the kernel is handed the calls left out through `calls`, and B through `end`)."""

    def __init__(self, cut: batch_busy.Cut) -> None:
        self.window, self.end, self.calls, self._repeats = cut.window, cut.end, cut.calls, cut.repeats

    @property
    def repeats(self) -> np.ndarray:
        return np.zeros_like(self._repeats)
