"""Blocks turned into the flat templates the scheduler's hot loop reads, built once per (block, rank class) and kept
for later points whose blocks have the same content (a study's points share most of their blocks; see Planner).

A plan op is a tuple, so the loop unpacks it instead of reading attributes. Without a timeline, a run of
consecutive compute kernels that can only wait on the compute stream itself is fused into one op: the stream is
in order, so the run starts when its first kernel does and its kernels follow back to back. On a transformer
layer that leaves about a quarter of the ops. The kernels inside a fused run that something else waits on keep
their end times through `marks`, offsets from the run's start.

A plan is its skeleton and its seconds (`skeletons`): the skeleton depends on the block and the network's shape
only, so a block's skeletons are kept from the first system it is planned on (`Form`), and every later system that
differs only in speeds prices seconds. Kept from the first, not the second: a revisit's second system is the one
most recipes see, and rebuilding every skeleton there, and with them every set's op rows (`op_rows`, kept per
skeletons' identities), cost its revisits 18% more Python calls and about a fifth more CPU than a third system's
(benchmarks/vs_calculon.py), while the first system's skeletons are held by its kept plans anyway.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dse.system import SystemSpec
from dse.workload import Block, Op, OpKind, Workload
from simulators.analytical.pricing import BlockPricer, facets, pricing_settings
from simulators.analytical.recipes import (
    COMPUTE,
    SKELETON_BYTES_PER_OP,
    SKELETONS,
    SPREADS_PER_SHELF,
    Cached,
    Form,
    Recipe,
    Shelf,
    dropped,
    find_recipe,
    formed,
    grown,
    shelf_of,
)
from simulators.analytical.skeletons import Link, Plan, Skeleton, renumbered, sums


@dataclass(slots=True)
class _Log:
    """What planners of workloads of one structure on networks of one shape were asked (`Planner.plans`) and what
    they handed, in order. Where a planner's places go follows from its calls and that structure alone (`_looked_up`
    reads of a block only whether it has p2p ops and the axes of its collectives, and of the workload its layout and
    classes, whose groups span the network by its NPUs per dimension): a planner that asks as the log did hands the
    same places, finding only each place's plan on its system and for its blocks' content (`Planner._kept`), instead
    of looking up each of a point's (block, class) pairs again. A revisit (the generator hands back a seen
    point's workload on a new system) asks as its first visit did, and so does most first visits' planner: the 96
    configurations of benchmarks/vs_calculon.py have 16 structures (a micro-batch size or recomputation changes
    blocks' compute ops and sizes, not which have p2p ops nor their collectives' axes), so 80 of their first visits
    follow a log."""

    calls: list[tuple[list[int], int, list[int]]]
    """Per `plans` call in turn: its blocks, its class and the places it gave. A place is new to the planner where
    it first appears, in order, and is the plan of the block and class it appears for first."""


@dataclass(slots=True)
class Resolved:
    """What one drive's `Planner.plans` calls resolved while following a log (`_Log`): per place new to its planner,
    the plan and what of the network its seconds read; kept by the compiled engine (`call_layout.Drive`) for a
    later planner that starts where this one did, on the same blocks and accelerator (a revisit: its workload on a
    system of another InfiniBand bandwidth), which hands those plans again and finds afresh only those whose
    dimensions changed (`Planner.replay`), instead of finding each of its places' spans and shelf entries again."""

    log: _Log
    blocks: Sequence[Block]
    """The workload's blocks (kept, so that their identity in the key stays theirs)."""
    context: tuple
    """`Planner._prefixes`' context: the accelerator and settings every plan's seconds read."""
    asked: int
    handed: int
    """The log's calls and the planner's plans handed before the drive."""
    calls: int
    names: tuple[tuple[str, ...], tuple[str, ...]]
    """The names of the streams and of the categories numbered before the drive."""
    numbered: tuple[tuple[str, ...], tuple[str, ...]]
    """And after it."""
    network: tuple[str, ...]
    """The system's dimensions (`Facets.network`) the plans were found on."""
    origins: list[tuple[int, int]]
    """Per place new to the planner, in order: the block and class it was first handed for (`Planner.origins`)."""
    plans: list[Plan]
    recipes: dict[int, Recipe]
    spreads: dict[tuple[tuple[str, ...], int], tuple[tuple, tuple]]
    """The planner's recipes and spans (`Planner._recipes`, `_spreads`), which hold those of its places."""
    places: list[tuple[int, int, frozenset[int] | None, Recipe]] | None = None
    """Per place, its block and class, the dimensions its seconds read (its class's groups span; None for a block
    with p2p ops, kept per network) and its block's recipe: found from `recipes` and `spreads` by the first replay,
    not by the drive that keeps it, which is most often a first visit's that no later one replays."""


