"""Blocks turned into the flat templates the scheduler's hot loop reads, built once per (block, rank class).

A plan op is a tuple, so the loop unpacks it instead of reading attributes. Without a timeline, a run of
consecutive compute kernels that can only wait on the compute stream itself is fused into one op: the stream is
in order, so the run starts when its first kernel does and its kernels follow back to back. On a transformer
layer that leaves about a quarter of the ops. The kernels inside a fused run that something else waits on keep
their end times through `marks`, offsets from the run's start.
"""

from dataclasses import dataclass

from dse.lru import MIB, ByteBoundedLru
from dse.system import SystemSpec
from dse.workload import BLOCK_INPUT, Block, Op, OpKind, Workload
from simulators.analytical.pricing import BlockPricer

COMPUTE, COLLECTIVE, SEND, RECV = range(4)
_KIND_CODE = {OpKind.COMPUTE: COMPUTE, OpKind.COLLECTIVE: COLLECTIVE, OpKind.SEND: SEND, OpKind.RECV: RECV}
_PRICED_ALONE = (OpKind.COMPUTE, OpKind.COLLECTIVE)
"""Kinds whose time is known from the plan; a p2p op's depends on when its partner is ready."""
_STREAM_PREFIX = {OpKind.COLLECTIVE: "comm", OpKind.SEND: "send", OpKind.RECV: "recv"}

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


def stream_of(op: Op) -> str:
    """The in-order queue an op runs on; every axis gets its own, as NCCL gives each communicator one."""
    return "compute" if op.kind is OpKind.COMPUTE else f"{_STREAM_PREFIX[op.kind]}:{op.axis}"


@dataclass(slots=True, frozen=True, eq=False)
class Plan:
    """A block as one rank class runs it: its communication priced for that class's groups and peers."""

    block: Block
    ops: tuple[PlanOp, ...]
    output: int
    category_seconds: tuple[tuple[int, float], ...]
    """Seconds per category of the ops that are not p2p; a p2p op's seconds are known only once it pairs."""
    categories: frozenset[int]


RECIPE_BYTES = 16 * MIB
"""Recipes of about 20,000 blocks (RECIPE_BYTES_PER_OP each op), far more than a study's distinct blocks."""
RECIPE_BYTES_PER_OP = 400
"""A recipe's bytes per op of its block: tracemalloc measured 209 B per op for the recipes of the 432 blocks of 24
of benchmarks/vs_calculon.py's workloads; the rest is an estimate of the block it keeps alive."""


@dataclass(slots=True, frozen=True)
class _Recipe:
    """What of a block's plan depends on the block alone: which ops fuse into which plan op, and the names their
    streams and categories are numbered by. Every rank class, and every later point whose workload holds the same
    block (a workload is generated once and priced on many systems), builds its plan from it, adding only the
    seconds the class's groups give."""

    categories: tuple[str, ...]
    """Per op, its category's name."""
    priced_alone: tuple[int, ...]
    """The ops whose seconds the plan's category totals hold (not the p2p ones)."""
    runs: tuple[tuple[int, int, str, tuple[int, ...], bool, tuple[tuple[int, bool], ...]], ...]
    """Per plan op: (its first block op, kind, stream name, deps, waits on inputs, and per later kernel fused into
    it, (block op, whether the kernel before it keeps its end time as a mark))."""


_RECIPES: ByteBoundedLru[tuple[int, bool], tuple[Block, _Recipe]] = ByteBoundedLru(
    "plan recipes", RECIPE_BYTES, lambda entry: RECIPE_BYTES_PER_OP * len(entry[0].ops)
)


def _recipe(block: Block, fuse: bool) -> _Recipe:
    """The block's recipe, kept by the block's identity (the entry holds the block, so the identity is its own)."""
    key = (id(block), fuse)
    entry = _RECIPES.get(key)
    if entry is not None and entry[0] is block:
        return entry[1]
    needed = {d for op in block.ops for d in op.deps if d != BLOCK_INPUT} | {block.output_index}
    runs: list[tuple[int, int, str, tuple[int, ...], bool, list[tuple[int, bool]]]] = []
    for index, op in enumerate(block.ops):
        run = runs[-1] if runs else None
        if fuse and run is not None and run[1] == COMPUTE and _joins(op, block, run[4]):
            members = run[5]
            members.append((index, (members[-1][0] if members else run[0]) in needed))
            continue
        deps = tuple(d for d in op.deps if d != BLOCK_INPUT)
        runs.append((index, _KIND_CODE[op.kind], stream_of(op), deps, BLOCK_INPUT in op.deps, []))
    recipe = _Recipe(
        categories=tuple(op.category for op in block.ops),
        priced_alone=tuple(i for i, op in enumerate(block.ops) if op.kind in _PRICED_ALONE),
        runs=tuple((*run[:5], tuple(run[5])) for run in runs),  # type: ignore[misc]
    )
    _RECIPES.put(key, (block, recipe))
    return recipe


