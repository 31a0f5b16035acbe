"""A point's programs' calls joined and laid out for `engine_kernel`, kept for later points of the same shapes.

What the calls decide (their blocks, inputs and tags) is read from arrays kept on each program's `CallShape`
(`call_arrays`), joined over the programs (`joined_calls`) and laid out per call by their plans' structure in one
compiled pass (`laid_out`: each call's plan, each run's room for its ops' intervals, the p2p mailboxes, the layer
runs the kernel may fast-forward). Both are kept on the joined entry (`Joined`, in the "call layouts" cache) for
later points whose programs share those shapes and whose plans have the same structure, as is what a drive's
planner resolved (`Drive`), which a revisit replays (`compiled_engine.CompiledScheduler.drive`).
"""

from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import TypeVar

import numpy as np
from numba import njit

from dse.calls import CallColumns
from dse.lru import MIB, ByteBoundedLru
from dse.workload import Program
from simulators.analytical import op_rows
from simulators.analytical.calls import on_columns
from simulators.analytical.plans import Resolved
from simulators.analytical.skeletons import Skeleton

_INT = np.int64
V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class CallArrays:
    """What the kernel reads of a program's calls, derived once per CallShape (one check that the shape still holds
    the calls, not one per array)."""

    blocks: np.ndarray
    tags: np.ndarray
    input_counts: np.ndarray
    inputs: np.ndarray
    """Every call's inputs in order."""
    used: list[int]
    """The blocks the program calls, sorted."""


_CALLS_KEY = ("compiled.calls",)


def call_arrays(program: Program) -> CallArrays:
    """What the kernel reads of a program's calls: its shape's columns (`CallShape.columns`, which a spliced shape
    is made of), else derived from the calls."""
    shape = program.call_shape()
    if shape is None:
        return _arrays(CallColumns.of(program.calls))
    return on_columns(shape, _CALLS_KEY, _arrays)


def _arrays(columns: CallColumns) -> CallArrays:
    return CallArrays(
        blocks=columns.block,
        tags=columns.tag,
        input_counts=columns.input_counts,
        inputs=columns.inputs,
        used=np.unique(columns.block).tolist(),
    )


def _ptr_of(counts: np.ndarray) -> np.ndarray:
    """Where each count's entries start when laid out in turn; one more entry for the end."""
    ptr = np.zeros(len(counts) + 1, dtype=_INT)
    np.cumsum(counts, out=ptr[1:])
    return ptr


CALL_LAYOUT_BYTES = 32 * MIB
"""Programs' calls joined and laid out (`Joined`): the 96 configurations of benchmarks/vs_calculon.py join 4
tuples of shapes (their steady and longer forms at pp 8 and 16, 4,140 to 24,692 calls) laid out 28 ways, 10 MiB
in all."""
LAYOUTS_PER_JOIN = 16
"""Layouts (plans' structures) a joined entry keeps: a study's configurations of one schedule number their plans
in a few ways; more would let one entry grow without bound (the layout kept first goes first)."""
DRIVES_PER_JOIN = 64
"""Drives (`Drive`) a joined entry keeps, as LAYOUTS_PER_JOIN bounds its layouts: one per workload's blocks and
form, of which the 96 configurations of benchmarks/vs_calculon.py join up to 48 to one tuple of shapes."""
DRIVE_BYTES_PER_PLACE = 200
"""An estimate of a drive's bytes per block a program calls (its entry in `Drive.places`, and a share of
`Resolved`'s lists and tuples), besides the op rows it holds (counted in full, though `op_rows` mostly holds
the same)."""


@dataclass(frozen=True, slots=True)
class LaidOut:
    """What `_lay_out_calls` and `layer_runs` give for one structure of the plans, for every point whose plans
    have that structure (the kernel reads a copy)."""

    call_plan: np.ndarray
    mail_ptr: np.ndarray
    mailbox: np.ndarray
    mailboxes: int
    run_last: np.ndarray
    other_inputs: int
    compute_ptr: np.ndarray
    compute_ops: int
    comm_ptr: np.ndarray
    comm_ops: int
    t_ptr: np.ndarray


