"""The fast path's programs laid out as arrays for the compiled loop (`fast_kernel`), its misses simulated, and its
records turned into schedules.

What a program's calls decide (where its segments start and end, what they read from outside, which calls are
transfers and what they read) is the same for every point of its schedule shape, so it is derived once per
`CallShape` (`_static`); a point adds only its plans' figures: each lone transfer's op, each segment's structure.
The schedules are assembled with numpy over all runs at once: every applied outcome's call times and busy intervals
shifted by its t0, as `fastpath._FastScheduler._finish` does one outcome at a time.
"""

from dataclasses import dataclass
from math import inf
from typing import TYPE_CHECKING

import numpy as np

from dse.workload import Program
from simulators.analytical import fast_kernel as kernel
from simulators.analytical.calls import call_array, memoised
from simulators.analytical.engine import ClassSchedule
from simulators.analytical.intervals import Busy

if TYPE_CHECKING:
    from simulators.analytical.fastpath import _FastScheduler, _Layout, _Outcome

_INT = np.int64


@dataclass(frozen=True, slots=True)
class _Static:
    """A program's calls as the kernel reads them, the same for every point of its shape."""

    starts: np.ndarray
    """The calls a segment starts at."""
    ends: np.ndarray
    kinds: np.ndarray
    """Per segment, its signature in the layout."""
    external_count: np.ndarray
    external: np.ndarray
    first_count: np.ndarray
    first: np.ndarray
    input_count: np.ndarray
    inputs: np.ndarray
    """Per call (all of them), its inputs."""


def _static(program: Program, layout: "_Layout", p2p: frozenset[int]) -> _Static:
    def derive(calls) -> _Static:
        segments = [s for s in layout.segments if s is not None]
        return _Static(
            starts=np.array([s.start for s in segments], dtype=_INT),
            ends=np.array([s.end for s in segments], dtype=_INT),
            kinds=np.array([s.kind for s in segments], dtype=_INT),
            external_count=np.array([len(s.external) for s in segments], dtype=_INT),
            external=np.array([i for s in segments for i in s.external], dtype=_INT),
            first_count=np.array([len(s.first_inputs) for s in segments], dtype=_INT),
            first=np.array([i for s in segments for i in s.first_inputs], dtype=_INT),
            input_count=np.array([len(call.inputs) for call in calls], dtype=_INT),
            inputs=np.array([i for call in calls for i in call.inputs], dtype=_INT),
        )

    return memoised(program, ("fast_compiled.static", p2p), derive)


