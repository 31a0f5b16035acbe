"""Many systems priced at once for one workload: the reference schedule's tape (`tape`) evaluated in a compiled loop.

A hardware-planning sweep prices one generated workload (one parallel configuration) on many systems: HBM size,
accelerator FLOP/s and bandwidth, link bandwidths and latencies. The ops, their FLOPs and bytes and their order are
the same on every one; only durations differ. `price_many` records the reference scheduler's decisions once per
network shape as a tape (`tape.record`, kept for the workload's later batches: `batch_structure`), prices every
op's duration for every system (`batch_durations`: the network's formulas over arrays of systems, compute once per
distinct accelerator), and evaluates the tape node by node in a compiled loop, a row of systems per node
(`tape_program`), a chunk of systems at a time. The figures are those
`AnalyticalCostModel(exact=True)` gives point by point (`tests/test_analytical_batch.py` pins the agreement, to
about 1e-13), and so does the default path, the same reference rules compiled over the steady form.

A workload with a steady form (a 1F1B pipeline with many micro-batches) is evaluated on its shorter step and
extended by its period, per system, after `steady`'s checks (`batch_steady`); the systems whose timeline does not
show the period are evaluated on the longer form where the step has one (its timeline once for all of them, each
extended by the first period it shows, as `steady` tries them), and those left on the whole step. Systems that
differ only in what no duration reads (HBM size, runtime reserve, fragmentation, the overlap slowdown applied after
scheduling) are evaluated once.

What depends on times, and how each is handled:
- The scheduler's decisions do not (see `tape`): stream order, dependencies, the programs' round-robin, parking
  on an unmatched p2p op and first-in-first-out matching are fixed by the workload and the network's shape
  (dimensions' sizes, which decide which links a collective and a transfer occupy). Systems of different shapes
  get a tape each.
- Link sharing (`plans.PlanOp` shares, `engine._rendezvous`): a collective queues behind what holds a dimension,
  which is a max; a transfer next to a collective is stretched by min(s, busy - start), which the tape carries
  as such. Neither chooses between branches.
- Communication time and its exposed share are unions of intervals, whose order in time differs between systems:
  each system's intervals are sorted on their own (`batch_busy`).
- Peak memory is a sweep over allocation and free events in time order: a system whose events keep the first
  system's order shares its peak and breakdown; another is swept on its own times (`memory.Liveness`).
- The steady form's period and its checks are read per system (`batch_steady`), as `steady` reads them.
"""

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from itertools import repeat
from operator import itemgetter

import numpy as np

from dse.errors import InfeasibleError
from dse.interfaces import ClassResult, SimResult
from dse.lru import MIB, ByteBoundedLru
from dse.system import SystemSpec
from dse.tables.deepep import exchange_tables
from dse.tables.nccl import node_tables
from dse.workload import SteadyForm, Workload
from simulators.analytical import batch_kernels
from simulators.analytical.batch_busy import BLOCK, BusyMany, Spans
from simulators.analytical.batch_durations import Priced, durations_of
from simulators.analytical.batch_steady import Extension, Period, StageArrays, extend, first_shown, joined
from simulators.analytical.batch_structure import Reads, structure
from simulators.analytical.memory import FRAGMENTATION, RESERVE, Liveness, reserved
from simulators.analytical.steady import forms
from simulators.analytical.steady_reads import reads as stage_reads
from simulators.analytical.tape import Tape

