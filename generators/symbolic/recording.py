"""Module traces recorded once per structure and replayed on the sizes of later points (`tape`).

A trace is a structure (layouts, collectives, the derived backward) with numbers made of the point's sizes. It is
recorded once per model family, parallel layout and kind of step (`trace_structure`), over the sizes (the model's
widths among them) and the tp, ep and dp degrees, and later points of that structure replay the recording with
their own: the walk runs once, the arithmetic per point. A comparison the trace made on sizes is a guard; a point
for which one comes out otherwise is traced anew, and its recording kept beside the first.
"""

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from operator import itemgetter
from typing import Any

from dse.fields import Spec
from dse.lru import MIB, ByteBoundedLru
from dse.spec import DesignPoint, MLASpec, ModelSpec, MoESpec, SSMSpec, canonical
from dse.workload import AttentionShape, Block, Op
from generators.symbolic.blocks import GradPiece, LayerKey, Modules, Traced
from generators.symbolic.experts import regroups_slots
from generators.symbolic.sharding import Sharding
from generators.symbolic.tape import Sym, Tape

SHAPE_SIZES = ("queries", "keys", "head_dim", "batch", "heads", "kv_heads")
"""The sizes of an AttentionShape (its flags are structure)."""


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class BlockStructure:
    """What a recorded block is besides its numbers (its name, output, its ops' names, kinds, axes, peers, deps
    and attention flags, and which of its distinct numbers each of their fields reads): blocks of different
    recordings that are alike in it share the blocks they replay to (`_replayed_block`). One object per distinct
    structure alive (`of`), so that keys compare it by identity."""

    key: tuple

    @staticmethod
    def of(key: tuple) -> "BlockStructure":
        structure = _STRUCTURES.get(key)
        if structure is None:
            structure = _STRUCTURES[key] = BlockStructure(key)
        return structure


_STRUCTURES: "weakref.WeakValueDictionary[tuple, BlockStructure]" = weakref.WeakValueDictionary()
"""The block structures of the recordings and replayed blocks alive, by their key."""


