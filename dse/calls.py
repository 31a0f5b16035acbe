"""A program's calls: one instance of a block each (`Call`), the sequence every program of one shape shares
(`CallShape`), its calls as arrays (`CallColumns`), and a program's own view of it (`ShapeCalls`). Apart from
`dse.workload` so that the workload's module stays one file's worth; it re-exports `Call` and `CallShape`, which
every generator and cost model reads."""

from collections.abc import Iterable, Iterator, MutableSequence, Sequence
from itertools import chain
from operator import attrgetter
from typing import NamedTuple, overload

import numpy as np


class Call(NamedTuple):
    """One instance of a block in a program. inputs: indices of earlier calls whose outputs it consumes.

    A named tuple rather than a frozen dataclass: a generator makes one per layer and micro-batch of every stage,
    and a tuple is built in under half the time, immutable all the same."""

    block: int
    inputs: tuple[int, ...] = ()
    layer: int = -1
    microbatch: int = -1
    tag: int = 0
    """Matches a send with its recv: both ends of one transfer carry the same tag."""


_new = tuple.__new__


class CallColumns(NamedTuple):
    """Calls as arrays, one entry per call but `inputs`: every call's inputs in turn, `input_counts` of them each.
    What a cost model reads of a shape's calls, and what a generator that makes calls by array arithmetic (a
    spliced skeleton, `generators.symbolic.splice`) makes them as: a pp 16 longer form's 1,800 calls a stage as
    Python tuples cost more than its splice's arithmetic, and a cost model turned them back into these."""

    block: np.ndarray
    inputs: np.ndarray
    input_counts: np.ndarray
    layer: np.ndarray
    microbatch: np.ndarray
    tag: np.ndarray

    @staticmethod
    def of(calls: Sequence[Call]) -> "CallColumns":
        count = len(calls)
        inputs = list(map(attrgetter("inputs"), calls))
        counts = np.fromiter(map(len, inputs), np.int64, count)

        def field(name: str) -> np.ndarray:
            return np.fromiter(map(attrgetter(name), calls), np.int64, count)

        flat = np.fromiter(chain.from_iterable(inputs), np.int64, int(counts.sum()))
        return CallColumns(field("block"), flat, counts, field("layer"), field("microbatch"), field("tag"))

    def span(self, start: int, stop: int) -> "CallColumns":
        """The columns of calls [start, stop)."""
        ends = np.cumsum(self.input_counts)
        first, last = (int(ends[i - 1]) if i > 0 else 0 for i in (start, stop))
        return CallColumns(
            self.block[start:stop],
            self.inputs[first:last],
            self.input_counts[start:stop],
            self.layer[start:stop],
            self.microbatch[start:stop],
            self.tag[start:stop],
        )

    def same(self, other: "CallColumns") -> bool:
        """Whether both hold the same calls."""
        return all(np.array_equal(a, b) for a, b in zip(self, other, strict=True))

    @staticmethod
    def joined(parts: Sequence["CallColumns"]) -> "CallColumns":
        """The calls of `parts` in turn."""
        return CallColumns(*[np.concatenate(column) for column in zip(*parts, strict=True)])

    def calls(self) -> tuple[Call, ...]:
        """The calls these columns hold, as tuples of Python ints (as a walk makes them)."""
        flat, ends = self.inputs.tolist(), np.cumsum(self.input_counts).tolist()
        reads = [tuple(flat[start:end]) for start, end in zip([0, *ends[:-1]], ends, strict=True)]
        fields = zip(
            self.block.tolist(), reads, self.layer.tolist(), self.microbatch.tolist(), self.tag.tolist(), strict=True
        )
        return tuple([_new(Call, call) for call in fields])


class CallShape:
    """One sequence of calls, shared by every program that runs it (a generator hands the same object to the
    programs of later points of the same shape).

    What a cost model derives from the calls alone (where pipeline transfers split a program, which calls read
    which) is the same for all of them, so it may keep that in `memo` and skip the walk for later programs;
    `holds` is the check that a program's calls are still these. Made of calls or of their columns, either made
    from the other on first use (and kept)."""

    __slots__ = ("_calls", "_columns", "memo")

    def __init__(self, calls: tuple[Call, ...] | None = None, columns: CallColumns | None = None) -> None:
        assert (calls is None) != (columns is None), "a shape is made of its calls or of their columns"
        self._calls = calls
        self._columns = columns
        self.memo: dict = {}

    @property
    def calls(self) -> tuple[Call, ...]:
        if self._calls is None:
            assert self._columns is not None
            self._calls = self._columns.calls()
        return self._calls

    def columns(self) -> CallColumns:
        if self._columns is None:
            assert self._calls is not None
            self._columns = CallColumns.of(self._calls)
        return self._columns

    def __len__(self) -> int:
        return len(self._calls) if self._calls is not None else len(self.columns().block)

    def program_calls(self) -> "ShapeCalls":
        """A program's own calls, reading these until something edits them; `holds` checks them in one step while
        nothing has."""
        return ShapeCalls(self)

    def holds(self, calls: Sequence[Call]) -> bool:
        if type(calls) is ShapeCalls and calls.shape is self and not calls.edited:
            return True
        # Equal calls compare by identity first, so this is cheap when the program copied the sequence.
        return len(calls) == len(self) and tuple(calls) == self.calls


