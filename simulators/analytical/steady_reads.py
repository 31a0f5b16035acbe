"""What a steady form's calls read back, for the splice argument of `steady._periods`.

A stage's timeline is extended by splicing periods into its steady stretch, and that is sound only if every call
after the splice reads times from inside the stretch: then the calls it reads were checked to repeat a period
apart, and a step with more micro-batches reads the same times moved by as many periods. A call reads its inputs
(and a transfer its partner's side on another stage), but not every input can set its start: every op reading a
block's inputs waits for all of them (`dse.workload.expand`), so an input that another input of the same call
waits on itself, through inputs whose output waits on them and through the transfers that join the stages (a
recv ends with its send, `engine._rendezvous`), never ends last. A backward reads its own forward's activations,
a pipeline's depth back, but it also reads the gradient from the next stage, which waits on the same forward
through that stage: the activations never set its start, and the stretch need not reach back that far.
"""

from dataclasses import dataclass, field

import numpy as np
from numba import njit

from dse.lru import MIB, ByteBoundedLru, IdentityMemo
from dse.workload import BLOCK_INPUT, Block, OpKind, Program
from simulators.analytical.call_layout import call_arrays
from simulators.analytical.calls import call_array

_OTHER, _SEND, _RECV, _BOTH, _LOOSE = 0, 1, 2, 3, 4
"""A block's side of transfers between pipeline stages: none; one send that is its output; one recv its output
waits on; p2p ops otherwise, all with one stage (a tied weight's gradients exchanged); otherwise (its partners not
followed)."""

_NONE = np.iinfo(np.intp).max
"""No call read."""


@dataclass(frozen=True, slots=True)
class Reads:
    """What the calls of a form's stages read back (joined over the stages, stage s's calls from base[s] on)."""

    base: np.ndarray
    floor: np.ndarray
    """Stage s's at base[s] + s + h: the earliest call of the stage that one of its calls h.. reads (an input that
    can set its start), h up to its call count (then none: the largest intp); found from the end back, as far as
    asked so far (`done`: a run's end, mostly where the drain starts, so the warm-up's are not walked)."""
    done: np.ndarray
    """Per stage, the first call from which `floor` is found."""
    pairs: np.ndarray
    """4 x transfers: (stage, call, partner's stage, partner's call) of every call that transfers with a call of
    another stage."""
    walk: tuple[np.ndarray, ...]
    """What `_fill` walks: the calls' inputs and what they wait on (and its scratch arrays)."""
    memo: dict = field(default_factory=dict)
    """What the steady checks derive from the form's calls, kept with them (`steady._joined_twins`, a few bytes a
    call per period tried: not counted in `bytes`), and per period the stage that ruled it out last
    (`steady._periods`: which stage is read first, never what is found)."""

    @property
    def bytes(self) -> int:
        return sum(a.nbytes for a in (self.base, self.floor, self.done, self.pairs, *self.walk))

    def holds(self, stage: int, lo: int, hi: int, distance: int) -> bool:
        """Whether the steady run [lo, hi) of `stage`, `distance` calls a period, may be spliced as far as its own
        stage goes (`steady._periods`, per point and per system of a batch alike): it spans two periods, so that
        three periods of the timeline repeat, and every call after it reads only calls inside it (`within`)."""
        # the rule's Python function: a compiled call from Python costs more than the rule (batch asks per system)
        return spans_two_periods.py_func(lo, hi, distance) and self.within(stage, lo, hi)

    def within(self, stage: int, lo: int, hi: int) -> bool:
        """Whether every call of `stage` from `hi` on reads only calls of its own from `lo` on."""
        if hi < self.done[stage]:
            _fill(stage, hi, self.base, self.floor, self.done, *self.walk)
        return bool(self.floor[self.base[stage] + stage + hi] >= lo)

    def joined(self, lo: np.ndarray, hi: np.ndarray, distance: np.ndarray) -> np.ndarray:
        """Per system (stages x systems: each stage's run [lo, hi) and its calls per period), whether the stages'
        transfers join their runs as `steady._periods` needs: every call from hi on transfers with a call from the
        partner's lo on, and every call of the run's first period (lo .. lo + distance - 1) with one of the
        partner's checked calls (before its hi + distance)."""
        return _joined(self.pairs, lo, hi, distance)


