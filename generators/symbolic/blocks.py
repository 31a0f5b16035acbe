"""The blocks a workload is made of: a block from the ops an emitter collected, what tracing one module gives
(`Traced`: its forward, backward, gradient-sync and weight-gather blocks) and all modules of a point (`Modules`),
and the names of layer blocks."""

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from dse.lru import MIB, ByteBoundedLru
from dse.modelstats import LayerKind
from dse.spec import ParallelSpec
from dse.workload import BLOCK_INPUT, Block, OpKind
from generators.symbolic.emitter import Emitter
from generators.symbolic.tensors import STensor


def block_of(name: str, emitter: Emitter, output: int = -1) -> Block:
    """The block of an emitter's ops. Its temporary memory counts the weights all-gathered for it, unless those are
    prefetched: their gather call holds them then (`Traced.gathered_bytes`)."""
    temp = emitter.peak_temp + (0.0 if emitter.prefetch else emitter.gathered_params)
    return Block(name, tuple(emitter.ops), output, temp)


def add_block(blocks: list[Block], name: str, emitter: Emitter, output: int = -1) -> int:
    """Add the block of an emitter's ops to the workload's blocks; its index."""
    blocks.append(block_of(name, emitter, output))
    return len(blocks) - 1


MADE_BLOCK_CACHE_BYTES = 4 * MIB
"""About 5,000 blocks of one or two ops: the pipeline transfers and tied-weight exchanges of many studies."""
MADE_BLOCK_BYTES_PER_OP = 700
"""A made block's bytes per op, as a replayed block's (`recording.BLOCK_BYTES_PER_OP`), its key counted with it."""
_MADE: ByteBoundedLru[tuple, Block] = ByteBoundedLru(
    "made_blocks", MADE_BLOCK_CACHE_BYTES, lambda block: MADE_BLOCK_BYTES_PER_OP * (1 + len(block.ops))
)
"""Per process (an evaluator actor keeps it across trials), least recently used out first."""


def made_block(key: tuple, make: Callable[[], Block]) -> Block:
    """The block `make` makes, made once per key: a small block that a study's points make alike (a pipeline
    transfer of the same bytes, a tied weight's gradient exchange), whose ops' making is most of what it costs a
    point. The key holds everything the block follows from, its numbers with their types."""
    block = _MADE.get(key)
    if block is None:
        block = make()
        _MADE.put(key, block)
    return block


def only_ops(block: Block, kept: list[int], name: str, output: int = -1, temp_bytes: float = 0.0) -> Block:
    """A block of the ops at `kept` (in order); what they waited for outside them is the block's input. output:
    the kept position of its output op."""
    index = {old: new for new, old in enumerate(kept)}
    ops = [
        replace(block.ops[i], deps=tuple(sorted({index.get(d, BLOCK_INPUT) for d in block.ops[i].deps}))) for i in kept
    ]
    return Block(name, tuple(ops), output, temp_bytes)


def split_weight_gradients(block: Block) -> tuple[Block, Block | None]:
    """A backward block as its input-gradient half (B: the ops its output, the input gradient, depends on) and its
    weight-gradient half (W: the rest, the weight-gradient GEMMs and what only they read, such as the
    sequence-parallel regather of their input), for zero-bubble schedules that defer W (Qi et al. 2023). W's ops
    that read B's results read the call's input instead: its call follows B's. None for W when nothing is left
    (a module without an input gradient, the embedding, keeps its backward whole). Sends and receives, and what
    they read, stay in B: their partners on other ranks pair with them in issue order."""
    ops = block.ops
    needed: set[int] = set()
    stack = [i for i, op in enumerate(ops) if op.kind in (OpKind.SEND, OpKind.RECV)]
    stack += [block.output_index] if ops else []
    while stack:
        i = stack.pop()
        if i not in needed:
            needed.add(i)
            stack.extend(d for d in ops[i].deps if d != BLOCK_INPUT)
    if len(needed) == len(ops):
        return block, None
    first = sorted(needed)
    rest = [i for i in range(len(ops)) if i not in needed]
    output = first.index(block.output_index)
    weight = only_ops(block, rest, f"{block.name}.weight", temp_bytes=block.temp_bytes)
    return only_ops(block, first, block.name, output, block.temp_bytes), weight


