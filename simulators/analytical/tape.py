"""The reference schedule recorded as a formula of op durations, to be evaluated for many systems at once.

`engine` schedules by fixed rules: each stream runs its ops in issue order, an op starts at the latest of its
stream's free time, its dependencies' ends and its call's inputs (a collective also waits for the network streams
it shares), and a send and its recv start together once both are ready. Which op waits on which, the order programs
advance in, where a program parks on an unmatched p2p op and which send pairs with which recv (first in, first out
per link and tag) depend on the workload and the network's shape only, never on a duration: `start == inf` in the
engine is a parked op, not a time. So every time of the step is a fixed expression of the op durations, built from
max, +, and, for a transfer that shares a link with a collective, `start + s + min(s, busy - start)`; this module
walks the engine's rules once with node ids in place of times and records that expression as a tape.

Node values: `MAX_ADD` is max(args) + column (column -1 adds nothing), `MIN` is min(args), `SHARED` is
start + s + min(s, busy - start) with args (start, busy) and s the column. Columns are the plan ops' durations
(a fused kernel run's total), the offsets of the kernels marked inside fused runs, and nothing else: the tape holds
no figure of any system. Nodes 0 and 1 are the constants 0 and inf.

Durations are never negative, so an argument that another argument of the same max was built on can never be the
latest and is left out (`tape_kernel._needed`): an op after a collective that itself waited for the op before it
waits for the collective alone. That keeps about a sixth of the nodes out and most maxes down to one argument; making a
marked kernel's node only once an op reads its end (`tape_kernel.MARKED`) keeps out as many again (Llama-3-70B's steady
form: 110k to 73k nodes).

`tape_kernel` walks `engine._Scheduler`'s rules step for step, compiled (its hot loop cannot carry node ids, and
slowing it to share code would slow every per-point simulation); `tests/test_analytical_batch.py` compares the two
on every schedule kind, so a rule changed in one and not the other fails there. This module lays the workload out in
the kernel's tables before the walk and keeps the used part of its arrays after.
"""

from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np

from dse.system import SystemSpec
from dse.workload import Workload
from simulators.analytical import tape_kernel as kernel
from simulators.analytical.call_layout import call_arrays
from simulators.analytical.plans import Link, Plan, Planner
from simulators.analytical.recipes import COMPUTE, SEND
from simulators.analytical.tape_kernel import INF, MAX_ADD, MIN, SHARED, ZERO

__all__ = ["INF", "MAX_ADD", "MIN", "SHARED", "ZERO", "ClassTape", "Column", "Tape", "record"]
assert (COMPUTE, SEND) == (kernel.COMPUTE, kernel.SEND)


@dataclass(slots=True, frozen=True)
class Column:
    """A duration the tape adds: block ops lo..hi (inclusive) of a block as one rank class runs it, summed."""

    block: int
    rank_class: int
    lo: int
    hi: int


@dataclass(slots=True)
class ClassTape:
    """What one rank class's figures are read from: node ids of its times, as arrays."""

    call_start: np.ndarray
    call_end: np.ndarray
    compute: np.ndarray
    """3 x intervals: (end node of its first op, that op's column, end node) of every compute interval: its start is
    the first op's end less its column. Ops that run back to back on every system (one waits for the other alone)
    make one interval; on one stream, the intervals never overlap."""
    compute_calls: np.ndarray
    """2 x intervals: the first and the last call (indices in the class's program) each compute interval runs in."""
    comm: np.ndarray
    """2 x ops: (start node, end node) of every communication op."""
    comm_calls: np.ndarray
    """Per communication op, its call (a p2p transfer's: the call of its side)."""
    transfers: np.ndarray
    """4 x transfers: (category, call, start node, end node) of every p2p transfer."""
    priced: np.ndarray
    """Per call, the plan its block runs as (an index into `Tape.plans`)."""


@dataclass(slots=True)
class Tape:
    """Nodes as arrays: node n's kind and column, its arguments `args[first[n]:first[n + 1]]` (compressed rows, so a
    compiled loop or numpy reads them without a Python object per node; int8 kinds, int32 the rest)."""

    kind: np.ndarray
    column: np.ndarray
    first: np.ndarray
    args: np.ndarray
    columns: list[Column] = field(default_factory=list)
    classes: list[ClassTape] = field(default_factory=list)
    plans: list[Plan] = field(default_factory=list)
    plan_class: list[int] = field(default_factory=list)
    """The rank class each plan was built for (its collectives priced for that class's groups)."""
    plan_block: list[int] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.kind)


