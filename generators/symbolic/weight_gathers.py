"""ZeRO-3's weight all-gathers in one walk of a stage's schedule (`walk.walk`): which module's forward or
backward gathers its weights, and how far ahead of the module each gather is issued (`parallel.fsdp_prefetch`).

FSDP issues a module's all-gather before the compute (and gradient reduce-scatter) of the module `fsdp_prefetch`
places before it in the order the pass runs them: 1 is FSDP's implicit prefetch (FSDP1's BACKWARD_PRE and
forward_prefetch, FSDP2's default), more is FSDP2's set_modules_to_forward_prefetch and
set_modules_to_backward_prefetch with that many modules, 0 a gather issued as its module is about to run, which
the module waits for. The gathered weights are held from their gather to the end of their module, so up to
`fsdp_prefetch` + 1 modules' weights are gathered at once.
"""

from dse.workload import Call, Program
from generators.symbolic.blocks import Traced
from generators.symbolic.sharding import Hold
from generators.symbolic.skeleton import Unit


class WeightGathers:
    """The gather calls of one stage's walk; `on` whether any module of the stage gathers (ZeRO-3 in training)."""

    def __init__(
        self, program: Program, trace_of: dict[Unit, Traced], held: Hold, depth: int, head: Hold | None = None
    ) -> None:
        """`held`: every module's hold (`Sharding.hold`) but the output head's, `head` (`Sharding.head_hold`;
        None: the same)."""
        self.program = program
        self.trace_of = trace_of
        self.hold, self.head_hold = held, held if head is None else head
        self.depth = depth
        self.on = any(traced.gathers != (None, None) for traced in trace_of.values())

    def held(self, unit: Unit) -> Hold:
        """How long the weights a unit gathers for its forward stay gathered."""
        return self.head_hold if unit[0] == "head" else self.hold

    def needed(self, unit: Unit, way: int, mb: int) -> bool:
        """Whether a module's forward (way 0) or backward (1) of micro-batch mb gathers its weights: a forward
        unless the weights are kept over the step and gathered already (by micro-batch 0's), a backward unless the
        weights are kept whole since the forward (see `Sharding.hold`)."""
        held = self.held(unit)
        if way == 0:
            return held != "step" or mb == 0
        return held in ("forward", "shard")

    def gather(
        self, units: list[tuple[int, Unit]], pos: int, way: int, after: tuple[int, ...], mb: int
    ) -> tuple[int, ...]:
        """The call that all-gathers the weights of units[pos] for its forward (way 0) or backward (1), issued
        now after the calls `after`, if the module gathers."""
        if not self.on or pos >= len(units) or not self.needed(units[pos][1], way, mb):
            return ()
        index, unit = units[pos]
        block = self.trace_of[unit].gathers[way]
        if block is None:
            return ()
        return (self.program.add(Call(block, after, index, mb)),)

    def ahead(
        self,
        units: list[tuple[int, Unit]],
        issued: list[tuple[int, ...]],
        pos: int,
        way: int,
        after: tuple[int, ...],
        mb: int,
    ) -> tuple[int, ...]:
        """Before units[pos] runs: its gather calls, once those of the units up to `depth` places after it are
        issued (`issued` holds a pass's gathers by place; `after` is units[pos]'s input, what the new ones wait
        for)."""
        while len(issued) < len(units) and len(issued) <= pos + self.depth:
            issued.append(self.gather(units, len(issued), way, after, mb))
        return issued[pos] if pos < len(issued) else ()
