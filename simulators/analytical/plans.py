"""Blocks turned into the flat templates the scheduler's hot loop reads, built once per (block, rank class) and kept
for later points whose blocks have the same content (a study's points share most of their blocks; see Planner).

A plan op is a tuple, so the loop unpacks it instead of reading attributes. Without a timeline, a run of
consecutive compute kernels that can only wait on the compute stream itself is fused into one op: the stream is
in order, so the run starts when its first kernel does and its kernels follow back to back. On a transformer
layer that leaves about a quarter of the ops. The kernels inside a fused run that something else waits on keep
their end times through `marks`, offsets from the run's start.

A plan is its skeleton and its seconds (`skeletons`): the skeleton depends on the block and the network's shape
only, so a block's skeletons are kept from the first system it is planned on (`_Form`), and every later system that
differs only in speeds prices seconds. Kept from the first, not the second: a revisit's second system is the one
most recipes see, and rebuilding every skeleton there, and with them every set's op rows (`op_rows`, kept per
skeletons' identities), cost its revisits 18% more Python calls and about a fifth more CPU than a third system's
(benchmarks/vs_calculon.py), while the first system's skeletons are held by its kept plans anyway.
"""

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from dse.lru import MIB, ByteBoundedLru
from dse.system import SystemSpec
from dse.workload import BLOCK_INPUT, Block, Op, OpKind, Workload
from simulators.analytical.pricing import BlockPricer, facets, pricing_settings
from simulators.analytical.skeletons import Link, Plan, Skeleton, code_of, renumbered, sums

COMPUTE, COLLECTIVE, SEND, RECV = range(4)
_KIND_CODE = {OpKind.COMPUTE: COMPUTE, OpKind.COLLECTIVE: COLLECTIVE, OpKind.SEND: SEND, OpKind.RECV: RECV}
_PRICED_ALONE = (OpKind.COMPUTE, OpKind.COLLECTIVE)
"""Kinds whose time is known from the plan; a p2p op's depends on when its partner is ready."""
_STREAM_PREFIX = {OpKind.COLLECTIVE: "comm", OpKind.SEND: "send", OpKind.RECV: "recv"}


def stream_of(op: Op) -> str:
    """The in-order queue an op runs on; every axis gets its own, as NCCL gives each communicator one."""
    return "compute" if op.kind is OpKind.COMPUTE else f"{_STREAM_PREFIX[op.kind]}:{op.axis}"


PLAN_BYTES = 32 * MIB
"""Recipes, skeletons and plans: the 96 configurations of benchmarks/vs_calculon.py keep about 5.4 MiB of them on one
system (its skeletons counted again as forms, though its plans hold the same objects), 7.1 MiB after a second and
1.7 MiB more per later system of another InfiniBand bandwidth (the blocks whose groups stay in a node keep theirs)."""
RECIPE_BYTES_PER_OP = 400
"""A recipe's bytes per op of its block: tracemalloc measured 209 B per op for the recipes of the 432 blocks of 24
of benchmarks/vs_calculon.py's workloads; the rest is an estimate of the block it keeps alive."""
PLAN_BYTES_PER_OP = 1000
"""A kept plan's bytes per op: a walk of the plans kept after benchmarks/vs_calculon.py's 96 configurations (their
op tuples, seconds, numberings, names and dicts, each object once) measured 940 B a plan op. A plan now keeps its
seconds as arrays and shares its skeleton, but joins its op tuples (`Plan.ops`) for the consumers that ask."""
SKELETON_BYTES_PER_OP = 1100
"""A kept skeleton's bytes per op: a plan op's tuples without its float (an estimate from PLAN_BYTES_PER_OP, 800 B),
and its encoding for the compiled engine (`Skeleton.encoding`: 280 B per op over the 1,244 skeletons of the 96
configurations of benchmarks/vs_calculon.py, most of it an array's header, as a skeleton has 1.5 ops on average)."""
FORMS_PER_RECIPE = 64
"""Shapes (a class's span keys, or the network's shape and class for a block with p2p ops) a recipe keeps
skeletons for, as SHELVES_PER_RECIPE bounds the systems."""


