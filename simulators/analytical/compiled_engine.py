"""The reference schedule, compiled: programs and plans laid out as arrays for `engine_kernel`, and its records
turned into the schedules `engine._Scheduler` gives.

Per point, the plans (each block as a rank class runs it) are built by `plans.Planner` as for the interpreted
engine and transposed into op rows, once per distinct plan (`op_rows`); what the calls decide (their blocks, inputs
and tags) is read from arrays kept on the program's `CallShape`, joined over the programs and laid out per call by one
compiled pass (`_lay_out_calls`); both are kept for later points whose programs share those shapes and whose
plans have the same structure (`_Joined`: a study's points run a few schedules). The kernel then schedules every
op, recording each class's busy intervals in the order its streams run them and its transfers per class, so that
its busy time (`ordered_busy`) and its transfers need no sorting; it lays out the later calls of a layer
run by shift once one repeats the call before (its fast-forward, on unless asked off: then the schedules are the
interpreted engine's to the bit). A deadlock (a generator bug) is left to the interpreted engine, which names the
ops that wait.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import chain
from typing import TypeVar

import numpy as np
from numba import njit

from dse.calls import CallColumns
from dse.lru import MIB, ByteBoundedLru
from dse.system import SystemSpec
from dse.workload import Program, Workload
from simulators.analytical import engine_kernel as kernel
from simulators.analytical import op_rows
from simulators.analytical.calls import on_columns
from simulators.analytical.engine import ClassSchedule, Transfers, _Scheduler
from simulators.analytical.ordered_busy import OrderedBusy, ordered_busy
from simulators.analytical.plans import Planner, Resolved
from simulators.analytical.skeletons import Skeleton

_INT = np.int64
V = TypeVar("V")


class CompiledScheduler:
    """`engine._Scheduler` without a timeline, with its loop compiled; the same schedules, plus each class's busy
    intervals (`ClassSchedule.busy`). The steady-state checks (`steady`) measure the busy intervals themselves
    (`busy`, with cuts) and build the schedules once extended (`classes`)."""

    def __init__(
        self, workload: Workload, system: SystemSpec, fast_forward: bool = True, planner: Planner | None = None
    ) -> None:
        self._workload = workload
        self._system = system
        self._fast_forward = fast_forward
        """Lay out a layer run's calls by shift once one repeats the call before (`engine_kernel.drive`); off, the
        schedules are the interpreted engine's to the bit."""
        self._planner = Planner(workload, system, fuse=True) if planner is None else planner
        self._plan_places: list[list[int]] = []
        """Per program, the plan of every block it calls (`CallArrays.used`), as its place in the planner's
        `Planner.handed`."""

    def run(self) -> list[ClassSchedule]:
        return self.schedules(self.drive())

    def for_programs(self, programs: list[Program]) -> "CompiledScheduler":
        """A scheduler of the workload with these programs instead (of its blocks, as a steady form's longer form
        has), on the same system. It shares this one's planner where plans do not depend on the programs (no
        memory tiers, `Planner.keeps`): the longer form asks for mostly the same plans, which a planner of its own
        looked up again (24 of the 120 planners of the 96 GPT-3 configurations of benchmarks/vs_calculon.py)."""
        workload = replace(self._workload, programs=programs, steady=None)
        planner = self._planner if self._planner.keeps else None
        return CompiledScheduler(workload, self._system, self._fast_forward, planner)

    @property
    def categories(self) -> list[str]:
        """The names of the categories its tables number (`EngineTables.category_time`), in their numbers' order."""
        return list(self._planner.categories)

    def drive(self) -> kernel.EngineTables:
        """Every op scheduled: the kernel's tables, whose call_start and call_end (run r's from base[r]) `steady`
        checks before it has any run's schedule built (`schedules`), so that a form failing them costs no more.

        What the plans' structure gives the tables (the places, the plans' numbering, rows and layout) is kept per
        drive on the joined calls (`_Drive`): a later drive that starts where this one did (a revisit on another
        system) replays its planner's calls (`Planner.replay`) and, where its plans have the same skeletons, reads
        the rest and joins only the plans' seconds, instead of looking up each place, row set and layout again."""
        programs = self._workload.programs
        calls = [call_arrays(program) for program in programs]
        joined = _joined_calls(calls, all(map(_on_shape, programs, calls)))
        planner = self._planner
        mark = planner.mark() if joined.kept else None
        key = None if mark is None else (self._fast_forward, *mark)
        kept = None if key is None else joined.drives.get(key)
        if kept is not None and planner.replay(kept.resolved):
            self._plan_places, resolved = kept.places, kept.resolved
        else:
            kept, names = None, planner.names()
            self._plan_places = [planner.plans(own.used, index) for index, own in enumerate(calls)]
            resolved = None if mark is None else planner.resolved(mark, names)
        layout = _Layout(self, joined, kept)
        if key is not None and resolved is not None and (kept is None or layout.order is not kept.order):
            skeletons = [plan.skeleton for plan in layout.plans]
            drive = _Drive(resolved, self._plan_places, layout.order, skeletons, layout.rows, layout.laid)
            _keep(joined, joined.drives, key, drive, _drive_bytes, DRIVES_PER_JOIN)
        tables = layout.tables()
        kernel.drive(tables)
        if (tables.position < np.diff(tables.base)).any() or (tables.mb_head >= 0).any():
            _Scheduler(self._workload, self._system, timeline=False).run()  # raises, naming the deadlock
            raise RuntimeError("pipeline deadlock in the compiled engine alone (an engine bug)")
        return tables

    def busy(self, t: kernel.EngineTables, cuts: np.ndarray | None = None) -> OrderedBusy:
        """Every run's busy intervals measured (`ordered_busy`), with `cuts` without those inside its
        cut: what `schedules` reads, and `steady` before it has any schedule built."""
        runs, streams = t.stream_end.shape  # not the planner's count: a longer form's may have numbered more since
        knot_ptr = 2 * np.stack((t.compute_ptr, t.compute_ptr + t.compute_count), axis=1)
        stream_ptr = t.comm_ptr[np.arange(runs)[:, None] * streams + np.arange(streams + 1)]
        return ordered_busy(t.compute_knots, knot_ptr, t.comm_starts, t.comm_ends, stream_ptr, cuts)

    def schedules(self, t: kernel.EngineTables, cuts: np.ndarray | None = None) -> list[ClassSchedule]:
        """Per run, its schedule with its busy intervals (`ClassSchedule.busy`) and its transfers."""
        busy = self.busy(t, cuts)
        out = self.classes(t, busy.totals)
        for r, (sched, b0, b1) in enumerate(zip(out, *_spans(t.t_ptr, t.t_count), strict=True)):
            sched.busy = busy.busy(r)
            sched.transfers = Transfers(t.t_call[b0:b1], t.t_category[b0:b1], t.t_seconds[b0:b1])
        return out

    def classes(
        self, t: kernel.EngineTables, figures: np.ndarray, categories: np.ndarray | None = None
    ) -> list[ClassSchedule]:
        """Per run, its schedule with `figures` (per run: compute, communication and exposed communication seconds
        and its end, as `OrderedBusy.totals`) and seconds per category (`categories`, numbered as
        `EngineTables.category_time`, which they default to), without its busy intervals and transfers: `steady`
        hands its extended figures and categories, so that a stage's schedule is built once, and reads neither."""
        names, handed, out = self.categories, self._planner.handed, []
        rows = (t.category_time if categories is None else categories).tolist()
        for places, lo, hi, row, (compute_s, comm_s, exposed_s, end_s) in zip(
            self._plan_places, *_spans(t.base), rows, figures.tolist(), strict=True
        ):
            used = sorted(frozenset().union(*[handed[place].categories for place in places]))
            out.append(
                ClassSchedule(
                    end_s=end_s,
                    compute_s=compute_s,
                    comm_s=comm_s,
                    exposed_comm_s=exposed_s,
                    time_by_category={names[i]: row[i] for i in used},
                    call_start=t.call_start[lo:hi],
                    call_end=t.call_end[lo:hi],
                    events=[],
                )
            )
        return out


