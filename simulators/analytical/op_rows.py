"""A point's plans as the op rows `engine_kernel` reads (`compiled_engine._Layout`): every distinct plan's
skeleton ops transposed into arrays, with what laying out its calls needs.

A point has about 60 plans of about 100 op rows in all, so transposing them cost numpy's per-call overhead, not
work: 0.16 ms a point over some 50 numpy calls, where the rows of a whole set of plans are kept (`_ROWS`) only for
a set seen before, and the first visits of the 72 GPT-3 configurations of benchmarks/vs_calculon.py that are not
tp8 sp-off found none. Most of a new set's skeletons were seen before though (about 80%): each skeleton is encoded
once into one int array (`_encoded`), and a set's rows are one compiled pass over the encodings joined
(`_assemble`), into one array whose parts are the fields.

A skeleton is kept per block and network shape, but a skeleton's encoding reads only its ops' structure, which
blocks of different configurations share: the first visits of those 72 configurations make 842 skeletons of 224
encodings, and 72 sets of plans of 36 sets of encodings. So encodings are kept per content (`_ENCODINGS`), one
object for every skeleton of it, and sets of rows per tuple of encodings: half those first visits find their
rows kept, and the rows cost 0.07-0.09 ms a first visit where they cost 0.10-0.13 (their CPU time on those
first visits, in alternating runs on a shared 2-core machine, 2026-11-30).
"""

from dataclasses import dataclass
from itertools import chain, pairwise

import numpy as np
from numba import njit

from dse.lru import MIB, ByteBoundedLru
from simulators.analytical.recipes import COLLECTIVE, COMPUTE
from simulators.analytical.skeletons import Encoding, Link, Plan, Skeleton

_INT = np.int64


@dataclass(frozen=True, slots=True)
class PerPlan:
    """Per distinct plan, what laying out its calls needs besides the kernel's fields."""

    compute: np.ndarray
    """Its compute ops (each call's room for busy intervals)."""
    comm: np.ndarray
    """plans x streams: its communication ops on each stream."""
    mails: np.ndarray
    """Its p2p ops."""


@dataclass(frozen=True, slots=True)
class Rows:
    """A set of plans' op rows (the kernel only reads them) but their seconds, their links numbered, and the bytes
    of what of them keys a layout: what of the plans their skeletons give, so kept across systems."""

    encodings: tuple[Encoding, ...]
    """The plans' skeletons' encodings, kept so that the identities the key holds stay theirs."""
    fields: dict[str, np.ndarray]
    """The EngineTables fields named p_* and o_* but the seconds."""
    per_plan: PerPlan
    link_ptr: np.ndarray
    link_ids: np.ndarray
    p_ops: np.ndarray
    anchored: np.ndarray
    touches: np.ndarray
    """The kernel's p_anchored and p_touches (`anchored_plans`, `touched_streams`): of the rows alone,
    so found here once per set, not per point."""
    key: tuple[bytes, ...]
    gather: np.ndarray
    """Where o_seconds, o_mark_offset and p_category_seconds, in turn, are in the plans' seconds joined (per plan
    the three parts in turn, `Plan.seconds`): seconds are joined per point; the rows are kept across systems."""
    bytes: int
    """The arrays' bytes, and as much again for the encodings the entry keeps alive."""


OP_ROW_BYTES = 8 * MIB
"""Sets of plans' op rows (`Rows`): one set is about 20 to 60 KiB."""
_ROWS: ByteBoundedLru[tuple[int, ...], Rows] = ByteBoundedLru("op rows", OP_ROW_BYTES, lambda e: e.bytes)
ENCODING_BYTES = 4 * MIB
"""Skeletons' encodings kept per content (`_encoded`): the 226 of the 96 GPT-3 configurations of
benchmarks/vs_calculon.py hold 46 KiB of codes, and with the contents they are kept with (a walk of their tuples)
4 times that, as an entry's size counts them."""
_ENCODINGS: ByteBoundedLru[int, tuple[tuple, Encoding]] = ByteBoundedLru(
    "skeleton encodings", ENCODING_BYTES, lambda e: 4 * e[1][0].nbytes
)
"""Per hash of what an encoding reads of a skeleton, that content (compared on a hit: contents whose hashes
collide take turns) and its encoding. Keyed by the hash, as `recipes.find_recipe` keys blocks: a key holding the
content would hash it again at each of the cache's lookups."""

