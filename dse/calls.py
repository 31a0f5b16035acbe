"""A program's calls: one instance of a block each (`Call`), the sequence every program of one shape shares
(`CallShape`), and a program's own view of it (`ShapeCalls`). Apart from `dse.workload` so that the workload's
module stays one file's worth; it re-exports `Call` and `CallShape`, which every generator and cost model reads."""

from collections.abc import Iterable, Iterator, MutableSequence, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, overload


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


@dataclass(slots=True, eq=False)
class CallShape:
    """One sequence of calls, shared by every program that runs it (a generator hands the same object to the
    programs of later points of the same shape).

    What a cost model derives from the calls alone (where pipeline transfers split a program, which calls read
    which) is the same for all of them, so it may keep that in `memo` and skip the walk for later programs;
    `holds` is the check that a program's calls are still these."""

    calls: tuple[Call, ...]
    memo: dict = field(default_factory=dict)

    def program_calls(self) -> "ShapeCalls":
        """A program's own calls, reading these until something edits them; `holds` checks them in one step while
        nothing has."""
        return ShapeCalls(self)

    def holds(self, calls: Sequence[Call]) -> bool:
        if type(calls) is ShapeCalls and calls.shape is self and not calls.edited:
            return True
        # Equal calls compare by identity first, so this is cheap when the program copied the sequence.
        return len(calls) == len(self.calls) and tuple(calls) == self.calls


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
        self._calls: tuple[Call, ...] | list[Call] = shape.calls
        self.shape = shape
        self.edited = False

    def _own(self) -> list[Call]:
        """The list the calls are edited in, made from the shape's on the first edit."""
        calls = self._calls
        if isinstance(calls, tuple):
            calls = self._calls = list(calls)
            self.edited = True
        return calls

    def __len__(self) -> int:
        return len(self._calls)

    @overload
    def __getitem__(self, index: int) -> Call: ...
    @overload
    def __getitem__(self, index: slice) -> list[Call]: ...
    def __getitem__(self, index: int | slice) -> Call | list[Call]:
        found = self._calls[index]
        return list(found) if type(found) is tuple and type(index) is slice else found

    def __iter__(self) -> Iterator[Call]:
        return iter(self._calls)

    def __contains__(self, call: object) -> bool:
        return call in self._calls

    def __eq__(self, other: object) -> bool:
        if type(other) is ShapeCalls:
            other = other._calls
        elif not isinstance(other, list):
            return NotImplemented
        return len(other) == len(self._calls) and tuple(other) == tuple(self._calls)

    __hash__ = None  # type: ignore[assignment]  # a list's

    def __repr__(self) -> str:
        return repr(list(self._calls))

    def __setitem__(self, index, value) -> None:  # type: ignore[no-untyped-def]  # a list's, either overload
        self._own()[index] = value

    def __delitem__(self, index: int | slice) -> None:
        del self._own()[index]

    def __iadd__(self, calls: Iterable[Call]) -> "ShapeCalls":
        self._own().extend(calls)
        return self

    def __imul__(self, times: int) -> "ShapeCalls":
        self._own()[:] = self._calls * times
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
        return self._calls.index(call, *bounds)

    def count(self, call: Call) -> int:
        return self._calls.count(call)