def _spans(ptr: np.ndarray, count: np.ndarray | None = None) -> tuple[list[int], list[int]]:
    """Per run, (start, end) of its entries: from ptr[r] to ptr[r + 1], or to ptr[r] + count[r]."""
    if count is None:
        return ptr[:-1].tolist(), ptr[1:].tolist()
    return ptr.tolist(), (ptr + count).tolist()


@dataclass(frozen=True, slots=True)
class CallArrays:
    """What the kernel reads of a program's calls, derived once per CallShape (one check that the shape still holds
    the calls, not one per array)."""

    blocks: np.ndarray
    tags: np.ndarray
    input_counts: np.ndarray
    inputs: np.ndarray
    """Every call's inputs in order."""
    used: list[int]
    """The blocks the program calls, sorted."""


_CALLS_KEY = ("compiled.calls",)


def call_arrays(program: Program) -> CallArrays:
    """What the kernel reads of a program's calls: its shape's columns (`CallShape.columns`, which a spliced shape
    is made of), else derived from the calls."""
    shape = program.call_shape()
    if shape is None:
        return _arrays(CallColumns.of(program.calls))
    return on_columns(shape, _CALLS_KEY, _arrays)


def _arrays(columns: CallColumns) -> CallArrays:
    return CallArrays(
        blocks=columns.block,
        tags=columns.tag,
        input_counts=columns.input_counts,
        inputs=columns.inputs,
        used=np.unique(columns.block).tolist(),
    )


