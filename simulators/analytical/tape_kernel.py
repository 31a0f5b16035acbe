"""`tape.record`'s walk of the reference scheduler's rules, compiled: the same steps over plain arrays.

Recording in Python cost ~3 us a node (GPT-3 175B tp4 pp8's steady form: 78k nodes, 0.23 s), as much as a first
batch of 1,000 systems is given in all; the walk itself is integer bookkeeping, so it is compiled here and
`tape.record` only lays the workload out in arrays before and trims the arrays after. Every step is the
Python recorder's, in its order, so the tape is the same node for node (`tape`'s docstring has the rules):
- a node: kind, column and its arguments (`lo`..`lo[n + 1]` of `flat`);
- what a node is never earlier than (`_beneath`): a max's arguments, a shared transfer's start, nothing for a min;
- per run: its streams' ends, the current call's op ends (`PARKED`, `MARKED`), the marked kernels'
  arguments and columns, its call and op;
- the busy intervals, each with its run and its calls' indices in the run (a compute interval joined over calls:
  its first and last), so that the batch path can leave a steady stretch's calls out by index (`batch_busy.Cut`);
- parked p2p sides in one first-in-first-out queue per link and tag (linked lists), runs to resume in a ring;
- per call and stream, the start of its first op and the end of its last, streams in the order first touched (the
  order of the Python recorder's dicts, which the call's start and end nodes take their arguments in).
Capacities are guesses: `OVERFLOW` says to call again with more room.

Every kernel here is compiled without numba's reference counting (`_nrt=False`): they allocate nothing and only read
and write the arrays handed in, yet with it each call and each array taken out of the `tape` and `state` tuples
counted references with atomic adds, 84% of the walk's time (perf on GPT-3 tp4 pp16: 34 ms of a 159k-node walk; 5 ms
without). An allocation (a slice assigned from an overlapping array copies it) then fails to compile rather than
slowing the walk.
"""

from numba import njit

MAX_ADD, MIN, SHARED = 0, 1, 2
ZERO, INF = 0, 1
PARKED = -1
"""A time the engine holds as inf: an op waiting on a transfer that has not paired yet."""
MARKED = -2
"""A kernel marked inside a fused run whose end no op has read yet: its node is made when one does (`_marked_end`),
as most are never read (Llama-3-70B's steady form: 16k of 25k)."""
COMPUTE, SEND = 0, 2
OK, OVERFLOW, DEADLOCK, BAD_ARGUMENT = 0, 1, 2, 3

# columns of the op table
KIND, STREAM, WAITS, SLOT, CATEGORY, LINK, RANK, COLUMN = range(8)
DEPS, DEPS_END, MARKS, MARKS_END, SHARES, SHARES_END = range(8, 14)
"""An op's deps, marked slots, their columns (at `MARKS_END - MARKS` past the slots) and shared streams are
ranges of the items array; RANK: a p2p op's index among its plan's p2p ops (its key in the call's keys)."""
# columns of the call table
PLAN, INPUTS, INPUTS_END, KEYS, CALL, RUN = range(6)
# columns of the tape's counters
NODES, ARGS, STATUS = range(3)
# columns of a run's position
CURRENT, OP, FIRST, CALLS, HELD, LAST_COMPUTE = range(6)
# columns of a side (a p2p op waiting to pair, or paired)
S_RUN, S_CALL, S_OP, S_READY, S_NEXT, S_OUTPUT, S_HELD = range(7)
"""S_HELD: its shared stream's end as it was issued (`_reserve`)."""
# the walk's counters
COMPUTED, COMMUNICATED, TRANSFERRED, SIDES, HEAD, TAIL = range(6)
UNTOUCHED = -9
"""A call's stream no op of the call ran on yet."""


