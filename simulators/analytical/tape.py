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
latest and is left out (`Tape.latest`): an op after a collective that itself waited for the op before it waits for
the collective alone. That keeps about a sixth of the nodes out and most maxes down to one argument; making a
marked kernel's node only once an op reads its end (`_MARKED`) keeps out as many again (Llama-3-70B's steady
form: 110k to 73k nodes).

`_Recorder` walks `engine._Scheduler`'s rules step for step (its hot loop cannot carry node ids, and slowing it to
share code would slow every per-point simulation); `tests/test_analytical_batch.py` compares the two on every
schedule kind, so a rule changed in one and not the other fails there.
"""

from collections import deque
from dataclasses import dataclass, field

from dse.system import SystemSpec
from dse.workload import Workload
from simulators.analytical.plans import COMPUTE, SEND, Link, Plan, Planner

MAX_ADD, MIN, SHARED = range(3)
ZERO, INF = 0, 1
_PARKED = -1
"""A time the engine holds as inf: an op waiting on a transfer that has not paired yet."""
_MARKED = -2
"""A kernel marked inside a fused run whose end no op has read yet: its node is made when one does (`_Run.marked`),
as most are never read (Llama-3-70B's steady form: 16k of 25k)."""


@dataclass(slots=True, frozen=True)
class Column:
    """A duration the tape adds: block ops lo..hi (inclusive) of a block as one rank class runs it, summed."""

    block: int
    rank_class: int
    lo: int
    hi: int


@dataclass(slots=True)
class ClassTape:
    """What one rank class's figures are read from: node ids of its times."""

    call_start: list[int]
    call_end: list[int]
    compute: list[tuple[int, int, int]]
    """(end node of its first op, that op's column, end node) of every compute interval: its start is the first
    op's end less its column. Ops that run back to back on every system (one waits for the other alone) make one
    interval; on one stream, the intervals never overlap."""
    comm: list[tuple[int, int]]
    """(start node, end node) of every communication op."""
    transfers: list[tuple[int, int, int, int]]
    """(category, call, start node, end node) of every p2p transfer."""
    priced: list[int]
    """Per call, the plan its block runs as (an index into `Tape.plans`)."""


@dataclass(slots=True)
class Tape:
    kind: list[int] = field(default_factory=lambda: [MAX_ADD, MAX_ADD])
    args: list[tuple[int, ...]] = field(default_factory=lambda: [(), ()])
    column: list[int] = field(default_factory=lambda: [-1, -1])
    under: list[tuple[int, ...]] = field(default_factory=lambda: [(), ()])
    depth: list[int] = field(default_factory=lambda: [0, 0])
    """1 + the deepest argument's depth: nodes of one depth can be evaluated together."""
    columns: list[Column] = field(default_factory=list)
    classes: list[ClassTape] = field(default_factory=list)
    plans: list[Plan] = field(default_factory=list)
    plan_class: list[int] = field(default_factory=list)
    """The rank class each plan was built for (its collectives priced for that class's groups)."""
    plan_block: list[int] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)

    def node(self, kind: int, args: tuple[int, ...], column: int = -1) -> int:
        self.kind.append(kind)
        self.args.append(args)
        self.column.append(column)
        # what the node is never earlier than: a max's arguments, a shared transfer's start (not the link's time)
        self.under.append(args if kind == MAX_ADD else args[:1] if kind == SHARED else ())
        depth = self.depth
        depth.append(depth[args[0]] + 1 if len(args) == 1 else 1 + max([depth[a] for a in args]))
        return len(depth) - 1

    def latest(self, args: list[int], column: int = -1) -> int:
        """The node max(args) + column (`after`, `needed`)."""
        return self.after(self.needed(args), column)

    def after(self, needed: tuple[int, ...], column: int = -1) -> int:
        """The node max(needed) + column, reusing an existing node for a plain max of one argument."""
        if column < 0 and len(needed) == 1:
            return needed[0]
        return self.node(MAX_ADD, needed, column)

    def needed(self, args: list[int]) -> tuple[int, ...]:
        """The arguments a max of `args` needs: each once, ZERO beside others left out, and an argument that another
        one is built on, two steps back, left out (see the module docstring). Ops of a stream read the same
        arguments for their start and their end: they work this out once for both."""
        if len(args) == 1:
            return (args[0],)
        if len(args) == 2:  # most maxes
            a, b = args
            if a == b or b == ZERO:
                return (a,)
            if a == ZERO or self._beneath(a, b):
                return (b,)
            return (a,) if self._beneath(b, a) else (a, b)
        distinct = list(dict.fromkeys(args))
        if len(distinct) > 1 and ZERO in distinct:
            distinct.remove(ZERO)
        if len(distinct) <= 1:
            return tuple(distinct) or (ZERO,)
        beneath = self._beneath
        return tuple(a for a in distinct if not any(beneath(a, b) for b in distinct))

    def _beneath(self, low: int, high: int) -> bool:
        """Whether `high` is built on `low`, one or two steps back (what a node is built on comes before it)."""
        if low >= high:
            return False
        under = self.under
        above = under[high]
        return low in above or any(low in under[b] for b in above)