def _csr(counts: list[np.ndarray], values: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    ptr = np.zeros(sum(len(c) for c in counts) + 1, dtype=_INT)
    np.cumsum(np.concatenate(counts), out=ptr[1:])
    return ptr, np.concatenate(values).astype(_INT) if values else np.zeros(0, dtype=_INT)


class _Growing:
    """The kernel's outcome store and key table, grown by the caller between calls of `drive`."""

    def __init__(self) -> None:
        self.outcomes: list[_Outcome | None] = []
        self.stream_ptr = [0]
        self.streams: list[int] = []
        self.stream_rel: list[float] = []
        self.out_ptr = [0]
        self.out_rel: list[float] = []
        self.entries = 0
        self.hashes: list[int] = []
        self.key_ptr = [0]
        self.keys: list[int] = []
        self.entry_outcome: list[int] = []

    def add(self, outcome: "_Outcome | None", key: np.ndarray) -> None:
        """Store the outcome (None: its key's clamp decided an op's start) under the key."""
        self.outcomes.append(outcome)
        if outcome is not None:
            self.streams.extend(s for s, _ in outcome.stream_end)
            self.stream_rel.extend(rel for _, rel in outcome.stream_end)
            self.out_rel.extend(outcome.out_end)
        self.stream_ptr.append(len(self.streams))
        self.out_ptr.append(len(self.out_rel))
        self.hashes.append(kernel.key_hash(key, len(key)))
        self.keys.extend(key.tolist())
        self.key_ptr.append(len(self.keys))
        self.entry_outcome.append(len(self.outcomes) - 1)

    def tables(self, t: kernel.Tables) -> kernel.Tables:
        slots = np.full(_power_of_two(4 * len(self.hashes)), -1, dtype=_INT)
        hashes = np.array(self.hashes, dtype=_INT)
        kernel.rehash(slots, hashes, len(hashes))
        return t._replace(
            o_stream_ptr=np.array(self.stream_ptr, dtype=_INT),
            o_streams=np.array(self.streams, dtype=_INT),
            o_stream_rel=np.array(self.stream_rel, dtype=float),
            o_out_ptr=np.array(self.out_ptr, dtype=_INT),
            o_out_rel=np.array(self.out_rel, dtype=float),
            o_unclampable=np.array([o is None for o in self.outcomes], dtype=np.bool_),
            slots=slots,
            e_hash=hashes,
            e_key_ptr=np.array(self.key_ptr, dtype=_INT),
            e_keys=np.array(self.keys, dtype=_INT),
            e_outcome=np.array(self.entry_outcome, dtype=_INT),
        )


def _power_of_two(n: int) -> int:
    return 1 << max(4, (n - 1).bit_length())


@dataclass(slots=True)
class _RunView:
    """What `_FastScheduler._simulate` reads of a run."""

    program: Program
    plans: object
    stream_end: list[float]
    out_end: np.ndarray


def run_compiled(scheduler: "_FastScheduler") -> list[ClassSchedule] | None:
    """The schedules by the compiled loop; None where a block both transfers and computes (ring attention's
    steps: the interpreted loop runs those) or the programs deadlock (the interpreted loop names where)."""
    from simulators.analytical.fastpath import _PlanView

    programs = scheduler._workload.programs
    layouts = scheduler._layouts
    statics, blocks, tags, transfers = [], [], [], []
    for program, layout, plans in zip(programs, layouts, scheduler._block_plans, strict=True):
        moving = {b for b in layout.used if b in scheduler._p2p_blocks}
        if any(op[8] is None for b in moving for op in plans[b].ops):
            return None
        statics.append(_static(program, layout, scheduler._p2p_blocks))
        blocks.append(call_array(program, "block"))
        tags.append(call_array(program, "tag"))
        transfers.append(moving)
    t = _tables(scheduler, statics, blocks, tags, transfers)
    store = _Growing()
    t = store.tables(t)
    while kernel.drive(t) == kernel.MISS:
        counters = t.counters
        r, c, tier = int(counters[kernel.MISS_RUN]), int(counters[kernel.MISS_CALL]), int(counters[kernel.TIER])
        key = t.key[: counters[kernel.KEY_LENGTH]].copy()
        lo, hi = t.base[r], t.base[r + 1]
        plans = _PlanView(programs[r].calls, scheduler._block_plans[r])
        view = _RunView(programs[r], plans, t.stream_end[r].tolist(), t.out_end[lo:hi])
        segment = layouts[r].segments[c]
        structure = int(t.structure[lo + c])
        outcome = scheduler._simulate(view, segment, scheduler._structure_streams[structure], float(t.miss_t0[0]), tier)
        store.add(outcome, key)
        t = store.tables(t)
    if (t.position < np.diff(t.base)).any() or (t.mb_head >= 0).any():
        return None  # a deadlock: the interpreted loop names it
    return _schedules(scheduler, t, store)


def _tables(
    scheduler: "_FastScheduler", statics: list[_Static], blocks: list, tags: list, transfers: list[set[int]]
) -> kernel.Tables:
    """The kernel's arrays for one point: the shape's statics and this point's plans; `transfers`: per run, its
    blocks of p2p ops only."""
    runs = len(statics)
    sizes = np.array([len(b) for b in blocks], dtype=_INT)
    base = np.zeros(runs + 1, dtype=_INT)
    np.cumsum(sizes, out=base[1:])
    calls = int(base[-1])
    kind = np.full(calls, -1, dtype=_INT)
    segment_end = np.zeros(calls, dtype=_INT)
    structure = np.zeros(calls, dtype=_INT)
    transfer = np.full(calls, -1, dtype=_INT)
    external_count = np.zeros(calls, dtype=_INT)
    first_count = np.zeros(calls, dtype=_INT)
    rows: list[tuple] = []
    entries: list[tuple[int, int, int]] = []
    """Per (run, transfer block): its first op row, its output op, its ops (its ends' room in `local`)."""
    links: dict = {}
    per_run = zip(statics, blocks, scheduler._block_plans, transfers, strict=True)
    for r, (static, block, plans, moving) in enumerate(per_run):
        lo = base[r]
        flat = lo + static.starts
        kind[flat] = kernel.SEGMENT
        segment_end[flat] = static.ends
        structure[flat] = np.asarray(scheduler._kinds[r], dtype=_INT)[static.kinds]
        external_count[flat] = static.external_count
        first_count[flat] = static.first_count
        if moving:
            lookup = np.full(int(block.max()) + 1, -1, dtype=_INT)
            for b in sorted(moving):
                plan = plans[b]
                lookup[b] = len(entries)
                entries.append((len(rows), plan.output, len(plan.block.ops)))
                for op in plan.ops:
                    link = links.setdefault(op[8], len(links))
                    rows.append((op[0], op[1], op[2], op[4], op[7], op[5], op[5] == plan.output, op[9], op[3], link))
            mine = lookup[block]
            transfer[lo : lo + len(block)] = mine
            kind[lo : lo + len(block)][mine >= 0] = kernel.TRANSFER
    entries.append((len(rows), 0, 0))
    row_ptr = np.array([e[0] for e in entries], dtype=_INT)
    external_ptr, external = _csr([external_count], [s.external for s in statics])
    first_ptr, first = _csr([first_count], [s.first for s in statics])
    input_ptr, inputs = _csr([s.input_count for s in statics], [s.inputs for s in statics])
    moved = np.flatnonzero(transfer >= 0)
    ops = np.diff(row_ptr)[transfer[moved]]
    mailbox_count = np.zeros(calls, dtype=_INT)
    mailbox_count[moved] = ops
    mailbox_ptr = np.zeros(calls + 1, dtype=_INT)
    np.cumsum(mailbox_count, out=mailbox_ptr[1:])
    local_count = np.zeros(calls, dtype=_INT)
    local_count[moved] = np.array([e[2] for e in entries], dtype=_INT)[transfer[moved]]
    local_ptr = np.cumsum(local_count) - local_count
    mailbox = np.zeros(0, dtype=_INT)
    if len(moved):
        tag = np.concatenate(tags).astype(_INT)
        call, _, op_row = _spread(moved, row_ptr[transfer[moved]], ops)
        link = np.array([row[9] for row in rows], dtype=_INT)
        code = link[op_row] * (int(tag.max()) + 1) + tag[moved[call]]
        _, mailbox = np.unique(code, return_inverse=True)
    share_ptr, shares = _csr(
        [np.array([len(row[7]) for row in rows], dtype=_INT)], [np.array([s for row in rows for s in row[7]])]
    )
    dep_ptr, deps = _csr(
        [np.array([len(row[8]) for row in rows], dtype=_INT)], [np.array([d for row in rows for d in row[8]])]
    )
    structure_stream_ptr, structure_streams = _csr(
        [np.array([len(s) for s in scheduler._structure_streams], dtype=_INT)],
        [np.array([x for s in scheduler._structure_streams for x in s])],
    )
    streams = len(scheduler._planner.streams)
    widest = max([len(s) for s in scheduler._structure_streams] + [0]) + int(np.max(external_count, initial=0))
    queued_calls = len(mailbox)
    segments = int((kind == kernel.SEGMENT).sum())
    empty_int, empty_float = np.zeros(0, dtype=_INT), np.zeros(0)
    counters = np.zeros(12, dtype=_INT)
    counters[kernel.RING_TAIL] = runs
    counters[kernel.CURRENT] = -1
    return kernel.Tables(
        base=base,
        kind=kind,
        segment_end=segment_end,
        structure=structure,
        external_ptr=external_ptr,
        external=external,
        first_ptr=first_ptr,
        first=first,
        input_ptr=input_ptr,
        inputs=inputs,
        transfer=transfer,
        xb_row_ptr=row_ptr,
        xb_output=np.array([e[1] for e in entries], dtype=_INT),
        mailbox_ptr=mailbox_ptr,
        mailbox=mailbox.astype(_INT),
        local_ptr=local_ptr,
        x_kind=np.array([row[0] for row in rows], dtype=_INT),
        x_stream=np.array([row[1] for row in rows], dtype=_INT),
        x_seconds=np.array([row[2] for row in rows], dtype=float),
        x_waits=np.array([row[3] for row in rows], dtype=np.bool_),
        x_category=np.array([row[4] for row in rows], dtype=_INT),
        x_slot=np.array([row[5] for row in rows], dtype=_INT),
        x_output=np.array([row[6] for row in rows], dtype=np.bool_),
        x_share_ptr=share_ptr,
        x_shares=shares,
        x_dep_ptr=dep_ptr,
        x_deps=deps,
        structure_stream_ptr=structure_stream_ptr,
        structure_streams=structure_streams,
        first_tier=np.zeros(len(scheduler._structure_streams), dtype=_INT),
        compute_stream=scheduler._compute_stream,
        o_stream_ptr=empty_int,
        o_streams=empty_int,
        o_stream_rel=empty_float,
        o_out_ptr=empty_int,
        o_out_rel=empty_float,
        o_unclampable=np.zeros(0, dtype=np.bool_),
        slots=empty_int,
        e_hash=empty_int,
        e_key_ptr=empty_int,
        e_keys=empty_int,
        e_outcome=empty_int,
        stream_end=np.zeros((runs, streams)),
        out_end=np.zeros(calls),
        call_start=np.full(calls, inf),
        call_end=np.zeros(calls),
        position=np.zeros(runs, dtype=_INT),
        op_position=np.zeros(runs, dtype=_INT),
        local=np.zeros(int(local_count.sum())),
        queued=np.ones(runs, dtype=np.bool_),
        ring=np.arange(runs, dtype=_INT),
        category_time=np.zeros((runs, len(scheduler._planner.categories))),
        mb_head=np.full(int(mailbox.max(initial=-1)) + 1, -1, dtype=_INT),
        mb_tail=np.full(int(mailbox.max(initial=-1)) + 1, -1, dtype=_INT),
        q_next=np.zeros(queued_calls, dtype=_INT),
        q_run=np.zeros(queued_calls, dtype=_INT),
        q_call=np.zeros(queued_calls, dtype=_INT),
        q_row=np.zeros(queued_calls, dtype=_INT),
        q_ready=np.zeros(queued_calls),
        a_run=np.zeros(segments, dtype=_INT),
        a_t0=np.zeros(segments),
        a_outcome=np.zeros(segments, dtype=_INT),
        a_first=np.zeros(segments, dtype=_INT),
        t_run=np.zeros(queued_calls, dtype=_INT),
        t_call=np.zeros(queued_calls, dtype=_INT),
        t_category=np.zeros(queued_calls, dtype=_INT),
        t_start=np.zeros(queued_calls),
        t_end=np.zeros(queued_calls),
        key=np.zeros(widest + 3, dtype=_INT),
        miss_t0=np.zeros(1),
        counters=counters,
    )


def _spread(first: np.ndarray, ptr: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For records whose item k of `counts` many goes to first + k from ptr + k: (record, target, source) per item."""
    total = int(counts.sum())
    record = np.repeat(np.arange(len(counts)), counts)
    k = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    return record, first[record] + k, ptr[record] + k


def _schedules(scheduler: "_FastScheduler", t: kernel.Tables, store: _Growing) -> list[ClassSchedule]:
    outcomes = store.outcomes
    n_applied, n_moved = int(t.counters[kernel.APPLIED]), int(t.counters[kernel.TRANSFERS])
    a_run, a_t0, a_outcome = t.a_run[:n_applied], t.a_t0[:n_applied], t.a_outcome[:n_applied]
    a_flat = t.base[a_run] + t.a_first[:n_applied]

    def csr(part) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        arrays = [part(o) if o is not None else (np.zeros(0), np.zeros(0)) for o in outcomes]
        counts = np.array([len(a[0]) for a in arrays], dtype=_INT)
        ptr = np.cumsum(counts) - counts
        return counts, ptr, [np.concatenate([a[j] for a in arrays]) if arrays else np.zeros(0) for j in (0, 1)]

    call_start, call_end = t.call_start.copy(), t.call_end.copy()
    counts, ptr, (starts, ends) = csr(lambda o: (o.call_start, o.call_end))
    record, target, source = _spread(a_flat, ptr[a_outcome], counts[a_outcome])
    shift = a_t0[record]
    call_start[target] = shift + starts[source]
    call_end[target] = shift + ends[source]
    busy_parts = []
    for part in (lambda o: o.compute, lambda o: o.comm):
        counts, ptr, (starts, ends) = csr(part)
        record, _, source = _spread(np.zeros(n_applied, dtype=_INT), ptr[a_outcome], counts[a_outcome])
        shift = a_t0[record]
        busy_parts.append((a_run[record], shift + starts[source], shift + ends[source]))
    category_time = t.category_time.copy()
    categories = [o.category_time if o is not None else () for o in outcomes]
    category_ptr = np.cumsum([0] + [len(c) for c in categories]).astype(_INT)
    kernel.category_times(
        category_time,
        a_run,
        a_outcome,
        len(outcomes),
        category_ptr,
        np.array([i for c in categories for i, _ in c], dtype=_INT),
        np.array([s for c in categories for _, s in c], dtype=float),
    )
    t_run = t.t_run[:n_moved]
    t_flat, t_category = t.t_call[:n_moved], t.t_category[:n_moved]
    t_start, t_end = t.t_start[:n_moved], t.t_end[:n_moved]
    names = list(scheduler._planner.categories)
    out = []
    for r in range(len(t.base) - 1):
        lo, hi = t.base[r], t.base[r + 1]
        moved = t_run == r
        (compute_run, cs, ce), (comm_run, ms, me) = busy_parts
        compute = compute_run == r
        comm = comm_run == r
        comm_starts = np.concatenate((t_start[moved], ms[comm]))
        comm_ends = np.concatenate((t_end[moved], me[comm]))
        busy = Busy.of(cs[compute], ce[compute], comm_starts, comm_ends)
        every_end = np.concatenate((ce[compute], comm_ends))
        used = set().union(*(plan.categories for plan in scheduler._block_plans[r].values()))
        transfers = list(
            zip(
                (t_flat[moved] - lo).tolist(),
                t_category[moved].tolist(),
                (t_end[moved] - t_start[moved]).tolist(),
                strict=True,
            )
        )
        compute_s, comm_s, exposed_s = busy.totals
        out.append(
            ClassSchedule(
                end_s=float(every_end.max()) if len(every_end) else 0.0,
                compute_s=compute_s,
                comm_s=comm_s,
                exposed_comm_s=exposed_s,
                time_by_category={names[i]: float(category_time[r, i]) for i in sorted(used)},
                call_start=call_start[lo:hi],
                call_end=call_end[lo:hi],
                events=[],
                busy=busy,
                transfers=transfers,
            )
        )
    return out
