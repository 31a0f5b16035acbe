"""The reference scheduler's hot loop (`engine._Scheduler`) compiled with numba, op by op, with its rules unchanged.

Every program's calls, every plan's ops and every p2p mailbox are arrays (`EngineTables`, laid out by
`compiled_engine`); `drive` runs the runnable programs round-robin, issues each call's ops in order with the same
max-plus rules and the same float operations, pairs sends and recvs first-in first-out per (link, tag), and parks a
program where an op needs a time not known yet, exactly as `engine._Scheduler._drive` does. Its schedules are the
reference's to the bit (`tests/test_compiled_engine.py`). Compiled, every op can be issued (a 1F1B steady form of
GPT-3 175B on 16 stages has about 100k), so no segment cache and no rounding of entry states is needed.

The tuple of arrays is unpacked once at the top of `drive` and the per-call steps are closures numba inlines: a
helper function taking the tuple would have numba count references to every array it reads, on every call.
"""

from typing import NamedTuple

import numpy as np
from numba import njit

from simulators.analytical.plans import COMPUTE, SEND

RING_HEAD, RING_TAIL, QUEUED = range(3)
"""Indices into EngineTables.counters."""


class EngineTables(NamedTuple):
    """What `drive` reads and writes; calls are numbered flat over the programs (`base`)."""

    base: np.ndarray
    """Per run, its first call's flat number; one more entry for the end."""
    call_plan: np.ndarray
    """Per call, its plan (a block as its run runs it)."""
    input_ptr: np.ndarray
    inputs: np.ndarray
    """CSR per call: program-local calls whose outputs it reads."""
    mail_ptr: np.ndarray
    """Per call, where its p2p ops' mailboxes start in `mailbox` (in op order)."""
    mailbox: np.ndarray
    """Per p2p op of a call, its (link, tag) numbered: both ends of a transfer share it."""
    p_op_ptr: np.ndarray
    """Per plan, its ops' rows; one more entry for the end."""
    p_output: np.ndarray
    p_slots: np.ndarray
    """Per plan, its block's ops (the room its call's op ends take in `local`)."""
    p_category_ptr: np.ndarray
    p_category: np.ndarray
    p_category_seconds: np.ndarray
    """CSR per plan: seconds per category of its ops that are not p2p."""
    o_kind: np.ndarray
    o_stream: np.ndarray
    o_seconds: np.ndarray
    o_waits: np.ndarray
    o_slot: np.ndarray
    o_category: np.ndarray
    o_mail: np.ndarray
    """Per op row: its place among its plan's p2p ops, -1 for an op that is not p2p."""
    o_dep_ptr: np.ndarray
    o_deps: np.ndarray
    o_mark_ptr: np.ndarray
    o_mark_slot: np.ndarray
    o_mark_offset: np.ndarray
    o_share_ptr: np.ndarray
    o_shares: np.ndarray
    stream_end: np.ndarray
    out_end: np.ndarray
    call_start: np.ndarray
    call_end: np.ndarray
    position: np.ndarray
    op_position: np.ndarray
    local: np.ndarray
    """runs x slots: the current call's block op ends (`engine._Run.local`)."""
    queued: np.ndarray
    ring: np.ndarray
    category_time: np.ndarray
    mb_head: np.ndarray
    mb_tail: np.ndarray
    q_next: np.ndarray
    q_run: np.ndarray
    q_call: np.ndarray
    q_row: np.ndarray
    q_ready: np.ndarray
    compute_ptr: np.ndarray
    compute_count: np.ndarray
    compute_knots: np.ndarray
    """Per run from twice its offset, its compute intervals' starts and ends in turn (as `intervals.Busy` keeps
    them)."""
    comm_ptr: np.ndarray
    comm_count: np.ndarray
    comm_starts: np.ndarray
    comm_ends: np.ndarray
    """Per run and stream (numbered run * streams + stream) from its own offset, its communication intervals in
    the order they settle (`engine._Run` comm_starts, ...): one stream's settle one after another, so
    `intervals.ordered_busy` merges the streams instead of sorting the intervals."""
    t_ptr: np.ndarray
    t_count: np.ndarray
    t_call: np.ndarray
    t_category: np.ndarray
    t_seconds: np.ndarray
    """Per run from its own offset, its settled transfer sides in order (`engine._Run.transfers`)."""
    counters: np.ndarray


