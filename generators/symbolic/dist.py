"""How a tensor is laid out across one parallel axis, and the collective that turns one layout into another.

The matcher pulls from the producer's layout and pushes to the consumer's: PartialSum -> Duplicated is an
all-reduce, PartialSum -> Partition a reduce-scatter, Partition -> Duplicated an all-gather, Partition(i) ->
Partition(j) an all-to-all, Duplicated -> Partition a local slice (no communication).
"""

from dataclasses import dataclass

from dse.workload import Collective


@dataclass(frozen=True, slots=True, eq=False)
class Duplicated:
    """Every rank of the axis holds the whole tensor. One instance, DUP: compared and hashed by identity."""

    def __reduce__(self) -> str:
        return "DUP"


@dataclass(frozen=True, slots=True, eq=False, init=False)
class Partition:
    """The tensor is split along one of its named dimensions.

    Interned, one instance per dimension, so that layouts compare and hash by identity: tracing hashes a
    tensor's layout for every size it asks, and a dataclass's generated __eq__ and __hash__ are Python calls."""

    dim: str

    def __new__(cls, dim: str) -> "Partition":
        interned = _PARTITIONS.get(dim)
        if interned is None:
            interned = _PARTITIONS[dim] = object.__new__(cls)
            object.__setattr__(interned, "dim", dim)
        return interned

    def __reduce__(self) -> tuple:
        return Partition, (self.dim,)


_PARTITIONS: dict[str, Partition] = {}


@dataclass(frozen=True, slots=True, eq=False)
class PartialSum:
    """Every rank holds a full-shaped addend; the tensor is their sum. One instance, PARTIAL."""

    def __reduce__(self) -> str:
        return "PARTIAL"


Dist = Duplicated | Partition | PartialSum
DUP = Duplicated()
PARTIAL = PartialSum()


class ImpossibleRedistribution(ValueError):
    """A layout change no collective performs (e.g. making a tensor a partial sum)."""


def collective_for(src: Dist, dst: Dist) -> Collective | None:
    """The collective that redistributes src into dst on one axis; None when no communication is needed."""
    if src == dst:
        return None
    match src, dst:
        case PartialSum(), Duplicated():
            return Collective.ALL_REDUCE
        case PartialSum(), Partition():
            return Collective.REDUCE_SCATTER
        case Partition(), Duplicated():
            return Collective.ALL_GATHER
        case Partition(), Partition():
            return Collective.ALL_TO_ALL
        case Duplicated(), Partition():
            return None
    raise ImpossibleRedistribution(f"no collective turns {src} into {dst}")


def gradient_layout(forward: Dist) -> Dist:
    """The layout a gradient must reach to match its tensor: the adjoint of a sum is a broadcast."""
    return DUP if isinstance(forward, PartialSum) else forward