@dataclass(slots=True, eq=False)
class _Run:
    index: int
    plans: list[Plan]
    plan_ids: list[int]
    stream_end: list[int]
    out_end: list[int]
    starts: list[dict[int, int]]
    """Per call and stream, the start of the call's first op on it: a stream runs in order, so the call's earliest
    start is the earliest of these."""
    ends: list[dict[int, int]]
    """Per call and stream, the end of the call's last op on it."""
    local: list[int] = field(default_factory=list)
    marked: dict[int, tuple[tuple[int, ...], int]] = field(default_factory=dict)
    """Per marked slot of the current call (`_MARKED` in `local`), the arguments and column of its node."""
    compute: list[tuple[int, int, int]] = field(default_factory=list)
    comm: list[tuple[int, int]] = field(default_factory=list)
    transfers: list[tuple[int, int, int, int]] = field(default_factory=list)
    call: int = 0
    op: int = 0
    queued: bool = True


@dataclass(slots=True, eq=False)
class _Side:
    run: _Run
    call: int
    op: int
    kind: int
    stream: int
    ready: int
    column: int
    local: list[int]
    category: int
    shares: tuple[int, ...]
    output: bool


def record(workload: Workload, system: SystemSpec) -> Tape:
    """The tape of the workload's step on any system with this one's network shape (`engine.schedule`'s rules)."""
    return _Recorder(workload, system).run()


