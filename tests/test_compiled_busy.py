"""The compiled scheduler's busy intervals (`ordered_busy`) are `Busy.of`'s to the bit: every field, the
totals and the last end, on timelines recorded in order (compute on one stream, communication in order per
stream), on timelines that are not (left to `Busy.of`), and on every class of the fast path's test cases."""

import random
from dataclasses import replace
from itertools import pairwise

import numpy as np
import pytest

from generators.symbolic import SymbolicGenerator
from simulators.analytical import engine_kernel as kernel
from simulators.analytical import intervals
from simulators.analytical.compiled_engine import CompiledScheduler
from simulators.analytical.intervals import Busy, pairwise_sum
from simulators.analytical.ordered_busy import _inside, _ordered, ordered_busy
from tests.helpers import make_point
from tests.test_analytical_fastpath import CASES

FIELDS = ("knots", "done", "comm_starts", "comm_ends", "hidden")


def _same(a: Busy, b: Busy) -> bool:
    """Every field equal to the bit (arrays compared as their bytes, so -0.0 and nan count too)."""
    arrays = all(np.array_equal(getattr(a, f).view(np.int64), getattr(b, f).view(np.int64)) for f in FIELDS)
    return arrays and a.totals == b.totals


def _reference(knots: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[Busy, float]:
    latest = max(float(knots[1::2].max(initial=0.0)), float(ends.max(initial=0.0)))
    return Busy.of(knots[0::2], knots[1::2], starts, ends), latest


def _stream(rng: random.Random, n: int, t: float, grid: float) -> list[tuple[float, float]]:
    """n intervals of one in-order stream: back to back or gapped, some of no length; on a coarse grid (so that
    streams start together and touch each other's ends) or not."""
    out = []
    for _ in range(n):
        t += rng.choice([0.0, 0.0, rng.uniform(0, 2)])
        length = rng.choice([0.0, rng.uniform(0, 3)])
        if grid:
            t, length = round(t / grid) * grid, round(length / grid) * grid
        out.append((t, t + length))
        t += length
    return out


def _one(knots: np.ndarray, starts: np.ndarray, ends: np.ndarray, ptr: np.ndarray) -> tuple[Busy, float]:
    """`ordered_busy` of one timeline."""
    [found] = ordered_busy(knots, np.array([[0, len(knots)]]), starts, ends, np.asarray(ptr)[None, :]).each()
    return found


def _in_order(knots: np.ndarray, starts: np.ndarray, ends: np.ndarray, ptr: np.ndarray) -> bool:
    """Whether the pass prices the timeline itself (not leaving it to Busy.of)."""
    *_, counts, _ = _ordered(
        knots, np.array([[0, len(knots)]]), starts, ends, np.asarray(ptr)[None, :], np.zeros((1, 2))
    )
    return bool(counts[0] >= 0)


def _timeline(rng: random.Random) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(knots, comm starts, comm ends, stream_ptr) of a timeline as the compiled scheduler records it."""
    grid = rng.choice([0.0, 0.5])
    compute = _stream(rng, rng.randint(0, 40), 0.0, grid)
    streams = [_stream(rng, rng.randint(0, 25), rng.uniform(0, 5), grid) for _ in range(rng.randint(0, 5))]
    knots = np.array([x for pair in compute for x in pair], dtype=float)
    comm = [pair for own in streams for pair in own]
    ptr = np.cumsum([0] + [len(own) for own in streams])
    return knots, np.array([s for s, _ in comm], dtype=float), np.array([e for _, e in comm], dtype=float), ptr


@pytest.mark.parametrize("n", [*range(0, 300), 1000, 1031, 4096, 10_007, 65_537])
def test_pairwise_sum_is_numpys(n):
    rng = np.random.default_rng(n)
    values = rng.random(n) * 10.0 ** rng.integers(-9, 9, n)
    assert 0.0 + pairwise_sum(values) == values.sum()


@pytest.mark.parametrize("seed", range(200))
def test_a_timeline_in_order_prices_as_busy_of(seed):
    knots, starts, ends, ptr = _timeline(random.Random(seed))
    assert _in_order(knots, starts, ends, ptr)  # priced by the pass, not left to Busy.of
    got, latest = _one(knots, starts, ends, ptr)
    want, want_latest = _reference(knots, starts, ends)
    assert _same(got, want) and latest == want_latest
    assert got.knots.base is knots  # a view, not a copy


@pytest.mark.parametrize("seed", range(50))
def test_a_timeline_out_of_order_is_left_to_busy_of(seed):
    """A stream whose intervals do not rise, or compute intervals that overlap: the pass declines, Busy.of
    prices them, with the same result as from the intervals in any order."""
    rng = random.Random(seed)
    knots, starts, ends, ptr = _timeline(rng)
    if len(starts) > 1 and rng.random() < 0.5:
        order = rng.sample(range(len(starts)), len(starts))
        starts, ends = starts[order], ends[order]
    elif len(knots) > 2:
        knots = knots.copy()
        knots[2] = knots[1] - 1.0  # the second interval starts before the first ends
    got, latest = _one(knots, starts, ends, ptr)
    want, want_latest = _reference(knots, starts, ends)
    assert _same(got, want) and latest == want_latest


def _laid_out(rng: random.Random, lines: list) -> tuple[tuple[np.ndarray, ...], list, list]:
    """`ordered_busy`'s arguments for `_timeline`s laid out in turn (compute with room to spare after each, as the
    scheduler leaves it), some streams reversed (out of order), and each timeline's communication starts and ends."""
    streams = max(len(ptr) for *_, ptr in lines)
    knots, starts, ends, knot_ptr, stream_ptr = [], [], [], [], []
    for k, s, e, ptr in lines:
        if len(s) > 1 and rng.random() < 0.3:
            s, e = s[::-1].copy(), e[::-1].copy()
        at = sum(map(len, knots))
        knots += [k, np.full(2 * rng.randint(0, 2), -1.0)]
        knot_ptr.append((at, at + len(k)))
        stream_ptr.append(sum(map(len, starts)) + np.pad(ptr, (0, streams - len(ptr)), mode="edge"))
        starts.append(s)
        ends.append(e)
    joined = np.concatenate(knots), np.array(knot_ptr), np.concatenate(starts), np.concatenate(ends)
    return (*joined, np.array(stream_ptr)), starts, ends