@dataclass
class Recording:
    """Modules traced with recording sizes (`Sym` numbers), their tape, and per block the slot of every number
    its ops carry (constants have slots too), so that a replay's values make the blocks without a type test
    per field."""

    tape: Tape
    modules: Modules
    shards: bool | None = None
    """Which side of ZeRO's split the modules are of, for a training trace below ZeRO 3: reduce-scattered
    gradients (ZeRO 1 and 2) or all-reduced ones (ZeRO 0); None for a trace that does not depend on it."""
    other: Modules | None = None
    """The other side's modules, recorded on the same tape by the same walk (`tracing.ZeroSibling`), if any."""
    blocks: list[tuple[BlockStructure, Callable[[list], tuple], int, tuple[tuple, ...]]] = field(init=False)
    """Per block: its structure, the getter of its numbers from a replay's values (every distinct slot its ops
    read, after its working memory's; that slot again last, so that the getter makes a tuple even of a block
    without ops), the slot of its working memory and its ops with slots for numbers (`_replayed_block`)."""
    other_blocks: list[tuple[BlockStructure, Callable[[list], tuple], int, tuple[tuple, ...]]] | None = field(
        init=False
    )
    """`blocks` of the other side (those alike shared), if any."""

    def __post_init__(self) -> None:
        self.blocks = [self._slots(b) for b in self.modules.blocks]
        self.other_blocks = None
        if self.other is not None:
            self.other_blocks = [
                own if block is mine else self._slots(block)
                for block, mine, own in zip(self.other.blocks, self.modules.blocks, self.blocks, strict=True)
            ]

    def serves(self, shards: bool | None) -> bool:
        """Whether the recording replays to the modules of that side of ZeRO's split (see `shards`)."""
        return self.shards is None or shards == self.shards or self.other is not None

    def _slots(self, b: Block) -> tuple[BlockStructure, Callable[[list], tuple], int, tuple[tuple, ...]]:
        """A block's entry of `blocks`."""
        slot = self.tape.slot
        ops = tuple(
            (
                op.name,
                op.kind,
                op.category,
                slot(op.flops),
                slot(op.bytes),
                slot(op.density),
                slot(op.comm_bytes),
                op.axis,
                op.peer,
                op.deps,
                slot(op.out_bytes),
                None if op.attention is None else self._shape_slots(op.attention),
                None if op.gemm is None else tuple(slot(x) for x in op.gemm),
            )
            for op in b.ops
        )
        temp = slot(b.temp_bytes)
        slots = [temp]
        for _, _, _, f, by, d, m, _, _, _, o, a, g in ops:
            slots += [f, by, d, m, o]
            slots += [] if a is None else [getattr(a, name) for name in SHAPE_SIZES]
            slots += [] if g is None else g
        # a block's ops read the same few numbers many times (an op's bytes, a shape's sizes): the key holds each
        # slot once, and the structure which fields read which, so that a lookup hashes and compares a quarter
        distinct = list(dict.fromkeys(slots))
        place = {s: i for i, s in enumerate(distinct)}
        structure = BlockStructure.of(
            (
                b.name,
                b.output,
                tuple(
                    (
                        n,
                        k,
                        c,
                        ax,
                        pe,
                        de,
                        None if a is None else a._replace(**dict.fromkeys(SHAPE_SIZES)),
                        None if g is None else len(g),
                    )
                    for n, k, c, _, _, _, _, ax, pe, de, _, a, g in ops
                ),
                tuple([place[s] for s in slots]),
            )
        )
        return structure, itemgetter(*distinct, temp), temp, ops

    def _shape_slots(self, shape: AttentionShape) -> AttentionShape:
        """An attention shape with its sizes as slots (its flags are structure, kept as they are)."""
        slot = self.tape.slot
        return shape._replace(**{name: slot(getattr(shape, name)) for name in SHAPE_SIZES})

    def numeric(self, values: list, shards: bool | None = None) -> Modules:
        """The modules (of that side of ZeRO's split, see `shards`) with every recorded number read from `values`
        (a replay of the tape)."""
        v = values
        m, entries = self.modules, self.blocks
        if self.shards is not None and shards != self.shards:
            assert self.other is not None and self.other_blocks is not None
            m, entries = self.other, self.other_blocks

        def num(x: Any) -> Any:
            return v[x.slot] if type(x) is Sym else x

        def traced(t: Traced) -> Traced:
            return replace(
                t,
                saved_bytes=num(t.saved_bytes),
                cache_bytes=num(t.cache_bytes),
                gathered_bytes=(num(t.gathered_bytes[0]), num(t.gathered_bytes[1])),
                held_for_weight=(num(t.held_for_weight[0]), num(t.held_for_weight[1])),
                grad_pieces=tuple([GradPiece(category, axis, num(nbytes)) for category, axis, nbytes in t.grad_pieces]),
                unrecomputed=None if t.unrecomputed is None else traced(t.unrecomputed),
            )

        blocks = [_replayed_block(structure, numbers(v), temp, ops, v) for structure, numbers, temp, ops in entries]
        layers = {key: traced(t) for key, t in m.layers.items()}
        weights = {key: (num(elems), expert) for key, (elems, expert) in m.weights.items()}
        return Modules(blocks, layers, traced(m.embedding), traced(m.head), m.table, m.tied, weights)


def _replayed_block(structure: BlockStructure, numbers: tuple, temp: int, ops: tuple[tuple, ...], v: list) -> Block:
    """The block of a recorded block's structure with these numbers, made once.

    Points of one structure differ in their sizes, but recordings of points that differ in ZeRO stage or
    recompute hold many blocks alike (the forwards, the backwards of unrecomputed layers) whose numbers come out
    equal too, and making a block's ops (frozen dataclasses) is most of a replay. Numbers key the block with
    their types, so that a block holds exactly the numbers (int or float) its own replay makes."""
    key = (structure, numbers, tuple(map(type, numbers)))
    block = _BLOCKS.get(key)
    if block is None:
        block = Block(
            structure.key[0],
            tuple(
                [
                    Op(n, k, c, v[f], v[b], v[d], v[m], ax, pe, de, v[o], _shape_values(a, v), _values(g, v))
                    for n, k, c, f, b, d, m, ax, pe, de, o, a, g in ops
                ]
            ),
            structure.key[1],
            v[temp],
        )
        _BLOCKS.put(key, block)
    return block