MEMORY_BUDGET_BYTES = 128 * 2**20
"""Node values kept at once, the largest array of a batch: systems are evaluated in chunks whose values fit
(`_chunks`), but at least a block of `BLOCK` systems (GPT-3 175B pp 16 with full recompute's longer form, 169k
nodes: 41 MiB), the systems measured together. Each chunk's figures cost some numpy calls per rank class
whatever its width, so fewer, larger chunks pay less Python. On vs_calculon's grid, when longer forms reached 405k
nodes (99 MiB a block; before they were 4p micro-batches), their one-block chunks set the peak (185 MiB traced at
most, with the structures kept) for any budget up to 128 MiB, where 256 MiB reached 299; 64 MiB cost 7% more
time with the structure kept. A process's first batch also pays for touching the array's pages: 0.05 to 0.25 s of
a first batch of 1,000 systems (GPT-3 175B tp4 pp8), erratic, which 64 MiB avoided in every run measured, but at
up to 10% more on tp4 pp16 with the structure kept."""
ROOM_BYTES = 2 * MEMORY_BUDGET_BYTES
"""The address space a thread keeps for the values (`_Room`): the budget, which every chunk of more than one block
fits in (`_chunks`), and room for a single block's values past it (GPT-3 175B's longer forms: 41 MiB at most, 131
MiB when they were longer), so that the room never grows. Only the pages a chunk writes are backed by memory: as
many as the largest chunk's."""
_TIMELESS = frozenset(
    {"name", "hbm_GiB", "runtime_reserve_GiB", "fragmentation", "overlap_slowdown", "tdp_W", "price_usd"}
)
"""Accelerator fields no op duration reads: systems that differ only in them share one schedule."""
_PLACING = frozenset({"hbm_GiB", "runtime_reserve_GiB", "fragmentation"})
"""Those of them that, on an accelerator with memory tiers, place the working set in its tiers: there they do
change what a memory-bound op takes (AcceleratorSpec.seconds_per_byte)."""


def price_many(workload: Workload, systems: Sequence[SystemSpec]) -> list[SimResult | InfeasibleError]:
    """The step on each system, as `AnalyticalCostModel(exact=True).simulate` prices it one by one (without the
    timeline); a system with fewer NPUs than the workload has ranks gets the InfeasibleError the simulation raises.
    """
    out: list[SimResult | InfeasibleError | None] = [None] * len(systems)
    shapes: dict[tuple[int, ...], list[int]] = {}
    for index, system in enumerate(systems):
        if (error := too_small(workload, system)) is not None:
            out[index] = error
        else:
            shapes.setdefault(tuple(dim.npus for dim in system.network), []).append(index)
    ranks = np.bincount(workload.class_of, minlength=len(workload.programs))
    classes_of = [(program.name, int(count)) for program, count in zip(workload.programs, ranks, strict=True)]
    room = _room()
    for members in shapes.values():  # which dimensions a group or a send spans: the tape's decisions
        timings: dict[tuple[str, str], int] = {}
        firsts: list[int] = []  # per distinct timing, the first member that has it
        timing_of = []
        for index in members:
            key = _timing_key(systems[index])
            if (timing := timings.get(key)) is None:
                timing = timings[key] = len(firsts)
                firsts.append(index)
            timing_of.append(timing)
        figures = _price_timings(workload, [systems[i] for i in firsts], list(timings), room)
        chosen = [systems[i] for i in members]
        for index, result in zip(members, _results(classes_of, figures, chosen, np.array(timing_of)), strict=True):
            out[index] = result
    room.trim()
    return out  # type: ignore[return-value]


def too_small(workload: Workload, system: SystemSpec) -> InfeasibleError | None:
    """The error of a system with fewer NPUs than the workload has ranks, or None."""
    if workload.layout.world <= system.npus:
        return None
    return InfeasibleError(
        f"the workload has {workload.layout.world} ranks but system '{system.name}' has "
        f"{system.npus} NPUs; enlarge system.network or lower the parallel degrees"
    )


_TIMING_KEYS: ByteBoundedLru[int, tuple[SystemSpec, tuple[str, str]]] = ByteBoundedLru(
    "timing keys", 16 * MIB, lambda entry: 200 + len(entry[1][0]) + len(entry[1][1])
)
"""Each system's timing key by its identity (the system kept with it, so that the id stays its): a sweep prices
every structure on the same system objects (`dse.search.sweep_pricer` decodes each once per process), and the key's
JSON is most of a kept batch's Python per system (30 of 40 us on a DGX H100). Specs are frozen, so an object's key
does not change. About 6 KB an entry: 16 MiB keeps some 2,700 systems."""


