"""Many systems priced at once for one workload: the reference schedule's tape (`tape`) evaluated with numpy.

A hardware-planning sweep prices one generated workload (one parallel configuration) on many systems: HBM size,
accelerator FLOP/s and bandwidth, link bandwidths and latencies. The ops, their FLOPs and bytes and their order are
the same on every one; only durations differ. `price_many` records the reference scheduler's decisions once per
network shape as a tape (`tape.record`), prices every op's duration per distinct accelerator and per distinct
network (the per-point code, `pricing.BlockPricer`, run once per distinct one), and evaluates the tape level by
level with a column per system. The figures are those `AnalyticalCostModel(exact=True)` gives point by point
(`tests/test_analytical_batch.py` pins the agreement); the default fast path agrees with that within its 1%.

What depends on times, and how each is handled:
- The scheduler's decisions do not (see `tape`): stream order, dependencies, the programs' round-robin, parking
  on an unmatched p2p op and first-in-first-out matching are fixed by the workload and the network's shape
  (dimensions' sizes, which decide which links a collective and a transfer occupy). Systems of different shapes
  get a tape each.
- Link sharing (`plans.PlanOp` shares, `engine._rendezvous`): a collective queues behind what holds a dimension,
  which is a max; a transfer next to a collective is stretched by min(s, busy - start), which the tape carries
  as such. Neither chooses between branches.
- Communication time and its exposed share are unions of intervals, which depend on the intervals' order in time.
  They are computed in the order of the first system of a batch, and each system is checked to keep that order
  (every start no earlier than the one before, every point where compute is read inside the same compute
  interval); a system that does not is measured on its own times by `intervals.Busy`, the per-point code.
- Peak memory is a sweep over allocation and free events in time order: a system whose events keep the first
  system's order has its peak and breakdown; another is swept on its own times (`memory.peak_memory`).
- What the per-point default path decides on times (the fast path's clamped segment keys, rounded to a
  nanosecond; `steady`'s periodicity check) is not part of the reference schedule and is not reproduced: the
  batch gives the reference figures, which the fast path approximates within 1%.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dse.errors import InfeasibleError
from dse.interfaces import ClassResult, SimResult
from dse.system import SystemSpec
from dse.workload import OpKind, Workload
from simulators.analytical.intervals import Busy
from simulators.analytical.memory import Liveness, with_runtime_reserve
from simulators.analytical.pricing import BlockPricer
from simulators.analytical.tape import INF, MAX_ADD, SHARED, Tape, record

MEMORY_BUDGET_BYTES = 256 * 2**20
"""Node values kept at once: systems are evaluated in chunks whose values fit (about 40 for Llama-3-70B's step)."""

_TIMELESS = frozenset({"name", "hbm_GiB", "runtime_reserve_GiB", "fragmentation", "overlap_slowdown", "tdp_W"})
"""Accelerator fields no op duration reads: systems that differ only in them share one schedule."""


def price_many(workload: Workload, systems: Sequence[SystemSpec]) -> list[SimResult | InfeasibleError]:
    """The step on each system, as `AnalyticalCostModel(exact=True).simulate` prices it one by one (without the
    timeline); a system with fewer NPUs than the workload has ranks gets the InfeasibleError the simulation raises.
    """
    out: list[SimResult | InfeasibleError | None] = [None] * len(systems)
    shapes: dict[tuple, list[int]] = {}
    for index, system in enumerate(systems):
        if workload.layout.world > system.npus:
            out[index] = InfeasibleError(
                f"the workload has {workload.layout.world} ranks but system '{system.name}' has "
                f"{system.npus} NPUs; enlarge system.network or lower the parallel degrees"
            )
        else:
            shapes.setdefault(_shape(system), []).append(index)
    for members in shapes.values():
        chosen = [systems[i] for i in members]
        for index, result in zip(members, _price_shape(workload, chosen), strict=True):
            out[index] = result
    return out  # type: ignore[return-value]


def _shape(system: SystemSpec) -> tuple:
    """What the scheduler's decisions depend on besides the workload: which dimensions a group or a send spans."""
    return tuple(dim.npus for dim in system.network)


def _timing_key(system: SystemSpec) -> tuple[str, str]:
    """What every op duration depends on: the accelerator's speeds and the network."""
    accelerator = system.accelerator.model_dump_json(exclude=set(_TIMELESS))
    return accelerator, "[" + ",".join(dim.model_dump_json() for dim in system.network) + "]"


@dataclass(slots=True)
class _Timelines:
    """One rank class's figures on many systems (arrays over systems), before the accelerator's corrections."""

    end: np.ndarray
    compute: np.ndarray
    comm: np.ndarray
    exposed: np.ndarray
    categories: dict[str, np.ndarray]
    peak: list[tuple[float, dict[str, float]]]


def _price_shape(workload: Workload, systems: list[SystemSpec]) -> list[SimResult]:
    """Systems of one network shape: one tape, evaluated once per distinct timing, in chunks."""
    tape = record(workload, systems[0])
    timings: dict[tuple[str, str], int] = {}
    timing_of = [timings.setdefault(_timing_key(s), len(timings)) for s in systems]
    distinct = [systems[timing_of.index(t)] for t in range(len(timings))]
    levels = _Levels.of(tape)
    liveness = [Liveness.of(program, workload.blocks) for program in workload.programs]
    chunk = max(1, MEMORY_BUDGET_BYTES // (8 * len(tape.kind)))
    per_class: list[list[_Timelines]] = []
    for lo in range(0, len(distinct), chunk):
        part = distinct[lo : lo + chunk]
        durations = _durations(workload, tape, part)
        values = levels.evaluate(durations.durations)
        per_class.append([_figures(tape, c, values, durations, liveness[c]) for c in range(len(tape.classes))])
    ranks = np.bincount(workload.class_of, minlength=len(workload.programs))
    results = []
    for system, timing in zip(systems, timing_of, strict=True):
        part, column = divmod(timing, chunk)
        classes = [
            _class_result(workload.programs[c].name, int(ranks[c]), figures, column, system)
            for c, figures in enumerate(per_class[part])
        ]
        results.append(SimResult(step_time_s=max((c.end_s for c in classes), default=0.0), classes=classes))
    return results


def _class_result(name: str, ranks: int, figures: _Timelines, column: int, system: SystemSpec) -> ClassResult:
    """The per-point ClassResult (`cost_model.AnalyticalCostModel._simulate`) from one system's figures."""
    accelerator = system.accelerator
    comm, exposed = float(figures.comm[column]), float(figures.exposed[column])
    slowed = accelerator.overlap_slowdown * (comm - exposed)
    peak, at_peak = figures.peak[column]
    at_peak = dict(at_peak)
    return ClassResult(
        name=name,
        ranks=ranks,
        end_s=float(figures.end[column]) + slowed,
        compute_s=float(figures.compute[column]) + slowed,
        comm_s=comm,
        exposed_comm_s=exposed,
        peak_memory_bytes=with_runtime_reserve(peak, at_peak, accelerator),
        memory_at_peak=at_peak,
        time_by_category={name: float(seconds[column]) for name, seconds in figures.categories.items()},
    )


@dataclass(frozen=True, slots=True)
class _Priced:
    durations: np.ndarray
    """(columns + 1) x systems: every tape column's seconds on every system, and a row of zeros for 'no column'."""
    plan_categories: np.ndarray
    """plans x categories x systems: busy seconds per category of one call of each plan, p2p transfers left out
    (their time is known only once paired), as `plans.Plan.category_seconds`."""


def _durations(workload: Workload, tape: Tape, systems: list[SystemSpec]) -> _Priced:
    """Every duration the tape reads, on every system.

    Block ops are priced by the per-point code, once per distinct accelerator (compute ops) and once per distinct
    network (communication), and summed per column as the planner sums a fused run."""
    accelerators: dict[str, int] = {}
    networks: dict[str, int] = {}
    acc_of = np.array([accelerators.setdefault(_timing_key(s)[0], len(accelerators)) for s in systems])
    net_of = np.array([networks.setdefault(_timing_key(s)[1], len(networks)) for s in systems])
    acc_pricers = [BlockPricer(workload, systems[int(np.argmax(acc_of == a))]) for a in range(len(accelerators))]
    net_pricers = [BlockPricer(workload, systems[int(np.argmax(net_of == n))]) for n in range(len(networks))]
    ops: dict[tuple[int, int], np.ndarray] = {}

    def seconds_of(pair: tuple[int, int]) -> np.ndarray:
        found = ops.get(pair)
        if found is None:
            found = ops[pair] = _block_seconds(workload, pair, acc_pricers, net_pricers, acc_of, net_of)
        return found

    durations = np.zeros((len(tape.columns) + 1, len(systems)))
    for index, column in enumerate(tape.columns):
        durations[index] = seconds_of((column.block, column.rank_class))[column.lo : column.hi + 1].sum(axis=0)
    categories = {name: index for index, name in enumerate(tape.categories)}
    plan_categories = np.zeros((len(tape.plans), len(categories), len(systems)))
    for index, pair in enumerate(zip(tape.plan_block, tape.plan_class, strict=True)):
        seconds = seconds_of(pair)
        for op, row in zip(workload.blocks[pair[0]].ops, seconds, strict=True):
            if op.kind in (OpKind.COMPUTE, OpKind.COLLECTIVE):
                plan_categories[index, categories[op.category]] += row
    return _Priced(durations, plan_categories)


def _block_seconds(
    workload: Workload,
    pair: tuple[int, int],
    acc_pricers: list[BlockPricer],
    net_pricers: list[BlockPricer],
    acc_of: np.ndarray,
    net_of: np.ndarray,
) -> np.ndarray:
    """ops x systems: each block op's seconds on each system (`BlockPricer.durations`)."""
    compute = np.array([op.kind is OpKind.COMPUTE for op in workload.blocks[pair[0]].ops])
    by_acc = np.array([pricer.durations(*pair) for pricer in acc_pricers]) * compute
    by_net = np.array([pricer.durations(*pair) for pricer in net_pricers]) * ~compute
    return (by_acc[acc_of] + by_net[net_of]).T


@dataclass(frozen=True, slots=True)
class _Group:
    """Nodes of one level, kind and argument count: evaluated together, a row per node and a column per system."""

    kind: int
    nodes: np.ndarray
    args: np.ndarray
    """nodes x arguments."""
    columns: np.ndarray


@dataclass(frozen=True, slots=True)
class _Levels:
    """The tape's nodes grouped so that every group depends only on groups before it."""

    groups: list[_Group]
    size: int

    @classmethod
    def of(cls, tape: Tape) -> "_Levels":
        level = [0] * len(tape.kind)
        found: dict[tuple[int, int, int], list[int]] = {}
        none = len(tape.columns)  # the zero row of the durations
        for node in range(2, len(tape.kind)):
            args = tape.args[node]
            depth = 1 + max(level[a] for a in args)
            level[node] = depth
            found.setdefault((depth, tape.kind[node], len(args)), []).append(node)
        groups = []
        for (_, kind, _), nodes in sorted(found.items()):
            columns = [tape.column[n] if tape.column[n] >= 0 else none for n in nodes]
            args = np.array([tape.args[n] for n in nodes], dtype=np.intp)
            groups.append(_Group(kind, np.array(nodes, dtype=np.intp), args, np.array(columns, dtype=np.intp)))
        return cls(groups, len(tape.kind))

    def evaluate(self, durations: np.ndarray) -> np.ndarray:
        """nodes x systems: every node's time on every system (durations: `_durations`)."""
        values = np.empty((self.size, durations.shape[1]))
        values[0], values[INF] = 0.0, np.inf
        for group in self.groups:
            args = group.args
            first = values[args[:, 0]]
            if group.kind == SHARED:
                seconds = durations[group.columns]
                busy = values[args[:, 1]]
                busy -= first
                np.minimum(busy, seconds, out=busy)
                first += seconds
                first += busy
            else:
                combine = np.maximum if group.kind == MAX_ADD else np.minimum
                for j in range(1, args.shape[1]):
                    combine(first, values[args[:, j]], out=first)
                if group.kind == MAX_ADD:
                    first += durations[group.columns]
            values[group.nodes] = first
        return values


def _figures(tape: Tape, rank_class: int, values: np.ndarray, priced: _Priced, liveness: Liveness) -> _Timelines:
    """One rank class's figures on every system of a chunk, from its nodes' values."""
    recorded = tape.classes[rank_class]
    durations = priced.durations
    systems = values.shape[1]
    end = values[recorded.stream_ends].max(axis=0) if recorded.stream_ends else np.zeros(systems)
    compute_nodes = np.array([node for node, _ in recorded.compute], dtype=np.intp)
    compute_columns = np.array([column for _, column in recorded.compute], dtype=np.intp)
    compute_seconds = durations[compute_columns]
    compute_ends = values[compute_nodes]
    comm_starts = values[np.array([start for start, _ in recorded.comm], dtype=np.intp)]
    comm_ends = values[np.array([end for _, end in recorded.comm], dtype=np.intp)]
    comm, exposed = _busy(compute_ends - compute_seconds, compute_ends, comm_starts, comm_ends)
    counts = np.bincount(recorded.priced, minlength=len(tape.plans)).astype(float)
    by_category = np.tensordot(counts, priced.plan_categories, axes=1)
    for category, start, stop in recorded.transfers:
        by_category[category] += values[stop] - values[start]
    used = sorted(set().union(*(tape.plans[p].categories for p in set(recorded.priced))))
    call_start, call_end = values[recorded.call_start], values[recorded.call_end]
    return _Timelines(
        end=end,
        compute=compute_seconds.sum(axis=0),
        comm=comm,
        exposed=exposed,
        categories={tape.categories[i]: by_category[i] for i in used},
        peak=_peaks(liveness, liveness.times(call_start, call_end)),
    )


def _busy(
    compute_starts: np.ndarray, compute_ends: np.ndarray, comm_starts: np.ndarray, comm_ends: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Communication seconds (the union of its intervals) and those no compute overlaps, per system (a column).

    `intervals.Busy` sorts each timeline; here the intervals are sorted once, by the first system's starts, and
    the union is the sum of what each interval adds past the furthest end before it. The compute seconds inside
    that union are read off the compute intervals (in stream order, so sorted on every system) at the position the
    first system finds each point at. A system where the communication starts fall out of that order, or a point
    lands in another compute interval or gap, is measured by `intervals.Busy` on its own times."""
    systems = comm_starts.shape[1] if comm_starts.ndim == 2 else compute_starts.shape[1]
    if not len(comm_starts):
        return np.zeros(systems), np.zeros(systems)
    order = np.argsort(comm_starts[:, 0], kind="stable")
    starts, ends = comm_starts[order], comm_ends[order]
    keeps = (np.diff(starts, axis=0) >= 0).all(axis=0)
    reach = np.maximum.accumulate(ends, axis=0)
    before = np.vstack((np.full((1, systems), -np.inf), reach[:-1]))
    opened, closed = np.maximum(starts, before), np.maximum(ends, before)
    comm = (closed - opened).sum(axis=0)
    exposed = comm.copy()
    if len(compute_starts):
        knots = np.empty((2 * len(compute_starts), systems))
        knots[0::2], knots[1::2] = compute_starts, compute_ends
        done = np.cumsum(compute_ends - compute_starts, axis=0)
        hidden = np.zeros(systems)
        for points, sign in ((closed, 1.0), (opened, -1.0)):
            seen, inside = _compute_before(knots, done, points)
            hidden += sign * seen.sum(axis=0)
            keeps &= inside
        exposed = np.maximum(0.0, comm - hidden)
    for system in np.flatnonzero(~keeps):
        _, comm[system], exposed[system] = Busy.of(
            compute_starts[:, system], compute_ends[:, system], comm_starts[:, system], comm_ends[:, system]
        ).totals
    return comm, exposed


def _compute_before(knots: np.ndarray, done: np.ndarray, points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Compute seconds before each point (points x systems), and per system whether every point lies where the
    first system's does (between the same two knots)."""
    position = np.searchsorted(knots[:, 0], points[:, 0], side="right")  # knots[position - 1] <= point
    count = len(knots)
    below = knots[np.maximum(position - 1, 0)]
    above = knots[np.minimum(position, count - 1)]
    inside = ((position == 0)[:, None] | (below <= points)) & ((position == count)[:, None] | (points <= above))
    # by knot k: done before it (a start, even k: the intervals before) or by it (an end, odd k)
    k = np.maximum(position - 1, 0)
    interval = k // 2
    finished = np.where(interval[:, None] > 0, done[np.maximum(interval - 1, 0)], 0.0)
    in_interval = (k % 2 == 0)[:, None]
    seen = np.where(in_interval, finished + (points - below), done[interval])
    seen = np.where((position == 0)[:, None], 0.0, seen)
    return seen, inside.all(axis=0)


def _peaks(liveness: Liveness, times: np.ndarray) -> list[tuple[float, dict[str, float]]]:
    """Peak memory and its breakdown per system (times: events x systems). Systems whose events sort as the first
    system's share its sweep; another is swept on its own."""
    if not len(times):
        return [liveness.peak(np.zeros(0))] * times.shape[1]
    order = liveness.order(times[:, 0])
    first = liveness.peak(times[:, 0], order)
    when = np.round(times[order], 9)
    allocates = (liveness.deltas > 0)[order][:, None]
    later = when[1:] > when[:-1]
    tied = (when[1:] == when[:-1]) & (allocates[1:] >= allocates[:-1])
    keeps = (later | tied).all(axis=0)
    return [first if keeps[s] else liveness.peak(times[:, s]) for s in range(times.shape[1])]
