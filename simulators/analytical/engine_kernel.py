"""The reference scheduler's hot loop (`engine._Scheduler`) compiled with numba, op by op, with its rules unchanged.

Every program's calls, every plan's ops and every p2p mailbox are arrays (`EngineTables`, laid out by
`compiled_engine`); `drive` runs the runnable programs round-robin, issues each call's ops in order with the same
max-plus rules and the same float operations, pairs sends and recvs first-in first-out per (link, tag), and parks a
program where an op needs a time not known yet, exactly as `engine._Scheduler._drive` does. Its schedules are the
reference's to the bit (`tests/test_compiled_engine.py`) with fast-forward off.

Fast-forward: most ops are in layer runs, a stage's consecutive calls of one transformer layer, each reading the
one before (a 1F1B steady form of GPT-3 175B on 8 stages issues 51k ops, 48k of them in such runs). The rules are
max-plus and move with their inputs (add a shift to every time a call reads and its times move by that shift), so
once a call of a run repeats the call before shifted, in its op intervals, the stream ends it leaves and its
output end, the run's later calls are that call moved by the shift again: they are laid out, not scheduled (10 of
each 12 layer calls there; drive 2.0 -> 1.2 ms a point over the 96 GPT-3 configurations of
benchmarks/vs_calculon.py). The same holds a level up: a stage enters a layer run in its steady state as it
entered its run of the micro-batch before, so a run whose entry (the ends of the streams its ops use and the
inputs its calls read, relative to when its first call's inputs are ready) is an earlier run's of the same plans
is that run moved, and is laid out whole from the run memo (GPT-3 175B tp 4: drive 0.40 -> 0.23 ms on 8 stages,
1.49 -> 0.57 ms on 16, whose runs are 6 calls). The times laid out differ from issuing every op by rounding
(benchmarks/pricing_digest.py: within 3e-12 relative on its 240 points, `tests/test_fast_forward.py`).

The tuple of arrays is unpacked once at the top of `drive` and the per-call steps are closures numba inlines: a
helper function taking the tuple would have numba count references to every array it reads, on every call.
"""

from typing import NamedTuple

import numpy as np
from numba import njit

from simulators.analytical.recipes import COMPUTE, SEND

RING_HEAD, RING_TAIL, QUEUED, SHIFTED, COPIED = range(5)
COUNTERS = 5
"""Indices into EngineTables.counters (COUNTERS long); SHIFTED counts the calls laid out by shift (`drive`'s
fast-forward, either way), COPIED the layer runs laid out whole from the run memo."""

SHIFT_ABS_S = 1e-12
SHIFT_ULPS = 16
"""A call repeats the one before shifted if each of its times is the earlier one's plus the shift within
SHIFT_ABS_S + SHIFT_ULPS ulps of the time. The repeats the engine makes differ from the shift by rounding only:
a call's few dozen additions, each within half an ulp of its time (well under 1e-12 s for times up to hundreds
of seconds). A real difference is a share of an op's seconds (microseconds). The rules are max-plus, so a
mismatch ε moves each later call by at most ε more: the calls laid out differ from the engine's by at most
(their number) x (this bound) each, plus rounding."""


MEMO_ENTRIES = 512
"""Layer runs `drive` keeps to lay later runs out from: the latest run per stage and signature (its plans and
length), a few signatures a stage (forward, backward, recomputed forward) on up to a few hundred stages."""


