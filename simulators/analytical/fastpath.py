"""The fast path: the reference schedule, with every run of calls between two p2p calls priced once per state.

A program is a sequence of *segments* (maximal runs of calls without a send or recv) separated by p2p calls.
A segment's ops depend only on the state it is entered with: when each stream it uses is free and when its
external inputs (outputs of earlier calls) are ready. Relative to the compute stream's free time `t0`, that
state repeats: every forward of a 1F1B steady state enters its stage the same way, and so does every backward.
So a segment is simulated once per (plans of its blocks, call structure, relative entry state) by the reference
rules, and every later segment with the same key reuses the result shifted by its own `t0`: the end of each
stream, each call's start, end and output, the busy intervals (merged) and the busy seconds per category. A
structure names the segment's external inputs by the order it reads them, not by where they are: a backward reads
its forward's activation from however far back, and only that output's time (in the key) matters. Pipeline stages
that run a segment's blocks with the same plans share its structure, and so its outcomes.

Where the p2p calls split a program (its `_Layout`) depends on its calls alone; the generator hands every program
of a later point with the same schedule shape the same `CallShape`, which keeps the layout, so only the first point
of a shape walks the calls.

Entry times before t0 mostly decide nothing (a stream that was free earlier, an input ready long before), so a
key first clamps them to t0 and recurs far more often; the simulation checks whether a clamped time decided any
op's start and, if one did, the key falls back to the exact times (see `_run_segment`). Inside a simulated
segment, calls are priced the same way one by one (`_price_call`), so the chained layers of a segment that is
new as a whole still come from the cache.

Keys round relative times to `QUANTUM_S`, so a reused result can be off by at most that per segment, far below
the 1% the fast path promises (`tests/test_analytical_fastpath.py` checks it against the reference). P2p calls
run through the reference rules one by one, so pipeline stages still couple through their rendezvous; a segment
whose entry state is not known yet (it waits on a recv still unmatched) parks its program as the reference does.
"""

from dataclasses import dataclass
from math import inf

import numpy as np

from dse.system import SystemSpec
from dse.workload import OpKind, Program, Workload
from simulators.analytical.engine import ClassSchedule, _Parked, _Run, _Scheduler
from simulators.analytical.fast_compiled import run_compiled
from simulators.analytical.intervals import Busy, merge
from simulators.analytical.plans import COMPUTE

QUANTUM_S = 1e-9
"""Resolution of the relative entry times in a segment's key (a nanosecond)."""
_SCALE = 1.0 / QUANTUM_S


@dataclass(slots=True, frozen=True)
class _Segment:
    """Calls [start, end) of one program and what their key is made of."""

    start: int
    end: int
    kind: int
    """Index of the segment's signature in its layout."""
    external: tuple[int, ...]
    """Earlier calls whose outputs the segment reads, one per read, in the order the signature meets them."""
    first_inputs: tuple[int, ...]
    """Inputs of the segment's first call: the latest of them and the compute stream's end make its t0."""


@dataclass(slots=True, frozen=True)
class _Layout:
    """Where a program's p2p calls split it. Derived from its calls alone, so a program whose CallShape holds
    keeps it in the shape's memo, and later points of the same shape skip the walk over every call."""

    segments: list["_Segment | None"]
    """By call: the segment that starts there; None for a p2p call and for calls inside a segment."""
    signatures: tuple[tuple[int, ...], ...]
    """The distinct segment structures: per call its block, its number of inputs and, per input, its position
    in the segment or, for an external input, -1 - its place in `external`, flat. Where the segment sits and
    which earlier calls it reads do not enter: only those calls' times do, through the key."""
    blocks: tuple[frozenset[int], ...]
    """The blocks of each signature."""
    used: tuple[int, ...]
    """Every block the program calls, sorted."""