@dataclass(slots=True)
class _Form:
    """A block's skeletons for one shape of a class's groups, one per numbering (as `_Cached` is for plans)."""

    shape: tuple | None
    """`Planner._shape` for a block with p2p ops (its key holds its hash; compared on every hit), else None."""
    names: tuple[tuple[str, ...], tuple[str, ...]]
    skeletons: dict[tuple[tuple[int, ...], tuple[int, ...]], Skeleton]


@dataclass(slots=True)
class SkeletonCounts:
    """How often a plan built took a kept skeleton (`reused`) or made one (`built`): what the skeletons save."""

    built: int = 0
    reused: int = 0


SKELETONS = SkeletonCounts()
SHELVES_PER_RECIPE = 64
"""Prefixes (accelerators, for one workload's settings; networks too for a block with p2p ops) a recipe keeps plans
for: pricing one workload on thousands of systems must not grow its entry past the cache (the prefix kept first
goes first)."""
SPREADS_PER_SHELF = 64
"""Spreads a shelf keeps plans for, as SHELVES_PER_RECIPE bounds its prefixes: a spread holds the values of the
dimensions it spans, so a grid of InfiniBand bandwidths gives a block whose groups cross nodes one per system."""


@dataclass(slots=True)
class _Cached:
    """A block's plans for one class spread, one per numbering of their streams and categories (the planners of
    most points of a study number alike: their generators name streams in the same order)."""

    names: tuple[tuple[str, ...], tuple[str, ...]]
    """The names of the streams and of the categories the plans number, in the order a build first numbers them."""
    plans: dict[tuple[tuple[int, ...], tuple[int, ...]], Plan]
    """Per numbering (each name's number, in the order above), the plan."""


@dataclass(slots=True)
class _Shelf:
    """A block's plans under one prefix (`Planner._prefixes`), per spread of a class (its `BlockPricer.spans` per
    axis; the class, for a block with p2p ops)."""

    prefix: tuple
    """What the recipe finds the shelf by the hash of, compared on every hit."""
    spreads: dict[tuple | int, _Cached]
    ops: int
    """Plan ops held, over every spread and numbering."""
    held: int
    """Bytes of the prefix's ranks' classes (none for a block without p2p ops)."""


@dataclass(slots=True)
class _Recipe:
    """What of a block's plan depends on the block alone: which ops fuse into which plan op, and the names their
    streams and categories are numbered by. Every rank class, and every later point whose workload holds a block
    of the same content, builds its plan from it, adding only the seconds the class's groups give; and the plans
    built, kept for later points (`shelves`)."""

    key: tuple[int, bool]
    block: Block
    """The first block of this content seen, whose plans keep it."""
    categories: tuple[str, ...]
    """The names of its ops' categories, in the order they first appear (the order a build numbers them)."""
    runs: tuple[tuple[int, int, str, tuple[int, ...], bool, int, tuple[int, ...], int], ...]
    """Per plan op: (its first block op, kind, stream name, deps, waits on inputs, slot, the block ops of its marks,
    its category's place in `categories`)."""
    axes: tuple[str, ...]
    """The axes its collectives run on, sorted: a class's plan depends on how their groups span the network."""
    p2p: tuple[tuple[str, int], ...]
    """(axis, peer offset) of each p2p op, in order; a block with any is planned per class (its links name it)."""
    code: np.ndarray
    """What sums its plans' seconds from their blocks' op durations (`skeletons.code_of`); category totals in the
    order their ops first name them."""
    totals: tuple[int, ...]
    """The categories of the totals (places in `categories`), in their order."""
    forms: dict[tuple, "_Form"]
    """The skeletons of its plans, per shape of a class's groups on the network (`Planner._skeleton`): kept across
    systems, unlike `shelves`."""
    shapes: dict[int, int]
    """Per hash of the shapes its forms of a block with p2p ops hold (`_Form.shape`), how many hold it: the ranks'
    classes it keeps are counted in `bytes` once, not per class."""
    shelves: dict[int, _Shelf]
    """Per prefix's hash, the plans built under it. One cache entry holds a block's recipe and plans, so that a
    point looks the cache up once per block."""
    bytes: int
    """The entry's size: the recipe's and its shelves' (kept up to date as they grow, so sizing it is cheap)."""


