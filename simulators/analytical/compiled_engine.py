"""The reference schedule, compiled: programs and plans laid out as arrays for `engine_kernel`, and its records
turned into the schedules `engine._Scheduler` gives.

Per point, the plans (each block as a rank class runs it) are built by `plans.Planner` as for the interpreted
engine and transposed into op rows, once per distinct plan; what the calls decide (their blocks, inputs and tags)
is read from arrays kept on the program's `CallShape`. The kernel then schedules every op. A deadlock (a generator
bug) is left to the interpreted engine, which names the ops that wait.
"""

from dataclasses import dataclass
from itertools import chain

import numpy as np

from dse.system import SystemSpec
from dse.workload import Program, Workload
from simulators.analytical import engine_kernel as kernel
from simulators.analytical.calls import memoised
from simulators.analytical.engine import ClassSchedule, _Scheduler
from simulators.analytical.intervals import Busy
from simulators.analytical.plans import COLLECTIVE, COMPUTE, Plan, Planner

_INT = np.int64


class CompiledScheduler:
    """`engine._Scheduler` without a timeline, with its loop compiled; the same schedules, plus each class's busy
    intervals (`ClassSchedule.busy`) for the steady-state checks (`steady`)."""

    def __init__(self, workload: Workload, system: SystemSpec) -> None:
        self._workload = workload
        self._system = system
        self._planner = Planner(workload, system, fuse=True)
        self._block_plans: list[dict[int, Plan]] = []
        """Per program, the plan of every block it calls."""

    def run(self) -> list[ClassSchedule]:
        programs = self._workload.programs
        calls = [_calls(program) for program in programs]
        self._block_plans = [{b: self._planner.plan(b, index) for b in own.used} for index, own in enumerate(calls)]
        tables = _Layout(self, calls).tables()
        kernel.drive(tables)
        if (tables.position < np.diff(tables.base)).any() or (tables.mb_head >= 0).any():
            return _Scheduler(self._workload, self._system, timeline=False).run()  # raises, naming the deadlock
        return self._schedules(tables)

    def _schedules(self, t: kernel.EngineTables) -> list[ClassSchedule]:
        names = list(self._planner.categories)
        moved = int(t.counters[kernel.TRANSFERS])
        t_run = t.t_run[:moved]
        order = np.argsort(t_run, kind="stable")
        bounds = np.searchsorted(t_run[order], np.arange(len(t.base))).tolist()
        t_call, t_category = t.t_call[order].tolist(), t.t_category[order].tolist()
        t_seconds = t.t_seconds[order].tolist()
        out = []
        for r, plans in enumerate(self._block_plans):
            lo, hi = t.base[r], t.base[r + 1]
            c0, c1 = t.compute_ptr[r], t.compute_ptr[r] + t.compute_count[r]
            m0, m1 = t.comm_ptr[r], t.comm_ptr[r] + t.comm_count[r]
            cs, ce, ms, me = t.compute_starts[c0:c1], t.compute_ends[c0:c1], t.comm_starts[m0:m1], t.comm_ends[m0:m1]
            busy = Busy.of(cs, ce, ms, me)
            compute, comm, exposed = busy.totals
            latest = max(float(ce.max(initial=0.0)), float(me.max(initial=0.0)))
            used = set().union(*(plan.categories for plan in plans.values()))
            b0, b1 = bounds[r], bounds[r + 1]
            out.append(
                ClassSchedule(
                    end_s=latest,
                    compute_s=compute,
                    comm_s=comm,
                    exposed_comm_s=exposed,
                    time_by_category={names[i]: float(t.category_time[r, i]) for i in sorted(used)},
                    call_start=t.call_start[lo:hi],
                    call_end=t.call_end[lo:hi],
                    events=[],
                    busy=busy,
                    transfers=list(zip(t_call[b0:b1], t_category[b0:b1], t_seconds[b0:b1], strict=True)),
                )
            )
        return out


@dataclass(frozen=True, slots=True)
class _Calls:
    """What the kernel reads of a program's calls, derived once per CallShape (one check that the shape still holds
    the calls, not one per array)."""

    blocks: np.ndarray
    tags: np.ndarray
    input_counts: np.ndarray
    inputs: np.ndarray
    """Every call's inputs in order."""
    used: list[int]
    """The blocks the program calls, sorted."""


def _calls(program: Program) -> _Calls:
    def derive(calls) -> _Calls:
        blocks = np.fromiter((call.block for call in calls), _INT, len(calls))
        counts = np.fromiter(map(len, (call.inputs for call in calls)), _INT, len(calls))
        return _Calls(
            blocks=blocks,
            tags=np.fromiter((call.tag for call in calls), _INT, len(calls)),
            input_counts=counts,
            inputs=np.fromiter(chain.from_iterable(call.inputs for call in calls), _INT, int(counts.sum())),
            used=np.unique(blocks).tolist(),
        )

    return memoised(program, ("compiled.calls",), derive)