@dataclass(slots=True)
class Joined:
    """A point's programs' call arrays joined (flat over the runs), kept per tuple of their CallArrays: the points
    of a study run a few schedules, and a generator hands every program of a schedule the same CallShape (whose
    CallArrays are kept on it), so joining ~9,000 calls per point again would redo the same work. The layouts of
    the calls by their plans' structure (`LaidOut`, keyed by everything the two passes read besides these
    arrays) are kept here too."""

    calls: tuple[CallArrays, ...]
    """Kept so that the identities the key holds stay theirs."""
    base: np.ndarray
    blocks: np.ndarray
    tags: np.ndarray
    input_ptr: np.ndarray
    inputs: np.ndarray
    width: int
    """One more than the highest block any program calls."""
    used: np.ndarray
    """run * width + block for every block each run calls, in turn (`CallArrays.used`): where `_Layout` puts the
    numbers of their plans."""
    laid_out: dict[tuple, LaidOut]
    drives: dict[tuple, "Drive"]
    """Per where a drive's planner started (`Planner.mark`) and fast_forward, what its plans' structure gave."""
    bytes: int
    kept: bool
    """Whether the cache holds it (else it serves one point)."""


JOINED: ByteBoundedLru[tuple[int, ...], Joined] = ByteBoundedLru("call layouts", CALL_LAYOUT_BYTES, lambda e: e.bytes)


def on_shape(program: Program, arrays: CallArrays) -> bool:
    """Whether the arrays are those kept on the program's CallShape (its calls unedited), which later points of the
    shape read too; a program's own arrays (edited calls) are derived afresh each point."""
    return program.shape is not None and program.shape.memo.get(_CALLS_KEY) is arrays


def joined_calls(calls: list[CallArrays], keep: bool) -> Joined:
    """The programs' calls joined; kept per tuple of CallArrays (checked by identity) if `keep`, as such a tuple
    recurs only when every program's arrays are kept on its shape."""
    key = tuple(map(id, calls))
    found = JOINED.get(key) if keep else None
    if found is not None and all(a is b for a, b in zip(found.calls, calls, strict=True)):
        return found
    input_counts = _joined([own.input_counts for own in calls])
    width = 1 + max((max(own.used, default=0) for own in calls), default=0)
    used = np.fromiter(chain.from_iterable(own.used for own in calls), _INT)
    used += np.repeat(np.arange(len(calls), dtype=_INT) * width, [len(own.used) for own in calls])
    arrays = (
        _ptr_of(np.fromiter((len(own.blocks) for own in calls), _INT, len(calls))),
        _joined([own.blocks for own in calls]),
        _joined([own.tags for own in calls]),
        _ptr_of(input_counts),
        _joined([own.inputs for own in calls]),
    )
    # Bytes: the joined arrays, and as much again for the CallArrays the entry keeps alive.
    bytes_ = 2 * sum(x.nbytes for x in arrays) + used.nbytes
    found = Joined(tuple(calls), *arrays, width, used, laid_out={}, drives={}, bytes=bytes_, kept=keep)
    if keep:
        JOINED.put(key, found)
    return found


def laid_out(
    joined: Joined,
    width: int,
    plan_of: np.ndarray,
    p_compute: np.ndarray,
    p_comm: np.ndarray,
    p_mails: np.ndarray,
    link_ptr: np.ndarray,
    link_ids: np.ndarray,
    p_ops: np.ndarray,
    fast_forward: bool,
) -> LaidOut:
    base = joined.base
    call_plan, compute_count, comm_count, transfer_count, mail_ptr, mailbox = _lay_out_calls(
        joined.blocks, base, plan_of, width, p_compute, p_comm, p_mails, link_ptr, link_ids, joined.tags
    )
    if fast_forward:
        run_last = layer_runs(base, call_plan, joined.input_ptr, joined.inputs, p_mails, p_ops)
    else:
        run_last = np.full(len(call_plan), -1, dtype=_INT)
    longest = other_inputs(base, run_last, joined.input_ptr, joined.inputs)
    return LaidOut(
        call_plan=call_plan,
        mail_ptr=mail_ptr,
        mailbox=mailbox,
        mailboxes=int(mailbox.max(initial=-1)) + 1,
        run_last=run_last,
        other_inputs=longest,
        compute_ptr=np.cumsum(compute_count) - compute_count,
        compute_ops=int(compute_count.sum()),
        comm_ptr=_ptr_of(comm_count),
        comm_ops=int(comm_count.sum()),
        t_ptr=np.cumsum(transfer_count) - transfer_count,
    )