@njit(cache=True)
def spans_two_periods(lo: int, hi: int, distance: int) -> bool:
    """Whether the steady run [lo, hi), `distance` calls a period, spans two periods: the part of `Reads.holds`
    read off the run alone, which `steady._steady_runs` checks as it finds each stage's run."""
    return hi - lo >= 2 * distance


_FACTS: IdentityMemo[tuple[bool, int, int]] = IdentityMemo(1024)
"""Per block, `_block_facts` of it."""
READS_BYTES = 16 * MIB
"""Forms' Reads kept (`_KEPT`): a study runs a few schedules, each with a form or two of 3,000 to 25,000 calls,
about 90 bytes a call."""
_KEPT: ByteBoundedLru[tuple, tuple[list, Reads]] = ByteBoundedLru(
    "steady reads", READS_BYTES, lambda entry: entry[1].bytes
)
"""Per form (its programs' CallArrays by identity, its blocks' facts), those arrays and its Reads."""


def reads(blocks: list[Block], programs: list[Program]) -> Reads:
    """The form's `Reads`, kept per form: its programs' calls and its blocks' facts are the same for every point
    of a schedule."""
    facts = [_block_facts(block) for block in blocks]
    arrays = [call_arrays(program) for program in programs]
    key = (tuple(map(id, arrays)), tuple(facts))
    kept = _KEPT.get(key)
    if kept is not None and all(a is b for a, b in zip(kept[0], arrays, strict=True)):
        return kept[1]
    waits, side, peer = (np.array(column, dtype=np.intp) for column in zip(*facts, strict=True))
    counts = np.array([len(own.blocks) for own in arrays], dtype=np.intp)
    base = np.zeros(len(arrays) + 1, dtype=np.intp)
    np.cumsum(counts, out=base[1:])
    block = np.concatenate([own.blocks for own in arrays])
    stage = np.repeat(np.arange(len(arrays)), counts)
    partner = _partners(side[block], peer[block], np.concatenate([own.tags for own in arrays]), stage)
    input_counts = np.concatenate([own.input_counts for own in arrays])
    microbatch = np.concatenate([call_array(program, "microbatch") for program in programs])
    ptr = np.zeros(len(block) + 1, dtype=np.intp)
    np.cumsum(input_counts, out=ptr[1:])
    floor = np.full(len(block) + len(arrays), _NONE, dtype=np.intp)
    done = counts.copy()
    scratch = (np.full(len(block), -1, dtype=np.intp), np.empty(len(block), dtype=np.intp), np.zeros(1, np.intp))
    inputs = np.concatenate([own.inputs for own in arrays])
    near = _near(base, microbatch)
    walk = (input_counts, inputs, ptr, microbatch, waits[block] > 0, side[block], partner, stage, near, *scratch)
    paired = np.flatnonzero(partner >= 0)
    there = partner[paired]
    pairs = np.stack((stage[paired], paired - base[stage[paired]], stage[there], there - base[stage[there]]))
    found = Reads(base, floor, done, pairs, walk)
    _KEPT.put(key, (arrays, found))
    return found


def _block_facts(block: Block) -> tuple[bool, int, int]:
    """(whether the block's output waits, through its ops, on an op reading its inputs; its p2p side; the offset
    along pp of the stage its p2p op sends to or receives from), kept per block (`_FACTS`)."""
    return _FACTS.get(block, lambda: _facts_of(block))


