"""The batch path's steady cut (`batch_busy.Cut`): the busy totals of a steady form measured without the intervals
of k repeated periods and corrected by k windows equal a full measurement within the documented bound, k * 3 *
TOLERANCE_S per figure, on real GPT-3 and Llama points; intervals really are left out, and the correction is what
makes the totals right."""

import random
from itertools import pairwise

import numpy as np
import pytest

from generators.symbolic import SymbolicGenerator
from simulators.analytical import batch_busy, batch_kernels
from simulators.analytical.batch import price_many
from simulators.analytical.steady import TOLERANCE_S
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
    seen = {"cut": 0, "needed": 0, "dropped": 0}

    def both(cls, values, durations, spans, moments, blocks, wanted=None, cut=None):
        full = measured(cls, values, durations, spans, moments, blocks, wanted, None)
        if cut is None:
            return full
        got = measured(cls, values, durations, spans, moments, blocks, wanted, cut)
        uncorrected = measured(cls, values, durations, spans, moments, blocks, wanted, _Uncorrected(cut))
        assert np.array_equal(full.covered, got.covered)  # nothing before A is left out
        shown = np.ones(values.shape[1], dtype=bool) if wanted is None else wanted.copy()
        covered = full.covered[cut.window : cut.window + 3]
        for q in range(3):
            shown &= np.abs((covered[1, q] - covered[0, q]) - (covered[2, q] - covered[1, q])) <= TOLERANCE_S
        bound = cut.repeats * 3 * TOLERANCE_S + 1e-12
        for a, b, c in zip(full.totals, got.totals, uncorrected.totals, strict=True):
            assert np.all(np.abs(a - b)[shown] <= bound[shown])
            seen["needed"] += int(np.sum((np.abs(a - c) > bound)[shown & (cut.repeats > 0)]))
        seen["cut"] += int(np.sum(cut.repeats[shown] > 0))
        seen["dropped"] += _dropped(values, durations, spans, moments[cut.window + 2], cut, blocks, wanted)
        return got

    monkeypatch.setattr(batch_busy.BusyMany, "of", classmethod(both))
    point = make_point(**case, system=NODES)
    price_many(SymbolicGenerator().generate(point), _systems(case, 8))
    assert seen["cut"] > 0
    assert seen["needed"] > 0
    assert seen["dropped"] > 0


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