def _ptr_of(counts: np.ndarray) -> np.ndarray:
    """Where each count's entries start when laid out in turn; one more entry for the end."""
    ptr = np.zeros(len(counts) + 1, dtype=_INT)
    np.cumsum(counts, out=ptr[1:])
    return ptr


CALL_LAYOUT_BYTES = 32 * MIB
"""Programs' calls joined and laid out (`_Joined`): the 96 configurations of benchmarks/vs_calculon.py join 4
tuples of shapes (their steady and longer forms at pp 8 and 16, 4,140 to 24,692 calls) laid out 28 ways, 10 MiB
in all."""
LAYOUTS_PER_JOIN = 16
"""Layouts (plans' structures) a joined entry keeps: a study's configurations of one schedule number their plans
in a few ways; more would let one entry grow without bound (the layout kept first goes first)."""
DRIVES_PER_JOIN = 64
"""Drives (`_Drive`) a joined entry keeps, as LAYOUTS_PER_JOIN bounds its layouts: one per workload's blocks and
form, of which the 96 configurations of benchmarks/vs_calculon.py join up to 48 to one tuple of shapes."""
DRIVE_BYTES_PER_PLACE = 200
"""An estimate of a drive's bytes per block a program calls (its entry in `_Drive.places`, and a share of
`Resolved`'s lists and tuples), besides the op rows it holds (counted in full, though `op_rows` mostly holds
the same)."""


@dataclass(frozen=True, slots=True)
class _LaidOut:
    """What `_lay_out_calls` and `_layer_runs` give for one structure of the plans, for every point whose plans
    have that structure (the kernel reads a copy)."""

    call_plan: np.ndarray
    mail_ptr: np.ndarray
    mailbox: np.ndarray
    mailboxes: int
    run_last: np.ndarray
    other_inputs: int
    compute_ptr: np.ndarray
    compute_ops: int
    comm_ptr: np.ndarray
    comm_ops: int
    t_ptr: np.ndarray


@dataclass(slots=True)
class _Joined:
    """A point's programs' call arrays joined (flat over the runs), kept per tuple of their CallArrays: the points
    of a study run a few schedules, and a generator hands every program of a schedule the same CallShape (whose
    CallArrays are kept on it), so joining ~9,000 calls per point again would redo the same work. The layouts of
    the calls by their plans' structure (`_LaidOut`, keyed by everything the two passes read besides these
    arrays) are kept here too."""

    calls: tuple[CallArrays, ...]
    """Kept so that the identities the key holds stay theirs."""
    base: np.ndarray
    blocks: np.ndarray
    tags: np.ndarray
    input_ptr: np.ndarray
    inputs: np.ndarray
    width: int
    """One more than the highest block any program calls."""
    used: np.ndarray
    """run * width + block for every block each run calls, in turn (`CallArrays.used`): where `_Layout` puts the
    numbers of their plans."""
    laid_out: dict[tuple, _LaidOut]
    drives: dict[tuple, "_Drive"]
    """Per where a drive's planner started (`Planner.mark`) and fast_forward, what its plans' structure gave."""
    bytes: int
    kept: bool
    """Whether the cache holds it (else it serves one point)."""