def _layout(calls: "list | tuple", p2p: frozenset[int]) -> _Layout:
    """Segments by their first call; p2p calls stay out of every segment. This loop touches every call of the
    program once, so it is kept to the bare minimum per call."""
    segments: list[_Segment | None] = [None] * len(calls)
    kinds: dict[tuple[int, ...], int] = {}
    start = -1
    signature: list[int] = []
    external: list[int] = []
    extend, add_external = signature.extend, external.append
    transfers: set[int] = set()

    def close(end: int) -> None:
        kind = kinds.setdefault(tuple(signature), len(kinds))
        segments[start] = _Segment(start, end, kind, tuple(external), calls[start].inputs)

    for c, call in enumerate(calls):
        block = call.block
        if block in p2p:
            transfers.add(block)
            if start >= 0:
                close(c)
                start = -1
            continue
        if start < 0:
            start = c
            signature.clear()
            external.clear()
        inputs = call.inputs
        if len(inputs) == 1:
            i = inputs[0]
            if i < start:
                i = -1 - len(external)
                add_external(inputs[0])
            else:
                i -= start
            extend((block, 1, i))
        else:
            extend((block, len(inputs)))
            for i in inputs:
                if i < start:
                    signature.append(-1 - len(external))
                    add_external(i)
                else:
                    signature.append(i - start)
    if start >= 0:
        close(len(calls))
    signatures = tuple(kinds)
    blocks = tuple(frozenset(sig[k] for k in _call_offsets(sig)) for sig in signatures)
    used = transfers.union(*blocks)
    return _Layout(segments, signatures, blocks, tuple(sorted(used)))


def _call_offsets(signature: tuple[int, ...]) -> list[int]:
    """Where each call starts in a flat signature."""
    offsets, k = [], 0
    while k < len(signature):
        offsets.append(k)
        k += 2 + signature[k + 1]
    return offsets


def program_layout(program: Program, p2p: frozenset[int]) -> _Layout:
    """The program's layout, from its CallShape's memo when the shape still holds its calls."""
    shape = program.call_shape()
    if shape is None:
        return _layout(program.calls, p2p)
    key = ("fastpath.layout", p2p)
    layout = shape.memo.get(key)
    if layout is None:
        layout = shape.memo[key] = _layout(shape.calls, p2p)
    return layout


@dataclass(slots=True, frozen=True)
class _Outcome:
    """A simulated segment, every time relative to its t0."""

    stream_end: tuple[tuple[int, float], ...]
    call_start: np.ndarray
    call_end: np.ndarray
    out_end: tuple[float, ...]
    compute: tuple[np.ndarray, np.ndarray]
    """Merged busy intervals (starts, ends) of the compute stream."""
    comm: tuple[np.ndarray, np.ndarray]
    """Merged busy intervals of the communication streams."""
    category_time: tuple[tuple[int, float], ...]


_CLAMP_AT_T0, _CLAMP_ALL, _CLAMP_INPUTS, _CLAMP_NONE = range(4)
"""How a key treats entry times up to t0: all clamped, those at t0 too (see _run_segment); all clamped but those at
t0; only the inputs clamped but those at t0; none clamped."""
_NONE = np.zeros(0)
_UNCLAMPABLE = _Outcome((), _NONE, _NONE, (), (_NONE, _NONE), (_NONE, _NONE), ())
"""Cached under a clamped key whose clamp decided some op's start: look the exact key up instead."""


def schedule_fast(workload: Workload, system: SystemSpec) -> list[ClassSchedule]:
    """The same schedules as `engine.schedule` (within QUANTUM_S per segment), without a timeline."""
    return _FastScheduler(workload, system).run()


_NO_ANCHOR = (-1, False)
"""The anchor of every call but a segment's first under _CLAMP_AT_T0 (see _price_call)."""
_BOUND = object()
"""A call whose ops' start a clamped entry time decided (see _FastScheduler._simulate)."""