def keep(joined: Joined, kept: dict[tuple, V], key: tuple, value: V, size: Callable[[V], int], most: int) -> None:
    """Keeps a layout or drive on its joined entry (in `kept`, which holds at most `most`: the one kept first goes
    first), putting the entry again so that the cache sees its new size."""
    if key in kept:
        joined.bytes -= size(kept.pop(key))
    elif len(kept) >= most:
        joined.bytes -= size(kept.pop(next(iter(kept))))
    kept[key] = value
    joined.bytes += size(value)
    if joined.kept:
        JOINED.put(tuple(map(id, joined.calls)), joined)


def laid_bytes(laid: LaidOut) -> int:
    return sum(x.nbytes for x in (laid.call_plan, laid.mail_ptr, laid.mailbox, laid.run_last, laid.comm_ptr))


@dataclass(frozen=True, slots=True)
class Drive:
    """What one drive's plans gave its tables besides their seconds: its planner's calls (`Resolved`) and places,
    the plans' numbering, rows and layout. A later drive that starts where it did hands the same places
    (`Planner.replay`), and where its plans have these skeletons, the same tables but for the seconds."""

    resolved: Resolved
    places: list[list[int]]
    order: list[int]
    """The places of the plans the tables number, in their numbers' order."""
    skeletons: list[Skeleton]
    rows: op_rows.Rows
    laid: LaidOut


def drive_bytes(drive: Drive) -> int:
    return drive.rows.bytes + DRIVE_BYTES_PER_PLACE * sum(map(len, drive.places))


def _joined(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype=_INT)


RANK_TABLE_PER_ENTRY = 16
"""`ranks` ranks values by a table of at most this many entries a value (the table is one pass; a sort's cost per
value grows with the log of their count)."""