_JOINED: ByteBoundedLru[tuple[int, ...], _Joined] = ByteBoundedLru("call layouts", CALL_LAYOUT_BYTES, lambda e: e.bytes)


def _on_shape(program: Program, arrays: CallArrays) -> bool:
    """Whether the arrays are those kept on the program's CallShape (its calls unedited), which later points of the
    shape read too; a program's own arrays (edited calls) are derived afresh each point."""
    return program.shape is not None and program.shape.memo.get(_CALLS_KEY) is arrays


def _joined_calls(calls: list[CallArrays], keep: bool) -> _Joined:
    """The programs' calls joined; kept per tuple of CallArrays (checked by identity) if `keep`, as such a tuple
    recurs only when every program's arrays are kept on its shape."""
    key = tuple(map(id, calls))
    found = _JOINED.get(key) if keep else None
    if found is not None and all(a is b for a, b in zip(found.calls, calls, strict=True)):
        return found
    input_counts = _joined([own.input_counts for own in calls])
    width = 1 + max((max(own.used, default=0) for own in calls), default=0)
    used = np.fromiter(chain.from_iterable(own.used for own in calls), _INT)
    used += np.repeat(np.arange(len(calls), dtype=_INT) * width, [len(own.used) for own in calls])
    arrays = (
        _ptr_of(np.fromiter((len(own.blocks) for own in calls), _INT, len(calls))),
        _joined([own.blocks for own in calls]),
        _joined([own.tags for own in calls]),
        _ptr_of(input_counts),
        _joined([own.inputs for own in calls]),
    )
    # Bytes: the joined arrays, and as much again for the CallArrays the entry keeps alive.
    bytes_ = 2 * sum(x.nbytes for x in arrays) + used.nbytes
    found = _Joined(tuple(calls), *arrays, width, used, laid_out={}, drives={}, bytes=bytes_, kept=keep)
    if keep:
        _JOINED.put(key, found)
    return found


def _laid_out(
    joined: _Joined,
    width: int,
    plan_of: np.ndarray,
    p_compute: np.ndarray,
    p_comm: np.ndarray,
    p_mails: np.ndarray,
    link_ptr: np.ndarray,
    link_ids: np.ndarray,
    p_ops: np.ndarray,
    fast_forward: bool,
) -> _LaidOut:
    base = joined.base
    call_plan, compute_count, comm_count, transfer_count, mail_ptr, mailbox = _lay_out_calls(
        joined.blocks, base, plan_of, width, p_compute, p_comm, p_mails, link_ptr, link_ids, joined.tags
    )
    if fast_forward:
        run_last = _layer_runs(base, call_plan, joined.input_ptr, joined.inputs, p_mails, p_ops)
    else:
        run_last = np.full(len(call_plan), -1, dtype=_INT)
    other_inputs = _other_inputs(base, run_last, joined.input_ptr, joined.inputs)
    return _LaidOut(
        call_plan=call_plan,
        mail_ptr=mail_ptr,
        mailbox=mailbox,
        mailboxes=int(mailbox.max(initial=-1)) + 1,
        run_last=run_last,
        other_inputs=other_inputs,
        compute_ptr=np.cumsum(compute_count) - compute_count,
        compute_ops=int(compute_count.sum()),
        comm_ptr=_ptr_of(comm_count),
        comm_ops=int(comm_count.sum()),
        t_ptr=np.cumsum(transfer_count) - transfer_count,
    )


def _keep(joined: _Joined, kept: dict[tuple, V], key: tuple, value: V, size: Callable[[V], int], most: int) -> None:
    """Keeps a layout or drive on its joined entry (in `kept`, which holds at most `most`: the one kept first goes
    first), putting the entry again so that the cache sees its new size."""
    if key in kept:
        joined.bytes -= size(kept.pop(key))
    elif len(kept) >= most:
        joined.bytes -= size(kept.pop(next(iter(kept))))
    kept[key] = value
    joined.bytes += size(value)
    if joined.kept:
        _JOINED.put(tuple(map(id, joined.calls)), joined)