def record(workload: Workload, system: SystemSpec) -> Tape:
    """The tape of the workload's step on any system with this one's network shape (`engine.schedule`'s rules)."""
    layout = _Layout(workload, system)
    nodes = 2 * layout.ops_run + 4 * layout.calls + 16  # GPT-3's steady forms: 1.5 nodes an op, 1.6 arguments a node
    while True:
        tape = _tape_arrays(nodes, 2 * nodes)
        state = layout.state()
        kernel.walk(tape, state, layout.ops, layout.call_table, layout.plan_table, layout.items, layout.scratch())
        status = int(tape[4][kernel.STATUS])
        if status != kernel.OVERFLOW:
            break
        nodes *= 4
    if status == kernel.DEADLOCK:
        raise RuntimeError("pipeline deadlock (a generator bug): the reference scheduler names the ops")
    if status != kernel.OK:
        raise RuntimeError("the recorded schedule read a parked transfer's time (a recorder bug)")
    return layout.tape(tape, state)


def _tape_arrays(nodes: int, args: int) -> tuple[np.ndarray, ...]:
    """kinds, columns, argument offsets, arguments, counters: the constants 0 and inf made. In the tape's own types,
    so that keeping them is a copy of their used part; left unset but for the constants, as the walk sets every node
    it makes (a zeroed array would be touched twice)."""
    kinds, columns = np.empty(nodes, dtype=np.int8), np.empty(nodes, dtype=np.int32)
    kinds[:2], columns[:2] = MAX_ADD, -1
    lo = np.empty(nodes + 1, dtype=np.int32)
    lo[:3] = 0
    counters = np.zeros(3, dtype=np.int64)
    counters[kernel.NODES] = 2
    return kinds, columns, lo, np.empty(args, dtype=np.int32), counters