_RECIPES: ByteBoundedLru[tuple[int, bool], _Recipe] = ByteBoundedLru("plans", PLAN_BYTES, lambda r: r.bytes)


def _recipe(block: Block, fuse: bool) -> _Recipe:
    """The recipe of the block's content. A workload is generated anew per point, so equal blocks of two points
    are different objects: the recipe is found by the block's hash and checked by comparing the blocks, each done
    once (hashing every op is most of what finding it costs; a key holding the block would hash it at each of the
    cache's lookups). Blocks whose hashes collide take turns in the cache."""
    seen = _SEEN.get((id(block), fuse))
    if seen is not None and seen[0] is block and _RECIPES.get(seen[1].key) is seen[1]:
        return seen[1]
    key = (hash(block), fuse)
    recipe = _RECIPES.get(key)
    if recipe is not None and (recipe.block is block or recipe.block == block):
        _see(block, fuse, recipe)
        return recipe
    needed = {d for op in block.ops for d in op.deps if d != BLOCK_INPUT} | {block.output_index}
    categories: dict[str, int] = {}
    totals: dict[int, int] = {}
    alone: list[int] = []  # per op priced alone (not p2p), it and its category's total
    runs: list[tuple[int, int, str, tuple[int, ...], bool, int, list[tuple[int, bool]]]] = []
    for index, op in enumerate(block.ops):
        category = categories.setdefault(op.category, len(categories))
        if op.kind in _PRICED_ALONE:
            alone += (index, totals.setdefault(category, len(totals)))
        run = runs[-1] if runs else None
        if fuse and run is not None and run[1] == COMPUTE and _joins(op, block, run[4]):
            members = run[6]
            members.append((index, members[-1][0] in needed))
            continue
        deps = tuple(d for d in op.deps if d != BLOCK_INPUT)
        runs.append(
            (index, _KIND_CODE[op.kind], stream_of(op), deps, BLOCK_INPUT in op.deps, category, [(index, False)])
        )
    fused = [run[6] for run in runs]
    recipe = _Recipe(
        key=key,
        block=block,
        categories=tuple(categories),
        runs=tuple(
            (*run[:5], members[-1][0], _marked(members), run[5]) for run, members in zip(runs, fused, strict=True)
        ),
        axes=tuple(sorted({op.axis for op in block.ops if op.kind is OpKind.COLLECTIVE})),
        p2p=tuple((op.axis, op.peer) for op in block.ops if op.kind in (OpKind.SEND, OpKind.RECV)),
        code=code_of(fused, alone, len(totals)),
        totals=tuple(totals),
        forms={},
        shapes={},
        shelves={},
        bytes=RECIPE_BYTES_PER_OP * len(block.ops),
    )
    _RECIPES.put(key, recipe)
    _see(block, fuse, recipe)
    return recipe


def _marked(members: list[tuple[int, bool]]) -> tuple[int, ...]:
    """The block ops of a fused run's marks: each kernel before one flagged as keeping its end."""
    if len(members) == 1:
        return ()
    return tuple([members[k - 1][0] for k in range(1, len(members)) if members[k][1]])


SEEN_BLOCKS = 1024
"""Blocks whose recipes `_SEEN` keeps: a point has a few dozen; a generator that keeps its blocks hands later
points the same objects, each found again by identity instead of by hashing it (about half a point's blocks)."""
_SEEN: dict[tuple[int, bool], tuple[Block, _Recipe]] = {}
"""Per (block's identity, fuse), the block (so that the identity stays its own) and its recipe, which is used only
while the cache still holds it under its key (else the block is looked up by hash as any other)."""


def _see(block: Block, fuse: bool, recipe: _Recipe) -> None:
    if len(_SEEN) >= SEEN_BLOCKS:
        _SEEN.clear()
    _SEEN[id(block), fuse] = (block, recipe)