_HEAD = 8
"""An encoding's header: ops, output, slots, totals, deps, marks, shares, p2p ops."""
_OP = 9
"""An encoding's fields per op: kind, stream, waits, slot, category, p2p, deps, marks, shares (the last three
counts; their values follow every op's fields)."""

_FIELDS = (
    "p_op_ptr",
    "p_output",
    "p_slots",
    "p_category_ptr",
    "p_category",
    "o_kind",
    "o_stream",
    "o_waits",
    "o_slot",
    "o_category",
    "o_mail",
    "o_dep_ptr",
    "o_deps",
    "o_mark_ptr",
    "o_mark_slot",
    "o_share_ptr",
    "o_shares",
)
"""The fields `_assemble` lays out, in turn; then per plan its compute ops, its comm ops per stream, its p2p ops,
link_ptr, its op rows and `Rows.gather`."""
_PARTS = len(_FIELDS) + 6
_ANCHORED_BY = ("p_op_ptr", "o_waits", "o_dep_ptr", "o_deps", "o_slot", "o_mark_ptr", "o_mark_slot", "p_slots")
_TOUCHED_BY = ("p_op_ptr", "o_stream", "o_share_ptr", "o_shares")
"""The fields `anchored_plans` and `touched_streams` read, in turn."""


def rows(plans: list[Plan], streams: int) -> Rows:
    """The plans' rows, kept per tuple of their skeletons' encodings (checked by identity): a point's plans are
    mostly kept ones, the steady check's longer form runs the same plans again (a quarter of the runs of the 96
    GPT-3 configurations of benchmarks/vs_calculon.py), a point on another system has plans of the same
    skeletons, and one of another configuration mostly skeletons of the same encodings (the module's docstring)."""
    encoded = tuple([p.skeleton.encoding or _encoded(p.skeleton) for p in plans])
    key = (streams, *map(id, encoded))
    found = _ROWS.get(key)
    if found is not None and all(a is b for a, b in zip(found.encodings, encoded, strict=True)):
        return found
    starts = np.zeros(len(encoded) + 1, dtype=_INT)
    np.cumsum(np.fromiter((len(e[0]) for e in encoded), _INT, len(encoded)), out=starts[1:])
    out = _assemble(np.concatenate([e[0] for e in encoded]) if encoded else starts[1:], starts, streams)
    ends = out[: _PARTS + 1].tolist()
    parts = [out[a:b] for a, b in pairwise(ends)]
    fields = dict(zip(_FIELDS, parts, strict=False))
    fields["o_waits"] = fields["o_waits"].astype(np.bool_)
    compute, comm, mails, link_ptr, p_ops, gather = parts[len(_FIELDS) :]
    links: dict[Link, int] = {}
    chained = chain.from_iterable(e[1] for e in encoded)
    link_ids = np.fromiter((links.setdefault(x, len(links)) for x in chained), _INT, int(link_ptr[-1]))
    anchored = anchored_plans(*[fields[name] for name in _ANCHORED_BY])
    touches = touched_streams(*[fields[name] for name in _TOUCHED_BY], streams)
    found = Rows(
        encodings=encoded,
        fields=fields,
        per_plan=PerPlan(compute=compute, comm=comm.reshape(len(plans), streams), mails=mails),
        link_ptr=link_ptr,
        link_ids=link_ids,
        p_ops=p_ops,
        anchored=anchored,
        touches=touches,
        # compute, comm, mails, link_ptr and p_ops lie in turn in `out`: their bytes key a layout, given the
        # plans and streams (the layout's key holds comm's shape).
        key=(out[ends[len(_FIELDS)] : ends[-2]].tobytes(), link_ids.tobytes()),
        gather=gather,
        bytes=2 * (out.nbytes + link_ids.nbytes + anchored.nbytes + touches.nbytes),
    )
    _ROWS.put(key, found)
    return found