class ShapeCalls(MutableSequence[Call]):
    """A program's calls as `CallShape.program_calls` made them: a list like any other (equal to a list of the same
    calls), which reads its shape's tuple until it is edited and then a list of its own (`edited`).

    Cost models ask whether a program's shape still holds its calls once per thing they keep on the shape (about 78
    times a point), and comparing every call (thousands a program) each time cost more than the rest of the lookup;
    an unedited program's calls hold them by construction. Not a copy: a copy of a point's 11,000 calls, kept alive
    with its workload by the generator's and the results' caches, was young when the next garbage collection came,
    which traversed it (half of the references the young collections of the first visits of
    benchmarks/vs_calculon.py's 96 configurations traversed; they took 0.22 ms a point, 0.16 without the copies);
    the shape's tuple is old by then, or shared with the points before."""

    __slots__ = ("_calls", "edited", "shape")

    def __init__(self, shape: CallShape) -> None:
        self._calls: tuple[Call, ...] | list[Call] | None = shape._calls
        """None: the shape's, which it has not made from its columns yet (`_read`)."""
        self.shape = shape
        self.edited = False

    def _read(self) -> tuple[Call, ...] | list[Call]:
        """The calls, the shape's made on first read where it holds only their columns."""
        calls = self._calls
        if calls is None:
            calls = self._calls = self.shape.calls
        return calls

    def _own(self) -> list[Call]:
        """The list the calls are edited in, made from the shape's on the first edit."""
        calls = self._read()
        if isinstance(calls, tuple):
            calls = self._calls = list(calls)
            self.edited = True
        return calls

    def __len__(self) -> int:
        return len(self.shape) if self._calls is None else len(self._calls)

    @overload
    def __getitem__(self, index: int) -> Call: ...
    @overload
    def __getitem__(self, index: slice) -> list[Call]: ...
    def __getitem__(self, index: int | slice) -> Call | list[Call]:
        found = self._read()[index]
        return list(found) if type(found) is tuple and type(index) is slice else found

    def __iter__(self) -> Iterator[Call]:
        return iter(self._read())

    def __contains__(self, call: object) -> bool:
        return call in self._read()

    def __eq__(self, other: object) -> bool:
        if type(other) is ShapeCalls:
            other = other._read()
        elif not isinstance(other, list):
            return NotImplemented
        return len(other) == len(self) and tuple(other) == tuple(self._read())

    __hash__ = None  # type: ignore[assignment]  # a list's

    def __repr__(self) -> str:
        return repr(list(self._read()))

    def __setitem__(self, index, value) -> None:  # type: ignore[no-untyped-def]  # a list's, either overload
        self._own()[index] = value

    def __delitem__(self, index: int | slice) -> None:
        del self._own()[index]

    def __iadd__(self, calls: Iterable[Call]) -> "ShapeCalls":
        self._own().extend(calls)
        return self

    def __imul__(self, times: int) -> "ShapeCalls":
        self._own()[:] = self._read() * times
        return self

    def insert(self, index: int, call: Call) -> None:
        self._own().insert(index, call)

    def append(self, call: Call) -> None:
        self._own().append(call)

    def extend(self, calls: Iterable[Call]) -> None:
        self._own().extend(calls)

    def pop(self, index: int = -1) -> Call:
        return self._own().pop(index)

    def remove(self, call: Call) -> None:
        self._own().remove(call)

    def clear(self) -> None:
        self._own().clear()

    def sort(self, **order: object) -> None:
        self._own().sort(**order)  # type: ignore[call-overload]

    def reverse(self) -> None:
        self._own().reverse()

    def index(self, call: Call, *bounds: int) -> int:  # type: ignore[override]
        return self._read().index(call, *bounds)

    def count(self, call: Call) -> int:
        return self._read().count(call)