class EngineTables(NamedTuple):
    """What `drive` reads and writes; calls are numbered flat over the programs (`base`)."""

    base: np.ndarray
    """Per run, its first call's flat number; one more entry for the end."""
    call_plan: np.ndarray
    """Per call, its plan (a block as its run runs it)."""
    run_last: np.ndarray
    """Per call that continues a layer run (the call before has its plan, it reads that call's output and its plan
    has ops and no p2p op; `call_layout.layer_runs`), the run's last call; -1 for any other call (and for
    every call with fast-forward off)."""
    other_inputs: int
    """The longest entry a layer run's calls add to the run memo's (`call_layout.other_inputs`, kept with the
    layout)."""
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
    p_anchored: np.ndarray
    """Per plan, whether the run memo may be anchored at its calls' inputs (`op_rows.anchored_plans`)."""
    p_touches: np.ndarray
    """plans x streams: whether an op of the plan runs on the stream or occupies it (`op_rows.touched_streams`)."""
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
    q_held: np.ndarray
    """Per queued side, its shares' latest end as it was issued (`engine._Parked.held`)."""
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
    `ordered_busy` merges the streams instead of sorting the intervals."""
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
    base, call_plan, run_last, input_ptr, inputs = t.base, t.call_plan, t.run_last, t.input_ptr, t.inputs
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
    mb_head, mb_tail, q_next, q_run, q_call, q_row, q_ready, q_held = (
        t.mb_head,
        t.mb_tail,
        t.q_next,
        t.q_run,
        t.q_call,
        t.q_row,
        t.q_ready,
        t.q_held,
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

    def reserve(r: int, x: int, ready: float) -> float:
        """`engine._reserve`: op row x's shares reserved from `ready`; their latest end before."""
        held = 0.0
        for k in range(o_share_ptr[x], o_share_ptr[x + 1]):
            if stream_end[r, o_shares[k]] > held:
                held = stream_end[r, o_shares[k]]
        if o_share_ptr[x + 1] > o_share_ptr[x]:
            busy = held if held > ready else ready
            reserved = ready + o_seconds[x] + min(o_seconds[x], busy - ready)
            for k in range(o_share_ptr[x], o_share_ptr[x + 1]):
                if reserved > stream_end[r, o_shares[k]]:
                    stream_end[r, o_shares[k]] = reserved
        return held

    def rendezvous(r: int, flat: int, x: int, m: int, ready: float, held: float) -> tuple[float, float]:
        """`engine._Scheduler._rendezvous`: pair with the head of mailbox m and settle both, or park ((inf, inf));
        `held`: the side's shares' end before it (`reserve`)."""
        head = mb_head[m]
        if head < 0 or o_kind[q_row[head]] == o_kind[x]:
            q = counters[QUEUED]
            counters[QUEUED] = q + 1
            q_run[q], q_call[q], q_row[q], q_ready[q], q_held[q], q_next[q] = r, flat, x, ready, held, -1
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
        if held > busy:
            busy = held
        if q_held[head] > busy:
            busy = q_held[head]
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
                start, end = rendezvous(r, flat, x, mailbox[mail_ptr[flat] + o_mail[x]], start, reserve(r, x, start))
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

    before = np.empty(streams)
    touched = np.zeros(streams, dtype=np.bool_)
    on_stream = np.zeros(streams, dtype=np.int64)
    ulp = SHIFT_ULPS * np.finfo(np.float64).eps

    def close(a: float, b: float, shift: float) -> bool:
        """a is b moved by shift, within the bound SHIFT_ABS_S and SHIFT_ULPS set (False on nan)."""
        return abs(a - b - shift) <= SHIFT_ABS_S + ulp * abs(a)

    def streams_of(p: int) -> int:
        """Mark the streams plan p's ops touch (their own and their shares) and count its collectives per stream;
        its compute ops' count."""
        touched[:] = False
        on_stream[:] = 0
        n = 0
        for x in range(p_op_ptr[p], p_op_ptr[p + 1]):
            touched[o_stream[x]] = True
            for k in range(o_share_ptr[x], o_share_ptr[x + 1]):
                touched[o_shares[k]] = True
            if o_kind[x] == COMPUTE:
                n += 1
            else:
                on_stream[o_stream[x]] += 1
        return n

    def repeated(r: int, flat: int, shift: float, n: int) -> bool:
        """Call `flat`, just issued, is the call before shifted: its output end, the ends of the streams it
        touches (`before` holds them as the call before left them) and every op interval it recorded."""
        if not close(out_end[flat], out_end[flat - 1], shift):
            return False
        for s in range(streams):
            if touched[s] and not close(stream_end[r, s], before[s], shift):
                return False
        end = 2 * (compute_ptr[r] + compute_count[r])
        for i in range(end - 2 * n, end):
            if not close(compute_knots[i], compute_knots[i - 2 * n], shift):
                return False
        for s in range(streams):
            m = on_stream[s]
            own = r * streams + s
            end = comm_ptr[own] + comm_count[own]
            for i in range(end - m, end):
                if not (
                    close(comm_starts[i], comm_starts[i - m], shift) and close(comm_ends[i], comm_ends[i - m], shift)
                ):
                    return False
        return True

    def ready_before(r: int, flat: int) -> int:
        """The last call of `flat`'s layer run up to which each call's other inputs (those besides the call
        before) ended by `flat`'s output end, the earliest the call before any of them ends: their inputs are then
        ready when the call before's output is, as for `flat`."""
        ready = out_end[flat]
        for g in range(flat + 1, run_last[flat] + 1):
            for k in range(input_ptr[g], input_ptr[g + 1]):
                if base[r] + inputs[k] != g - 1 and not out_end[base[r] + inputs[k]] <= ready:
                    return g - 1
        return run_last[flat]

    def lay_out(r: int, flat: int, last: int, shift: float, n: int) -> None:
        """The calls after `flat` up to `last` (of its layer run) as `flat` shifted by `shift` per call, without
        scheduling them.

        Call flat + k's times are flat's plus k x shift (`_repeat`). The touched streams' ends move by the shift,
        and a stream's is never before its last interval's end, as issuing leaves them. The categories add the
        plan's seconds once per call, in the order issuing the calls would."""
        p, more = call_plan[flat], last - flat
        end = 2 * (compute_ptr[r] + compute_count[r])
        _repeat(compute_knots, compute_knots, True, end - 2 * n, end, more, shift)
        compute_count[r] += more * n
        for s in range(streams):
            if touched[s]:
                stream_end[r, s] += more * shift
        end = 2 * (compute_ptr[r] + compute_count[r])
        for x in range(p_op_ptr[p], p_op_ptr[p + 1]):
            if o_kind[x] == COMPUTE:  # the compute stream's end is its last interval's, as issuing leaves it
                if compute_knots[end - 1] > stream_end[r, o_stream[x]]:
                    stream_end[r, o_stream[x]] = compute_knots[end - 1]
                break
        for s in range(streams):
            m = on_stream[s]
            if m:
                own = r * streams + s
                end = comm_ptr[own] + comm_count[own]
                _repeat(comm_starts, comm_ends, False, end - m, end, more, shift)
                comm_count[own] += more * m
                end += more * m
                if comm_ends[end - 1] > stream_end[r, s]:
                    stream_end[r, s] = comm_ends[end - 1]
        for k in range(1, more + 1):
            call_start[flat + k] = call_start[flat] + k * shift
            call_end[flat + k] = call_end[flat] + k * shift
            out_end[flat + k] = out_end[flat] + k * shift
            for c in range(p_category_ptr[p], p_category_ptr[p + 1]):
                category_time[r, p_category[c]] += p_category_seconds[c]
        position[r] = last - base[r] + 1
        counters[SHIFTED] += more

    # The run memo: a layer run whose stage enters it as an earlier run of the same plans entered (every stream
    # its ops touch and every input its calls read besides the call before, relative to when its first call's
    # inputs are ready) runs as that run did, moved by the difference (plans `op_rows.anchored_plans` marks only).
    anchored, touch, width = t.p_anchored, t.p_touches, streams + t.other_inputs
    m_run = np.full(MEMO_ENTRIES, -1, dtype=np.int64)
    m_sig = np.zeros((MEMO_ENTRIES, 3), dtype=np.int64)
    m_flat = np.zeros(MEMO_ENTRIES, dtype=np.int64)
    m_t0 = np.zeros(MEMO_ENTRIES)
    m_vec = np.zeros((MEMO_ENTRIES, width))
    m_len = np.zeros(MEMO_ENTRIES, dtype=np.int64)
    m_knots = np.zeros((MEMO_ENTRIES, 2), dtype=np.int64)
    m_comm = np.zeros((MEMO_ENTRIES, streams, 2), dtype=np.int64)
    m_final = np.zeros((MEMO_ENTRIES, streams))
    vec = np.zeros(width)
    used = np.zeros(streams, dtype=np.bool_)
    memo_count = 0
    recording, rec_last = -1, -1

    def entry(r: int, flat: int, last: int, t0: float) -> int:
        """The run's entry into `vec` (relative to t0, nothing before t0 told apart); its length, or -1 where a
        time is not known yet."""
        p, q = call_plan[flat], call_plan[flat + 1]
        n = 0
        for st in range(streams):
            used[st] = touch[p, st] or touch[q, st]
            if used[st]:
                v = stream_end[r, st] - t0
                if v == inf:
                    return -1
                vec[n] = v if v > 0.0 else 0.0
                n += 1
        for g in range(flat + 1, last + 1):
            mark = n
            vec[n] = 0.0
            n += 1
            for k in range(input_ptr[g], input_ptr[g + 1]):
                if base[r] + inputs[k] != g - 1:
                    v = out_end[base[r] + inputs[k]] - t0
                    if v == inf:
                        return -1
                    vec[n] = v if v > 0.0 else 0.0
                    vec[mark] += 1.0
                    n += 1
        return n

    def find(r: int, p: int, q: int, length: int, entries: int) -> int:
        """Memo entry of stage r's latest run of these plans and length, or -1."""
        for k in range(entries):
            if m_run[k] == r and m_sig[k, 0] == p and m_sig[k, 1] == q and m_sig[k, 2] == length:
                return k
        return -1

    def matches(k: int, n: int, t0: float) -> bool:
        """`vec` (n values) is memo entry k's entry, within the bound a repeat is checked to."""
        same, i, bound = m_len[k] == n, 0, SHIFT_ABS_S + ulp * abs(t0)
        while same and i < n:
            same = abs(vec[i] - m_vec[k, i]) <= bound
            i += 1
        return same

    def copy_run(k: int, r: int, flat: int, last: int, moved: float) -> None:
        """Run flat..last laid out as memo entry k's run moved by `moved`: its calls' times, its intervals (each
        stream kept in order as `_repeat` keeps it), the ends it leaves its streams and its categories' seconds."""
        src = m_flat[k]
        for i in range(last - flat + 1):
            call_start[flat + i] = call_start[src + i] + moved
            call_end[flat + i] = call_end[src + i] + moved
            out_end[flat + i] = out_end[src + i] + moved
            p = call_plan[flat + i]
            for c in range(p_category_ptr[p], p_category_ptr[p + 1]):
                category_time[r, p_category[c]] += p_category_seconds[c]
        at = 2 * (compute_ptr[r] + compute_count[r])
        _moved(compute_knots, compute_knots, True, m_knots[k, 0], m_knots[k, 1], at, at > 2 * compute_ptr[r], moved)
        compute_count[r] += m_knots[k, 1] // 2
        for st in range(streams):
            if used[st]:
                stream_end[r, st] = m_final[k, st] + moved
            own = r * streams + st
            count = m_comm[k, st, 1]
            if count:
                at = comm_ptr[own] + comm_count[own]
                _moved(comm_starts, comm_ends, False, m_comm[k, st, 0], count, at, comm_count[own] > 0, moved)
                comm_count[own] += count
                if comm_ends[at + count - 1] > stream_end[r, st]:
                    stream_end[r, st] = comm_ends[at + count - 1]
        if m_knots[k, 1]:
            end = 2 * (compute_ptr[r] + compute_count[r])
            for x in range(p_op_ptr[call_plan[last]], p_op_ptr[call_plan[last] + 1]):
                if o_kind[x] == COMPUTE:
                    if compute_knots[end - 1] > stream_end[r, o_stream[x]]:
                        stream_end[r, o_stream[x]] = compute_knots[end - 1]
                    break
        position[r] = last - base[r] + 1
        counters[SHIFTED] += last - flat + 1
        counters[COPIED] += 1

    while counters[RING_HEAD] != counters[RING_TAIL]:
        head = counters[RING_HEAD]
        r = ring[head % len(ring)]
        counters[RING_HEAD] = head + 1
        queued[r] = False
        calls = base[r + 1] - base[r]
        while position[r] < calls:
            flat = base[r] + position[r]
            if (
                op_position[r] == 0
                and flat + 1 < base[r + 1]
                and run_last[flat] < 0
                and run_last[flat + 1] > flat
                and anchored[call_plan[flat]]
                and anchored[call_plan[flat + 1]]
            ):  # the first call of a layer run
                last = run_last[flat + 1]
                t0 = 0.0
                for k in range(input_ptr[flat], input_ptr[flat + 1]):
                    if out_end[base[r] + inputs[k]] > t0:
                        t0 = out_end[base[r] + inputs[k]]
                n = entry(r, flat, last, t0) if t0 < inf else -1
                if n >= 0:
                    p, q, length = call_plan[flat], call_plan[flat + 1], last - flat + 1
                    k = find(r, p, q, length, memo_count)
                    if k >= 0 and matches(k, n, t0):
                        copy_run(k, r, flat, last, t0 - m_t0[k])
                        continue
                    if k < 0 and memo_count < MEMO_ENTRIES:
                        k = memo_count
                        memo_count += 1
                    if k >= 0:
                        m_run[k], m_sig[k, 0], m_sig[k, 1], m_sig[k, 2] = r, p, q, length
                        m_flat[k], m_t0[k], m_len[k] = flat, t0, n
                        m_vec[k, :n] = vec[:n]
                        m_knots[k, 0] = 2 * (compute_ptr[r] + compute_count[r])
                        for st in range(streams):
                            m_comm[k, st, 0] = comm_ptr[r * streams + st] + comm_count[r * streams + st]
                        recording, rec_last = k, last
            continues = run_last[flat] > flat
            if continues:
                before[:] = stream_end[r]
            if not issue_call(r):
                if recording >= 0:  # a run that parks is not laid out from
                    m_run[recording], recording = -1, -1
                break
            if continues:
                shift = call_start[flat] - call_start[flat - 1]
                n = streams_of(call_plan[flat])
                if shift >= 0.0 and repeated(r, flat, shift, n):
                    last = ready_before(r, flat)
                    if last > flat:
                        lay_out(r, flat, last, shift, n)
            if recording >= 0 and base[r] + position[r] > rec_last:
                k = recording
                m_knots[k, 1] = 2 * (compute_ptr[r] + compute_count[r]) - m_knots[k, 0]
                for st in range(streams):
                    m_comm[k, st, 1] = comm_ptr[r * streams + st] + comm_count[r * streams + st] - m_comm[k, st, 0]
                    m_final[k, st] = stream_end[r, st]
                recording = -1