def _encoded(skeleton: Skeleton) -> Encoding:
    """The skeleton's encoding (`_HEAD`, its totals, `_OP` per op, then its ops' deps, then their marks, then their
    shares) and its p2p ops' links in order; kept on the skeleton (`Skeleton.encoding`), and per what it reads of
    the skeleton (`_ENCODINGS`), so that skeletons alike share one."""
    found = skeleton.encoding
    if found is not None:
        return found
    ops = skeleton.ops
    content = (ops, skeleton.output, len(skeleton.block.ops), skeleton.totals)
    key = hash(content)
    kept = _ENCODINGS.get(key)
    if kept is not None and kept[0] == content:
        found = skeleton.encoding = kept[1]
        return found
    deps, marks, shares = [], [], []
    fields: list[int] = []
    for kind, stream, own_deps, waits, slot, own_marks, category, link, own_shares in ops:
        fields += (kind, stream, waits, slot, category, link is not None, *map(len, (own_deps, own_marks, own_shares)))
        deps += own_deps
        marks += own_marks
        shares += own_shares
    links = tuple(op[7] for op in ops if op[7] is not None)
    head = (len(ops), skeleton.output, len(skeleton.block.ops), len(skeleton.totals), len(deps), len(marks))
    code = np.array((*head, len(shares), len(links), *skeleton.totals, *fields, *deps, *marks, *shares), dtype=_INT)
    found = skeleton.encoding = (code, links)
    _ENCODINGS.put(key, (content, found))
    return found


@njit(cache=True)
def _assemble(code: np.ndarray, starts: np.ndarray, streams: int) -> np.ndarray:
    """The rows of the skeletons encoded in code[starts[p]:starts[p + 1]] (`_encoded`) in one array: where each
    part starts (`_PARTS` and the end), then the parts (`_FIELDS` and the rest) in turn. One array out, not a
    tuple: returning a tuple of arrays cost about 8 us a call, more than the work."""
    n = len(starts) - 1
    ops = totals = deps = marks = shares = 0
    for p in range(n):
        at = starts[p]
        ops += code[at]
        totals += code[at + 3]
        deps += code[at + 4]
        marks += code[at + 5]
        shares += code[at + 6]
    sizes = (n + 1, n, n, n + 1, totals, ops, ops, ops, ops, ops, ops, ops + 1, deps, ops + 1, marks, ops + 1, shares)
    rest = (n, n * streams, n, n + 1, n, ops + marks + totals)
    ends = np.empty(_PARTS + 1, dtype=np.int64)
    ends[0] = _PARTS + 1
    for i in range(_PARTS):
        ends[i + 1] = ends[i] + (sizes[i] if i < len(sizes) else rest[i - len(sizes)])
    out = np.zeros(ends[_PARTS], dtype=np.int64)
    out[: _PARTS + 1] = ends
    op_ptr, output, slots, category_ptr, category = ends[0], ends[1], ends[2], ends[3], ends[4]
    kind, stream, waits, slot, o_category, mail = ends[5], ends[6], ends[7], ends[8], ends[9], ends[10]
    value_ptr, value_at = (ends[11], ends[13], ends[15]), (ends[12], ends[14], ends[16])
    compute, comm, mails, link_ptr, p_ops, gather = ends[17], ends[18], ends[19], ends[20], ends[21], ends[22]
    filled = np.zeros(3, dtype=np.int64)  # deps, marks and shares laid out so far
    row = total = 0
    for p in range(n):
        at = starts[p]
        count, p_totals, p2p = code[at], code[at + 3], code[at + 7]
        out[output + p], out[slots + p] = code[at + 1], code[at + 2]
        for k in range(p_totals):
            out[category + total + k] = code[at + _HEAD + k]
        total += p_totals
        out[category_ptr + p + 1] = total
        fields = at + _HEAD + p_totals
        values = fields + _OP * count
        local = 0
        for i in range(count):
            f, x = fields + _OP * i, row + i
            out[kind + x], out[stream + x], out[waits + x] = code[f], code[f + 1], code[f + 2]
            out[slot + x], out[o_category + x] = code[f + 3], code[f + 4]
            if code[f + 5]:  # p2p: its place among the plan's p2p ops
                out[mail + x] = local
                local += 1
            else:
                out[mail + x] = -1
            if code[f] == COMPUTE:
                out[compute + p] += 1
            if code[f] == COLLECTIVE or code[f + 5]:
                out[comm + p * streams + code[f + 1]] += 1
        for j in range(3):  # deps, marks, shares: each op's in turn, after the ops' fields
            for i in range(count):
                values_of = code[fields + _OP * i + 6 + j]
                for k in range(values_of):
                    out[value_at[j] + filled[j] + k] = code[values + k]
                values += values_of
                filled[j] += values_of
                out[value_ptr[j] + row + i + 1] = filled[j]
        row += count
        out[op_ptr + p + 1] = row
        out[mails + p] = p2p
        out[link_ptr + p + 1] = out[link_ptr + p] + p2p
        out[p_ops + p] = count
    # A plan's seconds hold its ops', its marks' and its totals' in turn; o_seconds, o_mark_offset and
    # p_category_seconds each hold one part over the plans in turn.
    parts = (0, ops, ops + marks)
    at = 0
    for p in range(n):
        lo, hi = out[op_ptr + p], out[op_ptr + p + 1]
        bounds = (
            (lo, hi),
            (out[value_ptr[1] + lo], out[value_ptr[1] + hi]),
            (out[category_ptr + p], out[category_ptr + p + 1]),
        )
        for part in range(3):
            for k in range(parts[part] + bounds[part][0], parts[part] + bounds[part][1]):
                out[gather + k] = at
                at += 1
    return out


