"""Plans as two parts: a skeleton (`Skeleton`: which ops fuse, their streams, deps, slots, categories, links and
shares), which depends on the block and the network's shape, and the seconds (`Plan.seconds`) the system's speeds
give it. `plans.Planner` keeps skeletons across systems and plans per system; a plan on a new system costs its op
durations and one compiled pass (`sums`) over index arrays its block's recipe holds.
"""

from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np
from numba import njit

from dse.workload import Block

Link = tuple[int, int, str, int]
"""A p2p op's channel, named alike from both ends: sender class, receiver class, axis, receiver's offset."""

PlanOp = tuple[
    int, int, float, tuple[int, ...], bool, int, tuple[tuple[int, float], ...], int, Link | None, tuple[int, ...]
]
"""(kind, stream, seconds, deps inside the block, waits on the call's inputs, slot, marks, category, link, shares).

slot: the block op whose end this op's end is (the last kernel of a fused run). marks: (block op, seconds from
the start) for the kernels inside a fused run that a later op or the call's output needs. shares: the streams of
the network dimensions a collective occupies ("net:<index>"): collectives of different axes that need the same
dimension queue for it, so two concurrent transfers on one dimension take twice as long as one (their total
bandwidth is the dimension's, as with fair sharing; the first simply finishes first).
"""

SkeletonOp = tuple[int, int, tuple[int, ...], bool, int, tuple[int, ...], int, Link | None, tuple[int, ...]]
"""A PlanOp without its seconds: (kind, stream, deps, waits on inputs, slot, its marks' block ops, category, link,
shares)."""
Encoding = tuple[np.ndarray, tuple[Link, ...]]
"""A skeleton as `op_rows` lays it out: its ops as one int array, and its p2p ops' links (`op_rows._encoded`)."""


@dataclass(slots=True, eq=False)
class Skeleton:
    """What of a plan does not depend on the system's speeds: its ops' fusion, streams, deps, slots, categories,
    links and shares, which follow from the block and from the network's shape (which dimensions a group spans), not
    from bandwidths or FLOP/s. Kept across systems (`recipes.Form`), so a study
    that varies a speed prices only seconds. Not changed once made, but for `encoding`."""

    block: Block
    ops: tuple[SkeletonOp, ...]
    output: int
    totals: tuple[int, ...]
    """The category of each of the plan's category totals (the last of `Plan.seconds`), in their order."""
    categories: frozenset[int]
    encoding: Encoding | None = field(default=None, repr=False)
    """Its ops as one int array and its p2p ops' links, made by `op_rows` when it first lays the skeleton out (or
    found kept for a skeleton alike) and kept as long as the skeleton is: a cache of a bounded count of encodings,
    emptied when full, held too few of a study's skeletons (the 96 GPT-3 configurations of
    benchmarks/vs_calculon.py have 1,244 on a system) and encoded each of their first visits' three times."""


