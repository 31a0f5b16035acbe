"""`steady` for many systems at once: a pipeline's period found on each system's timeline of the shorter step,
and added on as many times as the step has more micro-batches.

The checks are `steady`'s, made per system on arrays (systems as columns): every stage repeats its calls with one
and the same period for long enough, and its busy seconds over one period recur in the next. On a longer form
(`SteadyForm.longer`) several periods are tried on one timeline, and each system takes the first that passes, as
`steady._extended` does. A system that fails every check is reported, not extended: the caller prices it on a
longer form or the whole step.
"""

from dataclasses import dataclass, field, replace

import numpy as np
from numba import njit

from dse.workload import Program, SteadyForm
from simulators.analytical import batch_kernels
from simulators.analytical.batch_busy import Cut
from simulators.analytical.calls import memoised
from simulators.analytical.steady import TOLERANCE_S, _twins, spare_periods
from simulators.analytical.steady_reads import Reads


@dataclass(frozen=True, slots=True)
class StageArrays:
    """One rank class's shorter step on every system, as the period search and the extension read it."""

    program: Program
    call_start: np.ndarray
    call_end: np.ndarray
    """calls x systems."""
    busy: tuple[np.ndarray, np.ndarray, np.ndarray]
    """(compute, communication, exposed communication) seconds per system (`BusyMany.totals`)."""
    periods: "list[Period]"
    """Where the workload has a steady form, one per period tried (`extend`); else none."""
    plan_of_call: np.ndarray
    """Per call, its plan (an index into plan_categories)."""
    plan_categories: np.ndarray
    """plans x categories x systems: busy seconds per category of one call of each plan, p2p left out."""
    finite: bool
    """Whether plan_categories is finite throughout (`batch_durations.Priced.finite`)."""
    transfers: tuple[np.ndarray, np.ndarray, np.ndarray]
    """(call, category, seconds per system) of every p2p transfer."""


@dataclass(frozen=True, slots=True)
class Period:
    """One stage's period on each system (`steady._periods`) and its busy seconds over the first two periods from
    `first` on, (compute, communication, exposed communication) each: what `extend` checks and adds."""

    length: np.ndarray
    first: np.ndarray
    """A call one period into the steady state."""
    ok: np.ndarray
    """Whether the timeline shows a period."""
    lo: np.ndarray
    hi: np.ndarray
    """The steady run of calls [lo, hi), each recurring one period later (`steady._periods`)."""
    windows: list[tuple[np.ndarray, ...]] = field(default_factory=list)
    """Filled in once the busy intervals are measured at `moments` (`BusyMany.windows`)."""

    @classmethod
    def find(
        cls, program: Program, call_start: np.ndarray, call_end: np.ndarray, period: int, read: Reads, stage: int
    ) -> "Period":
        return cls(*_period(program, call_start, call_end, period, read, stage))

    def moments(self, call_start: np.ndarray) -> list[np.ndarray]:
        """The bounds of the two periods from `first` on, per system."""
        at = call_start[self.first, np.arange(call_start.shape[1])]
        return [at + k * self.length for k in range(3)]

    @classmethod
    def each(cls, found: "list[Period]", by: np.ndarray) -> "Period":
        """Per system, its period of `found` (one per period tried): found[by] (by: an index per system), shown
        nowhere where by is -1. Its windows are not picked. With one period tried (a shorter form), its arrays."""
        if len(found) == 1:
            only = found[0]
            return cls(only.length, only.first, only.ok & (by >= 0), only.lo, only.hi)
        columns, pick = np.arange(len(by)), np.maximum(by, 0)

        def picked(name: str) -> np.ndarray:
            return np.array([getattr(period, name) for period in found])[pick, columns]

        ok = picked("ok") & (by >= 0)
        return cls(picked("length"), picked("first"), ok, picked("lo"), picked("hi"))

    def cut(self, call_start: np.ndarray, call_end: np.ndarray, window: np.ndarray) -> Cut:
        """The steady stretch past the two periods `moments` bounds (they are moments `window` on, per system) that
        the busy figures may measure by the period (`batch_busy.Cut`), per system: from A = M0 + 2L to B = A + kL,
        k whole periods (none where the period is not shown), k as `steady.spare_periods` finds it on the system's
        calls, the rule the per-point path cuts by. The calls left out are a run of them by index, from the one
        after the last that starts before A to the first that ends after B (`Cut.calls`)."""
        systems = call_start.shape[1]
        start = call_start[self.first, np.arange(systems)] + 2 * self.length
        distance = self.first - self.lo
        repeats = _spare_each(call_start, call_end, self.lo, self.hi, distance, self.length, self.ok)
        end = start + repeats * self.length
        steady = self.lo, self.hi, distance, self.length
        calls = batch_kernels.calls_inside(call_start, call_end, start, end, repeats > 0, *steady, TOLERANCE_S)
        return Cut(window, repeats, end, calls)