BLOCK_CACHE_BYTES = 32 * MIB
"""About 5,000 replayed blocks of GPT-3 175B's layers (~15 ops each)."""
BLOCK_BYTES_PER_OP = 700
"""A replayed block's bytes per op, estimated: an Op (13 slots, ~120 B) with its floats and tuples (~350 B), and
the key's numbers and their types (~2 distinct numbers per op, 32 B each, and the tuples holding them): an upper
bound, kept from when keys held every number an op reads (~7)."""
_BLOCKS: ByteBoundedLru[tuple, Block] = ByteBoundedLru(
    "replayed_blocks", BLOCK_CACHE_BYTES, lambda block: BLOCK_BYTES_PER_OP * (1 + len(block.ops))
)
"""Per process, like the recordings."""


def _shape_values(slots: AttentionShape | None, values: list) -> AttentionShape | None:
    if slots is None:
        return None
    return slots._replace(**{name: values[getattr(slots, name)] for name in SHAPE_SIZES})


def _values(slots: tuple[int, ...] | None, values: list) -> tuple | None:
    """A recorded tuple of numbers (a GEMM's shape) read from a replay's values."""
    return None if slots is None else tuple(values[slot] for slot in slots)


RECORDED_DEGREES = ("tp", "ep", "dp")
"""The parallel degrees a module trace is recorded over (`ModuleTracer.modules`), like the sizes."""


SCHEDULING_FIELDS = ("grad_bucket_mb", "fsdp_prefetch")
"""Parallel fields that decide only when the traced blocks' collectives are issued and how they are packed (the
pipeline's business), not what a module's trace is: points differing in them share recordings."""


MODEL_SIZES: dict[type, tuple[str, ...]] = {
    ModelSpec: ("name", "layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab", "max_seq"),
    MoESpec: ("experts", "expert_ffn", "shared_experts", "first_dense_layers"),
    MLASpec: ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
    SSMSpec: ("expand", "dt_rank", "attention_every"),
}
"""Model fields a module trace reads only as the tracer's sizes (DenseModule), or, for the layer counts and
patterns, through which layer kinds there are: the fields a model family's members differ in."""


def _family(spec: Spec) -> Spec:
    """The spec with its size fields blanked (nested sections too): what members of a family share."""
    update: dict[str, Any] = dict.fromkeys(MODEL_SIZES[type(spec)])
    for name in ("moe", "mla", "ssm"):
        section = getattr(spec, name, None)
        if section is not None:
            update[name] = _family(section)
    return spec.model_copy(update=update)


def family(model: ModelSpec) -> ModelSpec:
    """`_family` of a model, one object per family text seen (`FAMILIES_KEPT`): a study's points are new objects of
    a few models, and a trace structure's key compares its family by identity first, field by field otherwise."""
    text = canonical(model)
    found = _FAMILIES.get(text)
    if found is None:
        if len(_FAMILIES) >= FAMILIES_KEPT:
            _FAMILIES.clear()
        found = _FAMILIES[text] = _family(model)
    return found


FAMILIES_KEPT = 256
_FAMILIES: dict[str, ModelSpec] = {}
"""Per model's canonical text (`dse.spec.canonical`, which a point's workload key has made already), its family."""


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class TraceStructure:
    """A `trace_structure`, one object per distinct structure alive (`of`). Its parts (a model spec among them)
    are slow to hash and compare, and a cache lookup does both several times: a point does them once, finding
    the object, and the recordings are looked up by it, hashed by its digest and compared by identity."""

    key: tuple
    digest: int

    @staticmethod
    def of(key: tuple) -> "TraceStructure":
        structure = _TRACE_STRUCTURES.get(key)
        if structure is None:
            structure = _TRACE_STRUCTURES[key] = TraceStructure(key, hash(key))
        return structure

    def __hash__(self) -> int:
        return self.digest


_TRACE_STRUCTURES: "weakref.WeakValueDictionary[tuple, TraceStructure]" = weakref.WeakValueDictionary()
"""The trace structures of the recordings alive (and of the points being generated), by their key."""