class _Recorder:
    def __init__(self, workload: Workload, system: SystemSpec) -> None:
        self._workload = workload
        self._planner = Planner(workload, system, fuse=True)
        self._tape = Tape()
        self._plan_ids: dict[int, int] = {}
        self._op_columns: dict[int, list[int]] = {}
        self._mark_columns: dict[tuple[int, int], int] = {}
        self._mailbox: dict[tuple[Link, int], deque[_Side]] = {}
        self._runnable: deque[_Run] = deque()

    def run(self) -> Tape:
        runs = []
        for index, program in enumerate(self._workload.programs):
            plans = [self._planner.plan(c.block, index) for c in program.calls]
            ids = [self._plan_id(plan, index, c.block) for plan, c in zip(plans, program.calls, strict=True)]
            calls = len(program.calls)
            runs.append(
                _Run(index, plans, ids, [], [ZERO] * calls, [{} for _ in range(calls)], [{} for _ in range(calls)])
            )
        streams = len(self._planner.streams)
        for run in runs:  # streams are numbered while plans are built, so their count is known only now
            run.stream_end = [ZERO] * streams
        self._runnable.extend(runs)
        while self._runnable:
            run = self._runnable.popleft()
            run.queued = False
            while run.call < len(run.plans) and self._issue_call(run):
                pass
        if any(run.call < len(run.plans) for run in runs) or self._mailbox:
            raise RuntimeError("pipeline deadlock (a generator bug): the reference scheduler names the ops")
        tape = self._tape
        tape.categories = list(self._planner.categories)
        for run in runs:
            tape.classes.append(
                ClassTape(
                    call_start=[_earliest(tape, [*s.values()]) for s in run.starts],
                    call_end=[tape.latest([*e.values()]) for e in run.ends],
                    compute=run.compute,
                    comm=run.comm,
                    transfers=run.transfers,
                    priced=run.plan_ids,
                )
            )
        return tape

    def _plan_id(self, plan: Plan, rank_class: int, block: int) -> int:
        """The plan's index on the tape, its ops' and marks' columns made on first sight."""
        key = id(plan)
        found = self._plan_ids.get(key)
        if found is not None:
            return found
        tape = self._tape
        columns = []
        lo = 0
        for op in plan.ops:
            slot, marks = op[5], op[6]
            columns.append(self._column(Column(block, rank_class, lo, slot)))
            for k, _ in marks:
                self._mark_columns[(len(tape.plans), k)] = self._column(Column(block, rank_class, lo, k))
            lo = slot + 1
        self._plan_ids[key] = len(tape.plans)
        self._op_columns[len(tape.plans)] = columns
        tape.plans.append(plan)
        tape.plan_class.append(rank_class)
        tape.plan_block.append(block)
        return len(tape.plans) - 1

    def _column(self, column: Column) -> int:
        self._tape.columns.append(column)
        return len(self._tape.columns) - 1

    def _issue_call(self, run: _Run) -> bool:
        """`engine._Scheduler._issue_call` over node ids; False when the run parks."""
        tape = self._tape
        c = run.call
        plan, plan_id = run.plans[c], run.plan_ids[c]
        columns = self._op_columns[plan_id]
        if run.op == 0:
            run.local = [ZERO] * len(plan.block.ops)
            run.marked = {}
        stream_end, local = run.stream_end, run.local
        inputs = self._workload.programs[run.index].calls[c].inputs
        ready = [run.out_end[i] for i in inputs]
        inputs_ready = _PARKED if _PARKED in ready else tape.latest(ready)
        ops = plan.ops
        starts, ends, compute = run.starts[c], run.ends[c], run.compute
        j = run.op
        while j < len(ops):
            kind, stream, _, deps, waits_on_inputs, slot, marks, category, link, shares = ops[j]
            args = [stream_end[stream]]
            if waits_on_inputs:
                args.append(inputs_ready)
            if deps:
                read = [local[d] for d in deps]
                if _MARKED in read:
                    read = [self._marked_end(run, d) for d in deps]
                args += read
            if link is None:
                args += [stream_end[r] for r in shares]
            if _PARKED in args:
                run.op = j
                return False
            if link is None:
                needed = tape.needed(args)
                end = tape.after(needed, columns[j])
                local[slot] = end
                for k, _ in marks:
                    local[k] = _MARKED
                    run.marked[k] = (needed, self._mark_columns[(plan_id, k)])
                stream_end[stream] = end
                for r in shares:
                    stream_end[r] = end
                if kind == COMPUTE:
                    if compute and needed == (compute[-1][2],):  # waits for the last compute alone: one interval
                        compute[-1] = (compute[-1][0], compute[-1][1], end)
                    else:
                        compute.append((end, columns[j], end))
                    if stream not in starts:  # a stream runs in order: its first op of the call starts first
                        starts[stream] = tape.after(needed)
                else:
                    start = tape.after(needed)
                    run.comm.append((start, end))
                    starts.setdefault(stream, start)
                ends[stream] = end
            else:
                side = _Side(run, c, slot, kind, stream, tape.latest(args), columns[j], local, category, shares,
                             slot == plan.output)  # fmt: skip
                self._rendezvous(side, (link, self._workload.programs[run.index].calls[c].tag))
            j += 1
        run.out_end[c] = self._marked_end(run, plan.output)
        run.call, run.op = c + 1, 0
        return True

    def _marked_end(self, run: _Run, slot: int) -> int:
        """The end of the current call's op or marked kernel at `slot`, a marked kernel's node made on first read."""
        end = run.local[slot]
        if end == _MARKED:
            end = run.local[slot] = self._tape.after(*run.marked[slot])
        return end

    def _rendezvous(self, side: _Side, key: tuple[Link, int]) -> None:
        queue = self._mailbox.get(key)
        if not queue or queue[0].kind == side.kind:
            self._mailbox.setdefault(key, deque()).append(side)
            side.local[side.op] = _PARKED
            side.run.stream_end[side.stream] = _PARKED
            return
        other = queue.popleft()
        if not queue:
            del self._mailbox[key]
        tape = self._tape
        start = tape.latest([side.ready, other.ready])
        busy = tape.latest([start, *(s.run.stream_end[r] for s in (side, other) for r in s.shares)])
        column = side.column if side.kind == SEND else other.column
        end = tape.node(SHARED, (start, busy), column) if busy != start else tape.latest([start], column)
        for s in (side, other):
            self._settle(s, start, end)
        if not other.run.queued:
            other.run.queued = True
            self._runnable.append(other.run)

    def _settle(self, side: _Side, start: int, end: int) -> None:
        run = side.run
        side.local[side.op] = end
        run.stream_end[side.stream] = end
        for r in side.shares:
            run.stream_end[r] = self._tape.latest([run.stream_end[r], end])
        if side.output:
            run.out_end[side.call] = end
        run.transfers.append((side.category, side.call, start, end))
        run.comm.append((start, end))
        run.starts[side.call].setdefault(side.stream, start)
        run.ends[side.call][side.stream] = end


def _earliest(tape: Tape, starts: list[int]) -> int:
    """min(starts); inf for a call without ops, as the engine leaves it."""
    if not starts:
        return INF
    distinct = tuple(dict.fromkeys(starts))
    return distinct[0] if len(distinct) == 1 else tape.node(MIN, distinct)