@dataclass(frozen=True, slots=True)
class Extension:
    """What `repeats` more periods add to one rank class, per system."""

    end: np.ndarray
    compute: np.ndarray
    comm: np.ndarray
    exposed: np.ndarray
    categories: np.ndarray
    """categories x systems."""


def extend(form: SteadyForm, stages: list[StageArrays], periods: list[int]) -> tuple[list[Extension], np.ndarray]:
    """Per stage what the step's further periods add, and per system the index of the period it takes, -1 where
    its timeline is not periodic (there the extensions hold nothing). `periods`: the periods tried (micro-batches,
    each dividing the form's period), in order, as each stage's `StageArrays.periods` holds them; a system takes
    the first one that passes every check, as `steady._extended` does point by point."""
    systems = stages[0].call_start.shape[1]
    chosen = np.full(systems, -1)
    for index in range(len(periods)):
        found = [stage.periods[index] for stage in stages]
        windows = np.array([period.windows for period in found])  # stages x (two periods) x seconds x systems
        recur = (np.abs(windows[:, 0] - windows[:, 1]) <= TOLERANCE_S).all(axis=(0, 1))  # every stage's seconds
        chosen[(chosen < 0) & shown(found) & recur] = index
    taking = [np.flatnonzero(chosen == index) for index in range(len(periods))]  # the systems that take each
    extensions = []
    for stage in stages:
        categories = np.zeros((stage.plan_categories.shape[1], systems))
        end, compute, comm, exposed = (np.zeros(systems) for _ in range(4))
        for index, (period, columns) in enumerate(zip(periods, taking, strict=True)):
            if not len(columns):
                continue
            found = stage.periods[index]
            repeats = form.repeats * form.period // period
            once = found.windows[0]
            end[columns] = repeats * found.length[columns]
            compute[columns], comm[columns], exposed[columns] = (repeats * seconds[columns] for seconds in once)
            calls = _period_calls(stage.program, period)
            categories[:, columns] = repeats * _categories(stage, found.first, calls, columns)
        extensions.append(Extension(end=end, compute=compute, comm=comm, exposed=exposed, categories=categories))
    return extensions, chosen


def joined(found: list[list[Period]], read: Reads) -> list[list[Period]]:
    """found (per stage, one `Period` per period tried) without the systems whose runs the stages' transfers do
    not join (`Reads.joined`, as `steady._extended` checks them)."""
    for index in range(len(found[0])):
        lo, hi, first = (np.array([getattr(own[index], name) for own in found]) for name in ("lo", "hi", "first"))
        ok = read.joined(lo, hi, first - lo)
        for own in found:
            own[index] = replace(own[index], ok=own[index].ok & ok)
    return found


def first_shown(found: list[list[Period]]) -> np.ndarray:
    """Per system, the index of the first period tried that its timeline shows (`shown`; found: per stage, one
    `Period` per period tried), -1 where none is: the period it takes if that one's busy windows pass (`extend`)."""
    by = np.full(found[0][0].length.shape, -1)
    for index in range(len(found[0])):
        by[(by < 0) & shown([own[index] for own in found])] = index
    return by


def shown(found: list[Period]) -> np.ndarray:
    """Per system, whether every stage shows its period (one `Period` per stage, of one period tried) at one and
    the same length: `extend`'s checks before the busy windows, so that the systems failing them are known before
    any busy interval is measured (`batch`: they are priced again on a longer form)."""
    lengths = np.array([period.length for period in found])
    return np.logical_and.reduce([period.ok for period in found]) & (
        lengths.max(axis=0) - lengths.min(axis=0) <= TOLERANCE_S
    )


def _period_calls(program: Program, period: int) -> int:
    found = memoised(program, ("steady.twins", period), lambda: _twins(program, period))
    return found[0] if found else 0


