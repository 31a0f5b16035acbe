"""The reference schedule, compiled: programs and plans laid out as arrays for `engine_kernel`, and its records
turned into the schedules `engine._Scheduler` gives.

Per point, the plans (each block as a rank class runs it) are built by `plans.Planner` as for the interpreted
engine and transposed into op rows, once per distinct plan (`op_rows`); what the calls decide (their blocks, inputs
and tags) is read from arrays kept on the program's `CallShape`, joined over the programs and laid out per call by one
compiled pass (`call_layout`); both are kept for later points whose programs share those shapes and whose
plans have the same structure (`call_layout.Joined`: a study's points run a few schedules). The kernel then
schedules every op, recording each class's busy intervals in the order its streams run them and its transfers
per class, so that its busy time (`ordered_busy`) and its transfers need no sorting; it lays out the later calls of
a layer run by shift once one repeats the call before (its fast-forward, on unless asked off: then the schedules are the
interpreted engine's to the bit). A deadlock (a generator bug) is left to the interpreted engine, which names the
ops that wait.
"""

from dataclasses import replace
from itertools import chain

import numpy as np

from dse.system import SystemSpec
from dse.workload import Program, Workload
from simulators.analytical import engine_kernel as kernel
from simulators.analytical import op_rows
from simulators.analytical.call_layout import (
    DRIVES_PER_JOIN,
    LAYOUTS_PER_JOIN,
    Drive,
    Joined,
    call_arrays,
    drive_bytes,
    joined_calls,
    keep,
    laid_bytes,
    laid_out,
    on_shape,
)
from simulators.analytical.engine import ClassSchedule, Transfers, _Scheduler
from simulators.analytical.ordered_busy import OrderedBusy, ordered_busy
from simulators.analytical.plans import Planner

_INT = np.int64


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
        drive on the joined calls (`Drive`): a later drive that starts where this one did (a revisit on another
        system) replays its planner's calls (`Planner.replay`) and, where its plans have the same skeletons, reads
        the rest and joins only the plans' seconds, instead of looking up each place, row set and layout again."""
        programs = self._workload.programs
        calls = [call_arrays(program) for program in programs]
        joined = joined_calls(calls, all(map(on_shape, programs, calls)))
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
            drive = Drive(resolved, self._plan_places, layout.order, skeletons, layout.rows, layout.laid)
            keep(joined, joined.drives, key, drive, drive_bytes, DRIVES_PER_JOIN)
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


class _Layout:
    """The kernel's arrays for one point's programs and plans: the plans' numbering, rows and layout found (read
    from a drive that started where this one did, `Drive`, where its plans have its skeletons), and their seconds
    joined (`tables`)."""

    def __init__(self, scheduler: CompiledScheduler, joined: Joined, kept: "Drive | None") -> None:
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
            laid = laid_out(joined, *structure, rows.p_ops, scheduler._fast_forward)
            keep(joined, joined.laid_out, key, laid, laid_bytes, LAYOUTS_PER_JOIN)
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


def schedule_compiled(workload: Workload, system: SystemSpec) -> list[ClassSchedule]:
    """`engine.schedule` without a timeline, compiled: the same schedules, with each class's busy intervals."""
    return CompiledScheduler(workload, system).run()