def _timing_key(system: SystemSpec) -> tuple[str, str]:
    """What every op duration depends on (`_timing_text`), kept per system object."""
    found = _TIMING_KEYS.get(id(system))
    if found is not None and found[0] is system:
        return found[1]
    key = _timing_text(system)
    _TIMING_KEYS.put(id(system), (system, key))
    return key


def _timing_text(system: SystemSpec) -> tuple[str, str]:
    """What every op duration depends on: the accelerator's speeds and kernel tables (its collection names the GEMM,
    attention and fused-MoE tables that price compute), and the network with the NCCL tables that price the
    collectives within a node (`network.within_node`) and the DeepEP tables that price MoE all-to-alls."""
    timeless = _TIMELESS - _PLACING if system.accelerator.memory_tiers else _TIMELESS
    accelerator = system.accelerator.model_dump_json(exclude=set(timeless))
    network = "[" + ",".join(dim.model_dump_json() for dim in system.network) + "]"
    if (node := node_tables(system.accelerator)) is not None:
        network += f" {node[0]} {node[1].model_dump_json()}"
    if (exchange := exchange_tables(system.accelerator)) is not None:
        network += f" {exchange[0]} {exchange[1].model_dump_json()}"
    return accelerator, network


@dataclass(slots=True)
class _Figures:
    """One rank class's figures on many systems (one per distinct timing), before the accelerator's corrections:
    arrays and lists by system, so that the corrections run over arrays (`_results`) and no object is made per
    system before its ClassResult."""

    end: np.ndarray
    compute: np.ndarray
    comm: np.ndarray
    exposed: np.ndarray
    names: list[list[str]]
    """Per system, its categories' names (one list shared by a chunk's systems)."""
    seconds: list[list[float]]
    """Per system, its busy seconds in each category of `names`."""
    peaks: list[tuple[float, dict[str, float]]]
    """Per system, its peak bytes and their breakdown (systems whose sweeps agree share one)."""

    @classmethod
    def empty(cls, systems: int) -> "_Figures":
        nothing: list = [None] * systems
        return cls(*(np.zeros(systems) for _ in range(4)), list(nothing), list(nothing), list(nothing))

    @classmethod
    def joined(cls, parts: "list[_Figures]") -> "_Figures":
        """The figures of every part's systems, in turn."""
        if len(parts) == 1:
            return parts[0]
        arrays = [
            np.concatenate([getattr(part, name) for part in parts]) for name in ("end", "compute", "comm", "exposed")
        ]
        return cls(
            *arrays,
            [n for part in parts for n in part.names],
            [s for part in parts for s in part.seconds],
            [p for part in parts for p in part.peaks],
        )

    def put(self, at: list[int], figures: "_Figures") -> None:
        """Write `figures` (of as many systems as `at` holds) at those systems."""
        where = np.array(at, dtype=np.intp)
        self.end[where], self.compute[where] = figures.end, figures.compute
        self.comm[where], self.exposed[where] = figures.comm, figures.exposed
        for k, index in enumerate(at):
            self.names[index], self.seconds[index] = figures.names[k], figures.seconds[k]
            self.peaks[index] = figures.peaks[k]