class Planner:
    """Builds and caches plans, and numbers the streams and categories that plans refer to.

    A plan is kept for later points too, on its block's recipe (`_Recipe.shelves`), and its skeleton for later
    systems of the same shape (`_Recipe.forms`, `_skeleton`). Besides the block's content a plan depends on the
    accelerator and the workload's pricing settings (`_context`), and on how the class's groups spread over the
    network, the dimensions they span included (`BlockPricer.spans`); a block with p2p ops on the whole network,
    the class itself, its peers and their classes, so its plans are kept per network, layout, classes of the
    ranks, and class. Streams and categories are numbered per planner in
    first-use order; a kept plan is reused only under the numbering it was built with, and never for two blocks or
    classes of one planner that did not share a plan before (each gets its own object, as consumers number plans by
    identity; the planner numbers them too, `handed`)."""

    def __init__(self, workload: Workload, system: SystemSpec, fuse: bool, share_bandwidth: bool = True) -> None:
        self._workload = workload
        self.share_bandwidth = share_bandwidth
        self._pricer = BlockPricer(workload, system)
        self._fuse = fuse
        self.handed: list[Plan] = []
        """Every plan it gave out, each object once, in the order first given: `plans` gives places in it, which
        number a program's plans as they first appear there, so the compiled engine need not number them by
        identity (`compiled_engine._Layout`)."""
        self._plans: dict[tuple[int, int], int] = {}
        """Per (block, class), its plan's place in `handed`."""
        self._shared: dict[tuple, int] = {}
        self._recipes: dict[int, _Recipe] = {}
        self._spreads: dict[tuple[tuple[str, ...], int], tuple[tuple, tuple]] = {}
        self._shelves: dict[int, _Shelf] = {}
        self._numbers: dict[tuple[tuple[str, ...], tuple[str, ...]], tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self._handed: set[int] = set()
        """Identities of the plans this planner gave out."""
        context = _context(workload, system, fuse, share_bandwidth)
        classes = np.ascontiguousarray(workload.class_of)
        ranks = (workload.layout.axes, classes.dtype.str, classes.tobytes())
        self._prefixes = None if context is None else (context, (*context, facets(system).network, *ranks))
        """What keys a kept plan besides the block and its class's spread (`_shelf`, `_Shelf.spreads`): the
        context; for a block with p2p ops, which is kept per class, with every dimension of the network (a send's
        seconds read the dimensions between its ranks), the layout and the ranks' classes (its peers). A key holds
        their hashes, computed here once (hashing them per lookup would cost as much as the rest of the lookup)."""
        self._hashes = None if self._prefixes is None else tuple(hash(prefix) for prefix in self._prefixes)
        self._shape = (fuse, share_bandwidth, tuple(dim.npus for dim in system.network), *ranks)
        """What a skeleton of a block with p2p ops depends on besides the block and the class: its links name the
        peers' classes, and its shares the dimensions it crosses, which follow from the network's shape."""
        self._shape_hash = hash(self._shape)
        self._flags = (fuse, share_bandwidth)
        """What keys a skeleton of a block without p2p ops besides its class's span keys."""
        self.streams: dict[str, int] = {}
        self.categories: dict[str, int] = {}

    @property
    def keeps(self) -> bool:
        """Whether its plans are kept across points (not where they depend on the whole workload, `_context`): then
        they depend on the workload's blocks, layout and settings, not on its programs."""
        return self._prefixes is not None

    def plan(self, block_index: int, rank_class: int) -> Plan:
        place = self._plans.get((block_index, rank_class))
        return self.handed[self.plans((block_index,), rank_class)[0] if place is None else place]

    def plans(self, block_indices: Iterable[int], rank_class: int) -> list[int]:
        """The place in `handed` of each block's plan for the class: one call per program rather than per block, as
        the compiled engine asks for every block a program calls (about 125 a point) and a call's own cost was most
        of a kept plan's."""
        out: list[int] = []
        places, recipes, spreads, shared = self._plans, self._recipes, self._spreads, self._shared
        for block_index in block_indices:
            key = (block_index, rank_class)
            place = places.get(key)
            if place is None:
                recipe = recipes.get(block_index)
                if recipe is None:
                    recipe = recipes[block_index] = _recipe(self._workload.blocks[block_index], self._fuse)
                if recipe.p2p:
                    place = self._hand(self._kept(block_index, rank_class, recipe, rank_class, None))
                else:
                    spans = spreads.get((recipe.axes, rank_class))
                    if spans is None:
                        spans = spreads[recipe.axes, rank_class] = self._pricer.spans(recipe.axes, rank_class)
                    # Classes whose groups span the network alike run a block without p2p ops identically: they
                    # share one plan.
                    alike = (block_index, spans[0])
                    place = shared.get(alike)
                    if place is None:
                        place = shared[alike] = self._hand(
                            self._kept(block_index, rank_class, recipe, spans[1], spans[0])
                        )
                places[key] = place
            out.append(place)
        return out

    def _hand(self, plan: Plan) -> int:
        """The plan's place in `handed`, a new object's (`_kept` gives each (block, spread) its own)."""
        self.handed.append(plan)
        return len(self.handed) - 1

    def _kept(
        self, block_index: int, rank_class: int, recipe: _Recipe, spread: tuple | int, spans: tuple | None
    ) -> Plan:
        """The plan kept for this content and spread of the class on this system (`_Shelf`), numbered as this
        planner numbers; built if none. spans: the class's span keys (None for a block with p2p ops, which is
        kept per class under the prefix with the layout and classes)."""
        shelf = self._shelves.get(block_index)
        if shelf is None:
            if self._prefixes is None or self._hashes is None:
                return self._build(block_index, rank_class, recipe, spans)[0]
            p2p = int(spans is None)
            shelf = self._shelves[block_index] = _shelf(recipe, self._prefixes[p2p], self._hashes[p2p])
        entry = shelf.spreads.get(spread)
        if entry is None:
            plan, names = self._build(block_index, rank_class, recipe, spans)
            if len(shelf.spreads) >= SPREADS_PER_SHELF:
                _dropped(recipe, shelf, next(iter(shelf.spreads)))
            entry = shelf.spreads[spread] = _Cached(names, {})
            entry.plans[self._numbers[names]] = plan
            _grown(recipe, shelf, plan)
            self._handed.add(id(plan))
            return plan
        numbering = self._numbering(entry.names)
        plan = entry.plans.get(numbering)
        if plan is None:
            built = next(iter(entry.plans.values()))
            skeleton = self._skeleton(block_index, rank_class, recipe, spans)[0]
            plan = entry.plans[numbering] = Plan(skeleton, built.seconds, built.totals)
            _grown(recipe, shelf, plan)
        elif id(plan) in self._handed:
            plan = plan.copy()
        self._handed.add(id(plan))
        return plan

    def _numbering(self, names: tuple[tuple[str, ...], tuple[str, ...]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The numbers of the names of streams and of categories in this planner, numbering new ones in the order
        a build would; kept per names, as a name's number never changes once given."""
        found = self._numbers.get(names)
        if found is None:
            streams, categories = self.streams, self.categories
            found = self._numbers[names] = (
                tuple([streams.setdefault(name, len(streams)) for name in names[0]]),
                tuple([categories.setdefault(name, len(categories)) for name in names[1]]),
            )
        return found

    def _build(
        self, block_index: int, rank_class: int, recipe: _Recipe, spans: tuple | None
    ) -> tuple[Plan, tuple[tuple[str, ...], tuple[str, ...]]]:
        """The plan: its skeleton (kept across systems) and its seconds on this system; and the names its numbering
        numbers (`_Cached.names`)."""
        seconds = sums(np.array(self._pricer.durations(block_index, rank_class)), recipe.code)
        skeleton, names = self._skeleton(block_index, rank_class, recipe, spans)
        return Plan(skeleton, seconds, seconds[len(seconds) - len(skeleton.totals) :].tolist()), names

    def _skeleton(
        self, block_index: int, rank_class: int, recipe: _Recipe, spans: tuple | None
    ) -> tuple[Skeleton, tuple[tuple[str, ...], tuple[str, ...]]]:
        """The skeleton kept for the class's shape (`_Form`), numbered as this planner numbers; made if none, and
        kept where plans are (`keeps`)."""
        kept = self.keeps
        key = (self._shape_hash, rank_class) if spans is None else (self._flags, spans)
        form = recipe.forms.get(key) if kept else None
        if form is None or (spans is None and form.shape != self._shape):
            skeleton, streams = self._shaped(block_index, rank_class, recipe)
            names = (streams, recipe.categories)
            numbering = self._numbering(names)
            if kept:
                form = _Form(None if spans is not None else self._shape, names, {numbering: skeleton})
                _formed(recipe, key, form, len(skeleton.ops))
                SKELETONS.built += 1
            return skeleton, names
        SKELETONS.reused += 1
        numbering = self._numbering(form.names)
        skeleton = form.skeletons.get(numbering)
        if skeleton is None:
            skeleton = form.skeletons[numbering] = renumbered(*next(iter(form.skeletons.items())), numbering)
            recipe.bytes += SKELETON_BYTES_PER_OP * len(skeleton.ops)  # the caller puts the recipe again
        return skeleton, form.names

    def _shaped(self, block_index: int, rank_class: int, recipe: _Recipe) -> tuple[Skeleton, tuple[str, ...]]:
        """The skeleton, and the names of the streams it numbered in the order it first numbered them."""
        block = self._workload.blocks[block_index]
        numbered = self.categories
        categories = [numbered.setdefault(name, len(numbered)) for name in recipe.categories]
        streams = self.streams
        ops = []
        names: list[str] = []
        for first, kind, stream, deps, waits_on_inputs, slot, marks, category in recipe.runs:
            names.append(stream)
            number = streams.setdefault(stream, len(streams))
            if kind == COMPUTE:
                link, shares = None, ()
            else:
                link, shares = (
                    self._link(block.ops[first], rank_class),
                    self._shares(block.ops[first], rank_class, names),
                )
            ops.append((kind, number, deps, waits_on_inputs, slot, marks, categories[category], link, shares))
        skeleton = Skeleton(
            block=recipe.block,
            ops=tuple(ops),
            output=block.output_index,
            totals=tuple([categories[c] for c in recipe.totals]),
            categories=frozenset(categories),
        )
        return skeleton, tuple(dict.fromkeys(names))

    def source(self, block_index: int, op_index: int, rank_class: int) -> str:
        """What priced an op for this class (BlockPricer.source)."""
        return self._pricer.source(block_index, op_index, rank_class)

    def _shares(self, op: Op, rank_class: int, named: list[str]) -> tuple[int, ...]:
        """Network streams the op occupies: a collective both directions of every dimension its group spans, a
        send the outgoing and a recv the incoming direction of the dimension it crosses (links are full duplex,
        so a stage's send and its recv do not queue for each other). Their names are added to `named`."""
        if not self.share_bandwidth or op.kind is OpKind.COMPUTE:
            return ()
        if op.kind is OpKind.COLLECTIVE:
            names = [f"net:{d}:{way}" for d in self._pricer.dims(op.axis, rank_class) for way in ("out", "in")]
        else:
            d = self._pricer.p2p_dim(op.axis, op.peer, rank_class)
            names = [] if d is None else [f"net:{d}:{'out' if op.kind is OpKind.SEND else 'in'}"]
        named += names
        return tuple(self.streams.setdefault(name, len(self.streams)) for name in names)

    def _link(self, op: Op, rank_class: int) -> Link | None:
        if op.kind not in (OpKind.SEND, OpKind.RECV):
            return None
        peer_class = int(self._workload.class_of[self._pricer.peer(op.axis, op.peer, rank_class)[0]])
        if op.kind is OpKind.SEND:
            return (rank_class, peer_class, op.axis, op.peer)
        return (peer_class, rank_class, op.axis, -op.peer)


def _shelf(recipe: _Recipe, prefix: tuple, hashed: int) -> _Shelf:
    """The recipe's shelf for the prefix, made if none."""
    shelf = recipe.shelves.get(hashed)
    if shelf is None or shelf.prefix != prefix:
        if len(recipe.shelves) >= SHELVES_PER_RECIPE:
            recipe.bytes -= _shelf_bytes(recipe.shelves.pop(next(iter(recipe.shelves))))
        if shelf is not None:
            recipe.bytes -= _shelf_bytes(shelf)
        shelf = recipe.shelves[hashed] = _Shelf(prefix, {}, 0, sum(len(x) for x in prefix if type(x) is bytes))
        recipe.bytes += shelf.held
    return shelf


def _shelf_bytes(shelf: _Shelf) -> int:
    return PLAN_BYTES_PER_OP * shelf.ops + shelf.held


def _dropped(recipe: _Recipe, shelf: _Shelf, spread: tuple | int) -> None:
    """Takes the plans of a spread off the shelf, and their bytes off the recipe's."""
    ops = sum(len(plan.skeleton.ops) for plan in shelf.spreads.pop(spread).plans.values())
    shelf.ops -= ops
    recipe.bytes -= PLAN_BYTES_PER_OP * ops


def _grown(recipe: _Recipe, shelf: _Shelf, plan: Plan) -> None:
    """Counts a plan added to the shelf, putting the recipe again so that the cache sees its new size."""
    shelf.ops += len(plan.skeleton.ops)
    recipe.bytes += PLAN_BYTES_PER_OP * len(plan.skeleton.ops)
    _RECIPES.put(recipe.key, recipe)


def _formed(recipe: _Recipe, key: tuple, form: _Form, ops: int) -> None:
    """Counts a form put on the recipe, its first skeleton of `ops` ops (the caller puts the recipe again, so that
    the cache sees its new size); the form kept first goes first past FORMS_PER_RECIPE."""
    forms = recipe.forms
    if key in forms:  # another shape of the same hash: this one replaces it
        _unformed(recipe, key)
    elif len(forms) >= FORMS_PER_RECIPE:
        _unformed(recipe, next(iter(forms)))
    forms[key] = form
    recipe.bytes += SKELETON_BYTES_PER_OP * ops
    if form.shape is not None:
        held = recipe.shapes.get(key[0], 0)
        recipe.bytes += 0 if held else len(form.shape[-1])
        recipe.shapes[key[0]] = held + 1


def _unformed(recipe: _Recipe, key: tuple) -> None:
    form = recipe.forms.pop(key)
    recipe.bytes -= _form_bytes(form)
    if form.shape is not None:
        held = recipe.shapes.pop(key[0]) - 1
        if held:
            recipe.shapes[key[0]] = held
        else:
            recipe.bytes -= len(form.shape[-1])


def _form_bytes(form: _Form) -> int:
    return SKELETON_BYTES_PER_OP * sum(len(skeleton.ops) for skeleton in form.skeletons.values())


def _context(workload: Workload, system: SystemSpec, fuse: bool, share_bandwidth: bool) -> tuple | None:
    """What besides a block and its class's spread (`BlockPricer.spans` per axis of its collectives, which holds
    the dimensions they span as values) a plan of a block without p2p ops depends on: the accelerator (its compute
    model prices the compute ops, its NCCL and DeepEP tables the collectives within a node; `pricing._tables`),
    the workload's pricing settings, and how the plan is built (its fusing and its shares of the network's
    links). Not the network's other dimensions: a block whose groups stay inside a node keeps its plan on a
    system with another InfiniBand. None where the plans depend on the whole workload (memory tiers price an op by
    the step's working set), so plans are not kept across points."""
    if system.accelerator.memory_tiers:
        return None
    return (facets(system).accelerator, *pricing_settings(workload), fuse, share_bandwidth)


def _joins(op: Op, block: Block, run_waits_on_inputs: bool) -> bool:
    """Whether a kernel can follow the compute run before it back to back: all it waits on is earlier kernels
    (done by the time the stream reaches it) or inputs the run's first kernel already waited on."""
    if op.kind is not OpKind.COMPUTE:
        return False
    return all(run_waits_on_inputs if d == BLOCK_INPUT else block.ops[d].kind is OpKind.COMPUTE for d in op.deps)