@njit(cache=True)
def _moved(
    starts: np.ndarray, ends: np.ndarray, knots: bool, first: int, count: int, at: int, after: bool, moved: float
) -> None:
    """Intervals first..first + count (of one stream; with `knots`, starts is ends, Busy's knots) written at `at`
    moved by `moved`, each time rounded once; with `after` (intervals before `at` on the stream), a first
    interval that rounds to before the one before ends starts at that end instead, as `_repeat` keeps a stream in
    order."""
    for j in range(count):
        starts[at + j] = starts[first + j] + moved
    if not knots:
        for j in range(count):
            ends[at + j] = ends[first + j] + moved
    if after:
        j = at
        while j < at + count and starts[j] < ends[j - 1]:
            starts[j] = ends[j - 1]
            if ends[j] < starts[j]:
                ends[j] = starts[j]
            j += 1


@njit(cache=True)
def _repeat(starts: np.ndarray, ends: np.ndarray, knots: bool, first: int, end: int, more: int, shift: float) -> None:
    """Intervals first..end (of one stream: starts[i] to ends[i]; with `knots`, starts is ends, Busy's knots,
    each knot an interval of no length) repeated `more` times after end, the k-th moved by k x shift.

    Each time is rounded once, and one float added to every time of a call keeps their order and ties (a
    collective that starts as a kernel ends still does), where stepping each stream on by its own gaps would let
    streams drift apart by an ulp a step. A repeat's first interval can come out an ulp before the one before it
    ends; it (and what follows it into the same overlap) starts at that end instead: `ordered_busy`
    needs each stream in order, as issuing leaves it."""
    w = end - first
    for k in range(1, more + 1):
        _moved(starts, ends, knots, first, w, end + (k - 1) * w, True, k * shift)