def _ptr(lists) -> np.ndarray:
    """Where each list starts in their concatenation; one more entry for the end."""
    ptr = np.zeros(len(lists) + 1, dtype=_INT)
    np.cumsum(np.fromiter(map(len, lists), _INT, len(lists)), out=ptr[1:])
    return ptr


def _csr(lists) -> tuple[np.ndarray, np.ndarray]:
    """(_ptr, the values concatenated) of lists of ints."""
    ptr = _ptr(lists)
    return ptr, np.fromiter(chain.from_iterable(lists), _INT, int(ptr[-1]))


@dataclass(frozen=True, slots=True)
class _PerPlan:
    """Per distinct plan, what laying out its calls needs besides the kernel's fields."""

    compute: np.ndarray
    comm: np.ndarray
    """Its compute and its communication ops (each call's room for busy intervals)."""
    mails: np.ndarray
    """Its p2p ops."""
    links: list[list]
    """Its p2p ops' links, in order."""


class _Layout:
    """The kernel's arrays for one point's programs and plans."""

    def __init__(self, scheduler: CompiledScheduler, calls: list[_Calls]) -> None:
        self._scheduler = scheduler
        self._calls = calls
        self._plans: list[Plan] = []
        self._plan_index: dict[int, int] = {}

    def _plan(self, plan: Plan) -> int:
        index = self._plan_index.get(id(plan))
        if index is None:
            index = self._plan_index[id(plan)] = len(self._plans)
            self._plans.append(plan)
        return index

    def tables(self) -> kernel.EngineTables:
        calls, scheduler = self._calls, self._scheduler
        runs = len(calls)
        blocks = [own.blocks for own in calls]
        sizes = np.fromiter(map(len, blocks), _INT, runs)
        base = np.zeros(runs + 1, dtype=_INT)
        np.cumsum(sizes, out=base[1:])
        call_plan = np.empty(int(base[-1]), dtype=_INT)
        for r, (block, plans) in enumerate(zip(blocks, scheduler._block_plans, strict=True)):
            lookup = np.zeros(max(plans, default=0) + 1, dtype=_INT)
            for b, plan in plans.items():
                lookup[b] = self._plan(plan)
            call_plan[base[r] : base[r + 1]] = lookup[block]
        ops, per_plan = self._ops()
        input_ptr = np.zeros(int(base[-1]) + 1, dtype=_INT)
        np.cumsum(np.concatenate([own.input_counts for own in calls]) if calls else [], out=input_ptr[1:])
        run_of_call = np.repeat(np.arange(runs), sizes)
        compute_count = np.bincount(run_of_call, per_plan.compute[call_plan], runs).astype(_INT)
        comm_count = np.bincount(run_of_call, per_plan.comm[call_plan], runs).astype(_INT)
        mail_ptr, mailbox = self._mailboxes(call_plan, per_plan)
        moved = len(mailbox)
        mailboxes = int(mailbox.max(initial=-1)) + 1
        streams = len(scheduler._planner.streams)
        counters = np.zeros(4, dtype=_INT)
        counters[kernel.RING_TAIL] = runs  # every run starts queued
        return kernel.EngineTables(
            **ops,
            base=base,
            call_plan=call_plan,
            input_ptr=input_ptr,
            inputs=np.concatenate([own.inputs for own in calls]) if calls else np.zeros(0, dtype=_INT),
            mail_ptr=mail_ptr,
            mailbox=mailbox,
            stream_end=np.zeros((runs, streams)),
            out_end=np.zeros(int(base[-1])),
            call_start=np.full(int(base[-1]), np.inf),
            call_end=np.zeros(int(base[-1])),
            position=np.zeros(runs, dtype=_INT),
            op_position=np.zeros(runs, dtype=_INT),
            local=np.zeros((runs, int(ops["p_slots"].max(initial=1)))),
            queued=np.ones(runs, dtype=np.bool_),
            ring=np.arange(runs, dtype=_INT),
            category_time=np.zeros((runs, len(scheduler._planner.categories))),
            mb_head=np.full(mailboxes, -1, dtype=_INT),
            mb_tail=np.full(mailboxes, -1, dtype=_INT),
            q_next=np.zeros(moved, dtype=_INT),
            q_run=np.zeros(moved, dtype=_INT),
            q_call=np.zeros(moved, dtype=_INT),
            q_row=np.zeros(moved, dtype=_INT),
            q_ready=np.zeros(moved),
            compute_ptr=np.cumsum(compute_count) - compute_count,
            compute_count=np.zeros(runs, dtype=_INT),
            compute_starts=np.zeros(int(compute_count.sum())),
            compute_ends=np.zeros(int(compute_count.sum())),
            comm_ptr=np.cumsum(comm_count) - comm_count,
            comm_count=np.zeros(runs, dtype=_INT),
            comm_starts=np.zeros(int(comm_count.sum())),
            comm_ends=np.zeros(int(comm_count.sum())),
            t_run=np.zeros(moved, dtype=_INT),
            t_call=np.zeros(moved, dtype=_INT),
            t_category=np.zeros(moved, dtype=_INT),
            t_seconds=np.zeros(moved),
            counters=counters,
        )

    def _ops(self) -> tuple[dict[str, np.ndarray], _PerPlan]:
        """Every distinct plan's ops as rows (plans.PlanOp's fields, transposed) with, per plan, its rows, output,
        slots and category seconds: the EngineTables fields named p_* and o_*; and what laying out calls needs."""
        plans = self._plans
        lengths = np.fromiter((len(p.ops) for p in plans), _INT, len(plans))
        p_op_ptr = np.zeros(len(plans) + 1, dtype=_INT)
        np.cumsum(lengths, out=p_op_ptr[1:])
        rows = list(chain.from_iterable(p.ops for p in plans))
        kind, stream, seconds, deps, waits, slot, marks, category, link, shares = (
            zip(*rows, strict=True) if rows else ((),) * 10
        )
        o_kind = np.array(kind, dtype=_INT)
        p2p = np.fromiter((x is not None for x in link), np.bool_, len(link))
        plan_of_row = np.repeat(np.arange(len(plans)), lengths)
        first_p2p = np.zeros(len(plans) + 1, dtype=_INT)
        np.cumsum(np.bincount(plan_of_row, p2p, len(plans)).astype(_INT), out=first_p2p[1:])
        before = np.cumsum(p2p) - p2p  # each p2p op's place among its plan's p2p ops
        dep_ptr, dep_values = _csr(deps)
        share_ptr, share_values = _csr(shares)
        flat_marks = list(chain.from_iterable(marks))
        categories = [p.category_seconds for p in plans]
        flat_categories = list(chain.from_iterable(categories))
        fields = {
            "p_op_ptr": p_op_ptr,
            "p_output": np.fromiter((p.output for p in plans), _INT, len(plans)),
            "p_slots": np.fromiter((len(p.block.ops) for p in plans), _INT, len(plans)),
            "p_category_ptr": _ptr(categories),
            "p_category": np.array([i for i, _ in flat_categories], dtype=_INT),
            "p_category_seconds": np.array([s for _, s in flat_categories], dtype=float),
            "o_kind": o_kind,
            "o_stream": np.array(stream, dtype=_INT),
            "o_seconds": np.array(seconds, dtype=float),
            "o_waits": np.array(waits, dtype=np.bool_),
            "o_slot": np.array(slot, dtype=_INT),
            "o_category": np.array(category, dtype=_INT),
            "o_mail": np.where(p2p, before - first_p2p[plan_of_row], -1).astype(_INT),
            "o_dep_ptr": dep_ptr,
            "o_deps": dep_values,
            "o_mark_ptr": _ptr(marks),
            "o_mark_slot": np.array([k for k, _ in flat_marks], dtype=_INT),
            "o_mark_offset": np.array([o for _, o in flat_marks], dtype=float),
            "o_share_ptr": share_ptr,
            "o_shares": share_values,
        }
        per_plan = _PerPlan(
            compute=np.bincount(plan_of_row, o_kind == COMPUTE, len(plans)),
            comm=np.bincount(plan_of_row, (o_kind == COLLECTIVE) | p2p, len(plans)),
            mails=np.diff(first_p2p),
            links=[[x for x in own if x is not None] for own in _per_plan(link, lengths)],
        )
        return fields, per_plan

    def _mailboxes(self, call_plan: np.ndarray, per_plan: _PerPlan) -> tuple[np.ndarray, np.ndarray]:
        """Per call, where its p2p ops' mailboxes start, and the mailboxes: both ends of a transfer, a (link, tag),
        get the same number."""
        mails = per_plan.mails[call_plan]
        calls = np.flatnonzero(mails)
        mail_ptr = np.zeros(len(call_plan), dtype=_INT)
        counts = mails[calls]
        mail_ptr[calls] = np.cumsum(counts) - counts
        if not len(calls):
            return mail_ptr, np.zeros(0, dtype=_INT)
        links: dict = {}
        plan_links = [[links.setdefault(x, len(links)) for x in own] for own in per_plan.links]
        link_ptr, link_ids = _csr(plan_links)
        tags = np.concatenate([own.tags for own in self._calls])
        record = np.repeat(np.arange(len(calls)), counts)
        k = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        link = link_ids[link_ptr[call_plan[calls]][record] + k]
        code = link * (int(tags.max()) + 1) + tags[calls][record]
        return mail_ptr, np.unique(code, return_inverse=True)[1].astype(_INT)


def _per_plan(values: tuple, lengths: np.ndarray) -> list[tuple]:
    ends = np.cumsum(lengths).tolist()
    return [values[e - n : e] for e, n in zip(ends, lengths.tolist(), strict=True)]


def schedule_compiled(workload: Workload, system: SystemSpec) -> list[ClassSchedule]:
    """`engine.schedule` without a timeline, compiled: the same schedules, with each class's busy intervals."""
    return CompiledScheduler(workload, system).run()