@pytest.mark.parametrize("seed", range(30))
def test_timelines_priced_in_one_call_are_each_busy_of(seed):
    """Several timelines laid out in turn (compute with room to spare after each, as the scheduler leaves it),
    some out of order: each is priced as alone."""
    rng = random.Random(seed)
    lines = [_timeline(rng) for _ in range(rng.randint(1, 6))]
    args, starts, ends = _laid_out(rng, lines)
    measured = ordered_busy(*args)
    got = measured.each()
    for (busy, latest), k, s, e in zip(got, [x[0] for x in lines], starts, ends, strict=True):
        want, want_latest = _reference(k, s, e)
        assert _same(busy, want) and latest == want_latest
    # every timeline's windows in one call are each Busy's own, to the bit (those left to Busy.of too)
    lo = np.array([rng.uniform(-1, 30) for _ in lines])
    shift = np.array([rng.choice([0.0, rng.uniform(0, 10)]) for _ in lines])
    windows = measured.periods(lo, shift)
    for r, (busy, _) in enumerate(got):
        first, second = busy.periods(float(lo[r]), float(shift[r]))
        assert np.array_equal(windows[r].view(np.int64), np.array([*first, *second]).view(np.int64))


def test_the_pass_declines_what_it_cannot_price_in_order():
    knots = np.array([0.0, 2.0, 1.0, 3.0])  # overlapping compute
    rising = np.array([0.0, 1.0]), np.array([0.5, 2.0]), np.array([0, 2])
    assert not _in_order(knots, *rising)
    knots = np.array([0.0, 1.0, 1.0, 3.0])
    assert _in_order(knots, *rising)
    assert not _in_order(knots, np.array([1.0, 0.0]), np.array([2.0, 0.5]), np.array([0, 2]))
    assert _in_order(knots, np.array([1.0, 0.0]), np.array([2.0, 0.5]), np.array([0, 1, 2]))  # two streams
    assert not _in_order(knots, np.array([0.0, 1.0]), np.array([np.nan, 2.0]), np.array([0, 2]))