def _facts_of(block: Block) -> tuple[bool, int, int]:
    ops, out = block.ops, block.output_index
    above, stack, waits = {out}, [out], False
    while stack:
        for d in ops[stack.pop()].deps:
            if d == BLOCK_INPUT:
                waits = True
            elif d not in above:
                above.add(d)
                stack.append(d)
    # p2p along other axes (a ring's steps) pair a call with itself on the class's other ranks
    p2p = [op for op in ops if op.kind in (OpKind.SEND, OpKind.RECV) and op.axis == "pp"]
    side, peer = _OTHER, 0
    if p2p:
        side, peer = _LOOSE, p2p[0].peer
        if all(op.peer == peer for op in p2p) and peer != 0:
            side = _BOTH
            if len(p2p) == 1 and p2p[0].kind is OpKind.SEND and ops[out] is p2p[0]:
                side = _SEND
            elif len(p2p) == 1 and p2p[0].kind is OpKind.RECV and any(ops[i] is p2p[0] for i in above):
                side = _RECV
    return waits, side, peer


def _partners(side: np.ndarray, peer: np.ndarray, tags: np.ndarray, stage: np.ndarray) -> np.ndarray:
    """Per call (joined over the stages, the programs taken as the pipeline's stages in order), the joined index
    of the call it transfers with: the one other call of its tag between the same two stages, a send's recv or an
    exchange's exchange (the engine pairs by link and tag); -1 for a call without p2p, -2 for one whose partner is
    not that plain (a tag held by more calls there, or p2p ops of a block `_block_facts` does not follow)."""
    partner = np.full(len(side), -1, dtype=np.intp)
    p2p = np.flatnonzero(side != _OTHER)
    partner[p2p] = -2
    p2p = p2p[side[p2p] != _LOOSE]
    stages = int(stage[-1]) + 1
    other = (stage[p2p] + peer[p2p]) % stages
    key = (tags[p2p] * stages + np.minimum(stage[p2p], other)) * stages + np.maximum(stage[p2p], other)
    order = np.argsort(key, kind="stable")
    starts = np.flatnonzero(np.diff(key[order], prepend=-1, append=-1))
    two = starts[:-1][np.diff(starts) == 2]
    x, y = p2p[order[two]], p2p[order[two + 1]]
    sides = np.minimum(side[x], side[y]) * 8 + np.maximum(side[x], side[y])
    apart = (stage[x] != stage[y]) & ((sides == _SEND * 8 + _RECV) | (sides == _BOTH * 8 + _BOTH))
    partner[x[apart]], partner[y[apart]] = y[apart], x[apart]
    return partner


@njit(cache=True)
def _joined(pairs: np.ndarray, lo: np.ndarray, hi: np.ndarray, distance: np.ndarray) -> np.ndarray:
    """`Reads.joined`."""
    ok = np.ones(lo.shape[1], dtype=np.bool_)
    for k in range(pairs.shape[1]):
        stage, call, other, there = pairs[0, k], pairs[1, k], pairs[2, k], pairs[3, k]
        for s in range(len(ok)):
            spliced = call >= hi[stage, s]
            opening = lo[stage, s] <= call < lo[stage, s] + distance[stage, s]
            if (spliced and there < lo[other, s]) or (opening and there >= hi[other, s] + distance[other, s]):
                ok[s] = False
    return ok


@njit(cache=True)
def _near(base: np.ndarray, microbatch: np.ndarray) -> np.ndarray:
    """Per stage, two micro-batches' calls (the fewest any of its micro-batches has): an input no further back is
    not asked about (`_fill`), as a run spans two periods, each at least a micro-batch's calls."""
    near = np.full(len(base) - 1, _NONE, dtype=np.intp)
    sizes = np.zeros(int(microbatch.max()) + 1 if len(microbatch) else 0, dtype=np.intp)
    for s in range(len(base) - 1):
        sizes[:] = 0
        for g in range(base[s], base[s + 1]):
            if microbatch[g] >= 0:
                sizes[microbatch[g]] += 1
        for m in range(len(sizes)):
            if sizes[m]:
                near[s] = min(near[s], 2 * sizes[m])
    return near