@njit(cache=True, _nrt=False, inline="always")
def _node(tape, kind: int, args, n: int, column: int) -> int:
    kinds, columns, lo, flat, count = tape
    node, at = count[NODES], count[ARGS]
    if node + 1 >= len(kinds) or at + n > len(flat):
        count[STATUS] = OVERFLOW
        return ZERO
    for i in range(n):
        a = args[i]
        if a < 0:
            count[STATUS] = BAD_ARGUMENT
            return ZERO
        flat[at + i] = a
    kinds[node], columns[node] = kind, column
    lo[node + 1] = at + n
    count[NODES], count[ARGS] = node + 1, at + n
    return node


@njit(cache=True, _nrt=False, inline="always")
def _under(kinds, lo, node: int) -> tuple[int, int]:
    """The range of `flat` a node is never earlier than."""
    first = lo[node]
    if kinds[node] == MAX_ADD:
        return first, lo[node + 1]
    if kinds[node] == SHARED:
        return first, first + 1
    return first, first


@njit(cache=True, _nrt=False)
def _beneath(kinds, lo, flat, low: int, high: int) -> bool:
    if low >= high:
        return False
    first, last = _under(kinds, lo, high)
    for i in range(first, last):
        if flat[i] == low:
            return True
    for i in range(first, last):
        inner, inner_last = _under(kinds, lo, flat[i])
        for k in range(inner, inner_last):
            if flat[k] == low:
                return True
    return False


@njit(cache=True, _nrt=False)
def _needed(kinds, lo, flat, args, n: int, out, distinct) -> int:
    """`Tape.needed` of args[:n] into out; how many."""
    if n == 0:
        out[0] = ZERO
        return 1
    if n == 1:
        out[0] = args[0]
        return 1
    if n == 2:
        a, b = args[0], args[1]
        if a == b or b == ZERO:
            out[0] = a
            return 1
        if a == ZERO or _beneath(kinds, lo, flat, a, b):
            out[0] = b
            return 1
        if _beneath(kinds, lo, flat, b, a):
            out[0] = a
            return 1
        out[0], out[1] = a, b
        return 2
    m = 0
    for i in range(n):
        seen = False
        for k in range(m):
            if distinct[k] == args[i]:
                seen = True
                break
        if not seen:
            distinct[m] = args[i]
            m += 1
    if m > 1:  # ZERO left out beside others (once at most: they are distinct)
        kept = 0
        for k in range(m):
            if distinct[k] != ZERO:
                distinct[kept] = distinct[k]
                kept += 1
        m = kept
    if m <= 1:
        out[0] = distinct[0] if m == 1 else ZERO
        return 1
    kept = 0
    for i in range(m):
        under = False
        for k in range(m):
            if _beneath(kinds, lo, flat, distinct[i], distinct[k]):
                under = True
                break
        if not under:
            out[kept] = distinct[i]
            kept += 1
    return kept


@njit(cache=True, _nrt=False, inline="always")
def _after(tape, needed, n: int, column: int) -> int:
    if column < 0 and n == 1:
        return needed[0]
    return _node(tape, MAX_ADD, needed, n, column)


@njit(cache=True, _nrt=False, inline="always")
def _latest(tape, args, n: int, column: int, scratch) -> int:
    """max(args[:n]) + column as a node, the arguments `_needed` first (scratch: rows 1 and 2 are `_needed`'s room)."""
    count = _needed(tape[0], tape[2], tape[3], args, n, scratch[1], scratch[2])
    return _after(tape, scratch[1], count, column)


@njit(cache=True, _nrt=False, inline="always")
def _marked_end(tape, local, marked, held, run: int, slot: int) -> int:
    end = local[run, slot]
    if end == MARKED:
        at, n, column = marked[run, slot, 0], marked[run, slot, 1], marked[run, slot, 2]
        end = _after(tape, held[run, at : at + n], n, column)
        local[run, slot] = end
    return end