def _results(
    classes_of: list[tuple[str, int]], figures: list[_Figures], systems: list[SystemSpec], timing_of: np.ndarray
) -> list[SimResult]:
    """Each system's SimResult (`cost_model.AnalyticalCostModel._simulate`) from its timing's figures (timing_of:
    per system, its row of the figures); classes_of: each rank class's name and rank count. The accelerator's
    corrections (the overlap slowdown, `memory.with_runtime_reserve`) run over arrays of systems, each float
    operation the one the per-system code makes."""
    accelerators = [system.accelerator for system in systems]
    slowdown = np.array([accelerator.overlap_slowdown for accelerator in accelerators], dtype=float)
    reserve_GiB = np.array([accelerator.runtime_reserve_GiB for accelerator in accelerators], dtype=float)
    fragmentation = np.array([accelerator.fragmentation for accelerator in accelerators], dtype=float)
    timings = timing_of.tolist()
    distinct = timings == list(range(len(figures[0].end))) if figures else False  # each system its own timing

    def chosen(items: list) -> list:
        """Per system, its timing's item of `items` (one per timing)."""
        return items if distinct else [items[t] for t in timings]

    columns = []  # per rank class, its ClassResult on each system: made a class at a time, in C loops (map)
    ends = []
    for (name, count), own in zip(classes_of, figures, strict=True):
        comm, exposed = own.comm[timing_of], own.exposed[timing_of]
        slowed = slowdown * (comm - exposed)
        peaks = chosen(own.peaks)
        peak_bytes = np.fromiter(map(itemgetter(0), peaks), dtype=float, count=len(peaks))
        total, reserve, fragments = reserved(peak_bytes, reserve_GiB, fragmentation)
        at_peak = [
            {**breakdown, RESERVE: r, FRAGMENTATION: f}
            for (_, breakdown), r, f in zip(peaks, reserve.tolist(), fragments.tolist(), strict=True)
        ]
        names, seconds = chosen(own.names), chosen(own.seconds)
        categories = map(dict, map(zip, names, seconds))  # as many seconds as names, by construction
        ends.append((own.end[timing_of] + slowed).tolist())
        columns.append(
            map(
                ClassResult,
                repeat(name),
                repeat(count),
                ends[-1],
                (own.compute[timing_of] + slowed).tolist(),
                comm.tolist(),
                exposed.tolist(),
                total.tolist(),
                at_peak,
                categories,
            )
        )
    if not columns:
        return [SimResult(step_time_s=0.0, classes=[]) for _ in timings]
    step = map(max, zip(*ends, strict=True))
    return list(map(SimResult, step, map(list, zip(*columns, strict=True))))


