"""A pipeline's steady state priced once: the step simulated with fewer micro-batches, its period added on.

With identical micro-batches every stage of a 1F1B pipeline settles into a state that repeats each period (one
micro-batch; a group of p for interleaved 1F1B): the same calls, shifted by the same time. A step with more
micro-batches only repeats that state more often, so its timeline is the shorter step's with `repeats` more
periods spliced into the steady stretch, and everything summed over the timeline grows by as many periods' worth.
The generator supplies the shorter step (`Workload.steady`); whether its timeline really is periodic is checked
here, on the simulated times, never assumed: every stage must repeat its calls with one and the same period over
a stretch holding every time the calls after it read (`_periods`), and its busy seconds over one period must recur
in the next.

Some 1F1B pipelines repeat only every few micro-batches: where a stage's sends queue behind each other on a slow
shared link, a delay travels round the pp stages and comes back every pp micro-batches (GPT-3 175B at tp 8, pp 16
without sp, on 1,024 H100s: every 16), and the shorter form is too short to show three such cycles. When the
shorter form's timeline fails the checks, the step's longer form (`SteadyForm.longer`, built only then) is
simulated and searched for the shortest period that divides its cycle and that every stage repeats with one
shared length. When that fails too, the caller simulates the whole step.

What the checks do not see is which transfer last used a shared network link (`plans.PlanOp` shares). Where
pipeline transfers shared a link with collectives or ring-attention sends, that state once cycled over pp
micro-batches while every call's times repeated each one, and the drain after the steady state depended on where
in that cycle it started (a step priced from a steady form of the other phase was off by up to 0.8%, Llama-3-8B on
two pipeline stages across nodes; 0.11%, Mixtral-8x7B at pp 4 with ep across nodes and ZeRO-2), so the generator
made the form a whole number of six periods shorter than the step. It was the engine's order (which side of a
transfer it reached first), which transfers' reservations (`engine._reserve`) took out of every time, and the
form is now only a whole number of periods shorter (`generators.symbolic.schedule.steady_microbatches`): with
every time fixed by the programs, a link's state follows the calls' times, which the checks read, so where it
cycles they do too (a delay round the pp loop), and the longer form prices the step.

Peak memory comes from the shorter step's timeline: a 1F1B stage holds at most p micro-batches' activations
however many it runs, so the peak is the same (the generator offers no shorter form where it is not).
"""

from collections.abc import Iterator
from dataclasses import dataclass, replace
from itertools import pairwise

import numpy as np
from numba import njit

from dse.system import SystemSpec
from dse.workload import Program, SteadyForm, Workload
from simulators.analytical.calls import call_array, memoised
from simulators.analytical.compiled_engine import CompiledScheduler
from simulators.analytical.engine import ClassSchedule
from simulators.analytical.engine_kernel import EngineTables
from simulators.analytical.ordered_busy import OrderedBusy
from simulators.analytical.steady_reads import Reads, reads, spans_two_periods

TOLERANCE_S = 1e-7
"""How far apart two times may be and still count as one period apart: repeats of one state a period apart add
the same durations to different times, so they can differ by a few roundings of those times."""


@dataclass(frozen=True, slots=True)
class SteadySchedules:
    """The extended schedules, and the programs their call times belong to (the shorter step's)."""

    schedules: list[ClassSchedule]
    programs: list[Program]


def schedule_steady(workload: Workload, system: SystemSpec) -> SteadySchedules | None:
    """The step's schedules from its shorter form, or from its longer form where the shorter one's timeline does
    not repeat; None when it has neither or neither timeline is periodic."""
    form = workload.steady
    if form is None or not SteadyForm.holds(workload.programs):
        return None
    simulated: dict[int, _Simulated] = {}
    for steady, periods in forms(form):
        if (found := _extended(workload, system, steady, periods, simulated)) is not None:
            return found
    return None


def forms(form: SteadyForm) -> Iterator[tuple[SteadyForm, list[int]]]:
    """The forms a step is tried on, in order, each with the periods tried on it: the shorter form at its period,
    then the longer form, built only when asked for, at every multiple of that period dividing its own, smallest
    first (the per-point path here and the batch path, `batch`, alike)."""
    yield form, [form.period]
    if (longer := form.longer()) is not None:
        steps = range(form.period, longer.period + 1, form.period)
        yield longer, [k for k in steps if longer.period % k == 0]