class _Recording(CompiledScheduler):
    """Keeps the tables the kernel filled."""

    def schedules(self, t: kernel.EngineTables):
        self.tables = t
        return super().schedules(t)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_class_busy_is_busy_of_its_intervals(case):
    point = make_point(**CASES[case])
    workload = SymbolicGenerator().generate(point)
    scheduler = _Recording(workload, point.system)
    schedules = scheduler.run()
    t = scheduler.tables
    streams = len(scheduler._planner.streams)
    for r, sched in enumerate(schedules):
        c0, c1 = 2 * t.compute_ptr[r], 2 * (t.compute_ptr[r] + t.compute_count[r])
        m0, m1 = t.comm_ptr[r * streams], t.comm_ptr[(r + 1) * streams]
        want, latest = _reference(t.compute_knots[c0:c1], t.comm_starts[m0:m1], t.comm_ends[m0:m1])
        assert sched.busy is not None and _same(sched.busy, want)
        assert (sched.end_s, sched.compute_s, sched.comm_s, sched.exposed_comm_s) == (latest, *want.totals)


def _outside_cut(starts: np.ndarray, ends: np.ndarray, a: float, b: float) -> np.ndarray:
    """Which of a stream's intervals are kept with the cut (a, b): all but those `_inside` finds."""
    keep = np.ones(len(starts), dtype=bool)
    if a < b:
        i0, i1 = _inside(starts, ends, a, b)
        keep[i0:i1] = False
    return keep


@pytest.mark.parametrize("seed", range(60))
def test_a_cut_stepped_over_in_place_prices_as_the_timeline_laid_out_without_it(seed):
    """With cuts, each timeline prices as its intervals less those `_inside` its cut finds, laid out anew (as they
    were copied once): its Busy to the bit, its totals those outside the cut as `_outside` takes them from that
    Busy, and its windows, those ending at the cut's start (read off what `_outside` read there) too."""
    rng = random.Random(seed)
    lines = [_timeline(rng) for _ in range(rng.randint(1, 6))]
    args, starts, ends = _laid_out(rng, lines)
    lo = np.array([rng.uniform(-2, 50) for _ in lines])
    shift = np.array([rng.choice([0.0, rng.uniform(0, 10)]) for _ in lines])
    a = lo + 2 * shift  # as `steady` ends the windows at the cut's start
    cuts = np.stack((a, a + [rng.choice([-1.0, 0.0, rng.uniform(0, 30), 1e3]) for _ in lines]), axis=1)
    measured = ordered_busy(*args, cuts)
    windows = measured.periods(lo, shift)
    for r, ((k, _, _, ptr), s, e, (a, b)) in enumerate(zip(lines, starts, ends, cuts.tolist(), strict=True)):
        compute = np.repeat(_outside_cut(k[0::2], k[1::2], a, b), 2)
        comm = np.concatenate([np.ones(0, dtype=bool)] + [_outside_cut(s[p:q], e[p:q], a, b) for p, q in pairwise(ptr)])
        kept_ptr = np.cumsum([0] + [int(comm[p:q].sum()) for p, q in pairwise(ptr)])
        want, want_latest = _one(k[compute], s[comm], e[comm], kept_ptr)
        got, latest = measured.busy(r), float(measured.totals[r, 3])
        assert _same(replace(got, totals=want.totals), want) and latest == want_latest
        fields = want.knots, want.done, want.comm_starts, want.comm_ends, want.hidden
        expected = want.totals
        if a < b:
            at_a, at_b = (intervals._before(*fields, t) for t in (a, b))
            covered = 0.0 + pairwise_sum(want.hidden) if len(want.knots) else 0.0
            comm_s = want.totals[1] - (at_b[1] - at_a[1])
            exposed = comm_s - (covered - (at_b[2] - at_a[2]))
            expected = (want.totals[0] - (at_b[0] - at_a[0]), comm_s, exposed if exposed > 0.0 else 0.0)
        assert got.totals == expected
        first, second = want.periods(float(lo[r]), float(shift[r]))
        assert np.array_equal(windows[r].view(np.int64), np.array([*first, *second]).view(np.int64))
