"""The reference schedule, compiled: programs and plans laid out as arrays for `engine_kernel`, and its records
turned into the schedules `engine._Scheduler` gives.

Per point, the plans (each block as a rank class runs it) are built by `plans.Planner` as for the interpreted
engine and transposed into op rows, once per distinct plan; what the calls decide (their blocks, inputs and tags)
is read from arrays kept on the program's `CallShape`, and laid out per call by one compiled pass
(`_lay_out_calls`). The kernel then schedules every op, recording each class's busy intervals in the order its
streams run them and its transfers per class, so that its busy time (`intervals.ordered_busy`) and its transfers
need no sorting; it lays out the later calls of a layer run by shift once one repeats the call before (its
fast-forward, on unless asked off: then the schedules are the interpreted engine's to the bit). A deadlock (a
generator bug) is left to the interpreted engine, which names the ops that wait.
"""

from dataclasses import dataclass
from itertools import chain

import numpy as np
from numba import njit

from dse.system import SystemSpec
from dse.workload import Program, Workload
from simulators.analytical import engine_kernel as kernel
from simulators.analytical.calls import memoised
from simulators.analytical.engine import ClassSchedule, _Scheduler
from simulators.analytical.intervals import ordered_busy
from simulators.analytical.plans import COLLECTIVE, COMPUTE, Plan, Planner

_INT = np.int64