@dataclass(slots=True)
class _Simulated:
    """One form's programs driven by the compiled engine: their calls' times, which the period checks read, and
    their busy intervals, measured only once a period passes those checks: the shorter form of GPT-3 at tp 8
    without sp always fails them, and its busy intervals were measured for nothing. They are measured without the
    spare periods a period's checks find (`_cuts`), so kept with the cuts they had. The schedules are built once
    a period passes the window check too, extended (`_extend`)."""

    scheduler: CompiledScheduler
    tables: EngineTables
    measured: tuple[bytes, OrderedBusy] | None = None

    def times(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per run, its calls' starts and ends."""
        t, base = self.tables, self.tables.base.tolist()
        return [(t.call_start[a:b], t.call_end[a:b]) for a, b in pairwise(base)]

    def busy(self, cuts: np.ndarray | None) -> OrderedBusy:
        key = b"" if cuts is None else cuts.tobytes()
        if self.measured is None or self.measured[0] != key:
            self.measured = key, self.scheduler.busy(self.tables, cuts)
        return self.measured[1]


def _extended(
    workload: Workload,
    system: SystemSpec,
    form: SteadyForm,
    periods: list[int],
    simulated: dict[int, _Simulated],
) -> SteadySchedules | None:
    """The step from one form: its timeline simulated (once per programs: a longer form may run the shorter one's
    micro-batches), then extended by the first of `periods` (micro-batches, each dividing the form's period) that
    every stage repeats with one shared length."""
    if (run := simulated.get(id(form.programs))) is None:
        # A longer form runs the shorter one's blocks on the same system: its scheduler plans with the shorter
        # one's planner, whose plans it mostly asks for again (`CompiledScheduler.for_programs`).
        earlier = next(iter(simulated.values()), None)
        scheduler = (
            CompiledScheduler(replace(workload, programs=form.programs, steady=None), system)
            if earlier is None
            else earlier.scheduler.for_programs(form.programs)
        )
        run = simulated[id(form.programs)] = _Simulated(scheduler, scheduler.drive())
    read = reads(workload.blocks, form.programs)
    for period in periods:
        found = _periods(form.programs, run.tables, period, read)
        if found is None or not read.joined(*np.array([(*f[4], f[2]) for f in found]).T[:, :, None])[0]:
            continue
        shifts = [f[0] for f in found]
        if max(shifts) - min(shifts) > TOLERANCE_S:
            continue
        lo = _steady_starts(run.tables, found)
        busy = run.busy(_cuts(found, lo))
        if (windows := _windows(busy, found, lo)) is None:
            continue
        categories = _period_categories(run.tables, found)
        repeats = form.repeats * form.period // period
        return SteadySchedules(_extend(run, busy, found, windows, categories, repeats), form.programs)
    return None


Found = tuple[float, int, int, int, tuple[int, int]]
"""What `_periods` finds on a stage: (length, first, distance, spare periods, (lo, hi))."""


def _periods(programs: list[Program], tables: EngineTables, period: int, read: Reads) -> list[Found] | None:
    """Per stage of a form driven into `tables`, (the period's length, a call in the steady state, calls per
    period, periods its busy seconds surely recur beyond the two the window check reads, `spare_periods`, the
    steady run of calls [lo, hi)) if its calls' starts and ends show one; None if a stage's do not (one stage
    without it rules the period out). Every stage's run is found in one compiled call (`_steady_runs`), not one
    call per stage: a longer form tries several periods on 8 or 16 stages.

    A step with `period` more micro-batches has P more calls on the stage, P the calls of `period` micro-batches
    (`_twin_calls`). In the steady state each call recurs P calls later with the same block, the micro-batch
    `period` further on, and its start and end one period later; the steady run [lo, hi) is the longest run of
    calls that recur so, so calls lo .. hi + P - 1 (the checked calls) repeat a period apart. A step with R more
    periods is this one spliced at hi: its calls are these up to hi + P, then the checked calls' periodic
    continuation for R periods, then these from lo on moved by R periods and R times P calls. The three parts
    agree where they overlap, so the spliced timeline is the engine's for the longer step if every call's wait
    is met within one of them, given the longer step's calls follow the same rules per micro-batch (the
    generator's):
    - on its own stage, every call from hi on reads only calls from lo on (`Reads.within`), counting only inputs
      that can set its start: an input another input waits on never ends last, as every op reading a block's
      inputs waits for all of them (a drain backward's forward activations, waited on through its gradient);
    - across stages (`Reads.joined`, checked by the caller once every stage has its run): every call from hi on
      transfers with a call from its partner stage's lo on, and every call of the run's first period with a call
      before the partner's hi + P, so that each pair of transfers recurring a period apart has one pair among
      the checked calls of both stages (the rest are the continuation's) and no pair straddles a whole run.
    Warm-up and drain calls also recur at a period's length where a stage runs only forwards or only backwards,
    but at another distance (a drain backward's twin is the next backward, half a 1F1B period on), and a step with
    more micro-batches does not add those: the distance is what a period adds, not any at which calls recur. The
    run must also span two periods of calls (both checked in `Reads.holds`), so that three periods of the timeline
    repeat (`_windows` reads two).
    The call returned is one period into the run, away from the warm-up.

    What the checks do not see: a stream's previous op (the previous call's on every stream a period uses, within
    the run; a stream used after the run but not in it, as the last steps' reductions, last used before it) and
    shared links' state (which no longer cycles on its own: the module's docstring)."""
    distance, middle, twin, twin_ptr = _joined_twins(programs, period, read)
    start, end, base = tables.call_start, tables.call_end, tables.base
    key = ("steady.ruled_out_on", period)
    length, lo, hi, failed = _steady_runs(
        twin, twin_ptr, distance, middle, start, end, base, TOLERANCE_S, read.memo.get(key, 0)
    )
    if failed >= 0:
        read.memo[key] = failed
        return None
    stages = list(zip(distance.tolist(), lo.tolist(), hi.tolist(), length.tolist(), strict=True))
    for stage, (d, a, b, _) in enumerate(stages):
        if not read.holds(stage, a, b, d):
            return None
    spare = _spares(start, end, base, lo, hi, distance, length).tolist()
    return [(x, a + d, d, k, (a, b)) for (d, a, b, x), k in zip(stages, spare, strict=True)]


def _joined_twins(programs: list[Program], period: int, read: Reads) -> tuple[np.ndarray, ...]:
    """The stages' `_twins` at `period` joined, for `_steady_runs`: per stage P (-1 where none) and the middle,
    every stage's twin flags in turn and where each starts; kept with the form's `Reads` (its calls' facts)."""
    key = ("steady.twins", period)
    if (kept := read.memo.get(key)) is not None:
        return kept
    found = [memoised(program, key, lambda p=program: _twins(p, period)) for program in programs]
    distance = np.array([f[0] if f else -1 for f in found], dtype=np.intp)
    middle = np.array([f[2] if f else 0 for f in found], dtype=np.intp)
    flags = [f[1] if f else np.zeros(0, dtype=np.bool_) for f in found]
    twin_ptr = np.zeros(len(flags) + 1, dtype=np.intp)
    np.cumsum([len(f) for f in flags], out=twin_ptr[1:])
    joined = read.memo[key] = (distance, middle, np.concatenate(flags), twin_ptr)
    return joined


@njit(cache=True)
def _steady_runs(
    twin: np.ndarray,
    twin_ptr: np.ndarray,
    distance: np.ndarray,
    middle: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    base: np.ndarray,
    tolerance: float,
    first: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Per stage (its calls from base[s] on), the period's length (its middle call's start P calls on less its
    own) and its steady run [lo, hi) (`_longest_steady`), and the stage without one that spans two periods
    (`spans_two_periods`), -1 if every stage has one (whether each may be spliced is `Reads.holds`'s to say, the
    one place its rule is written). One such stage rules the period out, so the rest are not read (left at lo
    -1). The stages are read from `first` on, round to it: the one that ruled the period out on the form's last
    timeline (`_periods` keeps it with the form's calls), most often the one that does again, as the stage that
    does depends on the period far more than on the system. A longer form's shorter periods each fail on one
    stage (GPT-3 175B at tp 8, pp 16 without sp: periods 1, 2, 4 and 8 on stages 14, 13, 4 and 0, mostly by a
    run too short), so they cost a stage each, not up to every stage but one. Which stage is read first changes
    no figure: every stage's run and length are its own."""
    stages = len(distance)
    length = np.zeros(stages)
    lo = np.full(stages, -1, dtype=np.intp)
    hi = np.full(stages, -1, dtype=np.intp)
    for k in range(stages):
        s = (first + k) % stages
        if distance[s] < 0:
            return length, lo, hi, s
        own_start, own_end = start[base[s] : base[s + 1]], end[base[s] : base[s + 1]]
        length[s] = own_start[middle[s] + distance[s]] - own_start[middle[s]]
        flags = twin[twin_ptr[s] : twin_ptr[s + 1]]
        lo[s], hi[s] = _longest_steady(flags, own_start, own_end, distance[s], length[s], tolerance)
        if lo[s] < 0 or length[s] <= 0 or not spans_two_periods(lo[s], hi[s], distance[s]):
            return length, lo, hi, s
    return length, lo, hi, -1


@njit(cache=True)
def _spares(
    start: np.ndarray,
    end: np.ndarray,
    base: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    distance: np.ndarray,
    length: np.ndarray,
) -> np.ndarray:
    """`spare_periods` of every stage (its calls from base[s] on), in one call."""
    spare = np.zeros(len(lo), dtype=np.intp)
    for s in range(len(lo)):
        own_start, own_end = start[base[s] : base[s + 1]], end[base[s] : base[s + 1]]
        spare[s] = spare_periods(own_start, own_end, lo[s], hi[s], distance[s], length[s])
    return spare


def _steady_starts(t: EngineTables, found: list[Found]) -> np.ndarray:
    """Per stage, the start of the steady call `found` gives, which its windows start at (`_windows`)."""
    return t.call_start[t.base[:-1] + np.array([f[1] for f in found], dtype=np.intp)]


def _cuts(found: list[Found], lo: np.ndarray) -> np.ndarray | None:
    """Per stage, the (a, b) its busy seconds are measured without (`ordered_busy`): from the end of the
    two periods the window check reads to the end of its spare periods (a = b for none), or None where no stage
    has one. Each spare period is then added back as one window, as the step's further periods are (`_extend`).

    That assumes what the extension assumes, over a stretch of calls checked to repeat: each spare period's busy
    seconds are the window's. The window check lets the next period's figures differ from the window's by
    TOLERANCE_S each; with each spare period no further from it than that (and the hidden seconds, which the
    check sees only through communication and exposed, by twice that), each stage's figures differ from the
    whole measurement's by at most spare * 3 * TOLERANCE_S, and by rounding (tests/test_steady_cut.py)."""
    length, spare = np.array([f[0] for f in found]), np.array([f[3] for f in found], dtype=np.intp)
    a = lo + 2 * length  # as the window check's end (`intervals._windows`)
    cuts = np.stack((a, a + spare * length), axis=1)
    return cuts if (cuts[:, 0] < cuts[:, 1]).any() else None


@njit(cache=True)
def spare_periods(start: np.ndarray, end: np.ndarray, lo: int, hi: int, distance: int, length: float) -> int:
    """How many periods past the two the window check reads (from m0 = start[lo + distance] to a = m0 + 2 *
    length) the stage's busy intervals surely recur a period apart, a period to b = a + periods * length: the
    measurement may leave those out (`_cuts` here, `batch_steady.Period.cut` per system). Every interval of a call
    lies between its call's start and end (the engine widens them to each op it settles), and calls lo..hi recur
    as calls lo + distance .. hi + distance a period later, so the intervals in [m0 + length, b] are those in
    [m0, b - length] moved by a period if every call reaching into the latter is one of lo..hi and every one
    reaching into the former is one of their twins: calls before lo end by m0, those before lo + distance by m0 +
    length, those from hi on start no earlier than b - length, those from hi + distance on no earlier than b, with
    TOLERANCE_S to spare. 0 where none such is left after the stretch (the cut must keep the timeline's last
    end)."""
    n = len(start)
    if hi + distance >= n or not length > 0.0:
        return 0
    m0 = start[lo + distance]
    for c in range(lo + distance):
        if end[c] > (m0 if c < lo else m0 + length):
            return 0
    bound = np.inf
    for c in range(hi, n):
        bound = min(bound, start[c] if c >= hi + distance else start[c] + length)
    a = m0 + 2 * length
    periods = 0
    while a + (periods + 1) * length <= bound - TOLERANCE_S:
        periods += 1
    return periods


def _twins(program: Program, period: int) -> tuple[int, np.ndarray, int] | tuple[()]:
    """(P, whether each call recurs P calls later `period` micro-batches on, the middle of the longest run of
    such calls), or () if no micro-batch's calls recur at one distance: the calls' side of `_periods`, the same
    for every point of the program's shape (`_twin_calls`)."""
    distance, twin, middle = _twin_calls(call_array(program, "microbatch"), call_array(program, "block"), period)
    return () if distance < 0 else (int(distance), twin, int(middle))


@njit(cache=True)
def _twin_calls(microbatch: np.ndarray, block: np.ndarray, period: int) -> tuple[int, np.ndarray, int]:
    """`_twins` in one compiled pass, P -1 where there is none. P is the calls of `period` micro-batches, counted
    from the middle of the step outwards (the one before it first at each distance): the first group j..j +
    period - 1 whose calls number as many as the next group's. Every call that recurs P calls later with its
    block, `period` micro-batches on, is a twin, and the first longest run of twins gives the middle."""
    n = len(microbatch)
    count = 0
    for i in range(n):
        count = max(count, microbatch[i] + 1)
    ptr = np.zeros(count + 1, dtype=np.int64)  # where each micro-batch's calls start, counted in order
    for i in range(n):
        if microbatch[i] >= 0:
            ptr[microbatch[i] + 1] += 1
    for m in range(count):
        ptr[m + 1] += ptr[m]
    middle = max(0, count // 2 - period)
    for step in range(2 * count + 1):
        j = middle - (step + 1) // 2 if step % 2 else middle + step // 2
        if j < 0 or j + 2 * period > count:
            continue
        distance = ptr[j + period] - ptr[j]
        if distance == 0 or distance != ptr[j + 2 * period] - ptr[j + period]:
            continue
        twin = np.zeros(n - distance, dtype=np.bool_)
        for i in range(n - distance):
            twin[i] = (
                block[i] == block[i + distance]
                and microbatch[i] >= 0
                and microbatch[i + distance] == microbatch[i] + period
            )
        lo, hi = _first_longest(twin)
        if lo < 0:
            continue
        return distance, twin, (lo + hi) // 2
    return -1, np.zeros(0, dtype=np.bool_), 0


@njit(cache=True)
def _longest_steady(
    twin: np.ndarray, start: np.ndarray, end: np.ndarray, distance: int, length: float, tolerance: float
) -> tuple[int, int]:
    """[start, end) of the first longest run of calls that recur `distance` calls later with their start and end
    `length` later (within `tolerance`), among the `twin` calls; (-1, -1) if there is none. One pass, with the
    same float operations as the arrays' (end there - end here - length, in that order)."""
    steady = np.zeros(len(twin), dtype=np.bool_)
    for i in range(len(twin)):
        if twin[i]:
            shift = start[i + distance] - start[i]
            steady[i] = abs(shift - length) <= tolerance and abs(end[i + distance] - end[i] - length) <= tolerance
    return _first_longest(steady)


@njit(cache=True)
def _first_longest(flags: np.ndarray) -> tuple[int, int]:
    """[start, end) of the first longest run of True in flags; (-1, -1) if there is none."""
    best_lo, best_hi, run_lo = -1, -1, -1
    for i in range(len(flags) + 1):
        on = i < len(flags) and flags[i]
        if on and run_lo < 0:
            run_lo = i
        elif not on and run_lo >= 0:
            if i - run_lo > best_hi - best_lo:
                best_lo, best_hi = run_lo, i
            run_lo = -1
    return best_lo, best_hi


def _windows(busy: OrderedBusy, found: list[Found], lo: np.ndarray) -> np.ndarray | None:
    """Per stage, compute, communication and exposed-communication seconds in one period from its steady call's
    start (`lo`) on, if the next period has the same on every stage (within TOLERANCE_S each); every stage in one
    compiled call (`OrderedBusy.periods`)."""
    both = busy.periods(lo, np.array([f[0] for f in found]))
    first, second = both[:, :3], both[:, 3:]
    return None if (np.abs(first - second) > TOLERANCE_S).any() else first


def _period_categories(t: EngineTables, found: list[Found]) -> np.ndarray:
    """Per stage (row) and category (column, numbered as `EngineTables.category_time`), busy seconds of its calls
    in one period from the steady call `found` gives (as many as it gives a period): their plans' priced ops (each
    plan's category seconds as the kernel's tables `t` hold them, per call its plan's number), then their p2p
    transfers, each category's seconds added in that order, from 0.0 (as a dict's running sums were). Every stage
    in one compiled call (`_add_periods`)."""
    totals = np.zeros_like(t.category_time)
    first = np.array([f[1] for f in found], dtype=np.intp)
    calls = np.array([f[2] for f in found], dtype=np.intp)
    _add_periods(
        t.call_plan,
        t.base,
        first,
        calls,
        t.p_category_ptr,
        t.p_category,
        t.p_category_seconds,
        t.t_call,
        t.t_category,
        t.t_seconds,
        t.t_ptr,
        t.t_count,
        totals,
    )
    return totals


@njit(cache=True)
def _add_periods(
    call_plan: np.ndarray,
    base: np.ndarray,
    first: np.ndarray,
    calls: np.ndarray,
    ptr: np.ndarray,
    category: np.ndarray,
    seconds: np.ndarray,
    t_call: np.ndarray,
    t_category: np.ndarray,
    t_seconds: np.ndarray,
    t_ptr: np.ndarray,
    t_count: np.ndarray,
    totals: np.ndarray,
) -> None:
    """`_add_period` of every stage s (its calls first[s] .. first[s] + calls[s] - 1, counted from base[s]; its
    transfers t_ptr[s] .. t_ptr[s] + t_count[s] - 1) into totals[s]."""
    for s in range(len(first)):
        lo, a, b = base[s] + first[s], t_ptr[s], t_ptr[s] + t_count[s]
        _add_period(
            call_plan[lo : lo + calls[s]],
            first[s],
            ptr,
            category,
            seconds,
            t_call[a:b],
            t_category[a:b],
            t_seconds[a:b],
            totals[s],
        )


@njit(cache=True)
def _add_period(
    call_plan: np.ndarray,
    lo: int,
    ptr: np.ndarray,
    category: np.ndarray,
    seconds: np.ndarray,
    transfer_call: np.ndarray,
    transfer_category: np.ndarray,
    transfer_seconds: np.ndarray,
    totals: np.ndarray,
) -> None:
    """Adds into totals the category seconds of the plans of calls lo.. (`call_plan`, theirs in turn), call by call,
    then those of the transfers of those calls, in the order they settled."""
    for p in call_plan:
        for k in range(ptr[p], ptr[p + 1]):
            totals[category[k]] += seconds[k]
    hi = lo + len(call_plan)
    for k in range(len(transfer_call)):
        if lo <= transfer_call[k] < hi:
            totals[transfer_category[k]] += transfer_seconds[k]


def _extend(
    run: _Simulated,
    busy: OrderedBusy,
    found: list[Found],
    windows: np.ndarray,
    categories: np.ndarray,
    repeats: int,
) -> list[ClassSchedule]:
    """Per stage, its schedule with `repeats` more periods, its busy seconds with its spare periods (measured
    without, `_cuts`) too: its figures and its categories' seconds, each as its measured one plus as many
    periods' worth (the same float operations per stage as one at a time; a category without seconds in the
    period adds 0.0, which leaves its sum as it is), handed to `CompiledScheduler.classes`, so each schedule is
    built once."""
    length, spare = np.array([f[0] for f in found]), np.array([f[3] for f in found], dtype=np.intp)
    figures = np.empty_like(busy.totals)
    figures[:, :3] = busy.totals[:, :3] + (repeats + spare)[:, None] * windows
    figures[:, 3] = busy.totals[:, 3] + repeats * length
    return run.scheduler.classes(run.tables, figures, run.tables.category_time + repeats * categories)