@njit(cache=True, _nrt=False, inline="always")
def _first(state, call: int, stream: int, start: int) -> None:
    """The start of the call's first op on the stream, unless one came before."""
    spans, order = state[6], state[7]
    if spans[call, stream, 0] == UNTOUCHED:
        spans[call, stream, 0] = start
        n = order[call, -1]
        order[call, n] = stream
        order[call, -1] = n + 1


@njit(cache=True, _nrt=False)
def _issue_call(tape, state, run: int, ops, calls, plans, items, scratch) -> bool:
    """`engine._Scheduler._issue_call` over node ids; False when the run parks."""
    stream_end, local, marked, held, position, out_end = state[0], state[1], state[2], state[3], state[4], state[5]
    spans, compute, comm, counters = state[6], state[8], state[9], state[13]
    c = position[run, CURRENT]
    call = position[run, FIRST] + c
    plan = calls[call, PLAN]
    first_op, last_op, slots, output = plans[plan, 0], plans[plan, 1], plans[plan, 2], plans[plan, 3]
    if position[run, OP] == 0:
        local[run, :slots] = ZERO
        position[run, HELD] = 0
    args, needed = scratch[0], scratch[1]
    n = 0
    parked = False
    for i in range(calls[call, INPUTS], calls[call, INPUTS_END]):
        args[n] = out_end[items[i]]
        parked |= args[n] == PARKED
        n += 1
    inputs_ready = PARKED if parked else _latest(tape, args, n, -1, scratch)
    j = position[run, OP]
    while j < last_op - first_op:
        o = first_op + j
        stream = ops[o, STREAM]
        args[0] = stream_end[run, stream]
        n = 1
        if ops[o, WAITS]:
            args[n] = inputs_ready
            n += 1
        for i in range(ops[o, DEPS], ops[o, DEPS_END]):
            args[n] = _marked_end(tape, local, marked, held, run, items[i])
            n += 1
        if not ops[o, LINK]:
            for i in range(ops[o, SHARES], ops[o, SHARES_END]):
                args[n] = stream_end[run, items[i]]
                n += 1
        for i in range(n):
            if args[i] == PARKED:
                position[run, OP] = j
                return False
        if ops[o, LINK]:
            side = _side(state, run, call, o, plans[plan, 3], _latest(tape, args, n, -1, scratch), ops)
            _reserve(tape, state, side, ops, items, scratch)
            _rendezvous(tape, state, side, items[calls[call, KEYS] + ops[o, RANK]], ops, items, scratch)
            j += 1
            continue
        count = _needed(tape[0], tape[2], tape[3], args, n, needed, scratch[2])
        end = _after(tape, needed, count, ops[o, COLUMN])
        local[run, ops[o, SLOT]] = end
        if ops[o, MARKS] < ops[o, MARKS_END]:  # the marked kernels' nodes wait for a read (`_marked_end`)
            at = position[run, HELD]
            for i in range(count):
                held[run, at + i] = needed[i]
            position[run, HELD] = at + count
            for i in range(ops[o, MARKS], ops[o, MARKS_END]):
                local[run, items[i]] = MARKED
                marked[run, items[i], 0] = at
                marked[run, items[i], 1] = count
                marked[run, items[i], 2] = items[i + ops[o, MARKS_END] - ops[o, MARKS]]
        stream_end[run, stream] = end
        for i in range(ops[o, SHARES], ops[o, SHARES_END]):
            stream_end[run, items[i]] = end
        if ops[o, KIND] == COMPUTE:
            last = position[run, LAST_COMPUTE]
            if last >= 0 and count == 1 and needed[0] == compute[last, 3]:  # one interval with the last
                compute[last, 3], compute[last, 5] = end, c
            else:
                at = counters[COMPUTED]
                compute[at, 0], compute[at, 1], compute[at, 2], compute[at, 3] = run, end, ops[o, COLUMN], end
                compute[at, 4], compute[at, 5] = c, c
                counters[COMPUTED] = at + 1
                position[run, LAST_COMPUTE] = at
            if spans[call, stream, 0] == UNTOUCHED:
                _first(state, call, stream, _after(tape, needed, count, -1))
        else:
            start = _after(tape, needed, count, -1)
            at = counters[COMMUNICATED]
            comm[at, 0], comm[at, 1], comm[at, 2], comm[at, 3] = run, start, end, c
            counters[COMMUNICATED] = at + 1
            _first(state, call, stream, start)
        spans[call, stream, 1] = end
        j += 1
    out_end[call] = _marked_end(tape, local, marked, held, run, output)
    position[run, CURRENT], position[run, OP] = c + 1, 0
    return True


