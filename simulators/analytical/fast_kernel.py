"""The fast path's event loop (`fastpath`) compiled with numba: the same rules over plain arrays.

The interpreted loop spent about 6 microseconds an event on bookkeeping (a dict lookup for a segment's key, a deque
per mailbox, a call per transfer side), and a 1F1B step's steady form has thousands of events: about 1,700 segments
and 2,200 pipeline transfers for GPT-3 175B at pp 16. Here every program's calls, segments and transfers are
arrays (`Tables`, built by `fast_compiled`), and `drive` runs the round-robin of the runnable programs, the segments
priced from the outcome cache and the p2p rendezvous with the reference rules, in the same order and with the same
float operations as `fastpath._FastScheduler`, so the results are the same to the bit.

What stays in Python is what happens a few times a point: a segment whose key is new. `drive` then returns `MISS`
with the run, the call, the tier and the key; the caller simulates the segment (`_FastScheduler._simulate`),
stores its outcome (`insert`) and calls `drive` again, which resumes with that run.

Keys are the interpreted path's (structure, tier, relative entry times in nanoseconds) as int64s in an open-address
hash table whose entries keep the whole key, so a hash collision costs a comparison, never a wrong outcome.
"""

from typing import NamedTuple

import numpy as np
from numba import njit

PARK, DONE, MISS = 0, 1, 2
"""What `drive` returns: (internal) the run waits; every runnable run is done; a segment's key is new."""
SEGMENT, TRANSFER = 0, 1
"""Call kinds in `Tables.kind`: a segment starts there, or a block of p2p ops only; other calls (inside a segment)
are never reached."""
CLAMP_AT_T0, CLAMP_ALL, CLAMP_INPUTS, CLAMP_NONE = range(4)
"""The key tiers of `fastpath._run_segment`."""
SEND = 2
"""plans.SEND."""
SCALE = 1e9
"""1 / fastpath.QUANTUM_S."""
_FNV_PRIME = 1099511628211
_FNV_OFFSET = 1469598103934665603

# counters: indices into Tables.counters
RING_HEAD, RING_TAIL, CURRENT, APPLIED, TRANSFERS, ENTRIES, KEYS, QUEUED, KEY_LENGTH, MISS_RUN, MISS_CALL, TIER = range(
    12
)


class Tables(NamedTuple):
    """Everything `drive` reads and writes; calls are numbered flat over the programs (`base`)."""

    base: np.ndarray
    """Per run, its first call's flat number; one more entry for the end."""
    kind: np.ndarray
    """Per call: SEGMENT, TRANSFER, or another number (a call inside a segment)."""
    segment_end: np.ndarray
    """Per segment-starting call, the program-local index of the call after the segment."""
    structure: np.ndarray
    """Per segment-starting call, its structure (the outcome cache's first key)."""
    external_ptr: np.ndarray
    external: np.ndarray
    """CSR per call: the program-local calls whose outputs the segment reads from outside, in key order."""
    first_ptr: np.ndarray
    first: np.ndarray
    """CSR per call: the segment's first call's inputs (with the compute stream they make t0)."""
    input_ptr: np.ndarray
    inputs: np.ndarray
    """CSR per call: a transfer's inputs."""
    transfer: np.ndarray
    """Per transfer call, its (run, block) entry: its op rows and its output op."""
    xb_row_ptr: np.ndarray
    xb_output: np.ndarray
    mailbox_ptr: np.ndarray
    mailbox: np.ndarray
    """CSR per call: per op of a transfer call, its (link, tag) numbered (both ends of a transfer share it)."""
    local_ptr: np.ndarray
    """Per transfer call, where its block ops' ends start in `local`."""
    x_kind: np.ndarray
    x_stream: np.ndarray
    x_seconds: np.ndarray
    x_waits: np.ndarray
    x_category: np.ndarray
    x_slot: np.ndarray
    x_output: np.ndarray
    x_share_ptr: np.ndarray
    x_shares: np.ndarray
    x_dep_ptr: np.ndarray
    x_deps: np.ndarray
    """Per op row (the plan ops of a transfer block as one run runs it)."""
    structure_stream_ptr: np.ndarray
    structure_streams: np.ndarray
    """CSR per structure: the streams its key reads and its outcome writes."""
    first_tier: np.ndarray
    """Per structure, the tier its keys start from (raised where clamps fail, as `fastpath` does)."""
    compute_stream: int
    # outcomes, grown by the caller
    o_stream_ptr: np.ndarray
    o_streams: np.ndarray
    o_stream_rel: np.ndarray
    o_out_ptr: np.ndarray
    o_out_rel: np.ndarray
    o_unclampable: np.ndarray
    # the key table, grown by the caller
    slots: np.ndarray
    e_hash: np.ndarray
    e_key_ptr: np.ndarray
    e_keys: np.ndarray
    e_outcome: np.ndarray
    # state
    stream_end: np.ndarray
    out_end: np.ndarray
    call_start: np.ndarray
    call_end: np.ndarray
    position: np.ndarray
    op_position: np.ndarray
    """Per run, the op of its current transfer call to issue next (where it parked)."""
    local: np.ndarray
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
    # records
    a_run: np.ndarray
    a_t0: np.ndarray
    a_outcome: np.ndarray
    a_first: np.ndarray
    t_run: np.ndarray
    t_call: np.ndarray
    t_category: np.ndarray
    t_start: np.ndarray
    t_end: np.ndarray
    key: np.ndarray
    """The missed key (KEY_LENGTH long), and scratch."""
    miss_t0: np.ndarray
    counters: np.ndarray