class Planner:
    """Builds and caches plans, and numbers the streams and categories that plans refer to."""

    def __init__(self, workload: Workload, system: SystemSpec, fuse: bool, share_bandwidth: bool = True) -> None:
        self._workload = workload
        self.share_bandwidth = share_bandwidth
        self._pricer = BlockPricer(workload, system)
        self._fuse = fuse
        self._plans: dict[tuple[int, int], Plan] = {}
        self._shared: dict[tuple, Plan] = {}
        self._block_axes: dict[int, tuple[str, ...]] = {}
        self.streams: dict[str, int] = {}
        self.categories: dict[str, int] = {}

    def plan(self, block_index: int, rank_class: int) -> Plan:
        key = (block_index, rank_class)
        plan = self._plans.get(key)
        if plan is None:
            # Classes whose groups span the network alike run a block without p2p ops identically: they share
            # one plan.
            alike = self._alike(block_index, rank_class)
            plan = self._shared.get(alike) if alike is not None else None
            if plan is None:
                plan = self._build(block_index, rank_class)
                if alike is not None:
                    self._shared[alike] = plan
            self._plans[key] = plan
        return plan

    def _alike(self, block_index: int, rank_class: int) -> tuple | None:
        """What a block's plan depends on besides the block: the span of each axis its collectives use; None for
        a block with p2p ops (their links name the classes)."""
        axes = self._block_axes.get(block_index)
        if axes is None:
            ops = self._workload.blocks[block_index].ops
            if any(op.kind in (OpKind.SEND, OpKind.RECV) for op in ops):
                axes = self._block_axes[block_index] = ("p2p",)
            else:
                axes = self._block_axes[block_index] = tuple(
                    sorted({op.axis for op in ops if op.kind is OpKind.COLLECTIVE})
                )
        if axes == ("p2p",):
            return None
        return (block_index, *(self._pricer.span_key(axis, rank_class) for axis in axes))

    def _build(self, block_index: int, rank_class: int) -> Plan:
        block = self._workload.blocks[block_index]
        recipe = _recipe(block, self._fuse)
        seconds = self._pricer.durations(block_index, rank_class)
        categories = [self.categories.setdefault(name, len(self.categories)) for name in recipe.categories]
        totals: dict[int, float] = {}
        for index in recipe.priced_alone:
            category = categories[index]
            totals[category] = totals.get(category, 0.0) + seconds[index]
        ops = []
        for first, kind, stream, deps, waits_on_inputs, members in recipe.runs:
            number = self.streams.setdefault(stream, len(self.streams))
            if kind == COMPUTE:
                link, shares = None, ()
            else:
                link, shares = self._link(block.ops[first], rank_class), self._shares(block.ops[first], rank_class)
            slot, duration, marks = first, seconds[first], []
            for index, mark_previous in members:
                if mark_previous:
                    marks.append((slot, duration))
                duration += seconds[index]
                slot = index
            category = categories[first]
            ops.append((kind, number, duration, deps, waits_on_inputs, slot, tuple(marks), category, link, shares))
        return Plan(
            block=block,
            ops=tuple(ops),
            output=block.output_index,
            category_seconds=tuple(totals.items()),
            categories=frozenset(categories),
        )

    def source(self, block_index: int, op_index: int, rank_class: int) -> str:
        """What priced an op for this class (BlockPricer.source)."""
        return self._pricer.source(block_index, op_index, rank_class)

    def _shares(self, op: Op, rank_class: int) -> tuple[int, ...]:
        """Network streams the op occupies: a collective both directions of every dimension its group spans, a
        send the outgoing and a recv the incoming direction of the dimension it crosses (links are full duplex,
        so a stage's send and its recv do not queue for each other)."""
        if not self.share_bandwidth or op.kind is OpKind.COMPUTE:
            return ()
        if op.kind is OpKind.COLLECTIVE:
            names = [f"net:{d}:{way}" for d in self._pricer.dims(op.axis, rank_class) for way in ("out", "in")]
        else:
            d = self._pricer.p2p_dim(op.axis, op.peer, rank_class)
            names = [] if d is None else [f"net:{d}:{'out' if op.kind is OpKind.SEND else 'in'}"]
        return tuple(self.streams.setdefault(name, len(self.streams)) for name in names)

    def _link(self, op: Op, rank_class: int) -> Link | None:
        if op.kind not in (OpKind.SEND, OpKind.RECV):
            return None
        rank = self._pricer.representative(rank_class)
        peer_class = int(self._workload.class_of[self._workload.layout.peer(rank, op.axis, op.peer)])
        if op.kind is OpKind.SEND:
            return (rank_class, peer_class, op.axis, op.peer)
        return (peer_class, rank_class, op.axis, -op.peer)


def _joins(op: Op, block: Block, run_waits_on_inputs: bool) -> bool:
    """Whether a kernel can follow the compute run before it back to back: all it waits on is earlier kernels
    (done by the time the stream reaches it) or inputs the run's first kernel already waited on."""
    if op.kind is not OpKind.COMPUTE:
        return False
    return all(run_waits_on_inputs if d == BLOCK_INPUT else block.ops[d].kind is OpKind.COMPUTE for d in op.deps)
