"""Dependency-driven list scheduling of every rank class's program, all classes jointly.

Each op starts when its dependencies and the previous op on its stream have ended, as kernels do on CUDA
streams: compute on "compute", a collective on "comm:<axis>", sends on "send:<axis>", recvs on "recv:<axis>".
A send and its recv rendezvous, as NCCL's do: the transfer starts when both sides are ready and both ops end
together, so a pipeline stage that waits for its input idles rather than communicates.

The engine walks block plans (see `plans`) with the same dependency rules as `dse.workload.expand`, not the
expanded graph itself: an object per op would dominate the cost of a step with a hundred thousand ops, while a
plan is priced once and the hot loop touches only lists of floats. Programs advance round-robin. When an op
needs a time that is not known yet (it waits on a p2p of its own program whose partner has not been reached),
the program parks until that partner turns up; the ops it issued before keep their times, and independent p2p
ops on other streams can still post, so a send_forward/recv_backward exchange between two stages does not
deadlock here any more than it does on a GPU. Matching is first-in first-out per (link, tag), so reused tags
pair in issue order.
"""

from collections import deque
from dataclasses import dataclass, field
from math import inf
from typing import NamedTuple

import numpy as np

from dse.interfaces import TimelineEvent
from dse.system import SystemSpec
from dse.workload import Call, Program, Workload
from simulators.analytical.intervals import Busy, split_busy
from simulators.analytical.plans import Link, Plan, Planner
from simulators.analytical.recipes import COMPUTE, SEND, stream_of


class Transfers(NamedTuple):
    """(call, category, seconds) of every p2p transfer of a class, in the order they settle: unlike other ops',
    their time is known only once paired. Arrays, as the compiled scheduler records them and `steady` sums them."""

    call: np.ndarray
    category: np.ndarray
    seconds: np.ndarray

    @classmethod
    def of(cls, rows: list[tuple[int, int, float]]) -> "Transfers":
        calls, categories, seconds = zip(*rows, strict=True) if rows else ((), (), ())
        return cls(
            np.array(calls, dtype=np.int64), np.array(categories, dtype=np.int64), np.array(seconds, dtype=float)
        )

    def rows(self) -> list[tuple[int, int, float]]:
        """The transfers as (call, category, seconds) tuples."""
        return list(zip(self.call.tolist(), self.category.tolist(), self.seconds.tolist(), strict=True))


@dataclass(slots=True)
class ClassSchedule:
    """One rank class's simulated step, reduced to what its ClassResult and its memory sweep need."""

    end_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    time_by_category: dict[str, float]
    call_start: list[float]
    """Start of each call's earliest op."""
    call_end: list[float]
    """End of each call's latest op: until then the call holds its inputs and its working memory."""
    events: list[TimelineEvent]
    busy: Busy | None = None
    """The busy intervals, when the scheduler keeps them (the compiled one's `schedules` does)."""
    transfers: Transfers | None = None
    """Its p2p transfers, when the scheduler keeps them (both engines do; `steady`'s extended schedules do not)."""


@dataclass(slots=True, eq=False)
class _Run:
    """Where one program has got to, and everything it has recorded so far."""

    index: int
    program: Program
    calls: tuple[Call, ...]
    """The program's calls, read once per call issued: a tuple of them, as a generated program's read its shape's
    through Python (`dse.calls.ShapeCalls`)."""
    plans: list[Plan]
    stream_end: list[float]
    out_end: list[float]
    call_start: list[float]
    call_end: list[float]
    category_time: list[float]
    events: list[TimelineEvent] | None
    compute_starts: list[float] = field(default_factory=list)
    compute_ends: list[float] = field(default_factory=list)
    comm_starts: list[float] = field(default_factory=list)
    comm_ends: list[float] = field(default_factory=list)
    call: int = 0
    op: int = 0
    """Position in the current call's plan ops."""
    local: list[float] = field(default_factory=list)
    """End of each op of the current call's block, by block op index."""
    queued: bool = False
    transfers: list[tuple[int, int, float]] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.call == len(self.calls)


@dataclass(slots=True, eq=False)
class _Parked:
    """One side of a p2p transfer, waiting for the other; `local` is its call's list of op ends."""

    run: _Run
    call: int
    op: int
    """Block op index."""
    kind: int
    stream: int
    ready: float
    seconds: float
    local: list[float]
    category: int
    shares: tuple[int, ...]
    """Network streams the transfer occupies on this side (see plans.PlanOp)."""
    held: float
    """The latest end of its shares when it was issued (`_reserve`)."""
    output: bool
    """Whether the op's end is its call's output."""