class CompiledScheduler:
    """`engine._Scheduler` without a timeline, with its loop compiled; the same schedules, plus each class's busy
    intervals (`ClassSchedule.busy`) for the steady-state checks (`steady`)."""

    def __init__(self, workload: Workload, system: SystemSpec, fast_forward: bool = True) -> None:
        self._workload = workload
        self._system = system
        self._fast_forward = fast_forward
        """Lay out a layer run's calls by shift once one repeats the call before (`engine_kernel.drive`); off, the
        schedules are the interpreted engine's to the bit."""
        self._planner = Planner(workload, system, fuse=True)
        self._block_plans: list[dict[int, Plan]] = []
        """Per program, the plan of every block it calls."""

    def run(self) -> list[ClassSchedule]:
        programs = self._workload.programs
        calls = [call_arrays(program) for program in programs]
        self._block_plans = [{b: self._planner.plan(b, index) for b in own.used} for index, own in enumerate(calls)]
        tables = _Layout(self, calls).tables()
        kernel.drive(tables)
        if (tables.position < np.diff(tables.base)).any() or (tables.mb_head >= 0).any():
            return _Scheduler(self._workload, self._system, timeline=False).run()  # raises, naming the deadlock
        return self._schedules(tables)

    def _schedules(self, t: kernel.EngineTables) -> list[ClassSchedule]:
        names = list(self._planner.categories)
        streams = len(self._planner.streams)
        t_call, t_category, t_seconds = t.t_call.tolist(), t.t_category.tolist(), t.t_seconds.tolist()
        category_time = t.category_time.tolist()
        out = []
        for r, (plans, lo, hi, c0, c1, m0, m1, b0, b1) in enumerate(
            zip(
                self._block_plans,
                *_spans(t.base),
                *_spans(2 * t.compute_ptr, 2 * t.compute_count),
                *_spans(t.comm_ptr[np.arange(len(t.base)) * streams]),
                *_spans(t.t_ptr, t.t_count),
                strict=True,
            )
        ):
            comm = slice(m0, m1)
            stream_ptr = t.comm_ptr[r * streams : (r + 1) * streams + 1] - m0
            busy, latest = ordered_busy(t.compute_knots[c0:c1], t.comm_starts[comm], t.comm_ends[comm], stream_ptr)
            compute_s, comm_s, exposed_s = busy.totals
            used = set().union(*(plan.categories for plan in plans.values()))
            out.append(
                ClassSchedule(
                    end_s=latest,
                    compute_s=compute_s,
                    comm_s=comm_s,
                    exposed_comm_s=exposed_s,
                    time_by_category={names[i]: category_time[r][i] for i in sorted(used)},
                    call_start=t.call_start[lo:hi],
                    call_end=t.call_end[lo:hi],
                    events=[],
                    busy=busy,
                    transfers=list(zip(t_call[b0:b1], t_category[b0:b1], t_seconds[b0:b1], strict=True)),
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


def call_arrays(program: Program) -> CallArrays:
    def derive(calls) -> CallArrays:
        blocks = np.fromiter((call.block for call in calls), _INT, len(calls))
        counts = np.fromiter(map(len, (call.inputs for call in calls)), _INT, len(calls))
        return CallArrays(
            blocks=blocks,
            tags=np.fromiter((call.tag for call in calls), _INT, len(calls)),
            input_counts=counts,
            inputs=np.fromiter(chain.from_iterable(call.inputs for call in calls), _INT, int(counts.sum())),
            used=np.unique(blocks).tolist(),
        )

    return memoised(program, ("compiled.calls",), derive)


def _ptr(lists) -> np.ndarray:
    """Where each list starts in their concatenation; one more entry for the end."""
    return _ptr_of(np.fromiter(map(len, lists), _INT, len(lists)))


def _ptr_of(counts: np.ndarray) -> np.ndarray:
    """Where each count's entries start when laid out in turn; one more entry for the end."""
    ptr = np.zeros(len(counts) + 1, dtype=_INT)
    np.cumsum(counts, out=ptr[1:])
    return ptr


def _csr(lists) -> tuple[np.ndarray, np.ndarray]:
    """(_ptr, the values concatenated) of lists of ints."""
    ptr = _ptr(lists)
    return ptr, np.fromiter(chain.from_iterable(lists), _INT, int(ptr[-1]))


@dataclass(frozen=True, slots=True)
class _PerPlan:
    """Per distinct plan, what laying out its calls needs besides the kernel's fields."""

    compute: np.ndarray
    """Its compute ops (each call's room for busy intervals)."""
    comm: np.ndarray
    """plans x streams: its communication ops on each stream."""
    mails: np.ndarray
    """Its p2p ops."""
    links: list[list]
    """Its p2p ops' links, in order."""


class _Layout:
    """The kernel's arrays for one point's programs and plans."""

    def __init__(self, scheduler: CompiledScheduler, calls: list[CallArrays]) -> None:
        self._scheduler = scheduler
        self._calls = calls
        self._plans: list[Plan] = []

    def tables(self) -> kernel.EngineTables:
        calls, scheduler = self._calls, self._scheduler
        runs = len(calls)
        sizes = np.fromiter((len(own.blocks) for own in calls), _INT, runs)
        base = _ptr_of(sizes)
        # Per run and block, its plan's number: plans by identity, as classes alike share theirs.
        width = 1 + max((max(plans, default=0) for plans in scheduler._block_plans), default=0)
        index: dict[int, int] = {}
        keys, numbers = [], []
        for r, plans in enumerate(scheduler._block_plans):
            for b, plan in plans.items():
                if (number := index.get(id(plan))) is None:
                    number = index[id(plan)] = len(self._plans)
                    self._plans.append(plan)
                keys.append(r * width + b)
                numbers.append(number)
        plan_of = np.zeros(runs * width, dtype=_INT)
        plan_of[keys] = numbers
        ops, per_plan = self._ops()
        links: dict = {}
        link_ptr, link_ids = _csr([[links.setdefault(x, len(links)) for x in own] for own in per_plan.links])
        call_plan, compute_count, comm_count, transfer_count, mail_ptr, mailbox = _lay_out_calls(
            _joined([own.blocks for own in calls]),
            base,
            plan_of,
            width,
            per_plan.compute,
            per_plan.comm,
            per_plan.mails,
            link_ptr,
            link_ids,
            _joined([own.tags for own in calls]),
        )
        input_ptr = _ptr_of(_joined([own.input_counts for own in calls]))
        inputs = _joined([own.inputs for own in calls])
        if scheduler._fast_forward:
            run_last = _layer_runs(base, call_plan, input_ptr, inputs, per_plan.mails, np.diff(ops["p_op_ptr"]))
        else:
            run_last = np.full(len(call_plan), -1, dtype=_INT)
        moved = len(mailbox)
        mailboxes = int(mailbox.max(initial=-1)) + 1
        streams = len(scheduler._planner.streams)
        counters = np.zeros(4, dtype=_INT)
        counters[kernel.RING_TAIL] = runs  # every run starts queued
        return kernel.EngineTables(
            **ops,
            base=base,
            call_plan=call_plan,
            run_last=run_last,
            input_ptr=input_ptr,
            inputs=inputs,
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
            compute_knots=np.empty(2 * int(compute_count.sum())),
            comm_ptr=_ptr_of(comm_count),
            comm_count=np.zeros(len(comm_count), dtype=_INT),
            comm_starts=np.empty(int(comm_count.sum())),
            comm_ends=np.empty(int(comm_count.sum())),
            t_ptr=np.cumsum(transfer_count) - transfer_count,
            t_count=np.zeros(runs, dtype=_INT),
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
        o_kind, o_stream = np.array(kind, dtype=_INT), np.array(stream, dtype=_INT)
        p2p = np.fromiter((x is not None for x in link), np.bool_, len(link))
        comm = (o_kind == COLLECTIVE) | p2p
        streams = len(self._scheduler._planner.streams)
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
            "o_stream": o_stream,
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
            compute=np.bincount(plan_of_row[o_kind == COMPUTE], minlength=len(plans)),
            comm=np.bincount(plan_of_row[comm] * streams + o_stream[comm], minlength=len(plans) * streams).reshape(
                len(plans), streams
            ),
            mails=np.diff(first_p2p),
            links=[[x for x in own if x is not None] for own in _per_plan(link, lengths)],
        )
        return fields, per_plan


def _joined(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype=_INT)


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
    order = np.argsort(code)
    mailbox = np.empty(moved, dtype=np.int64)
    number = -1
    for i in range(moved):
        if i == 0 or code[order[i]] != code[order[i - 1]]:
            number += 1
        mailbox[order[i]] = number
    return call_plan, compute_count, comm_count, transfer_count, mail_ptr, mailbox


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


def _per_plan(values: tuple, lengths: np.ndarray) -> list[tuple]:
    ends = np.cumsum(lengths).tolist()
    return [values[e - n : e] for e, n in zip(ends, lengths.tolist(), strict=True)]


def schedule_compiled(workload: Workload, system: SystemSpec) -> list[ClassSchedule]:
    """`engine.schedule` without a timeline, compiled: the same schedules, with each class's busy intervals."""
    return CompiledScheduler(workload, system).run()