@njit(cache=True)
def _lay_out_calls(
    blocks: np.ndarray,
    base: np.ndarray,
    plan_of: np.ndarray,
    width: int,
    p_compute: np.ndarray,
    p_comm: np.ndarray,
    p_mails: np.ndarray,
    p_link_ptr: np.ndarray,
    p_links: np.ndarray,
    tags: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per call (flat), its plan (`plan_of[run * width + block]`); per run, its compute ops, its communication ops
    per stream (run * streams + stream) and its p2p transfers; per call, where its p2p ops' mailboxes start; and
    the mailboxes: both ends of a transfer, a (link, tag), get the same number (the rank of link * (top tag + 1)
    + tag among those of every p2p op)."""
    runs, (plans, streams) = len(base) - 1, p_comm.shape
    call_plan = np.empty(len(blocks), dtype=np.int64)
    mail_ptr = np.zeros(len(blocks), dtype=np.int64)
    uses = np.zeros((runs, plans), dtype=np.int64)
    moved = 0
    for r in range(runs):
        for c in range(base[r], base[r + 1]):
            p = plan_of[r * width + blocks[c]]
            call_plan[c] = p
            uses[r, p] += 1
            mail_ptr[c] = moved if p_mails[p] else 0
            moved += p_mails[p]
    compute_count = np.zeros(runs, dtype=np.int64)
    comm_count = np.zeros(runs * streams, dtype=np.int64)
    transfer_count = np.zeros(runs, dtype=np.int64)
    for r in range(runs):
        for p in range(plans):
            if uses[r, p]:
                compute_count[r] += uses[r, p] * p_compute[p]
                transfer_count[r] += uses[r, p] * p_mails[p]
                for s in range(streams):
                    comm_count[r * streams + s] += uses[r, p] * p_comm[p, s]
    code = np.empty(moved, dtype=np.int64)
    top = tags.max() + 1 if moved else 1
    for c in range(len(blocks)):
        p = call_plan[c]
        for k in range(p_mails[p]):
            code[mail_ptr[c] + k] = p_links[p_link_ptr[p] + k] * top + tags[c]
    links = p_links.max() + 1 if moved > 0 else 0
    size = links * top if moved > 0 and tags.min() >= 0 else -1
    return call_plan, compute_count, comm_count, transfer_count, mail_ptr, ranks(code, size)


@njit(cache=True)
def ranks(code: np.ndarray, size: int) -> np.ndarray:
    """Per entry, the rank of its value among the distinct values in `code`. Values all in 0..size - 1 (size -1 if
    not known so) are ranked by a table of `size` entries if that is at most RANK_TABLE_PER_ENTRY a value: sorting
    them took 20 of the 34 us a layout of a GPT-3 configuration at pp 16 took (2,164 values under 2,336), the table
    2 us; else by sorting."""
    out = np.empty(len(code), dtype=np.int64)
    if 0 <= size <= RANK_TABLE_PER_ENTRY * len(code):
        rank = np.zeros(size + 1, dtype=np.int64)
        for value in code:
            rank[value + 1] = 1
        for i in range(size):
            rank[i + 1] += rank[i]
        for i in range(len(code)):
            out[i] = rank[code[i]]
        return out
    order = np.argsort(code)
    number = -1
    for i in range(len(code)):
        if i == 0 or code[order[i]] != code[order[i - 1]]:
            number += 1
        out[order[i]] = number
    return out


@njit(cache=True)
def layer_runs(
    base: np.ndarray,
    call_plan: np.ndarray,
    input_ptr: np.ndarray,
    inputs: np.ndarray,
    p_mails: np.ndarray,
    p_ops: np.ndarray,
) -> np.ndarray:
    """`EngineTables.run_last`: per call that continues a layer run, the run's last call, else -1. A call continues
    one when the call before has its plan, it reads that call's output, and its plan has ops and no p2p op (whose
    time would depend on another program): such a call's times follow from the streams it touches, the call
    before's output end and its other inputs' (a backward layer's activations), so once one repeats the call
    before shifted and the other inputs are ready by then (`engine_kernel.drive` checks), the rest do."""
    run_last = np.full(len(call_plan), -1, dtype=np.int64)
    for r in range(len(base) - 1):
        for c in range(base[r + 1] - 1, base[r], -1):  # backwards: a call's run ends where the next call's does
            p = call_plan[c]
            reads = False
            for k in range(input_ptr[c], input_ptr[c + 1]):
                reads = reads or inputs[k] == c - 1 - base[r]
            if reads and call_plan[c - 1] == p and p_mails[p] == 0 and p_ops[p] > 0:
                run_last[c] = run_last[c + 1] if c + 1 < base[r + 1] and run_last[c + 1] >= 0 else c
    return run_last


@njit(cache=True)
def other_inputs(base: np.ndarray, run_last: np.ndarray, input_ptr: np.ndarray, inputs: np.ndarray) -> int:
    """The longest entry a layer run's calls add to the run memo's: per call after the first, a count and each
    input it reads besides the call before. Of the calls and their layout alone, so kept with the layout
    (`call_layout.LaidOut`)."""
    most = 0
    for r in range(len(base) - 1):
        g = base[r]
        while g < base[r + 1]:
            if run_last[g] < 0:
                g += 1
                continue
            last, count = run_last[g], 0
            for h in range(g, last + 1):
                count += 1
                for k in range(input_ptr[h], input_ptr[h + 1]):
                    if base[r] + inputs[k] != h - 1:
                        count += 1
            most = max(most, count)
            g = last + 1
    return most