@njit(cache=True)
def drive(t: EngineTables) -> None:
    """Advance runnable runs until none is left (`engine._Scheduler._drive`); the caller checks they finished."""
    base, call_plan, input_ptr, inputs = t.base, t.call_plan, t.input_ptr, t.inputs
    mail_ptr, mailbox = t.mail_ptr, t.mailbox
    p_op_ptr, p_output, p_slots = t.p_op_ptr, t.p_output, t.p_slots
    p_category_ptr, p_category, p_category_seconds = t.p_category_ptr, t.p_category, t.p_category_seconds
    o_kind, o_stream, o_seconds, o_waits, o_slot = t.o_kind, t.o_stream, t.o_seconds, t.o_waits, t.o_slot
    o_category, o_mail, o_dep_ptr, o_deps = t.o_category, t.o_mail, t.o_dep_ptr, t.o_deps
    o_mark_ptr, o_mark_slot, o_mark_offset = t.o_mark_ptr, t.o_mark_slot, t.o_mark_offset
    o_share_ptr, o_shares = t.o_share_ptr, t.o_shares
    stream_end, out_end, call_start, call_end = t.stream_end, t.out_end, t.call_start, t.call_end
    position, op_position, local, queued, ring = t.position, t.op_position, t.local, t.queued, t.ring
    category_time, counters = t.category_time, t.counters
    mb_head, mb_tail, q_next, q_run, q_call, q_row, q_ready = (
        t.mb_head,
        t.mb_tail,
        t.q_next,
        t.q_run,
        t.q_call,
        t.q_row,
        t.q_ready,
    )
    compute_ptr, compute_count, compute_knots = t.compute_ptr, t.compute_count, t.compute_knots
    comm_ptr, comm_count, comm_starts, comm_ends = t.comm_ptr, t.comm_count, t.comm_starts, t.comm_ends
    t_ptr, t_count = t.t_ptr, t.t_count
    streams = stream_end.shape[1]
    t_call, t_category, t_seconds = t.t_call, t.t_category, t.t_seconds
    inf = np.inf

    def settle(r: int, flat: int, x: int, start: float, end: float) -> None:
        """`engine._Scheduler._settle`: op row x of run r's call `flat` ends at `end`."""
        if base[r] + position[r] == flat:  # else the call is over and its op ends are no one's
            local[r, o_slot[x]] = end
        stream_end[r, o_stream[x]] = end
        for k in range(o_share_ptr[x], o_share_ptr[x + 1]):
            if end > stream_end[r, o_shares[k]]:
                stream_end[r, o_shares[k]] = end
        if o_slot[x] == p_output[call_plan[flat]]:
            out_end[flat] = end
        category_time[r, o_category[x]] += end - start
        n = t_ptr[r] + t_count[r]
        t_call[n], t_category[n], t_seconds[n] = flat - base[r], o_category[x], end - start
        t_count[r] += 1
        own = r * streams + o_stream[x]
        i = comm_ptr[own] + comm_count[own]
        comm_starts[i], comm_ends[i] = start, end
        comm_count[own] += 1

    def rendezvous(r: int, flat: int, x: int, m: int, ready: float) -> tuple[float, float]:
        """`engine._Scheduler._rendezvous`: pair with the head of mailbox m and settle both, or park ((inf, inf))."""
        head = mb_head[m]
        if head < 0 or o_kind[q_row[head]] == o_kind[x]:
            q = counters[QUEUED]
            counters[QUEUED] = q + 1
            q_run[q], q_call[q], q_row[q], q_ready[q], q_next[q] = r, flat, x, ready, -1
            if head < 0:
                mb_head[m] = q
            else:
                q_next[mb_tail[m]] = q
            mb_tail[m] = q
            local[r, o_slot[x]] = inf
            stream_end[r, o_stream[x]] = inf
            return inf, inf
        mb_head[m] = q_next[head]
        other, other_flat, y, other_ready = q_run[head], q_call[head], q_row[head], q_ready[head]
        start = ready if ready > other_ready else other_ready
        busy = start
        for k in range(o_share_ptr[x], o_share_ptr[x + 1]):
            if stream_end[r, o_shares[k]] > busy:
                busy = stream_end[r, o_shares[k]]
        for k in range(o_share_ptr[y], o_share_ptr[y + 1]):
            if stream_end[other, o_shares[k]] > busy:
                busy = stream_end[other, o_shares[k]]
        seconds = o_seconds[x] if o_kind[x] == SEND else o_seconds[y]
        end = start + seconds + min(seconds, busy - start)
        settle(r, flat, x, start, end)
        settle(other, other_flat, y, start, end)
        if start < call_start[other_flat]:
            call_start[other_flat] = start
        if end > call_end[other_flat]:
            call_end[other_flat] = end
        if not queued[other]:
            queued[other] = True
            tail = counters[RING_TAIL]
            ring[tail % len(ring)] = other
            counters[RING_TAIL] = tail + 1
        return start, end

    def issue_call(r: int) -> bool:
        """`engine._Scheduler._issue_call`: the rest of run r's current call; False when it parks."""
        c = position[r]
        flat = base[r] + c
        p = call_plan[flat]
        if op_position[r] == 0:
            local[r, : p_slots[p]] = 0.0
        inputs_ready = 0.0
        for k in range(input_ptr[flat], input_ptr[flat + 1]):
            if out_end[base[r] + inputs[k]] > inputs_ready:
                inputs_ready = out_end[base[r] + inputs[k]]
        first, last = call_start[flat], call_end[flat]
        rows = p_op_ptr[p]
        j = op_position[r]
        while j < p_op_ptr[p + 1] - rows:
            x = rows + j
            stream = o_stream[x]
            start = stream_end[r, stream]
            if o_waits[x] and inputs_ready > start:
                start = inputs_ready
            for k in range(o_dep_ptr[x], o_dep_ptr[x + 1]):
                if local[r, o_deps[k]] > start:
                    start = local[r, o_deps[k]]
            p2p = o_mail[x] >= 0
            if not p2p:
                for k in range(o_share_ptr[x], o_share_ptr[x + 1]):
                    if stream_end[r, o_shares[k]] > start:
                        start = stream_end[r, o_shares[k]]
            if start == inf:
                op_position[r] = j
                call_start[flat], call_end[flat] = min(call_start[flat], first), max(call_end[flat], last)
                return False
            if not p2p:
                end = start + o_seconds[x]
                local[r, o_slot[x]] = end
                for k in range(o_mark_ptr[x], o_mark_ptr[x + 1]):
                    local[r, o_mark_slot[k]] = start + o_mark_offset[k]
                stream_end[r, stream] = end
                for k in range(o_share_ptr[x], o_share_ptr[x + 1]):
                    stream_end[r, o_shares[k]] = end
                if o_kind[x] == COMPUTE:
                    i = 2 * (compute_ptr[r] + compute_count[r])
                    compute_knots[i], compute_knots[i + 1] = start, end
                    compute_count[r] += 1
                else:
                    own = r * streams + stream
                    i = comm_ptr[own] + comm_count[own]
                    comm_starts[i], comm_ends[i] = start, end
                    comm_count[own] += 1
            else:
                start, end = rendezvous(r, flat, x, mailbox[mail_ptr[flat] + o_mail[x]], start)
                if end == inf:
                    j += 1
                    continue
            if start < first:
                first = start
            if end > last:
                last = end
            j += 1
        call_start[flat], call_end[flat] = min(call_start[flat], first), max(call_end[flat], last)
        out_end[flat] = local[r, p_output[p]]
        for k in range(p_category_ptr[p], p_category_ptr[p + 1]):
            category_time[r, p_category[k]] += p_category_seconds[k]
        position[r], op_position[r] = c + 1, 0
        return True

    while counters[RING_HEAD] != counters[RING_TAIL]:
        head = counters[RING_HEAD]
        r = ring[head % len(ring)]
        counters[RING_HEAD] = head + 1
        queued[r] = False
        calls = base[r + 1] - base[r]
        while position[r] < calls:
            if not issue_call(r):
                break