@njit(cache=True, inline="always")
def key_hash(key: np.ndarray, length: int) -> int:
    h = _FNV_OFFSET
    for k in range(length):
        h = (h ^ key[k]) * _FNV_PRIME
    return h


@njit(cache=True)
def rehash(slots: np.ndarray, e_hash: np.ndarray, entries: int) -> None:
    """Place entries 0..entries-1 into empty `slots` (a power of two long)."""
    mask = len(slots) - 1
    for e in range(entries):
        i = e_hash[e] & mask
        while slots[i] >= 0:
            i = (i + 1) & mask
        slots[i] = e


@njit(cache=True)
def drive(t: Tables) -> int:
    """Advance the runnable runs, round-robin, until none is left (DONE) or a segment's key is new (MISS: the run
    resumes first on the next call)."""
    base = t.base
    kind = t.kind
    segment_end = t.segment_end
    structure = t.structure
    external_ptr = t.external_ptr
    external = t.external
    first_ptr = t.first_ptr
    first = t.first
    input_ptr = t.input_ptr
    inputs = t.inputs
    transfer = t.transfer
    xb_row_ptr = t.xb_row_ptr
    xb_output = t.xb_output
    mailbox_ptr = t.mailbox_ptr
    mailbox = t.mailbox
    local_ptr = t.local_ptr
    x_kind = t.x_kind
    x_stream = t.x_stream
    x_seconds = t.x_seconds
    x_waits = t.x_waits
    x_category = t.x_category
    x_slot = t.x_slot
    x_output = t.x_output
    x_share_ptr = t.x_share_ptr
    x_shares = t.x_shares
    x_dep_ptr = t.x_dep_ptr
    x_deps = t.x_deps
    structure_stream_ptr = t.structure_stream_ptr
    structure_streams = t.structure_streams
    first_tier = t.first_tier
    compute_stream = t.compute_stream
    o_stream_ptr = t.o_stream_ptr
    o_streams = t.o_streams
    o_stream_rel = t.o_stream_rel
    o_out_ptr = t.o_out_ptr
    o_out_rel = t.o_out_rel
    o_unclampable = t.o_unclampable
    slots = t.slots
    e_hash = t.e_hash
    e_key_ptr = t.e_key_ptr
    e_keys = t.e_keys
    e_outcome = t.e_outcome
    stream_end = t.stream_end
    out_end = t.out_end
    call_start = t.call_start
    call_end = t.call_end
    position = t.position
    op_position = t.op_position
    local = t.local
    queued = t.queued
    ring = t.ring
    category_time = t.category_time
    mb_head = t.mb_head
    mb_tail = t.mb_tail
    q_next = t.q_next
    q_run = t.q_run
    q_call = t.q_call
    q_row = t.q_row
    q_ready = t.q_ready
    a_run = t.a_run
    a_t0 = t.a_t0
    a_outcome = t.a_outcome
    a_first = t.a_first
    t_run = t.t_run
    t_call = t.t_call
    t_category = t.t_category
    t_start = t.t_start
    t_end = t.t_end
    key = t.key
    miss_t0 = t.miss_t0
    counters = t.counters

    def find(h: int, length: int) -> int:
        """The outcome stored under key[:length], or -1."""
        mask = len(slots) - 1
        i = h & mask
        while True:
            e = slots[i]
            if e < 0:
                return -1
            if e_hash[e] == h and e_key_ptr[e + 1] - e_key_ptr[e] == length:
                lo = e_key_ptr[e]
                same = True
                for k in range(length):
                    if e_keys[lo + k] != key[k]:
                        same = False
                        break
                if same:
                    return e_outcome[e]
            i = (i + 1) & mask

    def run_segment(r: int, c: int) -> int:
        """`fastpath._run_segment` for run r's call c (program-local): PARK, DONE (applied) or MISS."""
        lo = base[r]
        flat = lo + c
        kind_of = structure[flat]
        inf = np.inf
        t0 = stream_end[r, compute_stream]
        for k in range(first_ptr[flat], first_ptr[flat + 1]):
            v = out_end[lo + first[k]]
            if v > t0:
                t0 = v
        if t0 == inf:
            return PARK
        s_lo, s_hi = structure_stream_ptr[kind_of], structure_stream_ptr[kind_of + 1]
        e_lo, e_hi = external_ptr[flat], external_ptr[flat + 1]
        for k in range(s_lo, s_hi):
            if stream_end[r, structure_streams[k]] == inf:
                return PARK
        for k in range(e_lo, e_hi):
            if out_end[lo + external[k]] == inf:
                return PARK
        tier = first_tier[kind_of]
        while True:
            key[0], key[1] = kind_of, tier
            n = 2
            for k in range(s_lo, s_hi + e_hi - e_lo):
                if k < s_hi:
                    v = stream_end[r, structure_streams[k]]
                    is_input = False
                else:
                    v = out_end[lo + external[e_lo + k - s_hi]]
                    is_input = True
                if tier == CLAMP_AT_T0:
                    key[n] = np.int64(np.rint((v - t0) * SCALE)) if v > t0 else -1
                elif tier == CLAMP_ALL or (tier == CLAMP_INPUTS and is_input):
                    key[n] = np.int64(np.rint((v - t0) * SCALE)) if v > t0 else (0 if v == t0 else -1)
                else:
                    key[n] = np.int64(np.rint((v - t0) * SCALE))
                n += 1
            if tier == CLAMP_AT_T0:
                key[n] = 1 if stream_end[r, compute_stream] < t0 else 0
                n += 1
            h = key_hash(key, n)
            outcome = find(h, n)
            if outcome < 0:
                counters[KEY_LENGTH], counters[MISS_RUN], counters[MISS_CALL], counters[TIER] = n, r, c, tier
                miss_t0[0] = t0
                return MISS
            if not o_unclampable[outcome]:
                break
            tier += 1
            if tier > CLAMP_ALL:
                first_tier[kind_of] = tier
        for k in range(o_stream_ptr[outcome], o_stream_ptr[outcome + 1]):
            stream_end[r, o_streams[k]] = t0 + o_stream_rel[k]
        o = o_out_ptr[outcome]
        for k in range(o_out_ptr[outcome + 1] - o):
            out_end[flat + k] = t0 + o_out_rel[o + k]
        a = counters[APPLIED]
        a_run[a], a_t0[a], a_outcome[a], a_first[a] = r, t0, outcome, c
        counters[APPLIED] = a + 1
        position[r] = segment_end[flat]
        return DONE

    def settle(r: int, flat: int, x: int, start: float, end: float) -> None:
        """`engine._Scheduler._settle` for one side: op row x of run r's call `flat`."""
        local[local_ptr[flat] + x_slot[x]] = end
        stream_end[r, x_stream[x]] = end
        for k in range(x_share_ptr[x], x_share_ptr[x + 1]):
            s = x_shares[k]
            if end > stream_end[r, s]:
                stream_end[r, s] = end
        if x_output[x]:
            out_end[flat] = end
        category_time[r, x_category[x]] += end - start
        n = counters[TRANSFERS]
        t_run[n], t_call[n], t_category[n], t_start[n], t_end[n] = r, flat, x_category[x], start, end
        counters[TRANSFERS] = n + 1

    def rendezvous(r: int, flat: int, x: int, m: int, ready: float) -> tuple[float, float]:
        """`engine._Scheduler._rendezvous`: pair op row x with the head of mailbox m and settle both, or park it
        ((inf, inf))."""
        head = mb_head[m]
        if head < 0 or x_kind[q_row[head]] == x_kind[x]:
            q = counters[QUEUED]
            counters[QUEUED] = q + 1
            q_run[q], q_call[q], q_row[q], q_ready[q], q_next[q] = r, flat, x, ready, -1
            if head < 0:
                mb_head[m] = q
            else:
                q_next[mb_tail[m]] = q
            mb_tail[m] = q
            local[local_ptr[flat] + x_slot[x]] = np.inf
            stream_end[r, x_stream[x]] = np.inf
            return np.inf, np.inf
        mb_head[m] = q_next[head]
        other_run, other_flat, y, other_ready = q_run[head], q_call[head], q_row[head], q_ready[head]
        start = ready if ready > other_ready else other_ready
        busy = start
        for k in range(x_share_ptr[x], x_share_ptr[x + 1]):
            if stream_end[r, x_shares[k]] > busy:
                busy = stream_end[r, x_shares[k]]
        for k in range(x_share_ptr[y], x_share_ptr[y + 1]):
            if stream_end[other_run, x_shares[k]] > busy:
                busy = stream_end[other_run, x_shares[k]]
        seconds = x_seconds[x] if x_kind[x] == SEND else x_seconds[y]
        end = start + seconds + min(seconds, busy - start)
        settle(r, flat, x, start, end)
        settle(other_run, other_flat, y, start, end)
        if start < call_start[other_flat]:
            call_start[other_flat] = start
        if end > call_end[other_flat]:
            call_end[other_flat] = end
        if not queued[other_run]:
            queued[other_run] = True
            tail = counters[RING_TAIL]
            ring[tail % len(ring)] = other_run
            counters[RING_TAIL] = tail + 1
        return start, end

    def run_transfer(r: int, c: int) -> int:
        """`engine._Scheduler._issue_call` for run r's call c, a block of p2p ops only (most often one send or recv):
        PARK (at the op that must wait, resumed there) or DONE."""
        lo = base[r]
        flat = lo + c
        xb = transfer[flat]
        rows = xb_row_ptr[xb]
        room = local_ptr[flat]
        inputs_ready = 0.0
        for k in range(input_ptr[flat], input_ptr[flat + 1]):
            v = out_end[lo + inputs[k]]
            if v > inputs_ready:
                inputs_ready = v
        earliest, latest = call_start[flat], call_end[flat]
        j = op_position[r]
        while j < xb_row_ptr[xb + 1] - rows:
            x = rows + j
            start = stream_end[r, x_stream[x]]
            if x_waits[x] and inputs_ready > start:
                start = inputs_ready
            for k in range(x_dep_ptr[x], x_dep_ptr[x + 1]):
                if local[room + x_deps[k]] > start:
                    start = local[room + x_deps[k]]
            if start == np.inf:
                op_position[r] = j
                call_start[flat], call_end[flat] = min(call_start[flat], earliest), max(call_end[flat], latest)
                return PARK
            start, end = rendezvous(r, flat, x, mailbox[mailbox_ptr[flat] + j], start)
            j += 1
            if end == np.inf:
                continue
            if start < earliest:
                earliest = start
            if end > latest:
                latest = end
        call_start[flat], call_end[flat] = min(call_start[flat], earliest), max(call_end[flat], latest)
        out_end[flat] = local[room + xb_output[xb]]
        op_position[r] = 0
        position[r] = c + 1
        return DONE

    while True:
        r = counters[CURRENT]
        if r < 0:
            head = counters[RING_HEAD]
            if head == counters[RING_TAIL]:
                return DONE
            r = ring[head % len(ring)]
            counters[RING_HEAD] = head + 1
            queued[r] = False
            counters[CURRENT] = r
        calls = base[r + 1] - base[r]
        while position[r] < calls:
            c = position[r]
            status = run_segment(r, c) if kind[base[r] + c] == SEGMENT else run_transfer(r, c)
            if status == MISS:
                return MISS
            if status == PARK:
                break
        counters[CURRENT] = -1


@njit(cache=True)
def category_times(
    category_time: np.ndarray,
    a_run: np.ndarray,
    a_outcome: np.ndarray,
    outcomes: int,
    o_category_ptr: np.ndarray,
    o_category: np.ndarray,
    o_category_seconds: np.ndarray,
) -> None:
    """Add each run's applied outcomes' seconds per category, outcome by outcome in the order each first applied,
    seconds x applications, as `fastpath._FastScheduler._finish` adds them."""
    runs = category_time.shape[0]
    count = np.zeros((runs, outcomes), dtype=np.int64)
    order = np.empty((runs, outcomes), dtype=np.int64)
    seen = np.zeros(runs, dtype=np.int64)
    for i in range(len(a_run)):
        r, o = a_run[i], a_outcome[i]
        if count[r, o] == 0:
            order[r, seen[r]] = o
            seen[r] += 1
        count[r, o] += 1
    for r in range(runs):
        for j in range(seen[r]):
            o = order[r, j]
            for k in range(o_category_ptr[o], o_category_ptr[o + 1]):
                category_time[r, o_category[k]] += o_category_seconds[k] * count[r, o]