@njit(cache=True)
def anchored_plans(
    p_op_ptr: np.ndarray,
    o_waits: np.ndarray,
    o_dep_ptr: np.ndarray,
    o_deps: np.ndarray,
    o_slot: np.ndarray,
    o_mark_ptr: np.ndarray,
    o_mark_slot: np.ndarray,
    p_slots: np.ndarray,
) -> np.ndarray:
    """Per plan, whether every op of it waits for the call's inputs or for an op that does: then none starts
    before its call's inputs are ready, so a stream's end or an input's that comes before then decides nothing
    (the run memo tells those apart from none). Of the plans' rows alone, so kept with them (`op_rows.Rows`)."""
    plans = len(p_op_ptr) - 1
    out = np.zeros(plans, dtype=np.bool_)
    for p in range(plans):
        anchored_slot = np.zeros(max(1, p_slots[p]), dtype=np.bool_)
        every = True
        for x in range(p_op_ptr[p], p_op_ptr[p + 1]):
            here = o_waits[x]
            for k in range(o_dep_ptr[x], o_dep_ptr[x + 1]):
                if anchored_slot[o_deps[k]]:
                    here = True
            if not here:
                every = False
                break
            anchored_slot[o_slot[x]] = True
            for k in range(o_mark_ptr[x], o_mark_ptr[x + 1]):
                anchored_slot[o_mark_slot[k]] = True
        out[p] = every
    return out


@njit(cache=True)
def touched_streams(
    p_op_ptr: np.ndarray, o_stream: np.ndarray, o_share_ptr: np.ndarray, o_shares: np.ndarray, streams: int
) -> np.ndarray:
    """Per plan and stream, whether an op of the plan runs on the stream or occupies it; kept with the plans' rows
    (`op_rows.Rows`)."""
    plans = len(p_op_ptr) - 1
    out = np.zeros((plans, streams), dtype=np.bool_)
    for p in range(plans):
        for x in range(p_op_ptr[p], p_op_ptr[p + 1]):
            out[p, o_stream[x]] = True
            for k in range(o_share_ptr[x], o_share_ptr[x + 1]):
                out[p, o_shares[k]] = True
    return out