def _laid_bytes(laid: _LaidOut) -> int:
    return sum(x.nbytes for x in (laid.call_plan, laid.mail_ptr, laid.mailbox, laid.run_last, laid.comm_ptr))


@dataclass(frozen=True, slots=True)
class _Drive:
    """What one drive's plans gave its tables besides their seconds: its planner's calls (`Resolved`) and places,
    the plans' numbering, rows and layout. A later drive that starts where it did hands the same places
    (`Planner.replay`), and where its plans have these skeletons, the same tables but for the seconds."""

    resolved: Resolved
    places: list[list[int]]
    order: list[int]
    """The places of the plans the tables number, in their numbers' order."""
    skeletons: list[Skeleton]
    rows: op_rows.Rows
    laid: _LaidOut


def _drive_bytes(drive: _Drive) -> int:
    return drive.rows.bytes + DRIVE_BYTES_PER_PLACE * sum(map(len, drive.places))


class _Layout:
    """The kernel's arrays for one point's programs and plans: the plans' numbering, rows and layout found (read
    from a drive that started where this one did, `_Drive`, where its plans have its skeletons), and their seconds
    joined (`tables`)."""

    def __init__(self, scheduler: CompiledScheduler, joined: _Joined, kept: "_Drive | None") -> None:
        self._scheduler = scheduler
        self._joined = joined
        handed = scheduler._planner.handed
        if kept is not None:
            self.order = kept.order
            self.plans = [handed[place] for place in kept.order]
            if all(plan.skeleton is skeleton for plan, skeleton in zip(self.plans, kept.skeletons, strict=True)):
                self.rows, self.laid = kept.rows, kept.laid
                return
        runs, width = len(scheduler._plan_places), joined.width
        # Per run and block, its plan's number, in the order the plans first appear: a plan object has one place in
        # the planner's `handed` (classes alike share it), but a longer form's scheduler shares the planner, so its
        # places need not start at 0 nor come in order.
        numbers: dict[int, int] = {}
        plan_of = np.zeros(runs * width, dtype=_INT)
        places = chain.from_iterable(scheduler._plan_places)
        plan_of[joined.used] = [numbers.setdefault(place, len(numbers)) for place in places]
        self.order = list(numbers)
        self.plans = [handed[place] for place in self.order]
        self.rows = rows = op_rows.rows(self.plans, len(scheduler._planner.streams))
        per_plan = rows.per_plan
        structure = (width, plan_of, per_plan.compute, per_plan.comm, per_plan.mails, rows.link_ptr, rows.link_ids)
        key = (scheduler._fast_forward, width, per_plan.comm.shape, plan_of.tobytes(), *rows.key)
        laid = joined.laid_out.get(key)
        if laid is None:
            laid = _laid_out(joined, *structure, rows.p_ops, scheduler._fast_forward)
            _keep(joined, joined.laid_out, key, laid, _laid_bytes, LAYOUTS_PER_JOIN)
        self.laid = laid

    def tables(self) -> kernel.EngineTables:
        scheduler, joined, plans, rows, laid = self._scheduler, self._joined, self.plans, self.rows, self.laid
        ops, base, runs = rows.fields, joined.base, len(joined.base) - 1
        streams = len(scheduler._planner.streams)
        counters = np.zeros(kernel.COUNTERS, dtype=_INT)
        counters[kernel.RING_TAIL] = runs  # every run starts queued
        calls_in_all, moved = int(base[-1]), len(laid.mailbox)
        # The kept arrays go to the kernel as copies: by the next point they have left the CPU's caches, and the
        # kernel, which reads them call by call, ran 0.2 ms a point slower on them than on fresh copies, which
        # cost about 0.02 ms (the 96 GPT-3 configurations of benchmarks/vs_calculon.py).
        seconds = (np.concatenate([p.seconds for p in plans]) if plans else np.zeros(0))[rows.gather]
        o, m = len(ops["o_kind"]), len(ops["o_kind"]) + len(ops["o_mark_slot"])
        return kernel.EngineTables(
            **ops,
            o_seconds=seconds[:o],
            o_mark_offset=seconds[o:m],
            p_category_seconds=seconds[m:],
            p_anchored=rows.anchored,
            p_touches=rows.touches,
            base=base.copy(),
            call_plan=laid.call_plan.copy(),
            run_last=laid.run_last.copy(),
            other_inputs=laid.other_inputs,
            input_ptr=joined.input_ptr.copy(),
            inputs=joined.inputs.copy(),
            mail_ptr=laid.mail_ptr.copy(),
            mailbox=laid.mailbox.copy(),
            stream_end=np.zeros((runs, streams)),
            out_end=np.zeros(calls_in_all),
            call_start=np.full(calls_in_all, np.inf),
            call_end=np.zeros(calls_in_all),
            position=np.zeros(runs, dtype=_INT),
            op_position=np.zeros(runs, dtype=_INT),
            local=np.zeros((runs, int(ops["p_slots"].max(initial=1)))),
            queued=np.ones(runs, dtype=np.bool_),
            ring=np.arange(runs, dtype=_INT),
            category_time=np.zeros((runs, len(scheduler._planner.categories))),
            mb_head=np.full(laid.mailboxes, -1, dtype=_INT),
            mb_tail=np.full(laid.mailboxes, -1, dtype=_INT),
            q_next=np.zeros(moved, dtype=_INT),
            q_run=np.zeros(moved, dtype=_INT),
            q_call=np.zeros(moved, dtype=_INT),
            q_row=np.zeros(moved, dtype=_INT),
            q_ready=np.zeros(moved),
            q_held=np.zeros(moved),
            compute_ptr=laid.compute_ptr.copy(),
            compute_count=np.zeros(runs, dtype=_INT),
            compute_knots=np.empty(2 * laid.compute_ops),
            comm_ptr=laid.comm_ptr.copy(),
            comm_count=np.zeros(len(laid.comm_ptr) - 1, dtype=_INT),
            comm_starts=np.empty(laid.comm_ops),
            comm_ends=np.empty(laid.comm_ops),
            t_ptr=laid.t_ptr.copy(),
            t_count=np.zeros(runs, dtype=_INT),
            t_call=np.zeros(moved, dtype=_INT),
            t_category=np.zeros(moved, dtype=_INT),
            t_seconds=np.zeros(moved),
            counters=counters,
        )


