"""What of a block's plan depends on the block alone (its `Recipe`: which ops fuse, the names its streams and
categories are numbered by, what sums its seconds), and the plans and skeletons built from it, kept on it for later
points and systems (`Shelf`, `Form`) in one byte-bounded cache entry per block content (`RECIPES`). `plans.Planner`
builds from recipes and fills their shelves; this module only keeps them and counts their bytes.
"""

from dataclasses import dataclass

import numpy as np

from dse.lru import MIB, ByteBoundedLru
from dse.workload import BLOCK_INPUT, Block, Op, OpKind
from simulators.analytical.skeletons import Plan, Skeleton, code_of

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
class Form:
    """A block's skeletons for one shape of a class's groups, one per numbering (as `Cached` is for plans)."""

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
class Cached:
    """A block's plans for one class spread, one per numbering of their streams and categories (the planners of
    most points of a study number alike: their generators name streams in the same order)."""

    names: tuple[tuple[str, ...], tuple[str, ...]]
    """The names of the streams and of the categories the plans number, in the order a build first numbers them."""
    plans: dict[tuple[tuple[int, ...], tuple[int, ...]], Plan]
    """Per numbering (each name's number, in the order above), the plan."""


@dataclass(slots=True)
class Shelf:
    """A block's plans under one prefix (`Planner._prefixes`), per spread of a class (its `BlockPricer.spans` per
    axis; the class, for a block with p2p ops)."""

    prefix: tuple
    """What the recipe finds the shelf by the hash of, compared on every hit."""
    spreads: dict[tuple | int, Cached]
    ops: int
    """Plan ops held, over every spread and numbering."""
    held: int
    """Bytes of the prefix's ranks' classes (none for a block without p2p ops)."""


@dataclass(slots=True)
class Recipe:
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
    forms: dict[tuple, "Form"]
    """The skeletons of its plans, per shape of a class's groups on the network (`Planner._skeleton`): kept across
    systems, unlike `shelves`."""
    shapes: dict[int, int]
    """Per hash of the shapes its forms of a block with p2p ops hold (`Form.shape`), how many hold it: the ranks'
    classes it keeps are counted in `bytes` once, not per class."""
    shelves: dict[int, Shelf]
    """Per prefix's hash, the plans built under it. One cache entry holds a block's recipe and plans, so that a
    point looks the cache up once per block."""
    bytes: int
    """The entry's size: the recipe's and its shelves' (kept up to date as they grow, so sizing it is cheap)."""


RECIPES: ByteBoundedLru[tuple[int, bool], Recipe] = ByteBoundedLru("plans", PLAN_BYTES, lambda r: r.bytes)


def find_recipe(block: Block, fuse: bool) -> Recipe:
    """The recipe of the block's content. A workload is generated anew per point, so equal blocks of two points
    are different objects: the recipe is found by the block's hash and checked by comparing the blocks, each done
    once (hashing every op is most of what finding it costs; a key holding the block would hash it at each of the
    cache's lookups). Blocks whose hashes collide take turns in the cache."""
    seen = _SEEN.get((id(block), fuse))
    if seen is not None and seen[0] is block and RECIPES.get(seen[1].key) is seen[1]:
        return seen[1]
    key = (hash(block), fuse)
    recipe = RECIPES.get(key)
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
    recipe = Recipe(
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
    RECIPES.put(key, recipe)
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
_SEEN: dict[tuple[int, bool], tuple[Block, Recipe]] = {}
"""Per (block's identity, fuse), the block (so that the identity stays its own) and its recipe, which is used only
while the cache still holds it under its key (else the block is looked up by hash as any other)."""


def _see(block: Block, fuse: bool, recipe: Recipe) -> None:
    if len(_SEEN) >= SEEN_BLOCKS:
        _SEEN.clear()
    _SEEN[id(block), fuse] = (block, recipe)


def shelf_of(recipe: Recipe, prefix: tuple, hashed: int) -> Shelf:
    """The recipe's shelf for the prefix, made if none."""
    shelf = recipe.shelves.get(hashed)
    if shelf is None or shelf.prefix != prefix:
        if len(recipe.shelves) >= SHELVES_PER_RECIPE:
            recipe.bytes -= _shelf_bytes(recipe.shelves.pop(next(iter(recipe.shelves))))
        if shelf is not None:
            recipe.bytes -= _shelf_bytes(shelf)
        shelf = recipe.shelves[hashed] = Shelf(prefix, {}, 0, sum(len(x) for x in prefix if type(x) is bytes))
        recipe.bytes += shelf.held
    return shelf


def _shelf_bytes(shelf: Shelf) -> int:
    return PLAN_BYTES_PER_OP * shelf.ops + shelf.held


def dropped(recipe: Recipe, shelf: Shelf, spread: tuple | int) -> None:
    """Takes the plans of a spread off the shelf, and their bytes off the recipe's."""
    ops = sum(len(plan.skeleton.ops) for plan in shelf.spreads.pop(spread).plans.values())
    shelf.ops -= ops
    recipe.bytes -= PLAN_BYTES_PER_OP * ops


def grown(recipe: Recipe, shelf: Shelf, plan: Plan) -> None:
    """Counts a plan added to the shelf, putting the recipe again so that the cache sees its new size."""
    shelf.ops += len(plan.skeleton.ops)
    recipe.bytes += PLAN_BYTES_PER_OP * len(plan.skeleton.ops)
    RECIPES.put(recipe.key, recipe)


def formed(recipe: Recipe, key: tuple, form: Form, ops: int) -> None:
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


def _unformed(recipe: Recipe, key: tuple) -> None:
    form = recipe.forms.pop(key)
    recipe.bytes -= _form_bytes(form)
    if form.shape is not None:
        held = recipe.shapes.pop(key[0]) - 1
        if held:
            recipe.shapes[key[0]] = held
        else:
            recipe.bytes -= len(form.shape[-1])


def _form_bytes(form: Form) -> int:
    return SKELETON_BYTES_PER_OP * sum(len(skeleton.ops) for skeleton in form.skeletons.values())


def _joins(op: Op, block: Block, run_waits_on_inputs: bool) -> bool:
    """Whether a kernel can follow the compute run before it back to back: all it waits on is earlier kernels
    (done by the time the stream reaches it) or inputs the run's first kernel already waited on."""
    if op.kind is not OpKind.COMPUTE:
        return False
    return all(run_waits_on_inputs if d == BLOCK_INPUT else block.ops[d].kind is OpKind.COMPUTE for d in op.deps)