def _period(
    program: Program, call_start: np.ndarray, call_end: np.ndarray, period: int, read: Reads, stage: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per system: the period's length, a call one period into the steady state, whether there is one, and the
    steady run of calls (`steady._periods`; `joined` checks the stages' transfers)."""
    systems = call_start.shape[1]
    found = memoised(program, ("steady.twins", period), lambda: _twins(program, period))
    if not found:
        nothing = np.zeros(systems, dtype=np.intp)
        return np.zeros(systems), nothing, np.zeros(systems, dtype=bool), nothing, nothing
    distance, twin, middle = found
    length, lo, hi = batch_kernels.longest_steady(twin, call_start, call_end, distance, middle, TOLERANCE_S)
    ok = (hi > lo) & (length > 0)
    first = lo + distance
    found_in = np.flatnonzero(ok)
    if len(found_in):  # most systems find the same window: each distinct one checked once
        span = call_start.shape[0] + 1  # a window [lo, hi) as one number, lo * span + hi: one flat unique
        windows, which = np.unique(lo[found_in] * span + hi[found_in], return_inverse=True)
        long_enough = [read.holds(stage, a, b, distance) for a, b in (divmod(w, span) for w in windows.tolist())]
        ok[found_in] = np.array(long_enough, dtype=bool)[which]
    return length, first, ok, lo, hi


def _categories(stage: StageArrays, first: np.ndarray, calls: int, columns: np.ndarray) -> np.ndarray:
    """categories x columns: busy seconds per category of the `calls` calls from `first` on, on the systems of
    `columns` (first: per system)."""
    call, category, seconds = stage.transfers
    plans = (stage.plan_of_call, stage.plan_categories, stage.finite)
    return _window_categories(*plans, first, calls, columns, call, category, seconds)


@njit(cache=True)
def _spare_each(
    call_start: np.ndarray,
    call_end: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    distance: np.ndarray,
    length: np.ndarray,
    ok: np.ndarray,
) -> np.ndarray:
    """Per system (call_start, call_end: calls x systems) that shows its period, `steady.spare_periods` on its own
    calls, read down its column; 0 elsewhere."""
    systems = call_start.shape[1]
    out = np.zeros(systems)
    for s in range(systems):
        if ok[s]:
            out[s] = spare_periods(call_start[:, s], call_end[:, s], lo[s], hi[s], distance[s], length[s])
    return out


@njit(cache=True)
def _window_categories(
    plan_of_call: np.ndarray,
    plan_categories: np.ndarray,
    finite: bool,
    first: np.ndarray,
    calls: int,
    columns: np.ndarray,
    call: np.ndarray,
    category: np.ndarray,
    seconds: np.ndarray,
) -> np.ndarray:
    """`_categories` per system in one pass, reading the chunk's arrays in place (no copy of plan_categories'
    columns, no transfers x systems temporaries): each plan's count in the window times its seconds, summed over
    the plans in order from 0.0 (as einsum sums them on these layouts), then every p2p transfer added in order, 0.0
    for one outside the window (as `batch_kernels.add_rows` added them).

    Each sum's additions are those, in that order, but made a plan (then a transfer) at a time over every system,
    reading the arrays along their systems, in memory order; plans are counted once per distinct window (most
    systems share one). Adding 0.0 leaves a sum as it is (a sum that starts from 0.0 and adds products and
    seconds is never -0.0), so a transfer outside a system's window is skipped, and so is a plan no window runs
    (most of the tape's plans: the other stages') where plan_categories is `finite` (0.0 x inf is NaN)."""
    plans, categories, systems = plan_categories.shape[0], plan_categories.shape[1], len(columns)
    starts = first[columns]
    distinct = np.unique(starts)
    window = np.searchsorted(distinct, starts)
    count = np.zeros((len(distinct), plans))
    for w in range(len(distinct)):
        for i in range(distinct[w], min(distinct[w] + calls, len(plan_of_call))):
            count[w, plan_of_call[i]] += 1.0
    out = np.zeros((categories, systems))
    for p in range(plans):
        if finite and not count[:, p].any():
            continue
        for c in range(categories):
            for j in range(systems):
                out[c, j] += count[window[j], p] * plan_categories[p, c, columns[j]]
    for k in range(len(call)):
        if systems == 0 or not distinct[0] <= call[k] < distinct[-1] + calls:
            continue
        for j in range(systems):
            if starts[j] <= call[k] < starts[j] + calls:
                out[category[k], j] += seconds[k, columns[j]]
    return out