def _price_call(
    plan,
    stream_end: list[float],
    floor: set[int],
    ready: float,
    ready_floor: bool,
    base: float,
    streams: tuple,
    anchor: tuple[int, bool],
) -> "tuple | object":
    """One call of a segment by the reference rules, relative to `base`: the streams' new ends, the call's first
    start, last end and output, and its compute and communication intervals; _BOUND if a clamped time decided an
    op's start. Works on copies: the caller applies the result, so that a cached result applies the same way.

    For a segment's first call under _CLAMP_AT_T0, `anchor` is (the compute stream, whether the call has no
    inputs): its base is t0 = max(the compute stream's end, the call's inputs), so an op on the compute stream
    that waits for the inputs (any op there, with no inputs) starts at exactly t0 whichever of the two was
    clamped, and the clamp decides nothing."""
    anchor_stream, anchor_any = anchor
    ends = {x: stream_end[x] for x in streams}
    floored = floor.intersection(streams) if floor else set()
    local = [0.0] * len(plan.block.ops)
    first, last = inf, 0.0
    cs: list[float] = []
    ce: list[float] = []
    ms: list[float] = []
    me: list[float] = []
    for kind, stream, seconds, deps, waits_on_inputs, slot, marks, _category, _link, shares in plan.ops:
        start = ends[stream]
        bound = stream in floored
        if waits_on_inputs:
            if ready > start:
                start, bound = ready, ready_floor
            elif ready == start:
                bound = bound and ready_floor
        if bound and stream == anchor_stream and start == base and (waits_on_inputs or anchor_any):
            bound = False
        for d in deps:
            if local[d] >= start:
                start, bound = local[d], False
        for r in shares:
            if ends[r] > start:
                start, bound = ends[r], r in floored
            elif ends[r] == start:
                bound = bound and r in floored
        if bound:
            return _BOUND
        floored.discard(stream)
        end = start + seconds
        local[slot] = end
        for j, offset in marks:
            local[j] = start + offset
        ends[stream] = end
        for r in shares:
            ends[r] = end
            floored.discard(r)
        if kind == COMPUTE:
            cs.append(start - base)
            ce.append(end - base)
        else:
            ms.append(start - base)
            me.append(end - base)
        if start < first:
            first = start
        if end > last:
            last = end
    return (
        tuple(ends[x] - base for x in streams),
        first - base,
        last - base,
        local[plan.output] - base,
        tuple(cs),
        tuple(ce),
        tuple(ms),
        tuple(me),
    )