class Plan:
    """A block as one rank class runs it: its communication priced for that class's groups and peers. Its skeleton
    and seconds are kept apart (a later system reuses the skeleton); `ops` and `category_seconds` join them, once per
    plan object, for the consumers that read tuples (the interpreted engine, the tape, steady)."""

    __slots__ = ("_category_seconds", "_ops", "block", "categories", "output", "seconds", "skeleton", "totals")

    def __init__(self, skeleton: Skeleton, seconds: np.ndarray, totals: list[float]) -> None:
        self.skeleton = skeleton
        self.seconds = seconds
        """What `sums` gives: per plan op its duration, per mark its offset, per category total its seconds."""
        self.totals = totals
        """The category totals' seconds (the last of `seconds`) as floats, for the steady check, which reads them
        for every plan of a point (slicing the array each time cost it a third more)."""
        self.block = skeleton.block
        self.output = skeleton.output
        self.categories = skeleton.categories
        """The skeleton's, read as often as a plan is (the engines read them per run or call)."""
        self._ops: tuple[PlanOp, ...] | None = None
        self._category_seconds: tuple[tuple[int, float], ...] | None = None

    @property
    def ops(self) -> tuple[PlanOp, ...]:
        joined = self._ops
        if joined is None:
            ops = self.skeleton.ops
            seconds = self.seconds.tolist()
            at, ops_out = len(ops), []
            for (kind, stream, deps, waits, slot, marked, category, link, shares), duration in zip(
                ops, seconds, strict=False
            ):
                marks = tuple(zip(marked, seconds[at : at + len(marked)], strict=True))
                at += len(marked)
                ops_out.append((kind, stream, duration, deps, waits, slot, marks, category, link, shares))
            joined = self._ops = tuple(ops_out)
        return joined

    @property
    def category_seconds(self) -> tuple[tuple[int, float], ...]:
        """Seconds per category of the ops that are not p2p; a p2p op's seconds are known only once it pairs."""
        joined = self._category_seconds
        if joined is None:
            joined = self._category_seconds = tuple(zip(self.skeleton.totals, self.totals, strict=True))
        return joined

    def copy(self) -> "Plan":
        """Another object for the same plan (consumers number plans by identity), with what it has joined."""
        plan = Plan(self.skeleton, self.seconds, self.totals)
        plan._ops, plan._category_seconds = self._ops, self._category_seconds
        return plan


def renumbered(
    numbering: tuple[tuple[int, ...], tuple[int, ...]], skeleton: Skeleton, to: tuple[tuple[int, ...], tuple[int, ...]]
) -> Skeleton:
    """The skeleton a build under numbering `to` gives, from one built under `numbering`: only the numbers of its
    streams and categories differ (a category's total sums its ops in their order, whatever its number)."""
    streams = dict(zip(numbering[0], to[0], strict=True))
    categories = dict(zip(numbering[1], to[1], strict=True))
    ops = tuple(
        (
            kind,
            streams[stream],
            deps,
            waits,
            slot,
            marks,
            categories[category],
            link,
            tuple([streams[s] for s in shares]),
        )
        for kind, stream, deps, waits, slot, marks, category, link, shares in skeleton.ops
    )
    return Skeleton(
        block=skeleton.block,
        ops=ops,
        output=skeleton.output,
        totals=tuple([categories[c] for c in skeleton.totals]),
        categories=frozenset([categories[c] for c in skeleton.categories]),
    )


def code_of(fused: list[list[tuple[int, bool]]], alone: list[int], totals: int) -> np.ndarray:
    """What `sums` reads of a block's recipe, in one array (a compiled call's cost grows with its arguments): the
    counts of plan ops, marks and totals; where each plan op's entries start (and the end); per plan op in turn, its
    block ops whose seconds its duration sums, in order (its first, then the kernels fused into it), each with
    whether the sum before it is a mark (the kernel before keeps its end); then `alone`: per priced op (not p2p), its
    block op and its category's total."""
    entries = [x for members in fused for entry in members for x in entry]
    marks = sum(entries[1::2])
    return np.array([len(fused), marks, totals, 0, *accumulate(map(len, fused)), *entries, *alone], dtype=np.int64)


@njit(cache=True)
def sums(durations: np.ndarray, code: np.ndarray) -> np.ndarray:
    """A plan's seconds from its block's op durations, as `code_of` lays out what to sum: per plan op its duration
    (its block ops' seconds summed left to right), then per mark its offset (the sum so far), then per category its
    total (its priced ops' seconds summed in op order from 0.0): the same float operations in the same order as the
    Python loops they replace."""
    runs, marks, totals = code[0], code[1], code[2]
    out = np.zeros(runs + marks + totals)
    at = 4 + runs
    m = runs
    for r in range(runs):
        lo, hi = code[3 + r], code[4 + r]
        duration = durations[code[at + 2 * lo]]
        for k in range(lo + 1, hi):
            if code[at + 2 * k + 1]:
                out[m] = duration
                m += 1
            duration += durations[code[at + 2 * k]]
        out[r] = duration
    base = runs + marks
    for i in range(at + 2 * code[3 + runs], len(code), 2):
        out[base + code[i + 1]] += durations[code[i]]
    return out