def trace_structure(point: DesignPoint, keys: list[LayerKey]) -> TraceStructure:
    """What a module trace depends on besides the sizes and degrees it is recorded over: the model family and
    the layer kinds there are, the parallel layout but for those degrees, and the kind of step. The model's
    widths, micro-batch size and sequence length are sizes; the few size relations that decide structure are
    named here (grouped-query or not, shared experts or none, a compressed query or a full one)."""
    m, p = point.model, point.parallel
    relations = (
        m.n_kv_heads == m.heads,
        m.moe is not None and m.moe.shared_experts > 0,
        m.mla is not None and m.mla.q_lora_rank is None,
        p.layer_strategy(m.layers - 1),
        p.tp if p.tp_comm_overlap else None,  # TE's overlap splits the layer's TP collectives into tp chunks
        # decided on the recorded degrees outside the tape, so not guarded by it
        regroups_slots(point),
        p.zero == 3 and Sharding.of(p).shard < p.dp,  # FSDP's copies know a shard group narrower than dp
    )
    # ZeRO 1 and 2 shard the same gradient reductions (the stage decides when they run and what is kept: the
    # schedule's and the optimizer's business, not the trace's), and ZeRO 0 all-reduces them instead: below ZeRO
    # 3 one recording holds both sides (`Recording.shards`); so do the fields that only schedule them. Of the
    # pipeline's depth a trace reads only whether there is one (`Sharding.of`, a tied table's copies): pp 8 and 16
    # share recordings
    layout = tuple([(name, _traced_value(name, value)) for name, value in p.__dict__.items() if name not in UNTRACED])
    kinds = tuple(dict.fromkeys(keys))
    return TraceStructure.of((family(m), relations, kinds, layout, point.workload.mode, point.workload.kernels))


UNTRACED = frozenset((*RECORDED_DEGREES, *SCHEDULING_FIELDS))
"""Parallel fields a trace structure leaves out (`trace_structure`): the recorded degrees and the scheduling fields.
Its layout reads the others from the spec's `__dict__` (its fields, in order; the spec is frozen and forbids extra
fields), which pydantic's iteration of the spec filters name by name at several times the cost."""


def _traced_value(name: str, value: Any) -> Any:
    """A parallel field's value as far as a module trace reads it (`trace_structure`)."""
    if name == "zero" and value < 3:
        return 0
    if name == "pp":
        return min(value, 2)
    return value


RECORDING_CACHE_BYTES = 64 * MIB
"""About 400 recordings of GPT-3 175B's layers (~150 KB each)."""
RECORDING_BYTES_PER_STEP = 580
"""A recording's bytes per tape step: a walk of gc referents summed 145-156 KiB for recordings of 260-275 steps
(benchmarks/vs_calculon.py's GPT-3 175B layers: the tape, its values and the modules traced)."""
RECORDING_VARIANTS = 4
"""Recordings kept per structure whose comparisons came out differently (FSDP1's gradient divide factors with dp
4, 8 and 16), so that points alternating between them replay instead of recording again."""
_RECORDINGS: ByteBoundedLru[tuple, list[Recording]] = ByteBoundedLru(
    "recordings",
    RECORDING_CACHE_BYTES,
    lambda variants: RECORDING_BYTES_PER_STEP * sum(len(kept.tape.steps) for kept in variants),
)
"""Per process, like the skeletons."""


def recorded_modules(key: tuple, numbers: dict[str, Any], shards: bool | None) -> Modules | None:
    """The modules of structure `key` and that side of ZeRO's split (`Recording.shards`) replayed on `numbers`
    (sizes and degrees), from the first recording of that structure serving the side whose guards hold for
    them; None if none does."""
    for recording in _RECORDINGS.get(key) or []:
        if recording.serves(shards):
            values = recording.tape.replay(numbers)
            if values is not None:
                return recording.numeric(values, shards)
    return None


def keep_recording(key: tuple, recording: Recording) -> None:
    """Keep a recording of structure `key` for later points, the last RECORDING_VARIANTS of the structure."""
    variants = [*(_RECORDINGS.peek(key) or []), recording][-RECORDING_VARIANTS:]
    _RECORDINGS.put(key, variants)  # put again: its size changed