def _joined(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype=_INT)


RANK_TABLE_PER_ENTRY = 16
"""`_ranks` ranks values by a table of at most this many entries a value (the table is one pass; a sort's cost per
value grows with the log of their count)."""


@njit(cache=True)
def _lay_out_calls(
    blocks: np.ndarray,
    base: np.ndarray,
    plan_of: np.ndarray,
    width: int,
    p_compute: np.ndarray,
    p_comm: np.ndarray,
    p_mails: np.ndarray,
    p_link_ptr: np.ndarray,
    p_links: np.ndarray,
    tags: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per call (flat), its plan (`plan_of[run * width + block]`); per run, its compute ops, its communication ops
    per stream (run * streams + stream) and its p2p transfers; per call, where its p2p ops' mailboxes start; and
    the mailboxes: both ends of a transfer, a (link, tag), get the same number (the rank of link * (top tag + 1)
    + tag among those of every p2p op)."""
    runs, (plans, streams) = len(base) - 1, p_comm.shape
    call_plan = np.empty(len(blocks), dtype=np.int64)
    mail_ptr = np.zeros(len(blocks), dtype=np.int64)
    uses = np.zeros((runs, plans), dtype=np.int64)
    moved = 0
    for r in range(runs):
        for c in range(base[r], base[r + 1]):
            p = plan_of[r * width + blocks[c]]
            call_plan[c] = p
            uses[r, p] += 1
            mail_ptr[c] = moved if p_mails[p] else 0
            moved += p_mails[p]
    compute_count = np.zeros(runs, dtype=np.int64)
    comm_count = np.zeros(runs * streams, dtype=np.int64)
    transfer_count = np.zeros(runs, dtype=np.int64)
    for r in range(runs):
        for p in range(plans):
            if uses[r, p]:
                compute_count[r] += uses[r, p] * p_compute[p]
                transfer_count[r] += uses[r, p] * p_mails[p]
                for s in range(streams):
                    comm_count[r * streams + s] += uses[r, p] * p_comm[p, s]
    code = np.empty(moved, dtype=np.int64)
    top = tags.max() + 1 if moved else 1
    for c in range(len(blocks)):
        p = call_plan[c]
        for k in range(p_mails[p]):
            code[mail_ptr[c] + k] = p_links[p_link_ptr[p] + k] * top + tags[c]
    links = p_links.max() + 1 if moved > 0 else 0
    size = links * top if moved > 0 and tags.min() >= 0 else -1
    return call_plan, compute_count, comm_count, transfer_count, mail_ptr, _ranks(code, size)


@njit(cache=True)
def _ranks(code: np.ndarray, size: int) -> np.ndarray:
    """Per entry, the rank of its value among the distinct values in `code`. Values all in 0..size - 1 (size -1 if
    not known so) are ranked by a table of `size` entries if that is at most RANK_TABLE_PER_ENTRY a value: sorting
    them took 20 of the 34 us a layout of a GPT-3 configuration at pp 16 took (2,164 values under 2,336), the table
    2 us; else by sorting."""
    out = np.empty(len(code), dtype=np.int64)
    if 0 <= size <= RANK_TABLE_PER_ENTRY * len(code):
        rank = np.zeros(size + 1, dtype=np.int64)
        for value in code:
            rank[value + 1] = 1
        for i in range(size):
            rank[i + 1] += rank[i]
        for i in range(len(code)):
            out[i] = rank[code[i]]
        return out
    order = np.argsort(code)
    number = -1
    for i in range(len(code)):
        if i == 0 or code[order[i]] != code[order[i - 1]]:
            number += 1
        out[order[i]] = number
    return out


@njit(cache=True)
def _layer_runs(
    base: np.ndarray,
    call_plan: np.ndarray,
    input_ptr: np.ndarray,
    inputs: np.ndarray,
    p_mails: np.ndarray,
    p_ops: np.ndarray,
) -> np.ndarray:
    """`EngineTables.run_last`: per call that continues a layer run, the run's last call, else -1. A call continues
    one when the call before has its plan, it reads that call's output, and its plan has ops and no p2p op (whose
    time would depend on another program): such a call's times follow from the streams it touches, the call
    before's output end and its other inputs' (a backward layer's activations), so once one repeats the call
    before shifted and the other inputs are ready by then (`engine_kernel.drive` checks), the rest do."""
    run_last = np.full(len(call_plan), -1, dtype=np.int64)
    for r in range(len(base) - 1):
        for c in range(base[r + 1] - 1, base[r], -1):  # backwards: a call's run ends where the next call's does
            p = call_plan[c]
            reads = False
            for k in range(input_ptr[c], input_ptr[c + 1]):
                reads = reads or inputs[k] == c - 1 - base[r]
            if reads and call_plan[c - 1] == p and p_mails[p] == 0 and p_ops[p] > 0:
                run_last[c] = run_last[c + 1] if c + 1 < base[r + 1] and run_last[c + 1] >= 0 else c
    return run_last


def schedule_compiled(workload: Workload, system: SystemSpec) -> list[ClassSchedule]:
    """`engine.schedule` without a timeline, compiled: the same schedules, with each class's busy intervals."""
    return CompiledScheduler(workload, system).run()


@njit(cache=True)
def _other_inputs(base: np.ndarray, run_last: np.ndarray, input_ptr: np.ndarray, inputs: np.ndarray) -> int:
    """The longest entry a layer run's calls add to the run memo's: per call after the first, a count and each
    input it reads besides the call before. Of the calls and their layout alone, so kept with the layout
    (`compiled_engine._LaidOut`)."""
    most = 0
    for r in range(len(base) - 1):
        g = base[r]
        while g < base[r + 1]:
            if run_last[g] < 0:
                g += 1
                continue
            last, count = run_last[g], 0
            for h in range(g, last + 1):
                count += 1
                for k in range(input_ptr[h], input_ptr[h + 1]):
                    if base[r] + inputs[k] != h - 1:
                        count += 1
            most = max(most, count)
            g = last + 1
    return most
