"""A tape (`tape`) compiled into a short program of numpy passes, a column per system.

Evaluating the tape node by node in Python would cost microseconds per node and system; evaluating it depth by
depth costs a few numpy calls per depth, whatever the number of systems. This module makes those calls as few and
as cheap as it can, since Llama-3-70B's steady form is ~9k depths deep:
- only the nodes the figures read, and what they are built on, are kept;
- the kept nodes are renumbered depth by depth (and kind by kind within a depth), so a group of nodes is one slice
  of the values: results are written into it in place rather than scattered; a node no other node reads (a
  call's earliest start, an op's last end) waits for the last group of its kind, so that its kind adds no group
  at its own depth (Llama-3-70B's steady form: 8.9k groups instead of 10.7k);
- the values start as every node's own duration (one gather for the whole tape), so a max-plus node is a gather of
  its arguments and an addition into its slice, and a shared transfer (`SHARED`) reads its seconds in place.
Additions happen in the order `tape` defines them (duration + latest argument), so the values are the per-point
path's to the last bit wherever the per-point path adds the same way.
"""

from dataclasses import dataclass
from itertools import chain

import numpy as np

from simulators.analytical.tape import INF, MAX_ADD, MIN, SHARED, ZERO, Tape


@dataclass(frozen=True, slots=True)
class _Group:
    """Nodes of one depth and kind: rows lo..hi of the values, their arguments' rows (padded with
    their last, which changes neither a max nor a min)."""

    kind: int
    lo: int
    hi: int
    args: np.ndarray
    """(hi - lo) x arguments."""


@dataclass(frozen=True, slots=True)
class TapeProgram:
    """The kept nodes of a tape in evaluation order, and where each tape node went."""

    groups: list[_Group]
    columns: np.ndarray
    """Per row, the duration row it starts from (the zero row for a node without a column)."""
    row_of: np.ndarray
    """Per tape node, its row (-1: not kept)."""

    @property
    def size(self) -> int:
        return len(self.columns)

    @classmethod
    def of(cls, tape: Tape, read: np.ndarray) -> "TapeProgram":
        """The program that yields the nodes `read` (node ids) and everything they depend on."""
        count = len(tape.kind)
        lengths = np.fromiter(map(len, tape.args), np.intp, count)
        flat = np.fromiter(chain.from_iterable(tape.args), np.intp, int(lengths.sum()))
        width = int(lengths.max(initial=1))
        first = np.cumsum(lengths) - lengths
        last = np.maximum(lengths, 1)[:, None] - 1
        args = np.full((count, width), ZERO, dtype=np.intp)
        if len(flat):
            args = flat[np.minimum(first[:, None] + np.minimum(np.arange(width), last), len(flat) - 1)]
            args[lengths == 0] = ZERO
        kind = np.array(tape.kind, dtype=np.intp)
        depth = np.array(tape.depth, dtype=np.intp)
        nodes = np.flatnonzero(_kept(tape, read))
        consumed = np.zeros(count, dtype=bool)
        consumed[args[nodes[lengths[nodes] > 0]]] = True
        depth[~consumed] = depth.max(initial=0) + 1  # what no node reads waits for the last group of its kind
        depth[[ZERO, INF]] = 0
        nodes = nodes[np.lexsort((kind[nodes], depth[nodes]))]
        row_of = np.full(count, -1, dtype=np.intp)
        row_of[nodes] = np.arange(len(nodes))
        column = np.array(tape.column, dtype=np.intp)[nodes]
        column[column < 0] = len(tape.columns)  # the zero row of the durations
        key = depth[nodes] * 4 + kind[nodes]
        if len(nodes) == 2:  # the constants alone
            return cls([], column, row_of)
        bounds = np.array([2, *(np.flatnonzero(np.diff(key[2:])) + 3)])  # rows 0 and 1 are the constants
        used = np.maximum.reduceat(lengths[nodes], bounds).tolist()
        rows = row_of[args[nodes]]
        groups = [
            _Group(group_kind, lo, hi, rows[lo:hi, :width])
            for group_kind, lo, hi, width in zip(
                kind[nodes[bounds]].tolist(), bounds.tolist(), [*bounds[1:].tolist(), len(nodes)], used, strict=True
            )
        ]
        return cls(groups, column, row_of)

    def evaluate(self, durations: np.ndarray) -> np.ndarray:
        """rows x systems: every kept node's time on every system (durations: columns + 1 rows, the last zero);
        read node n as row `row_of[n]`."""
        values = durations[self.columns]
        values[ZERO], values[INF] = 0.0, np.inf
        for group in self.groups:
            args, out = group.args, values[group.lo : group.hi]
            latest = values[args[:, 0]]
            if group.kind == SHARED:  # start + s + min(s, busy - start), s in place
                busy = values[args[:, 1]]
                busy -= latest
                np.minimum(busy, out, out=busy)
                latest += out
                latest += busy
                out[...] = latest
                continue
            combine = np.minimum if group.kind == MIN else np.maximum
            for j in range(1, args.shape[1]):
                combine(latest, values[args[:, j]], out=latest)
            if group.kind == MAX_ADD:
                out += latest
            else:
                out[...] = latest
        return values


def _kept(tape: Tape, read: np.ndarray) -> np.ndarray:
    """Which nodes `read` depends on, itself included, ZERO and INF too: a sweep from the last node down, as every
    node's arguments come before it."""
    flags = bytearray(len(tape.kind))
    for node in read.tolist():
        flags[node] = 1
    flags[ZERO] = flags[INF] = 1
    args = tape.args
    for node in range(len(flags) - 1, 1, -1):
        if flags[node]:
            for a in args[node]:
                flags[a] = 1
    return np.frombuffer(flags, dtype=np.bool_)