class _FastScheduler(_Scheduler):
    """The reference scheduler's p2p pairing and parking, with segments priced through the caches."""

    def __init__(self, workload: Workload, system: SystemSpec) -> None:
        super().__init__(workload, system, timeline=False)
        self._outcomes: dict[tuple, _Outcome] = {}
        self.simulated = 0
        """Segments simulated by the reference rules (the rest came from the outcome cache)."""
        self._first_tier: dict[int, int] = {}
        self._structures: dict[tuple, int] = {}
        self._structure_streams: list[tuple[int, ...]] = []
        self._calls: dict[tuple, tuple | object] = {}
        """Calls priced inside segment simulations, by plan and relative entry state (see _price_call)."""
        self._plan_streams: dict[int, tuple[int, ...]] = {}
        self._p2p_blocks = frozenset(
            b
            for b, block in enumerate(workload.blocks)
            if any(op.kind in (OpKind.SEND, OpKind.RECV) for op in block.ops)
        )
        self._layouts: list[_Layout] = []
        self._kinds: list[list[int]] = []
        self._lone_transfers: list[set[int]] = []
        """Per program, the blocks that are one p2p op (see _issue_transfer)."""
        """Per program, the structure number of each signature of its layout."""
        self._compute_stream = 0

    def run(self) -> list[ClassSchedule]:
        programs = self._workload.programs
        self._layouts = [program_layout(p, self._p2p_blocks) for p in programs]
        plans = [{b: self._planner.plan(b, index) for b in layout.used} for index, layout in enumerate(self._layouts)]
        self._compute_stream = self._planner.streams.setdefault("compute", len(self._planner.streams))
        self._kinds = [self._structures_of(index, plans[index]) for index in range(len(programs))]
        self._lone_transfers = [
            {b for b, plan in built.items() if len(plan.ops) == 1 and plan.ops[0][8] is not None} for built in plans
        ]
        self._applied: list[list[tuple[float, _Outcome, int]]] = [[] for _ in programs]
        self._block_plans = plans
        if (compiled := run_compiled(self)) is not None:
            return compiled
        runs = [self._start_fast(index, program) for index, program in enumerate(programs)]
        return self._drive(runs)

    def _structures_of(self, index: int, plans: dict) -> list[int]:
        """Number the distinct (plans, signature) pairs of a program's segments: cache keys hash a small int.
        Classes that run a segment's blocks with the same plans (pipeline stages alike but for their ends) share
        its structure, and so its outcomes."""
        numbers = []
        for signature, blocks in zip(self._layouts[index].signatures, self._layouts[index].blocks, strict=True):
            key = (tuple([id(plans[b]) for b in sorted(blocks)]), signature)
            structure = self._structures.get(key)
            if structure is None:
                structure = self._structures[key] = len(self._structures)
                streams = {x for b in blocks for op in plans[b].ops for x in (op[1], *op[9])}
                self._structure_streams.append(tuple(sorted(streams)))
            numbers.append(structure)
        return numbers

    def _start_fast(self, index: int, program) -> _Run:
        calls = len(program.calls)
        plans = self._block_plans[index]
        first = plans[program.calls[0].block] if calls else None
        return _Run(
            index=index,
            program=program,
            plans=_PlanView(program.calls, plans),
            stream_end=[0.0] * len(self._planner.streams),
            out_end=[0.0] * calls,
            call_start=[inf] * calls,
            call_end=[0.0] * calls,
            category_time=[0.0] * len(self._planner.categories),
            events=None,
            local=[0.0] * len(first.block.ops) if first else [],
            queued=True,
        )

    def _advance(self, run: _Run) -> None:
        calls = run.program.calls
        segments = self._layouts[run.index].segments
        alone = self._lone_transfers[run.index]
        while run.call < len(calls):
            if run.op:
                issued = self._issue_call(run)
            elif (segment := segments[run.call]) is not None:
                issued = self._run_segment(run, segment)
            elif calls[run.call].block in alone:
                issued = self._issue_transfer(run)
            else:
                issued = self._issue_call(run)
            if not issued:
                return

    def _issue_transfer(self, run: _Run) -> bool:
        """`_issue_call` for a call whose block is a single send or recv (a pipeline transfer), without the loop
        over a block's ops; False when it parks."""
        c = run.call
        call = run.program.calls[c]
        plan = self._block_plans[run.index][call.block]
        kind, stream, seconds, _, waits_on_inputs, slot, _, category, link, shares = plan.ops[0]
        stream_end, out_end = run.stream_end, run.out_end
        start = stream_end[stream]
        if waits_on_inputs:
            for i in call.inputs:
                if out_end[i] > start:
                    start = out_end[i]
        if start == inf:
            return False
        local = [0.0] * len(plan.block.ops)
        start, end = self._rendezvous(
            _Parked(run, c, slot, kind, stream, start, seconds, local, category, shares, slot == plan.output),
            (link, call.tag),
        )
        if end != inf:
            if start < run.call_start[c]:
                run.call_start[c] = start
            if end > run.call_end[c]:
                run.call_end[c] = end
        out_end[c] = local[plan.output]
        run.call += 1
        return True

    def _run_segment(self, run: _Run, segment: _Segment) -> bool:
        """Price a segment from the cache or by the reference rules; False when it must wait (parks the run).

        Entry times before t0 are first tried clamped to t0: a stream that was free earlier, or an input that was
        ready earlier, rarely decides anything, and clamped keys recur far more often. The simulation checks
        whether a clamp decided an op's start; if one did, that key is marked and the exact times are used.
        """
        stream_end, out_end = run.stream_end, run.out_end
        structure = self._kinds[run.index][segment.kind]
        t0 = stream_end[self._compute_stream]
        for i in segment.first_inputs:
            if out_end[i] > t0:
                t0 = out_end[i]
        if t0 == inf:
            return False
        segment_streams = self._structure_streams[structure]
        ends = [stream_end[s] for s in segment_streams]
        inputs = [out_end[i] for i in segment.external]
        if inf in ends or inf in inputs:
            return False
        tier = self._first_tier.get(structure, _CLAMP_AT_T0)
        # A clamped time keys as -1. _CLAMP_AT_T0 clamps times at t0 too, so a stream free at t0 and one free
        # earlier share a key, and the simulation checks that neither decided an op's start. Its key says only
        # which of the two times that make t0 does: the compute stream's end, or the first call's inputs (which
        # then stay exact, see _simulate). The other tiers key a time at t0 as 0 and leave it unchecked: an outcome
        # simulated from it must not serve a stream free earlier, where an op that waits on nothing else (a
        # prefetch gather) starts before t0.
        while True:
            if tier == _CLAMP_AT_T0:
                clamped = [round((v - t0) * _SCALE) if v > t0 else -1 for v in ends + inputs]
                times = tuple([*clamped, stream_end[self._compute_stream] < t0])
            elif tier == _CLAMP_ALL:
                times = tuple([round((v - t0) * _SCALE) if v > t0 else (v == t0) - 1 for v in ends + inputs])
            elif tier == _CLAMP_INPUTS:
                late = [round((v - t0) * _SCALE) if v > t0 else (v == t0) - 1 for v in inputs]
                times = tuple([round((v - t0) * _SCALE) for v in ends] + late)
            else:
                times = tuple([round((v - t0) * _SCALE) for v in ends + inputs])
            key = (structure, tier, times)
            outcome = self._outcomes.get(key)
            if outcome is None:
                outcome = self._simulate(run, segment, segment_streams, t0, tier) or _UNCLAMPABLE
                self._outcomes[key] = outcome
            if outcome is not _UNCLAMPABLE:
                break
            # A clamp before t0 that failed once for this structure usually fails again (an op that does not wait
            # for the segment's input, like a prefetch): start from the next tier next time. One at t0 that failed
            # (an op that waits for an input at t0 alone) says little of the structure's other entry states.
            tier += 1
            if tier > _CLAMP_ALL:
                self._first_tier[structure] = tier
        start, end = segment.start, segment.end
        for s, rel in outcome.stream_end:
            stream_end[s] = t0 + rel
        out_end[start:end] = [t0 + x for x in outcome.out_end]
        self._applied[run.index].append((t0, outcome, start))
        run.call = end
        return True

    def _simulate(
        self, run: _Run, segment: _Segment, streams_used: tuple[int, ...], t0: float, tier: int
    ) -> "_Outcome | None":
        """The reference rules over one segment, from the run's current state, on scratch copies.

        Entry times before t0 count as t0 (stream ends and inputs with _CLAMP_AT_T0 and _CLAMP_ALL, inputs only
        with _CLAMP_INPUTS), and with _CLAMP_AT_T0 so do those at t0, but for the first call's inputs when they
        make t0: the call waits for exactly t0 then. Returns None if a clamped time decided the start of any op
        (then the result would differ from the exact one).
        """
        self.simulated += 1
        stream_end = list(run.stream_end)
        out_end = run.out_end
        calls = run.program.calls
        first_call = segment.start
        compute_stream = self._compute_stream
        floor: set[int] = set()
        clamp = tier != _CLAMP_NONE
        at_t0 = tier == _CLAMP_AT_T0
        inputs_make_t0 = stream_end[compute_stream] < t0
        if tier <= _CLAMP_ALL:
            for s in streams_used:
                if stream_end[s] < t0 or (at_t0 and stream_end[s] == t0):
                    stream_end[s] = t0
                    floor.add(s)
        n = segment.end - first_call
        call_start, call_end, outputs = [inf] * n, [0.0] * n, [0.0] * n
        compute_s: list[float] = []
        compute_e: list[float] = []
        comm_s: list[float] = []
        comm_e: list[float] = []
        totals: dict[int, float] = {}
        for k in range(n):
            c = first_call + k
            call = calls[c]
            plan = run.plans[c]
            ready, floored_input = 0.0, False
            anchor = (compute_stream, not call.inputs) if at_t0 and k == 0 else _NO_ANCHOR
            for i in call.inputs:
                if i >= first_call:
                    value = outputs[i - first_call]
                else:
                    value = out_end[i]
                    if clamp and (value < t0 or (at_t0 and value == t0 and (k or not inputs_make_t0))):
                        floored_input = True
                        continue
                if value > ready:
                    ready = value
            if floored_input and ready < t0:
                ready_floor = True
                ready = t0
            else:
                # With no inputs, `ready` (0) decides nothing: a tie with it must not clear a clamped stream's
                # part in an op's start, which can be 0 too when the segment starts the program.
                ready_floor = not call.inputs
            streams = self._plan_streams.get(id(plan))
            if streams is None:
                streams = self._plan_streams[id(plan)] = tuple(sorted({x for op in plan.ops for x in (op[1], *op[9])}))
            base = stream_end[compute_stream]
            if ready > base:
                base = ready
            key = (
                id(plan),
                round((ready - base) * _SCALE),
                ready_floor,
                tuple([round((stream_end[x] - base) * _SCALE) for x in streams]),
                tuple([x in floor for x in streams]) if floor else (),
                anchor,
            )
            priced = self._calls.get(key)
            if priced is None:
                priced = self._calls[key] = _price_call(
                    plan, stream_end, floor, ready, ready_floor, base, streams, anchor
                )
            if priced is _BOUND:
                return None
            ends, first, last, output, cs, ce, ms, me = priced
            for x, rel in zip(streams, ends, strict=True):
                stream_end[x] = base + rel
            if floor:
                floor.difference_update(streams)
            compute_s.extend([base + x for x in cs])
            compute_e.extend([base + x for x in ce])
            comm_s.extend([base + x for x in ms])
            comm_e.extend([base + x for x in me])
            first, last = base + first, base + last
            call_start[k], call_end[k], outputs[k] = first, last, base + output
            for index, busy in plan.category_seconds:
                totals[index] = totals.get(index, 0.0) + busy
            continue

        def rel(values: list[float]) -> np.ndarray:
            return np.asarray(values, dtype=float) - t0

        def merged(starts: list[float], ends: list[float]) -> tuple[np.ndarray, np.ndarray]:
            s, e = merge(starts, ends)
            return s - t0, e - t0

        return _Outcome(
            stream_end=tuple((s, stream_end[s] - t0) for s in streams_used),
            call_start=rel(call_start),
            call_end=rel(call_end),
            out_end=tuple(v - t0 for v in outputs),
            compute=merged(compute_s, compute_e),
            comm=merged(comm_s, comm_e),
            category_time=tuple(totals.items()),
        )

    def _finish(self, run: _Run) -> ClassSchedule:
        """Lay the applied segments' call times and intervals out with numpy, one outcome at a time."""
        call_start = np.asarray(run.call_start, dtype=float)
        call_end = np.asarray(run.call_end, dtype=float)
        # The ops issued one by one (the p2p ones) next to the segments' merged intervals.
        compute = [(np.asarray(run.compute_starts), np.asarray(run.compute_ends))]
        comm = [(np.asarray(run.comm_starts), np.asarray(run.comm_ends))]
        by_outcome: dict[int, tuple[_Outcome, list[float], list[int]]] = {}
        for t0, outcome, first in self._applied[run.index]:
            entry = by_outcome.get(id(outcome))
            if entry is None:
                entry = by_outcome[id(outcome)] = (outcome, [], [])
            entry[1].append(t0)
            entry[2].append(first)
        category_time = list(run.category_time)
        for outcome, t0s, firsts in by_outcome.values():
            for index, seconds in outcome.category_time:
                category_time[index] += seconds * len(t0s)
            shift = np.asarray(t0s)[:, None]
            index = np.asarray(firsts)[:, None] + np.arange(len(outcome.call_start))
            call_start[index] = shift + outcome.call_start
            call_end[index] = shift + outcome.call_end
            compute.append(((shift + outcome.compute[0]).ravel(), (shift + outcome.compute[1]).ravel()))
            comm.append(((shift + outcome.comm[0]).ravel(), (shift + outcome.comm[1]).ravel()))
        busy = Busy.of(
            np.concatenate([c[0] for c in compute]),
            compute_ends := np.concatenate([c[1] for c in compute]),
            np.concatenate([c[0] for c in comm]),
            comm_ends := np.concatenate([c[1] for c in comm]),
        )
        compute_s, comm_s, exposed_s = busy.totals
        ends = np.concatenate((compute_ends, comm_ends))
        names = list(self._planner.categories)
        used = set().union(*(plan.categories for plan in self._block_plans[run.index].values()))
        return ClassSchedule(
            end_s=float(ends.max()) if len(ends) else 0.0,
            compute_s=compute_s,
            comm_s=comm_s,
            exposed_comm_s=exposed_s,
            time_by_category={names[i]: category_time[i] for i in sorted(used)},
            call_start=call_start,
            call_end=call_end,
            events=[],
            busy=busy,
            transfers=run.transfers,
        )


class _PlanView:
    """run.plans[c] for the shared engine code, without a list of one plan per call."""

    __slots__ = ("_calls", "_plans")

    def __init__(self, calls: list, plans: dict) -> None:
        self._calls = calls
        self._plans = plans

    def __getitem__(self, c: int):
        return self._plans[self._calls[c].block]