def _reserve(stream_end: list[float], shares: tuple[int, ...], ready: float, seconds: float) -> float:
    """Reserve a transfer's shares on its side as it is issued, ready at `ready`: until it would end were its
    partner ready then as well (stretched as `_Scheduler._rendezvous` stretches it by what holds them). The latest
    end they had before, returned, is what the transfer shares them with.

    The reservation, not the transfer's settled end, is what its run's later ops on the link queue behind: both
    are known once the side is issued, whichever side the scheduler reaches first. The settled end is not: a side
    reached first parks while its run goes on, and its later ops would queue behind the transfer or take the link
    before it (and stretch it) by the order the scheduler advances programs in (a stage's last send-backward, then
    its optimizer's reductions: stretched by its own length in a step and not in its steady form). Waiting for
    the settled end instead is no rule: two stages that each send to the other before a collective and receive
    after it would deadlock, where NCCL runs both collectives while the sends wait (interleaved 1F1B with cp on
    one node)."""
    held = 0.0
    for r in shares:
        if stream_end[r] > held:
            held = stream_end[r]
    if shares:
        busy = held if held > ready else ready
        reserved = ready + seconds + min(seconds, busy - ready)
        for r in shares:
            if reserved > stream_end[r]:
                stream_end[r] = reserved
    return held


def schedule(workload: Workload, system: SystemSpec, timeline: bool = False) -> list[ClassSchedule]:
    """The simulated step of every program, in workload.programs order. Raises RuntimeError on a deadlock."""
    return _Scheduler(workload, system, timeline).run()