LOGS_KEPT = 256
"""Logs `_LOGS` keeps (a plain dict emptied when full, as `_SEEN`): one per workload structure and network shape a
study meets; a log holds a few hundred small ints, its key (`Planner._structure`) the network's NPUs per dimension,
the layout, the ranks' classes and per block its p2p flag and collectives' axes."""
_LOGS: dict[tuple, _Log] = {}
_BLOCKS: dict[tuple[int, bool], tuple[Sequence[Block], tuple]] = {}
"""Per (blocks' identity, fuse), the blocks (so that the identity stays theirs) and their part of the log's key
(`Planner._structure`): a revisit's workload hands back the same blocks, whose recipes it then finds only for the
places new to its planner, as before logs were keyed by structure (finding all of them again cost the revisits of
benchmarks/vs_calculon.py about 0.08 ms each on a loaded 2-core machine). Emptied when full, as `_LOGS`."""


def _log(key: tuple) -> _Log:
    """The log of planners of this workload structure and network shape (`Planner._structure`), made empty if
    none."""
    found = _LOGS.get(key)
    if found is None:
        if len(_LOGS) >= LOGS_KEPT:
            _LOGS.clear()
        found = _LOGS[key] = _Log([])
    return found


class Planner:
    """Builds and caches plans, and numbers the streams and categories that plans refer to.

    A plan is kept for later points too, on its block's recipe (`Recipe.shelves`), and its skeleton for later
    systems of the same shape (`Recipe.forms`, `_skeleton`). Besides the block's content a plan depends on the
    accelerator and the workload's pricing settings (`_context`), and on how the class's groups spread over the
    network, the dimensions they span included (`BlockPricer.spans`); a block with p2p ops on the whole network,
    the class itself, its peers and their classes, so its plans are kept per network, layout, classes of the
    ranks, and class. Streams and categories are numbered per planner in
    first-use order; a kept plan is reused only under the numbering it was built with, and never for two blocks or
    classes of one planner that did not share a plan before (each gets its own object, as consumers number plans by
    identity; the planner numbers them too, `handed`). What it was asked and handed is logged per workload structure
    and network shape, and a later planner that asks the same (a revisit on a new system, or a first visit of a
    workload of the same structure) follows the log (`_Log`)."""

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
        self.origins: list[tuple[int, int]] = []
        """Per place in `handed`, the block and class it was first handed for."""
        self._recipes: dict[int, Recipe] = {}
        self._spreads: dict[tuple[tuple[str, ...], int], tuple[tuple, tuple]] = {}
        self._shelves: dict[int, Shelf] = {}
        self._numbers: dict[tuple[tuple[str, ...], tuple[str, ...]], tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self._handed: set[int] = set()
        """Identities of the plans this planner gave out."""
        context = _context(workload, system, fuse, share_bandwidth)
        classes = np.ascontiguousarray(workload.class_of)
        ranks = (workload.layout.axes, classes.dtype.str, classes.tobytes())
        self._network = facets(system).network
        """The system's dimensions as JSON: what a replayed drive compares (`replay`)."""
        self._prefixes = None if context is None else (context, (*context, self._network, *ranks))
        """What keys a kept plan besides the block and its class's spread (`recipes.shelf_of`, `Shelf.spreads`): the
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
        self._log: _Log | None = _log(self._structure())
        """The log of planners of this workload's structure on networks of this shape (`_Log`) while it asks as the
        log did; None once it asks otherwise (its places are then looked up as the log's were not: `_diverge`)."""
        self._asked = 0
        """`plans` calls so far, while it follows the log."""

    def _structure(self) -> tuple:
        """What of the workload and network `_looked_up` places plans by, which keys the log (`_Log`): the flags and
        the network's NPUs per dimension, the layout and the ranks' classes (`_shape`), and per block whether it has
        p2p ops and the axes of its collectives (its recipe's; kept per blocks' identity, `_BLOCKS`)."""
        blocks = self._workload.blocks
        key = (id(blocks), self._fuse)
        found = _BLOCKS.get(key)
        if found is None or found[0] is not blocks:
            if len(_BLOCKS) >= LOGS_KEPT:
                _BLOCKS.clear()
            recipes = map(self._recipe_of, range(len(blocks)))
            found = _BLOCKS[key] = (blocks, tuple([(bool(recipe.p2p), recipe.axes) for recipe in recipes]))
        return (*self._shape, found[1])

    @property
    def keeps(self) -> bool:
        """Whether its plans are kept across points (not where they depend on the whole workload, `_context`): then
        they depend on the workload's blocks, layout and settings, not on its programs."""
        return self._prefixes is not None

    def plan(self, block_index: int, rank_class: int) -> Plan:
        """The block's plan for the class. Its callers (the interpreted engine, the tape) ask per call and find most
        plans in `_plans`, which a planner following its log does not fill: so they leave the log."""
        if self._log is not None:
            self._diverge()
        place = self._plans.get((block_index, rank_class))
        return self.handed[self.plans([block_index], rank_class)[0] if place is None else place]

    def plans(self, block_indices: list[int], rank_class: int) -> list[int]:
        """The place in `handed` of each block's plan for the class: one call per program rather than per block, as
        the compiled engine asks for every block a program calls (about 125 a point) and a call's own cost was most
        of a kept plan's. A call the log holds next (`_Log`) gives the log's places, finding the plans of those new
        to this planner (`_replay`); one past the log's end is looked up and added to it."""
        log = self._log
        if log is not None:
            if self._asked < len(log.calls):
                blocks, of, given = log.calls[self._asked]
                if of == rank_class and blocks == block_indices:
                    self._asked += 1
                    self._replay(blocks, of, given)
                    return list(given)
                self._diverge()
            else:
                self._asked += 1
                log.calls.append((list(block_indices), rank_class, self._looked_up(block_indices, rank_class)))
                return list(log.calls[-1][2])
        return self._looked_up(block_indices, rank_class)

    def mark(self) -> tuple | None:
        """Where it stands, as what keys a drive's `resolved` from here: None unless it follows a log and keeps its
        plans. The log, its calls and the plans handed so far, the blocks and the context's hash (`replay` checks
        them)."""
        if self._log is None or self._hashes is None:
            return None
        return (id(self._log), self._asked, len(self.handed), id(self._workload.blocks), self._hashes[0])

    def resolved(self, mark: tuple, names: tuple[tuple[str, ...], tuple[str, ...]]) -> Resolved | None:
        """What its `plans` calls since `mark` (with `names` numbered then) resolved, if it still follows that
        log."""
        log = self._log
        if log is None or id(log) != mark[0] or self._prefixes is None:
            return None
        asked, handed = mark[1], mark[2]
        return Resolved(
            log=log,
            blocks=self._workload.blocks,
            context=self._prefixes[0],
            asked=asked,
            handed=handed,
            calls=self._asked - asked,
            names=names,
            numbered=self.names(),
            network=self._network,
            origins=self.origins[handed:],
            plans=self.handed[handed:],
            recipes=self._recipes,
            spreads=self._spreads,
        )

    def names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The names of the streams and of the categories numbered so far, in order."""
        return tuple(self.streams), tuple(self.categories)

    def replay(self, resolved: Resolved) -> bool:
        """Whether it could make the calls `resolved` made (it stands where they started, on the same blocks and
        accelerator), and if so makes them: hands their plans again, found afresh only where a dimension their
        seconds read differs on this system (a block with p2p ops: any dimension), as those plans' seconds follow
        from the context, the block and its class's spread (what `_kept` keys them by). `resolved` then holds this
        system's plans, for the next. On benchmarks/vs_calculon.py's revisits most places do change (9 in 10: every
        stage's sends cross the InfiniBand), and what it saves is looking each place up in the log (`_replay`)."""
        log = self._log
        if (
            log is not resolved.log
            or self._asked != resolved.asked
            or len(self.handed) != resolved.handed
            or self._workload.blocks is not resolved.blocks
            or self._prefixes is None
            or self._prefixes[0] != resolved.context
            or self.names() != resolved.names
        ):
            return False
        for name in resolved.numbered[0][len(resolved.names[0]) :]:
            self.streams[name] = len(self.streams)
        for name in resolved.numbered[1][len(resolved.names[1]) :]:
            self.categories[name] = len(self.categories)
        network = self._network
        changed = {d for d, (a, b) in enumerate(zip(resolved.network, network, strict=True)) if a != b}
        plans, places = resolved.plans, resolved.places or _placed(resolved)
        fresh = [k for k, place in enumerate(places) if changed and (place[2] is None or place[2] & changed)]
        if fresh:
            plans = list(plans)
            kept = set(range(len(plans))).difference(fresh)
            self._handed.update([id(plans[k]) for k in kept])
            for k in fresh:  # after the others are handed, so that `_kept` copies a plan one of them holds
                block_index, rank_class, _, recipe = places[k]
                plans[k] = self._found(block_index, rank_class, recipe)
            resolved.plans, resolved.network = plans, network
        else:
            self._handed.update(map(id, plans))
        self.handed += plans
        self.origins += resolved.origins
        self._asked += resolved.calls
        return True

    def _replay(self, blocks: list[int], rank_class: int, given: list[int]) -> None:
        """Hands the places a logged call gave that this planner has not: each new place first appears in order, for
        the block whose lookup handed it, with the plan that lookup found (`_kept`)."""
        handed = self.handed
        for block_index, place in zip(blocks, given, strict=True):
            if place == len(handed):
                handed.append(self._found(block_index, rank_class, self._recipe_of(block_index)))
                self.origins.append((block_index, rank_class))

    def _diverge(self) -> None:
        """Leaves the log: fills in what looking up the calls it followed would have left (`_plans`, `_shared`)."""
        log, self._log = self._log, None
        assert log is not None
        for blocks, rank_class, given in log.calls[: self._asked]:
            for block_index, place in zip(blocks, given, strict=True):
                self._plans[block_index, rank_class] = place
                recipe = self._recipe_of(block_index)
                if not recipe.p2p:
                    self._shared.setdefault((block_index, self._spans(recipe.axes, rank_class)[0]), place)

    def _recipe_of(self, block_index: int) -> Recipe:
        recipe = self._recipes.get(block_index)
        if recipe is None:
            recipe = self._recipes[block_index] = find_recipe(self._workload.blocks[block_index], self._fuse)
        return recipe

    def _spans(self, axes: tuple[str, ...], rank_class: int) -> tuple[tuple, tuple]:
        spans = self._spreads.get((axes, rank_class))
        if spans is None:
            spans = self._spreads[axes, rank_class] = self._pricer.spans(axes, rank_class)
        return spans

    def _looked_up(self, block_indices: list[int], rank_class: int) -> list[int]:
        """`plans` without the log: each (block, class) looked up, and a new place's plan found (`_kept`)."""
        out: list[int] = []
        places, recipes, spreads, shared = self._plans, self._recipes, self._spreads, self._shared
        for block_index in block_indices:
            key = (block_index, rank_class)
            place = places.get(key)
            if place is None:
                # `_recipe_of` and `_spans` inline: this runs per (block, class), ~270 times a point.
                recipe = recipes.get(block_index)
                if recipe is None:
                    recipe = self._recipe_of(block_index)
                if recipe.p2p:
                    place = self._hand(self._found(block_index, rank_class, recipe), key)
                else:
                    spans = spreads.get((recipe.axes, rank_class))
                    if spans is None:
                        spans = self._spans(recipe.axes, rank_class)
                    # Classes whose groups span the network alike run a block without p2p ops identically: they
                    # share one plan.
                    alike = (block_index, spans[0])
                    place = shared.get(alike)
                    if place is None:
                        place = shared[alike] = self._hand(self._found(block_index, rank_class, recipe), key)
                places[key] = place
            out.append(place)
        return out

    def _found(self, block_index: int, rank_class: int, recipe: Recipe) -> Plan:
        """The block's plan for the class as a lookup finds it (`_kept`): a block with p2p ops kept per class, any
        other per its class's spread."""
        if recipe.p2p:
            return self._kept(block_index, rank_class, recipe, rank_class, None)
        spans = self._spans(recipe.axes, rank_class)
        return self._kept(block_index, rank_class, recipe, spans[1], spans[0])

    def _hand(self, plan: Plan, origin: tuple[int, int]) -> int:
        """The plan's place in `handed`, a new object's (`_kept` gives each (block, spread) its own), handed first
        for `origin` (block, class)."""
        self.handed.append(plan)
        self.origins.append(origin)
        return len(self.handed) - 1

    def _kept(
        self, block_index: int, rank_class: int, recipe: Recipe, spread: tuple | int, spans: tuple | None
    ) -> Plan:
        """The plan kept for this content and spread of the class on this system (`Shelf`), numbered as this
        planner numbers; built if none. spans: the class's span keys (None for a block with p2p ops, which is
        kept per class under the prefix with the layout and classes)."""
        shelf = self._shelves.get(block_index)
        if shelf is None:
            if self._prefixes is None or self._hashes is None:
                return self._build(block_index, rank_class, recipe, spans)[0]
            p2p = int(spans is None)
            shelf = self._shelves[block_index] = shelf_of(recipe, self._prefixes[p2p], self._hashes[p2p])
        entry = shelf.spreads.get(spread)
        if entry is None:
            plan, names = self._build(block_index, rank_class, recipe, spans)
            if len(shelf.spreads) >= SPREADS_PER_SHELF:
                dropped(recipe, shelf, next(iter(shelf.spreads)))
            entry = shelf.spreads[spread] = Cached(names, {})
            entry.plans[self._numbers[names]] = plan
            grown(recipe, shelf, plan)
            self._handed.add(id(plan))
            return plan
        numbering = self._numbering(entry.names)
        plan = entry.plans.get(numbering)
        if plan is None:
            built = next(iter(entry.plans.values()))
            skeleton = self._skeleton(block_index, rank_class, recipe, spans)[0]
            plan = entry.plans[numbering] = Plan(skeleton, built.seconds, built.totals)
            grown(recipe, shelf, plan)
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
        self, block_index: int, rank_class: int, recipe: Recipe, spans: tuple | None
    ) -> tuple[Plan, tuple[tuple[str, ...], tuple[str, ...]]]:
        """The plan: its skeleton (kept across systems) and its seconds on this system; and the names its numbering
        numbers (`Cached.names`)."""
        seconds = sums(np.array(self._pricer.durations(block_index, rank_class)), recipe.code)
        skeleton, names = self._skeleton(block_index, rank_class, recipe, spans)
        return Plan(skeleton, seconds, seconds[len(seconds) - len(skeleton.totals) :].tolist()), names

    def _skeleton(
        self, block_index: int, rank_class: int, recipe: Recipe, spans: tuple | None
    ) -> tuple[Skeleton, tuple[tuple[str, ...], tuple[str, ...]]]:
        """The skeleton kept for the class's shape (`Form`), numbered as this planner numbers; made if none, and
        kept where plans are (`keeps`)."""
        kept = self.keeps
        key = (self._shape_hash, rank_class) if spans is None else (self._flags, spans)
        form = recipe.forms.get(key) if kept else None
        if form is None or (spans is None and form.shape != self._shape):
            skeleton, streams = self._shaped(block_index, rank_class, recipe)
            names = (streams, recipe.categories)
            numbering = self._numbering(names)
            if kept:
                form = Form(None if spans is not None else self._shape, names, {numbering: skeleton})
                formed(recipe, key, form, len(skeleton.ops))
                SKELETONS.built += 1
            return skeleton, names
        SKELETONS.reused += 1
        numbering = self._numbering(form.names)
        skeleton = form.skeletons.get(numbering)
        if skeleton is None:
            skeleton = form.skeletons[numbering] = renumbered(*next(iter(form.skeletons.items())), numbering)
            recipe.bytes += SKELETON_BYTES_PER_OP * len(skeleton.ops)  # the caller puts the recipe again
        return skeleton, form.names

    def _shaped(self, block_index: int, rank_class: int, recipe: Recipe) -> tuple[Skeleton, tuple[str, ...]]:
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


def _placed(resolved: Resolved) -> list[tuple[int, int, frozenset[int] | None, Recipe]]:
    """`Resolved.places`, found once and kept on it."""
    places = []
    for block_index, rank_class in resolved.origins:
        recipe = resolved.recipes[block_index]
        dims = None
        if not recipe.p2p:
            dims = frozenset([d for key in resolved.spreads[recipe.axes, rank_class][0] for d, _ in key])
        places.append((block_index, rank_class, dims, recipe))
    resolved.places = places
    return places


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