@njit(cache=True, _nrt=False)
def _side(state, run: int, call: int, op: int, output: int, ready: int, ops) -> int:
    """A p2p op ready to pair: its row of the sides."""
    sides, counters = state[11], state[13]
    side = counters[SIDES]
    counters[SIDES] = side + 1
    row = sides[side]
    row[S_RUN], row[S_CALL], row[S_OP], row[S_READY], row[S_NEXT] = run, call, op, ready, -1
    row[S_OUTPUT] = ops[op, SLOT] == output
    return side


@njit(cache=True, _nrt=False)
def _reserve(tape, state, side: int, ops, items, scratch) -> None:
    """`engine._reserve`: the side's shared stream (a transfer crosses one dimension one way at most) reserved
    from its ready time; what it held before is the side's S_HELD."""
    stream_end, sides = state[0], state[11]
    op = sides[side, S_OP]
    if ops[op, SHARES_END] == ops[op, SHARES]:
        return
    run, stream = sides[side, S_RUN], items[ops[op, SHARES]]
    held = stream_end[run, stream]
    sides[side, S_HELD] = held
    args = scratch[3]
    args[0], args[1] = sides[side, S_READY], held
    busy = _latest(tape, args, 2, -1, scratch)
    args[0], args[1] = sides[side, S_READY], busy
    if busy != args[0]:
        reserved = _node(tape, SHARED, args, 2, ops[op, COLUMN])
    else:
        reserved = _latest(tape, args, 1, ops[op, COLUMN], scratch)
    args[0], args[1] = held, reserved
    stream_end[run, stream] = _latest(tape, args, 2, -1, scratch)


@njit(cache=True, _nrt=False)
def _rendezvous(tape, state, side: int, key: int, ops, items, scratch) -> None:
    stream_end, local, sides, queues = state[0], state[1], state[11], state[12]
    head = queues[key, 0]
    kind = ops[sides[side, S_OP], KIND]
    if head < 0 or ops[sides[head, S_OP], KIND] == kind:
        if head < 0:
            queues[key, 0] = side
        else:
            sides[queues[key, 1], S_NEXT] = side
        queues[key, 1] = side
        run, op = sides[side, S_RUN], sides[side, S_OP]
        local[run, ops[op, SLOT]] = PARKED
        stream_end[run, ops[op, STREAM]] = PARKED
        return
    other = head
    queues[key, 0] = sides[other, S_NEXT]
    if queues[key, 0] < 0:
        queues[key, 1] = -1
    args = scratch[3]
    args[0], args[1] = sides[side, S_READY], sides[other, S_READY]
    start = _latest(tape, args, 2, -1, scratch)
    args[0] = start
    n = 1
    for s in (side, other):
        if ops[sides[s, S_OP], SHARES_END] > ops[sides[s, S_OP], SHARES]:
            args[n] = sides[s, S_HELD]
            n += 1
    busy = _latest(tape, args, n, -1, scratch)
    column = ops[sides[side, S_OP], COLUMN] if kind == SEND else ops[sides[other, S_OP], COLUMN]
    args[0], args[1] = start, busy
    end = _node(tape, SHARED, args, 2, column) if busy != start else _latest(tape, args, 1, column, scratch)
    _settle(tape, state, side, start, end, ops, items, scratch)
    _settle(tape, state, other, start, end, ops, items, scratch)
    run = sides[other, S_RUN]
    queued, counters = state[15], state[13]
    if not queued[run]:
        queued[run] = 1
        ring = state[14]
        ring[counters[TAIL] % len(ring)] = run
        counters[TAIL] += 1