@dataclass(slots=True)
class _Room:
    """One flat array the chunks of every form a call evaluates write their values in, kept for the thread's next
    calls (`_room`): a process's first touches of fresh memory are what its first batch pays most for these values
    (0.01 to 0.3 s of CPU time for 128 MiB in huge pages, erratic, where evaluating into them takes 0.05 s), so
    they are touched once a process where they can be. A room freed after each call was taken afresh whenever the
    heap no longer held its size in one piece (on vs_calculon's grid, GPT-3 175B tp4 pp8 mb1 full sp off's first
    batch: 0.2 s), and one grown was too; so a room is taken at ROOM_BYTES, kept, and only the pages written are
    ever touched. A larger room (a single block's values over it) is dropped when its call ends."""

    values: np.ndarray = field(default_factory=lambda: np.empty(0))

    def of(self, size: int) -> np.ndarray:
        """A flat array of at least `size` floats."""
        if len(self.values) < size:
            self.values = np.empty(0)  # the smaller room freed before the larger is taken
            self.values = np.empty(max(size, ROOM_BYTES // 8))
        return self.values

    def trim(self) -> None:
        """Drop a room larger than ROOM_BYTES."""
        if self.values.nbytes > ROOM_BYTES:
            self.values = np.empty(0)


_ROOMS = threading.local()
"""Per thread, its room (`_Room`): threads pricing batches at once each write their own."""


def _room() -> _Room:
    room = getattr(_ROOMS, "room", None)
    if room is None:
        room = _ROOMS.room = _Room()
    return room


def _price_timings(
    workload: Workload, systems: list[SystemSpec], timings: list[tuple[str, str]], room: _Room
) -> list[_Figures]:
    """Per rank class, its figures on each system (of one network shape, each of a distinct timing: `timings`,
    their `_timing_key`s).

    A workload with a steady form is evaluated on its shorter step and extended by its period (`batch_steady`);
    the systems whose timelines do not show it are evaluated on the longer form (built only then), once for all of
    them, and extended by the first period that each one's timeline shows, as `steady.schedule_steady` tries them;
    what is left is evaluated on the whole step."""
    form = workload.steady
    if form is None or not SteadyForm.holds(workload.programs):
        return _evaluate(workload, systems, timings, room)[0]
    out = [_Figures.empty(len(systems)) for _ in workload.programs]
    left = list(range(len(systems)))
    for steady, periods in forms(form):
        evaluated = replace(workload, programs=steady.programs, steady=None)
        figures, redo = _evaluate(
            evaluated, [systems[i] for i in left], [timings[i] for i in left], room, steady, periods
        )
        again = set(redo)
        done = [index for k, index in enumerate(left) if k not in again]
        for whole, own in zip(out, figures, strict=True):
            whole.put(done, own)
        left = [left[i] for i in redo]
        if not left:
            break
    if left:  # not periodic on these systems: the whole step, as the per-point path prices it then
        figures, _ = _evaluate(
            replace(workload, steady=None), [systems[i] for i in left], [timings[i] for i in left], room
        )
        for whole, own in zip(out, figures, strict=True):
            whole.put(left, own)
    return out


def _evaluate(
    evaluated: Workload,
    systems: list[SystemSpec],
    timings: list[tuple[str, str]],
    room: _Room,
    form: SteadyForm | None = None,
    periods: Sequence[int] = (),
) -> tuple[list[_Figures], list[int]]:
    """Per rank class, its figures of `evaluated`'s step on each system; with a steady form (whose programs those
    are), extended by the first of `periods` each system's timeline shows, on the systems that show one; and the
    systems that show none (their figures are not made). room: where the chunks' values are evaluated, shared with
    the call's other forms."""
    built = structure(evaluated, systems[0])
    tape, program, spans, reads, liveness = built.tape, built.program, built.spans, built.reads, built.liveness
    ordered: list[Spans] | None = None  # the spans in the first system's order, once its values are known
    parts: list[list[_Figures]] = [[] for _ in tape.classes]
    redo: list[int] = []
    every = durations_of(evaluated, tape, systems, timings)
    chunks = _chunks(len(systems), program.size)
    values_room = room.of(program.size * max(int(c[-1] - c[0]) for c in chunks))  # every chunk's values, in turn
    counted = [_Counted.of(tape, c) for c in range(len(tape.classes))]
    sweeps: list[_Sweep | None] = [None] * len(tape.classes)  # per rank class, the sweep its chunks share
    read = stage_reads(evaluated.blocks, list(evaluated.programs)) if form else None
    for bounds in chunks:
        lo, hi = int(bounds[0]), int(bounds[-1])
        durations = np.ascontiguousarray(every.durations[:, lo:hi])
        priced = Priced(durations, every.plan_categories[:, :, lo:hi], every.finite)
        values = program.evaluate(durations, values_room)
        if ordered is None:
            ordered = [s.ordered(values[:, 0], priced.durations[:, 0]) for s in spans]
        calls = [(values.take(r.call_start, axis=0), values.take(r.call_end, axis=0)) for r in reads]
        found = [
            [Period.find(evaluated.programs[c], *calls[c], p, read, c) for p in periods] for c in range(len(calls))
        ]
        found = joined(found, read) if read is not None else found
        by = first_shown(found) if form else np.full(hi - lo, -1)
        wanted = by >= 0 if form else None
        blocks = bounds - lo
        for _ in range(2):  # again where the period cut by fails its windows and a later one may pass: uncut there
            stages = [
                _stage(evaluated, tape, c, ordered[c], reads[c], values, priced, calls[c], found[c], blocks, wanted, by)
                for c in range(len(tape.classes))
            ]
            extensions, chosen = extend(form, stages, list(periods)) if form else ([], np.zeros(hi - lo, dtype=int))
            again = (by >= 0) & (chosen != by) & (by < len(periods) - 1)
            if not again.any():
                break
            by = np.where(again, -1, by)
        valid = chosen >= 0
        kept = None if valid.all() else np.flatnonzero(valid)
        for c, stage in enumerate(stages):
            own, sweeps[c] = _figures_of(
                counted[c], stage, liveness[c], extensions[c] if form else None, kept, sweeps[c]
            )
            parts[c].append(own)
        redo.extend(lo + i for i in np.flatnonzero(~valid).tolist())
    return [_Figures.joined(own) for own in parts], redo


def _chunks(systems: int, rows: int) -> list[np.ndarray]:
    """Each chunk of systems evaluated together, as the bounds of the blocks of `BLOCK` systems it is measured in
    ([lo, ..., hi]): as many blocks as MEMORY_BUDGET_BYTES holds the values of, at least one (each chunk costs some
    numpy calls per rank class, whatever its width); a last chunk shorter than a block joins the one before where
    the budget holds both (a longer form's 67 systems at 35 a budget: 32 and 35, not 32, 32 and 3). Neither the
    chunks nor the blocks change a figure."""
    per_chunk = max(1, MEMORY_BUDGET_BYTES // (8 * rows * BLOCK))
    bounds = [*range(0, systems, BLOCK), systems]
    chunks = [bounds[first : first + per_chunk + 1] for first in range(0, len(bounds) - 1, per_chunk)]
    if len(chunks) > 1 and 8 * rows * (systems - chunks[-2][0]) <= MEMORY_BUDGET_BYTES:
        chunks[-2:] = [chunks[-2] + chunks[-1][1:]]
    return [np.array(chunk) for chunk in chunks]


def _stage(
    workload: Workload,
    tape: Tape,
    rank_class: int,
    spans: Spans,
    reads: Reads,
    values: np.ndarray,
    priced: Priced,
    calls: tuple[np.ndarray, np.ndarray],
    found: list[Period],
    blocks: np.ndarray,
    wanted: np.ndarray | None,
    by: np.ndarray,
) -> StageArrays:
    """One rank class's times on every system of a chunk, from its nodes' values (the program's rows x systems);
    spans and reads: its busy intervals (`batch_busy.Spans.ordered`) and the rows its figures read; calls: its
    calls' starts and ends (calls x systems); found: the steady form's periods found on them, one per period tried
    (one busy measurement serves them all), if the step is a steady form; blocks: the chunk's blocks (`_chunks`),
    from its first system; wanted: the systems that can pass the steady checks (`batch_steady.shown`), the only
    ones measured (all where None); by: per system, the period of `found` whose steady stretch its busy figures
    measure by the period (`batch_busy.Cut`), -1 for none: the first its timeline shows, which it takes if that
    period's windows pass (`_evaluate` measures it again without where they fail and a later period may pass)."""
    recorded = tape.classes[rank_class]
    call_start, call_end = calls
    moments = [moment for period in found for moment in period.moments(call_start)]
    each = len(moments) // len(found) if found else 0
    cut = Period.each(found, by).cut(call_start, call_end, each * np.maximum(by, 0)) if found else None
    busy = BusyMany.of(values, priced.durations, spans, moments, blocks, wanted, cut)
    transfers = recorded.transfers
    return StageArrays(
        program=workload.programs[rank_class],
        call_start=call_start,
        call_end=call_end,
        busy=busy.totals,
        periods=[replace(f, windows=busy.windows(slice(i * each, (i + 1) * each))) for i, f in enumerate(found)],
        plan_of_call=recorded.priced,
        plan_categories=priced.plan_categories,
        finite=priced.finite,
        transfers=(
            transfers[1],
            transfers[0],
            values[reads.transfer_end] - values[reads.transfer_start],
        ),
    )


@dataclass(frozen=True, slots=True)
class _Counted:
    """What one rank class's figures read of its tape whatever the systems: how many calls run each plan, and the
    categories its plans use (in the tape's order) with their names."""

    counts: np.ndarray
    used: list[int]
    names: list[str]

    @classmethod
    def of(cls, tape: Tape, rank_class: int) -> "_Counted":
        recorded = tape.classes[rank_class]
        counts = np.bincount(recorded.priced, minlength=len(tape.plans)).astype(float)
        used = sorted(set().union(*(tape.plans[p].categories for p in np.unique(recorded.priced).tolist())))
        return cls(counts, used, [tape.categories[i] for i in used])


def _figures_of(
    counted: _Counted,
    stage: StageArrays,
    liveness: Liveness,
    extension: Extension | None,
    kept: np.ndarray | None,
    sweep: "_Sweep | None",
) -> "tuple[_Figures, _Sweep | None]":
    """One rank class's figures on the systems of a chunk in `kept` (columns; all where None): a steady form's
    systems that show no period are priced again on a longer form or the whole step, so their figures and their
    memory sweeps are not made. The per-category sums are made over the whole chunk, then taken: a matrix product
    over other columns could round its sums otherwise. sweep: the rank class's reference sweep so far (`_peaks`),
    returned as the chunk leaves it."""
    pick = slice(None) if kept is None else kept
    end = batch_kernels.latest(stage.call_end)[pick]  # every op ends inside its call
    compute, comm, exposed = (seconds[pick] for seconds in stage.busy)
    by_category = np.tensordot(counted.counts, stage.plan_categories, axes=1)
    calls, categories, seconds = stage.transfers
    if len(calls):
        batch_kernels.add_rows(by_category, categories, seconds)
    if extension is not None:
        end = end + extension.end[pick]
        compute, comm = compute + extension.compute[pick], comm + extension.comm[pick]
        exposed = exposed + extension.exposed[pick]
        by_category = by_category + extension.categories
    peaks, sweep = _peaks(liveness, stage.call_start, stage.call_end, sweep, kept)
    systems = len(end)
    figures = _Figures(
        end=end,
        compute=compute,
        comm=comm,
        exposed=exposed,
        names=[counted.names] * systems,
        seconds=by_category[counted.used][:, pick].T.tolist(),  # Python floats: one conversion for the chunk
        peaks=peaks,
    )
    return figures, sweep


@dataclass(frozen=True, slots=True)
class _Sweep:
    """One system's memory events in sweep order (`memory.Liveness.order`), which of them allocate, and its peak
    and breakdown. The sweep reads nothing of the times but their order, so every system whose events keep that
    order (`batch_kernels.keeps_order`) has that peak and breakdown, whichever chunk it is in."""

    order: np.ndarray
    allocates: np.ndarray
    peak: tuple[float, dict[str, float]]

    @classmethod
    def of(cls, liveness: Liveness, call_start: np.ndarray, call_end: np.ndarray) -> "_Sweep":
        """The sweep of the system whose calls start and end at these times (one time per call)."""
        times = liveness.times(call_start, call_end)
        order = liveness.order(times)
        return cls(order, (liveness.deltas > 0)[order], liveness.peak(times, order))

    def keeps(self, liveness: Liveness, call_start: np.ndarray, call_end: np.ndarray) -> np.ndarray:
        """Per system (calls x systems), whether its events keep this order."""
        at_start, at_end = liveness.at_start, liveness.at_end
        return batch_kernels.keeps_order(call_start, call_end, at_start, at_end, self.order, self.allocates)


def _peaks(
    liveness: Liveness,
    call_start: np.ndarray,
    call_end: np.ndarray,
    sweep: _Sweep | None,
    kept: np.ndarray | None = None,
) -> tuple[list[tuple[float, dict[str, float]]], _Sweep | None]:
    """Peak memory and its breakdown per system of `kept` (columns of call_start, call_end: calls x systems; all
    where None), and the sweep the systems that keep its order share: `sweep`, one made on an earlier chunk, while
    the first of them keeps it, else the first one's (most systems keep the order of any one of them). Another
    system is swept on its own. Every column's order is checked, kept or not (a column's check is its own): taking
    the kept columns first copied both arrays for a few systems left out."""
    columns = np.arange(call_start.shape[1]) if kept is None else kept
    systems = len(columns)
    if not len(liveness.deltas) or not systems:
        return [liveness.peak(np.zeros(0))] * systems, sweep
    keeps = None if sweep is None else sweep.keeps(liveness, call_start, call_end)[columns]
    if keeps is None or not keeps[0]:
        first = int(columns[0])
        sweep = _Sweep.of(liveness, call_start[:, first], call_end[:, first])
        keeps = sweep.keeps(liveness, call_start, call_end)[columns]
    if keeps.all():
        return [sweep.peak] * systems, sweep
    peaks = [
        sweep.peak if keep else liveness.peak(liveness.times(call_start[:, s], call_end[:, s]))
        for s, keep in zip(columns.tolist(), keeps.tolist(), strict=True)
    ]
    return peaks, sweep