class GradPiece(NamedTuple):
    """One parameter's gradient reduction over one group: what gradient buckets are packed from
    (`generators.symbolic.buckets`)."""

    category: str
    axis: str
    nbytes: float


@dataclass
class Traced:
    """A module traced once: its forward and backward blocks and what they imply for memory and sync."""

    forward: int
    backward: int | None
    sync: int | None
    saved_bytes: float
    params: list[STensor] = field(default_factory=list)
    cache_bytes: float = 0.0
    """KV cache (or SSM state) bytes one micro-batch of this module holds (inference)."""
    gathers: tuple[int | None, int | None] = (None, None)
    """The blocks of ZeRO-3 weight all-gathers its forward and its backward read, issued ahead of it
    (`weight_gathers`)."""
    gathered_bytes: tuple[float, float] = (0.0, 0.0)
    """Bytes those gathers bring in, held from the gather's start to the end of the call that reads them."""
    unrecomputed: "Traced | None" = None
    """The same layer with a backward that recomputes nothing, for the layers `recompute_every` skips."""
    backward_weight: int | None = None
    """With a zero-bubble schedule, the block of the backward's weight-gradient half (`split_weight_gradients`),
    run later; `backward` is then its input-gradient half."""
    held_for_weight: tuple[float, float] = (0.0, 0.0)
    """Bytes the weight-gradient half keeps alive until it runs: of the saved activations (the rest is freed by the
    input-gradient half), and of what the input-gradient half makes for it (`ModuleTracer.held_for_weight`)."""
    unsynced: int | None = None
    """Its backward without the gradient reduce-scatters, for the micro-batches before the last when gradients
    are reduced once per step (`ModuleTracer.backward_blocks`)."""
    held_forward: int | None = None
    """Its forward without FSDP's copies around the weight gathers, for the micro-batches that find the weights
    still gathered (`ModuleTracer.held_forward`)."""
    post_backward: int | None = None
    """Those gradient reduce-scatters alone, issued after the stage's last backward under pipelining."""
    grad_pieces: tuple[GradPiece, ...] = ()
    """What `sync` reduces, parameter by parameter in the order backward makes the gradients, for gradient
    buckets that span modules (`parallel.grad_bucket_mb`)."""


def block_name(kind: LayerKind) -> str:
    """'layer' for the dense transformer layer (every dense model's only kind), else layer.<mixer>.<mlp>."""
    return "layer" if kind == ("attn", "dense") else f"layer.{kind[0]}.{kind[1]}"


LayerKey = tuple[LayerKind, str, str]
"""A layer's kind, its strategy for the tp ranks, and the previous layer's (whose layout its input comes in)."""


def layer_keys(kinds: list[LayerKind], p: ParallelSpec) -> list[LayerKey]:
    """Per layer, what it is traced for: layers alike in all three share one trace. The embedding hands on in
    the tp layout."""
    cycle = p.layer_strategies or ("tp",)  # `ParallelSpec.layer_strategy`, read once rather than per layer
    strategies = [cycle[i % len(cycle)] for i in range(len(kinds))]
    previous = ["tp", *strategies[:-1]]
    return list(zip(kinds, strategies, previous, strict=True))


def layer_block_name(key: LayerKey) -> str:
    """block_name, marked '.dp' for a layer using the tp ranks as data parallel and '.from_<s>' when its input
    changes layout from the previous layer's strategy s."""
    kind, strategy, previous = key
    name = block_name(kind) + ("" if strategy == "tp" else f".{strategy}")
    return name + ("" if previous == strategy else f".from_{previous}")


@dataclass(frozen=True)
class Modules:
    """What tracing the modules gives (`ModuleTracer.trace_modules`): the workload's first blocks, and the Traced
    of every layer kind, of the embedding and of the head; with `Sym` numbers when recorded on a tape."""

    blocks: list[Block]
    layers: dict[LayerKey, Traced]
    embedding: Traced
    head: Traced
    table: STensor
    """The embedding's token table."""
    tied: bool
    """Whether the head reads that table (tied embeddings on a single stage)."""
    weights: dict[int, tuple[float, bool]] = field(default_factory=dict)
    """By id of each module's weight: its elements on one rank before ZeRO shards it, and whether it is an
    expert's (`optimizer.weight_elements`), recorded on the tape with the trace so that a replay need not size
    them again."""
