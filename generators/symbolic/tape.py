"""Sizes that remember how every number was made from them, so that a trace is recorded once and replayed.

A module's trace is a walk over its structure (layouts, collectives, the derived backward) that ends in numbers:
each op's FLOPs and bytes, each block's working memory, each module's saved activations. Those numbers are
arithmetic on the design point's sizes (micro-batch, sequence, hidden, ...), while the walk depends on the model,
the parallel layout and the mode. Tracing with `Sym` sizes records that arithmetic on a `Tape` as it runs; another
point of the same structure gets its numbers by replaying the tape on its own sizes, a flat loop over the recorded
operations instead of the walk.

Replay is exact: the same float operations in the same order as a trace with plain numbers would run. A
comparison the walk made on sizes (which of two buffers is larger, whether the query has more than one token) is
recorded as a guard; a point for which a guard comes out otherwise is traced anew. A size turned into a plain
number (float(), int(), round()) would be baked into the recording, so it raises instead.
"""

import operator
from collections.abc import Callable
from typing import Any

Number = int | float
Operation = Callable[[Any, Any], Any]


class Tape:
    """The recorded arithmetic: `values` holds every slot's value at recording (leaves, constants and results),
    `steps` how each result slot is computed from earlier slots, `guards` the comparisons that must hold."""

    def __init__(self) -> None:
        self.values: list[Number] = []
        self.steps: list[tuple[int, Operation, int, int]] = []
        self.guards: list[tuple[Operation, int, int, bool]] = []
        self.leaves: dict[str, int] = {}
        self._constants: dict[tuple[type, Number], int] = {}
        self._made: dict[tuple[Operation, int, int], Sym] = {}
        """Each operation on the same slots is recorded once (a trace computes many a size more than once)."""

    def leaf(self, name: str, value: Number) -> "Sym":
        slot = self.leaves[name] = self._slot(value)
        return Sym(self, slot, value)

    def replay(self, sizes: dict[str, Number]) -> list[Number] | None:
        """Every slot's value for these sizes; None when a recorded comparison comes out otherwise."""
        values = list(self.values)
        for name, slot in self.leaves.items():
            values[slot] = sizes[name]
        for slot, op, a, b in self.steps:
            values[slot] = op(values[a], values[b])
        for op, a, b, expected in self.guards:
            if op(values[a], values[b]) is not expected:
                return None
        return values

    def _slot(self, value: Number) -> int:
        self.values.append(value)
        return len(self.values) - 1

    def slot(self, x: "Sym | Number") -> int:
        """Where a replay's values hold x: a recorded number's slot, or a constant's (replays keep those)."""
        return self._operand(x)[0]

    def _constant(self, value: Number) -> int:
        key = (type(value), value)
        slot = self._constants.get(key)
        if slot is None:
            slot = self._constants[key] = self._slot(value)
        return slot

    def apply(self, op: Operation, a: "Sym | Number", b: "Sym | Number") -> "Sym":
        (slot_a, a), (slot_b, b) = self._operand(a), self._operand(b)
        key = (op, slot_a, slot_b)
        made = self._made.get(key)
        if made is None:
            value = op(a, b)
            made = self._made[key] = Sym(self, len(self.values), value)
            self.values.append(value)
            self.steps.append((made.slot, op, slot_a, slot_b))
        return made

    def compare(self, op: Operation, a: "Sym | Number", b: "Sym | Number") -> bool:
        (slot_a, a), (slot_b, b) = self._operand(a), self._operand(b)
        result = bool(op(a, b))
        self.guards.append((op, slot_a, slot_b, result))
        return result

    def _operand(self, x: "Sym | Number") -> tuple[int, Number]:
        return (x.slot, x.value) if type(x) is Sym else (self._constant(x), x)


def _arithmetic(op: Operation) -> tuple[Callable, Callable]:
    """A binary operator's method on Sym and its reflected form (number op Sym)."""

    def forward(self: "Sym", other: "Sym | Number") -> "Sym":
        return self.tape.apply(op, self, other)

    def reflected(self: "Sym", other: Number) -> "Sym":
        return self.tape.apply(op, other, self)

    return forward, reflected


def _comparison(op: Operation) -> Callable:
    def compare(self: "Sym", other: object) -> bool:
        return self.tape.compare(op, self, other)  # type: ignore[arg-type]

    return compare


class Sym:
    """A number computed from sizes, with its slot on the tape that records how."""

    __slots__ = ("slot", "tape", "value")

    def __init__(self, tape: Tape, slot: int, value: Number) -> None:
        self.tape = tape
        self.slot = slot
        self.value = value

    __add__, _radd = _arithmetic(operator.add)
    __sub__, __rsub__ = _arithmetic(operator.sub)
    __mul__, _rmul = _arithmetic(operator.mul)
    __truediv__, __rtruediv__ = _arithmetic(operator.truediv)
    __floordiv__, __rfloordiv__ = _arithmetic(operator.floordiv)
    __mod__, __rmod__ = _arithmetic(operator.mod)
    __gt__, __lt__ = _comparison(operator.gt), _comparison(operator.lt)
    __ge__, __le__ = _comparison(operator.ge), _comparison(operator.le)
    __eq__, __ne__ = _comparison(operator.eq), _comparison(operator.ne)  # type: ignore[assignment]

    def __radd__(self, other: Number) -> "Sym":
        if type(other) is int and other == 0:  # sum()'s start: x + 0 is x, and of x's type
            return self
        return self._radd(other)

    def __rmul__(self, other: Number) -> "Sym":
        if type(other) is int and other == 1:  # prod()'s start: 1 * x is x, and of x's type
            return self
        return self._rmul(other)

    def __bool__(self) -> bool:
        return self.tape.compare(operator.ne, self, 0)

    __hash__ = None  # type: ignore[assignment]

    def _baked(self, *_: object) -> Any:
        raise TypeError("a traced size was turned into a plain number, which a replay could not redo")

    __float__ = __int__ = __index__ = __round__ = __trunc__ = __floor__ = __ceil__ = _baked

    def __repr__(self) -> str:
        return f"Sym({self.value!r} @ {self.slot})"


def larger(a: "Sym | Number", b: "Sym | Number") -> "Sym | Number":
    """max(a, b); over recorded numbers one step on the tape, so that a replay takes the larger of its own two
    (a comparison would hold only for the sizes it was recorded with)."""
    if type(a) is Sym:
        return a.tape.apply(max, a, b)
    if type(b) is Sym:
        return b.tape.apply(max, a, b)
    return max(a, b)
