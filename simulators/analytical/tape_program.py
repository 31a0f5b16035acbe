"""A tape (`tape`) kept to what the figures read, as plain arrays a compiled loop evaluates (`batch_kernels`).

Only the nodes the figures read, and what they are built on, are kept, in the tape's order (every node's arguments
come before it, so that order evaluates each node after its arguments). The loop walks them once per chunk of
systems, a row of systems per node, so the work per node is spread over every system of the chunk; the figures
are the per-point path's to the last bit wherever the per-point path adds the same way (duration + latest argument).
A numpy evaluation needed the nodes grouped depth by depth, a few calls per group; the compiled loop needs no
grouping, so the tape's own order serves and the program costs next to nothing to build.
"""

from dataclasses import dataclass

import numpy as np

from simulators.analytical import batch_kernels
from simulators.analytical.tape import ZERO, Tape


@dataclass(frozen=True, slots=True)
class TapeProgram:
    """The kept nodes of a tape as rows, in evaluation order, and where each tape node went (int8 kinds, int32 the
    rest, as the tape's: a structure kept keeps them)."""

    kind: np.ndarray
    first: np.ndarray
    """Per row, where its arguments start in `args` (one more entry: where the last row's end)."""
    args: np.ndarray
    """The rows each row reads (a node without arguments reads the zero row)."""
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
        count = tape.size
        lengths = np.diff(tape.first)
        args = tape.args
        empty = np.flatnonzero(lengths == 0)  # no arguments: the zero row's
        if len(empty):
            args = np.insert(args, tape.first[empty], ZERO)
            lengths[empty] = 1
        first = np.zeros(count + 1, dtype=np.int32)
        np.cumsum(lengths, out=first[1:])
        flags = batch_kernels.kept(first, args, read.astype(np.int32))
        nodes = np.flatnonzero(flags)
        row_of = np.full(count, -1, dtype=np.int32)
        row_of[nodes] = np.arange(len(nodes))
        kept_first = np.zeros(len(nodes) + 1, dtype=np.int32)
        np.cumsum(lengths[nodes], out=kept_first[1:])
        kept_args = row_of[args[np.repeat(flags, lengths)]]  # the arguments of the kept nodes, in their order
        column = tape.column[nodes]
        column[column < 0] = len(tape.columns)  # the zero row of the durations
        kind = tape.kind[nodes]
        return cls(kind, kept_first, kept_args, column, row_of)

    def evaluate(self, durations: np.ndarray, room: np.ndarray | None = None) -> np.ndarray:
        """rows x systems: every kept node's time on every system (durations: (columns + 1) x systems, the last
        row zero, C-ordered); read node n as row `row_of[n]`. room: a flat float array of at least rows x systems
        to write them in, from its start. A batch passes one room for all its chunks, so that its pages are touched
        once: a fresh 120 MiB array costs up to 30 ms of first touches, more than evaluating into it."""
        shape = (self.size, durations.shape[1])
        values = np.empty(shape) if room is None else room[: shape[0] * shape[1]].reshape(shape)
        batch_kernels.evaluate(self.kind, self.first, self.args, self.columns, durations, values)
        return values