@njit(cache=True)
def _fill(
    s: int,
    hi: int,
    base: np.ndarray,
    floor: np.ndarray,
    done: np.ndarray,
    input_counts: np.ndarray,
    inputs: np.ndarray,
    ptr: np.ndarray,
    microbatch: np.ndarray,
    waits: np.ndarray,
    side: np.ndarray,
    partner: np.ndarray,
    stage: np.ndarray,
    near: np.ndarray,
    mark: np.ndarray,
    stack: np.ndarray,
    query: np.ndarray,
) -> None:
    """`Reads.floor` of stage s from call hi on: per call, back from the first found, the earliest of its inputs
    that can set its start (the call itself without any; -1 for a p2p call whose partner is not plain: it reads a
    time not followed), and their running minimum."""
    at = base[s]
    own = np.empty(max(1, input_counts.max()), dtype=np.intp)
    low = floor[at + s + done[s]]
    for g in range(at + done[s] - 1, at + hi - 1, -1):
        count = input_counts[g]
        earliest = -1 if partner[g] == -2 else g - at
        if count and partner[g] != -2:
            for i in range(count):  # its inputs in order (insertion sort: a call has a few)
                x, j = inputs[ptr[g] + i], i
                while j > 0 and own[j - 1] > x:
                    own[j] = own[j - 1]
                    j -= 1
                own[j] = x
            earliest = own[count - 1]
            for i in range(count - 1):
                query[0] += 1
                if g - at - own[i] <= near[s] or not _implied(
                    own[i],
                    own,
                    count,
                    at,
                    query[0],
                    mark,
                    stack,
                    ptr,
                    inputs,
                    base,
                    stage,
                    microbatch,
                    waits,
                    side,
                    partner,
                ):
                    earliest = own[i]
                    break
        low = min(low, earliest)
        floor[g + s] = low
    done[s] = hi


@njit(cache=True, inline="always")
def _implied(
    a: int,
    own: np.ndarray,
    count: int,
    at: int,
    query: int,
    mark: np.ndarray,
    stack: np.ndarray,
    ptr: np.ndarray,
    inputs: np.ndarray,
    base: np.ndarray,
    stage: np.ndarray,
    microbatch: np.ndarray,
    waits: np.ndarray,
    side: np.ndarray,
    partner: np.ndarray,
) -> bool:
    """Whether input `a` (local to the stage starting at joined index `at`) is waited on by another of the call's
    inputs `own`: a walk back from those through inputs of calls whose output waits on theirs and from plain recvs
    to their sends, over calls of a's micro-batch only (a narrower walk finds fewer: it can only keep an input)."""
    target = at + a
    mb = microbatch[target]
    if mb < 0:
        return False
    top = 0
    for i in range(count):
        b = own[i]
        if b != a and mark[at + b] != query:
            mark[at + b] = query
            stack[top] = at + b
            top += 1
    while top:
        top -= 1
        v = stack[top]
        if v == target:
            return True
        w = partner[v]
        if side[v] == _RECV and w >= 0 and side[w] == _SEND and mark[w] != query and microbatch[w] == mb:
            mark[w] = query
            stack[top] = w
            top += 1
        if waits[v]:
            pushed = top
            for i in range(ptr[v], ptr[v + 1]):
                u = base[stage[v]] + inputs[i]
                if mark[u] != query and microbatch[u] == mb and not (stage[u] == stage[target] and u < target):
                    mark[u] = query
                    stack[top] = u
                    top += 1
            # the earliest input walked first: a backward's way back to its forward goes through it
            for i in range(pushed, top - 1):
                if stack[i] < stack[top - 1]:
                    stack[i], stack[top - 1] = stack[top - 1], stack[i]
    return False