class _Scheduler:
    def __init__(self, workload: Workload, system: SystemSpec, timeline: bool) -> None:
        self._workload = workload
        self._planner = Planner(workload, system, fuse=not timeline)
        self._timeline = timeline
        self._mailbox: dict[tuple[Link, int], deque[_Parked]] = {}
        self._runnable: deque[_Run] = deque()

    def run(self) -> list[ClassSchedule]:
        programs = self._workload.programs
        plans = [[self._planner.plan(c.block, index) for c in p.calls] for index, p in enumerate(programs)]
        runs = [self._start(index, program, plans[index]) for index, program in enumerate(programs)]
        return self._drive(runs)

    def _drive(self, runs: list[_Run]) -> list[ClassSchedule]:
        """Advance runnable programs until none is left, check every one finished, and summarise them."""
        self._runnable.extend(runs)
        while self._runnable:
            run = self._runnable.popleft()
            run.queued = False
            self._advance(run)
        self._check_finished(runs)
        return [self._finish(run) for run in runs]

    def _start(self, index: int, program: Program, plans: list[Plan]) -> _Run:
        own = tuple(program.calls)
        calls = len(own)
        return _Run(
            index=index,
            program=program,
            calls=own,
            plans=plans,
            stream_end=[0.0] * len(self._planner.streams),
            out_end=[0.0] * calls,
            call_start=[inf] * calls,
            call_end=[0.0] * calls,
            category_time=[0.0] * len(self._planner.categories),
            events=[] if self._timeline else None,
            local=[0.0] * len(plans[0].block.ops) if plans else [],
            queued=True,
        )

    def _advance(self, run: _Run) -> None:
        """Schedule the run's ops in issue order until it finishes or needs a time not known yet."""
        calls = run.calls
        while run.call < len(calls):
            if not self._issue_call(run):
                return

    def _issue_call(self, run: _Run) -> bool:
        """Schedule the rest of the run's current call; False when it parks on a p2p partner not reached yet."""
        c = run.call
        call, plan = run.calls[c], run.plans[c]
        if run.op == 0:
            run.local = [0.0] * len(plan.block.ops)
        stream_end, out_end, local, events = run.stream_end, run.out_end, run.local, run.events
        inputs_ready = 0.0
        for i in call.inputs:
            if out_end[i] > inputs_ready:
                inputs_ready = out_end[i]
        first, last = run.call_start[c], run.call_end[c]
        ops = plan.ops
        j = run.op
        while j < len(ops):
            kind, stream, seconds, deps, waits_on_inputs, slot, marks, category, link, shares = ops[j]
            start = stream_end[stream]
            if waits_on_inputs and inputs_ready > start:
                start = inputs_ready
            for d in deps:
                if local[d] > start:
                    start = local[d]
            if link is None:  # a transfer shares its link instead of queueing for it (`_rendezvous`)
                for r in shares:
                    if stream_end[r] > start:
                        start = stream_end[r]
            if start == inf:
                run.op = j
                run.call_start[c], run.call_end[c] = min(run.call_start[c], first), max(run.call_end[c], last)
                return False
            if link is None:
                end = start + seconds
                local[slot] = end
                for k, offset in marks:
                    local[k] = start + offset
                stream_end[stream] = end
                for r in shares:
                    stream_end[r] = end
                if kind == COMPUTE:
                    run.compute_starts.append(start)
                    run.compute_ends.append(end)
                else:
                    run.comm_starts.append(start)
                    run.comm_ends.append(end)
                if events is not None:
                    self._event(run, c, slot, start, end)
            else:
                held = _reserve(stream_end, shares, start, seconds)
                side = _Parked(
                    run, c, slot, kind, stream, start, seconds, local, category, shares, held, slot == plan.output
                )
                start, end = self._rendezvous(side, (link, call.tag))
                if end == inf:
                    j += 1
                    continue
            if start < first:
                first = start
            if end > last:
                last = end
            j += 1
        run.call_start[c], run.call_end[c] = min(run.call_start[c], first), max(run.call_end[c], last)
        out_end[c] = local[plan.output]
        for index, busy in plan.category_seconds:
            run.category_time[index] += busy
        run.call, run.op = c + 1, 0
        return True

    def _rendezvous(self, side: _Parked, key: tuple[Link, int]) -> tuple[float, float]:
        """Pair a p2p op with its partner and settle both, or park it; (inf, inf) when parked.

        A transfer starts once both ends are ready, even while a collective holds a network dimension it crosses:
        NCCL runs the two communicators' kernels at once and they share the link, so the transfer goes at half
        rate while the collective lasts (stretched by up to its own length). Queueing it behind the collective
        instead held the last backward sends of a pipeline behind the data-parallel reductions issued before
        them (hundreds of ms per stage on a 405B point), where on the wire they are a small share of the link.
        Collectives still queue behind what holds a dimension (`plans.PlanOp`), a transfer as its side reserved it
        (`_reserve`); the busy time is each side's shares' end as it was issued."""
        queue = self._mailbox.get(key)
        if not queue or queue[0].kind == side.kind:
            if queue is None:
                queue = self._mailbox[key] = deque()
            queue.append(side)
            side.local[side.op] = inf
            side.run.stream_end[side.stream] = inf
            return inf, inf
        other = queue.popleft()
        if not queue:  # tags are mostly unique: keep the mailbox to the transfers still waiting
            del self._mailbox[key]
        start = side.ready if side.ready > other.ready else other.ready
        busy = start
        for end_of in (side, other):
            if end_of.held > busy:
                busy = end_of.held
        seconds = side.seconds if side.kind == SEND else other.seconds
        end = start + seconds + min(seconds, busy - start)
        self._settle(side, start, end)
        self._settle(other, start, end)
        run = other.run
        if start < run.call_start[other.call]:
            run.call_start[other.call] = start
        if end > run.call_end[other.call]:
            run.call_end[other.call] = end
        if not run.queued:
            run.queued = True
            self._runnable.append(run)
        return start, end

    def _settle(self, side: _Parked, start: float, end: float) -> None:
        run = side.run
        side.local[side.op] = end
        run.stream_end[side.stream] = end
        if side.output:
            run.out_end[side.call] = end
        run.category_time[side.category] += end - start
        run.transfers.append((side.call, side.category, end - start))
        run.comm_starts.append(start)
        run.comm_ends.append(end)
        if run.events is not None:
            self._event(run, side.call, side.op, start, end)

    def _event(self, run: _Run, call: int, op_index: int, start: float, end: float) -> None:
        op = run.plans[call].block.ops[op_index]
        source = self._planner.source(run.calls[call].block, op_index, run.index)
        run.events.append(TimelineEvent(run.index, stream_of(op), op.name, op.category, start, end, source))

    def _check_finished(self, runs: list[_Run]) -> None:
        stuck = []
        for run in runs:
            if not run.done:
                slot = run.plans[run.call].ops[run.op][5]
                stuck.append(f"'{run.program.name}' waits at call {run.call} op '{self._op_name(run, run.call, slot)}'")
        unmatched = [
            f"unmatched {'send' if p.kind == SEND else 'recv'} '{self._op_name(p.run, p.call, p.op)}' of "
            f"'{p.run.program.name}' call {p.call} (link {key[0]}, tag {key[1]})"
            for key, queue in self._mailbox.items()
            for p in queue
        ]
        if stuck or unmatched:
            raise RuntimeError(f"pipeline deadlock (a generator bug): {'; '.join(stuck + unmatched)}")

    @staticmethod
    def _op_name(run: _Run, call: int, op_index: int) -> str:
        return run.plans[call].block.ops[op_index].name

    def _finish(self, run: _Run) -> ClassSchedule:
        compute_s, comm_s, exposed_s = split_busy(run.compute_starts, run.compute_ends, run.comm_starts, run.comm_ends)
        names = list(self._planner.categories)
        used = set().union(*(plan.categories for plan in run.plans))
        return ClassSchedule(
            end_s=max(run.compute_ends + run.comm_ends, default=0.0),
            compute_s=compute_s,
            comm_s=comm_s,
            exposed_comm_s=exposed_s,
            time_by_category={names[i]: run.category_time[i] for i in sorted(used)},
            call_start=run.call_start,
            call_end=run.call_end,
            events=run.events or [],
            transfers=Transfers.of(run.transfers),
        )