@njit(cache=True, _nrt=False)
def _settle(tape, state, side: int, start: int, end: int, ops, items, scratch) -> None:
    stream_end, local, position, out_end, spans = state[0], state[1], state[4], state[5], state[6]
    comm, transfers, sides, counters = state[9], state[10], state[11], state[13]
    run, call, op = sides[side, S_RUN], sides[side, S_CALL], sides[side, S_OP]
    stream = ops[op, STREAM]
    if position[run, FIRST] + position[run, CURRENT] == call:  # else the run left the call: its ends are gone
        local[run, ops[op, SLOT]] = end
    stream_end[run, stream] = end
    if sides[side, S_OUTPUT]:
        out_end[call] = end
    at = counters[TRANSFERRED]
    row = transfers[at]
    row[0], row[1], row[2], row[3], row[4] = run, ops[op, CATEGORY], call - position[run, FIRST], start, end
    counters[TRANSFERRED] = at + 1
    at = counters[COMMUNICATED]
    comm[at, 0], comm[at, 1], comm[at, 2], comm[at, 3] = run, start, end, call - position[run, FIRST]
    counters[COMMUNICATED] = at + 1
    _first(state, call, stream, start)
    spans[call, stream, 1] = end


@njit(cache=True, _nrt=False)
def walk(tape, state, ops, calls, plans, items, scratch) -> None:
    """Every run's calls issued, in the engine's order; then every call's start and end node. The status lands
    in the tape's counters."""
    position, ring, queued, counters, queues = state[4], state[14], state[15], state[13], state[12]
    runs = len(position)
    for run in range(runs):
        ring[run] = run
        queued[run] = 1
    counters[TAIL] = runs
    while counters[HEAD] < counters[TAIL]:
        run = ring[counters[HEAD] % len(ring)]
        counters[HEAD] += 1
        queued[run] = 0
        while position[run, CURRENT] < position[run, CALLS] and _issue_call(
            tape, state, run, ops, calls, plans, items, scratch
        ):
            pass
        if tape[4][STATUS] != OK:
            return
    for run in range(runs):
        if position[run, CURRENT] < position[run, CALLS]:
            tape[4][STATUS] = DEADLOCK
            return
    for key in range(len(queues)):
        if queues[key, 0] >= 0:
            tape[4][STATUS] = DEADLOCK
            return
    spans, order, edges = state[6], state[7], state[16]
    args = scratch[0]
    for run in range(runs):
        first, last = position[run, FIRST], position[run, FIRST] + position[run, CALLS]
        for call in range(first, last):  # min(starts); inf for a call without ops, as the engine leaves it
            n = 0
            for i in range(order[call, -1]):
                start = spans[call, order[call, i], 0]
                seen = False
                for k in range(n):
                    seen |= args[k] == start
                if not seen:
                    args[n] = start
                    n += 1
            edges[call, 0] = INF if n == 0 else args[0] if n == 1 else _node(tape, MIN, args, n, -1)
        for call in range(first, last):
            for i in range(order[call, -1]):
                args[i] = spans[call, order[call, i], 1]
            edges[call, 1] = _latest(tape, args, order[call, -1], -1, scratch)


@njit(cache=True, _nrt=False)
def grouped(rows, start, count, taken, out) -> None:
    """rows (a run, then its fields) laid out in out run by run: run r's part, from start[r], its fields x its
    count[r] rows in their order (taken: zeros, each run's rows so far)."""
    for i in range(len(rows)):
        run = rows[i, 0]
        at = start[run] + taken[run]
        taken[run] += 1
        for f in range(rows.shape[1] - 1):
            out[at + f * count[run]] = rows[i, 1 + f]