class _Layout:
    """The workload's programs and plans as the kernel's tables (`tape_kernel`'s columns): per distinct plan its
    ops, per call its plan, inputs and p2p keys (link and tag, numbered); lists in one items array, the plans' first,
    then every call's inputs, then the p2p calls' keys. Only the distinct plans take a Python loop of their own; a
    call's rows are laid out with numpy per program, and the p2p calls' keys with numpy once every plan is made."""

    def __init__(self, workload: Workload, system: SystemSpec) -> None:
        self._planner = Planner(workload, system, fuse=True)
        self._columns: list[Column] = []
        self._plans: list[Plan] = []
        self._plan_class: list[int] = []
        self._plan_block: list[int] = []
        self._plan_ids: dict[int, int] = {}
        self._plan_links: list[list[Link]] = []
        """Per plan, the links of its p2p ops, in order (a call's keys pair each with the call's tag)."""
        self._op_rows: list[list[int]] = []
        self._plan_rows: list[list[int]] = []
        self._items: list[int] = []
        self.priced: list[np.ndarray] = []
        p2p_calls: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        """Per program, its rows, its p2p calls and their tags (their keys numbered once every plan is made)."""
        inputs: list[np.ndarray] = []
        parts: list[np.ndarray] = []
        """Per program, its calls' rows of the call table: plan, inputs, inputs' end and keys (those from the
        start of their parts of the items array), call, run."""
        self.first_call: list[int] = []
        calls = 0
        widest = 0
        for index, program in enumerate(workload.programs):
            arrays = call_arrays(program)  # kept on the program's CallShape, as the per-point path reads it too
            blocks, lengths = arrays.blocks, arrays.input_counts
            count = len(blocks)
            distinct, first = np.unique(blocks, return_index=True)
            plan_of = np.zeros(int(distinct.max(initial=0)) + 1, dtype=np.int64)
            for b in distinct[np.argsort(first)].tolist():  # the plans in order of first sight
                plan_of[b] = self._plan_id(self._planner.plan(b, index), index, b)
            ids = plan_of[blocks]
            self.priced.append(ids)
            self.first_call.append(calls)
            rows = np.zeros((count, 6), dtype=np.int64)
            rows[:, kernel.PLAN] = ids
            widest = max(widest, int(lengths.max(initial=0)))
            ends = np.cumsum(lengths) + sum(map(len, inputs))
            rows[:, kernel.INPUTS], rows[:, kernel.INPUTS_END] = ends - lengths, ends
            inputs.append(arrays.inputs + calls)
            linked = np.array([len(links) > 0 for links in self._plan_links])
            p2p = np.flatnonzero(linked[rows[:, kernel.PLAN]])
            p2p_calls.append((rows, p2p, arrays.tags[p2p]))
            rows[:, kernel.CALL] = np.arange(count)
            rows[:, kernel.RUN] = index
            parts.append(rows)
            calls += count
        key_items, self._keys = self._keys_of(p2p_calls)
        call_table = np.concatenate(parts) if parts else np.zeros((0, 6), dtype=np.int64)
        call_table[:, kernel.INPUTS : kernel.KEYS] += len(self._items)
        call_table[:, kernel.KEYS] += len(self._items) + sum(map(len, inputs))
        sizes = np.diff(np.array(self._plan_rows, dtype=np.int64).reshape(-1, 4)[:, :2], axis=1).ravel()
        self.ops_run = int(sizes[call_table[:, kernel.PLAN]].sum())
        self.links = len(key_items)
        self.calls = calls
        self.streams = len(self._planner.streams)
        self.ops = np.array(self._op_rows, dtype=np.int64).reshape(-1, 14)
        self.plan_table = np.array(self._plan_rows, dtype=np.int64).reshape(-1, 4)
        self.call_table = call_table
        self.items = np.concatenate([np.array(self._items, dtype=np.int64), *inputs, key_items])
        self.categories = list(self._planner.categories)
        self.runs = len(workload.programs)
        self.calls_of = [len(program.calls) for program in workload.programs]
        self._inputs = widest

    def _keys_of(self, p2p_calls: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, int]:
        """Every p2p call's keys, calls in order and each call's links in its plan's order: a number per distinct
        (link, tag), in order of first sight; each p2p call's start in them written to its row. How many keys."""
        numbers: dict[Link, int] = {}
        own = [
            np.array([numbers.setdefault(link, len(numbers)) for link in links], np.int64) for links in self._plan_links
        ]
        plan_links = np.concatenate([np.zeros(0, np.int64), *own])
        counts = np.array([len(links) for links in own], dtype=np.int64)
        starts = np.cumsum(counts) - counts
        pairs, at = [], 0
        for rows, p2p, tags in p2p_calls:
            plans = rows[p2p, kernel.PLAN]
            many = counts[plans]
            before = np.cumsum(many) - many  # each call's first key among the program's
            rows[p2p, kernel.KEYS] = at + before
            step = np.arange(int(many.sum())) - np.repeat(before, many)  # each key's link within its plan
            pairs.append(np.stack((plan_links[np.repeat(starts[plans], many) + step], np.repeat(tags, many)), axis=1))
            at += int(many.sum())
        if not at:
            return np.zeros(0, dtype=np.int64), 0
        links, tags = np.concatenate(pairs).T
        _, tag_ids = np.unique(tags, return_inverse=True)  # one number per (link, tag): a 1-d unique is far cheaper
        distinct, first, inverse = np.unique(tag_ids * len(plan_links) + links, return_index=True, return_inverse=True)
        number = np.empty(len(distinct), dtype=np.int64)
        number[np.argsort(first)] = np.arange(len(distinct))
        return number[inverse.ravel()], len(distinct)

    def _plan_id(self, plan: Plan, rank_class: int, block: int) -> int:
        """The plan's index on the tape, its ops' and marks' columns and rows of the op table made on first
        sight (the columns in the order the Python recorder made them)."""
        found = self._plan_ids.get(id(plan))
        if found is not None:
            return found
        plan_id = len(self._plans)
        first = len(self._op_rows)
        lo = rank = 0
        for kind, stream, _, deps, waits, slot, marks, category, link, shares in plan.ops:
            column = self._column(Column(block, rank_class, lo, slot))
            mark_columns = [self._column(Column(block, rank_class, lo, k)) for k, _ in marks]
            lo = slot + 1
            at_deps = len(self._items)
            self._items += deps
            at_marks = len(self._items)
            self._items += [k for k, _ in marks]
            self._items += mark_columns
            at_shares = len(self._items)
            self._items += shares
            self._op_rows.append([kind, stream, int(waits), slot, category, int(link is not None), rank, column,
                                  at_deps, at_deps + len(deps), at_marks, at_marks + len(marks), at_shares,
                                  at_shares + len(shares)])  # fmt: skip
            rank += link is not None
        self._plan_links.append([op[8] for op in plan.ops if op[8] is not None])
        self._plan_rows.append([first, len(self._op_rows), len(plan.block.ops), plan.output])
        self._plan_ids[id(plan)] = plan_id
        self._plans.append(plan)
        self._plan_class.append(rank_class)
        self._plan_block.append(block)
        return plan_id

    def _column(self, column: Column) -> int:
        self._columns.append(column)
        return len(self._columns) - 1

    def state(self) -> tuple[np.ndarray, ...]:
        """The walk's state (`tape_kernel`'s numbering): runs' streams, op ends, marks and positions, calls' ends
        and streams' spans, the intervals, the p2p sides and queues, the runs to resume."""
        runs, calls, streams, slots = self.runs, self.calls, self.streams, int(self.plan_table[:, 2].max(initial=1))
        ops = self.ops
        width = np.where(ops[:, 11] > ops[:, 10], 2 + ops[:, 9] - ops[:, 8] + ops[:, 13] - ops[:, 12], 0)
        total = np.concatenate(([0], np.cumsum(width)))
        held = 1 + int((total[self.plan_table[:, 1]] - total[self.plan_table[:, 0]]).max(initial=0))
        position = np.zeros((runs, 6), dtype=np.int64)
        position[:, kernel.FIRST] = self.first_call
        position[:, kernel.CALLS] = self.calls_of
        position[:, kernel.LAST_COMPUTE] = -1
        return (
            np.full((runs, streams), ZERO, dtype=np.int64),
            np.full((runs, slots), ZERO, dtype=np.int64),
            np.zeros((runs, slots, 3), dtype=np.int64),
            np.zeros((runs, held), dtype=np.int64),
            position,
            np.full(calls, ZERO, dtype=np.int64),
            np.full((calls, streams, 2), kernel.UNTOUCHED, dtype=np.int64),
            np.zeros((calls, streams + 1), dtype=np.int64),
            np.zeros((self.ops_run, 6), dtype=np.int64),
            np.zeros((self.ops_run + self.links, 4), dtype=np.int64),
            np.zeros((self.links, 5), dtype=np.int64),
            np.zeros((self.links, 7), dtype=np.int64),
            np.full((max(self._keys, 1), 2), -1, dtype=np.int64),
            np.zeros(6, dtype=np.int64),
            np.zeros(max(runs, 1), dtype=np.int64),
            np.zeros(max(runs, 1), dtype=np.int64),
            np.zeros((calls, 2), dtype=np.int64),
        )

    def scratch(self) -> np.ndarray:
        """Rows of room for one max's arguments: an op's, `_needed`'s two, a transfer's (its busy time, or what its
        side reserves: `tape_kernel._reserve`)."""
        ops = self.ops
        widest = max(int((ops[:, 9] - ops[:, 8]).max(initial=0)), 0) + 2 * int((ops[:, 13] - ops[:, 12]).max(initial=0))
        return np.zeros((4, 4 + widest + self.streams + self._inputs), dtype=np.int64)

    def tape(self, arrays: tuple[np.ndarray, ...], state: tuple[np.ndarray, ...]) -> Tape:
        """The walk's arrays as a `Tape`: copies of their used parts, so the room left over is freed (a structure kept
        keeps them: `batch_structure`; the walk writes the tape's narrow types)."""
        kinds, columns, lo, flat, counters = arrays
        nodes = int(counters[kernel.NODES])
        owned = [self._by_run(state[8 + i][: state[13][i]]) for i in range(3)]  # compute, comm, transfers
        # the intervals' nodes and calls copied apart (calls in int32): a kept structure holds no room beyond them
        edges = state[16]
        classes = []
        for run in range(self.runs):
            first, last = self.first_call[run], self.first_call[run] + self.calls_of[run]
            classes.append(
                ClassTape(
                    call_start=edges[first:last, 0].copy(),
                    call_end=edges[first:last, 1].copy(),
                    compute=owned[0][run][:3].copy(),
                    compute_calls=owned[0][run][3:].astype(np.int32),
                    comm=owned[1][run][:2].copy(),
                    comm_calls=owned[1][run][2].astype(np.int32),
                    transfers=owned[2][run],
                    priced=self.priced[run].astype(np.intp, copy=False),
                )
            )
        return Tape(
            kind=kinds[:nodes].copy(),
            column=columns[:nodes].copy(),
            first=lo[: nodes + 1].copy(),
            args=flat[: lo[nodes]].copy(),
            columns=self._columns,
            classes=classes,
            plans=self._plans,
            plan_class=self._plan_class,
            plan_block=self._plan_block,
            categories=self.categories,
        )

    def _by_run(self, rows: np.ndarray) -> list[np.ndarray]:
        """Per run, its rows (the run first, then the fields) as fields x rows, in the walk's order: grouped in one
        compiled pass (`tape_kernel.grouped`), each run's part contiguous in one array."""
        fields = rows.shape[1] - 1
        count = np.bincount(rows[:, 0], minlength=self.runs)
        ends = np.cumsum(count * fields)
        out = np.empty(int(ends[-1]) if len(ends) else 0, dtype=rows.dtype)
        kernel.grouped(rows, ends - count * fields, count, np.zeros(self.runs, dtype=np.int64), out)
        return [out[lo:hi].reshape(fields, -1) for lo, hi in pairwise([0, *ends.tolist()])]
