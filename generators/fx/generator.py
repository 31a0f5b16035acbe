"""The fx generator: a step whose transformer layers, embedding and head are captured from the model's own PyTorch
code.

The layers' forward and backward blocks come from the captured graphs of one block of each kind the model has (a
MoE model's dense first layers and its MoE ones: `capture`, `lower`), the embedding's and the head's (with the loss)
from those of the model's prologue and epilogue (`ends`); everything the graphs do not show is the symbolic
generator's, assembled by its builder exactly as for a symbolic point: the data-parallel gradient sync (and
ZeRO's), the pipeline stages with their sends and receives and their schedule, the optimizer step and the model
states, and ZeRO-3's weight gathers and gradient reduce-scatters with FSDP's copies (`fsdp`: fully_shard runs in
hooks the graph does not show). The builder traces its own modules as usual; `_CapturedModules` then swaps each
one's forward and backward blocks for the lowered ones and its saved activation bytes for the captured forward's,
so the schedule keeps those activations alive from each forward call to its backward (liveness memory) as it does a
symbolic module's.

A capture depends on the factory, the model, the tensor- and expert-parallel degrees and sp, the micro-batch's
shape and, for a layer, its recompute policy (captured under activation checkpointing with that policy,
`recompute`), not on dp, pp, ZeRO, the schedule or the global batch; it is kept per process (`CAPTURE_CACHE_BYTES`)
and on disk (`disk_cache`: a later process, a Ray worker, reuses it without importing torch), and reused by every
point that shares those, so a study pays it once per distinct shape. Micro-batches above 3 are
scaled from the captures at 2 and 3 (`scaling`), so a sweep over the micro-batch pays at most three captures of each
piece.
"""

import contextlib
import importlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction

from dse.errors import InfeasibleError
from dse.interfaces import ModelDescription
from dse.lru import MIB, ByteBoundedLru
from dse.modelstats import LayerKind, layer_kinds
from dse.point.described import agree
from dse.spec import DesignPoint, ModelSpec, WorkloadSpec
from dse.workload import Block, Workload
from generators.fx import disk_cache
from generators.fx.factories import (
    check,
    describe_models,
    described_sources,
    described_workload,
    factory_name,
    resolve,
)
from generators.fx.fsdp import with_fsdp
from generators.fx.pieces import EPILOGUE, PROLOGUE, CaptureError, LoweredLayer
from generators.fx.scaling import CONTEXTS, along, capture_batches
from generators.symbolic.blocks import LayerKey, Modules, Traced, split_weight_gradients
from generators.symbolic.generator import WORKLOAD_CACHE_BYTES, SymbolicGenerator, _Builder, workload_bytes
from generators.symbolic.tracing import ModuleTracer

CAPTURE_CACHE_BYTES = 64 * MIB
"""About 32 captured layers, as many as were kept by count before."""
PIECE_BYTES_PER_NODE = 7000
"""A kept piece's bytes per node of its graphs: tracemalloc measured 1,902,319 B for tiny-llama's layer at tp 2
under selective recompute (278 nodes, its lowering and the workload built from it included). A piece loaded from
disk holds no graphs: its ops count instead, which overstates it."""


def piece_bytes(piece: LoweredLayer) -> int:
    """A kept piece's estimated bytes (PIECE_BYTES_PER_NODE)."""
    graphs = (piece.captured.forward, piece.captured.backward)
    nodes = sum(len(graph.graph.nodes) for graph in graphs if graph is not None)
    if nodes == 0:
        nodes = sum(len(lowered.block.ops) for lowered in (piece.forward, piece.backward) if lowered is not None)
    return PIECE_BYTES_PER_NODE * nodes


BUILT = "built"
"""The disk cache's marker that a factory built a model (from the sources it records): its pre-flight passed."""
IMBALANCE_DENOMINATOR = 100
"""A routing imbalance is read as a fraction of at most this denominator (1.37 = 137/100) to find the batches at
which the experts' padded capacity is exact."""
LAYER, PLAIN_LAYER = "layer", "layer.plain"
"""The pieces besides the ends (`generators.fx.ends`): a layer, and a layer without recompute."""


def unsupported(point: DesignPoint) -> str | None:
    """What of the point the fx generator does not build yet (its captured layer would not stand for it)."""
    p, m = point.parallel, point.model
    checks = {
        "parallel.cp": (p.cp > 1, "1"),
        "parallel.tp_comm_overlap": (p.tp_comm_overlap, "false"),
        "parallel.layer_strategies": (any(s != "tp" for s in p.layer_strategies), "every layer tp"),
        "model.family": (m.ssm is not None, "a transformer (attention or latent attention, dense or experts)"),
    }
    for field, (bad, fix) in checks.items():
        if bad:
            return f"field '{field}': the fx generator does not build this yet; use {fix}, or generator symbolic"
    return None


@dataclass(frozen=True)
class CapturedPieces:
    """A point's captured pieces, lowered: a layer of each kind, the model's prologue (the embedding) and its
    epilogue (the final norm, the output projection and the loss)."""

    layers: dict[LayerKind, LoweredLayer]
    prologue: LoweredLayer
    epilogue: LoweredLayer
    plain_layers: dict[LayerKind, LoweredLayer] | None = None
    """With `recompute_every` > 1, the layers captured without recompute, for the layers the policy skips."""


def _swapped(
    blocks: list[Block], traced: Traced, lowered: LoweredLayer, done: set[int], decode: bool = False
) -> Traced:
    """A symbolic module's blocks in `blocks` replaced by the lowered ones: the forward and backward, and the variants
    some ZeRO-3 schedules run (a forward that finds the weights still gathered, a backward that leaves its gradients
    unreduced until the step's last), each with the symbolic block's FSDP ops; its saved activations the
    captured forward's, and in `decode` its KV cache the state the captured forward updates (a prefill's model
    writes no cache, so its cache stays the symbolic module's). `done`: the blocks already swapped (a layer and its
    unrecomputed variant share their forward), which it adds to."""
    forward = lowered.forward.block
    backward = None if lowered.backward is None else lowered.backward.block
    variants = ((traced.forward, forward), (traced.held_forward, forward))
    variants += ((traced.backward, backward), (traced.unsynced, backward))
    for index, captured in variants:
        if index is not None and captured is not None and index not in done:
            blocks[index] = with_fsdp(blocks[index], captured, blocks[index].name)
            done.add(index)
    if traced.backward_weight is not None:  # a zero-bubble schedule: the backward as its two halves
        assert traced.backward is not None
        halves = split_weight_gradients(blocks[traced.backward])
        for index, half in zip((traced.backward, traced.backward_weight), halves, strict=True):
            if half is not None:
                blocks[index] = replace(half, name=blocks[index].name)
    cache = lowered.forward.state_bytes if decode else traced.cache_bytes
    return replace(traced, saved_bytes=lowered.forward.saved_bytes, cache_bytes=cache)


class _CapturedModules(ModuleTracer):
    """The symbolic tracer whose layer (each of its kind), embedding and head blocks are the captured pieces'."""

    def __init__(self, point: DesignPoint, pieces: CapturedPieces) -> None:
        super().__init__(point)
        self.pieces = pieces

    def modules(self, keys: list[LayerKey]) -> Modules:
        modules = super().modules(keys)
        blocks, done, pieces = list(modules.blocks), set(), self.pieces
        decode = self.point.workload.mode == "decode"
        layers = {}
        for key, traced in modules.layers.items():
            layers[key] = _swapped(blocks, traced, pieces.layers[key[0]], done, decode)
            if traced.unrecomputed is not None:
                assert pieces.plain_layers is not None
                plain = _swapped(blocks, traced.unrecomputed, pieces.plain_layers[key[0]], done)
                layers[key] = replace(layers[key], unrecomputed=plain)
        embedding = _swapped(blocks, modules.embedding, pieces.prologue, done)
        head = _swapped(blocks, modules.head, pieces.epilogue, done)
        return replace(modules, blocks=blocks, layers=layers, embedding=embedding, head=head)


class _FxBuilder(_Builder):
    def __init__(self, point: DesignPoint, pieces: CapturedPieces) -> None:
        super().__init__(point)
        self.tracing = _CapturedModules(point, pieces)


def _capture_batches(point: DesignPoint, piece: str, index: int) -> tuple[int, int]:
    """The micro-batches a piece is scaled from (`scaling.capture_batches`): a MoE layer's by its experts' capacity
    on the tokens of a sequence the rank routes (one in decode, a sequence shard under SP), padded by the routing's
    imbalance (`generators.fx.routing.capacity`: exact where imbalance x tokens x top_k / experts is whole)."""
    m, w, p = point.model, point.workload, point.parallel
    if piece not in (LAYER, PLAIN_LAYER) or m.moe is None or layer_kinds(m)[index][1] != "moe":
        return capture_batches(1)
    tokens = 1 if w.mode == "decode" else w.seq_len // (p.tp if p.sp else 1)
    skew = Fraction(w.routing.imbalance).limit_denominator(IMBALANCE_DENOMINATOR)
    return capture_batches(tokens * skew.numerator, m.moe.experts * skew.denominator, m.moe.top_k)


def _agree(point: DesignPoint) -> None:
    """The fields the point gives agree with the model its factory builds (`dse.point.described.agree`): a point
    made without a file (a test's, an API caller's) is held to what a loaded one is. Described here, once per
    model (a loaded point's description is known already)."""
    name, model = factory_name(point.model), point.model.model_dump(mode="json")
    (done,) = describe_models([(name, model, described_workload(point.workload))], here=True)
    agree(point.model.model_dump(mode="json", exclude_unset=True), ModelDescription(name, **done))


class FxGenerator:
    """Workloads from a model's PyTorch code (see the module docstring); `last_capture_s` is the capture time of
    the last generation that captured (0 when it reused one), for benchmarks."""

    name = "fx"

    def __init__(self) -> None:
        self._pieces: ByteBoundedLru[tuple, LoweredLayer] = ByteBoundedLru(
            "fx pieces", CAPTURE_CACHE_BYTES, piece_bytes
        )
        self._workloads: ByteBoundedLru[str, Workload] = ByteBoundedLru(
            "fx workloads", WORKLOAD_CACHE_BYTES, workload_bytes
        )
        self.last_capture_s = 0.0

    def generate(self, point: DesignPoint) -> Workload:
        reason = unsupported(point)
        if reason is not None:
            raise InfeasibleError(reason)
        workload = self._workloads.get(point.workload_key)
        if workload is None:
            _agree(point)
            self.last_capture_s = 0.0
            pieces = CapturedPieces(
                self._layers(point, LAYER), *(self._piece(point, end) for end in (PROLOGUE, EPILOGUE))
            )
            p = point.parallel
            if p.recompute_every > 1 and p.recompute != "none":
                pieces = replace(pieces, plain_layers=self._layers(point, PLAIN_LAYER))
            workload = _FxBuilder(point, pieces).build()
            self._workloads.put(point.workload_key, workload)
        return replace(workload, point_key=point.key)

    def layer(self, point: DesignPoint, index: int = 0) -> LoweredLayer:
        """The lowered block `index` of the point's layer stack."""
        self.last_capture_s = 0.0
        return self._piece(point, LAYER, index)

    def _layers(self, point: DesignPoint, piece: str) -> dict[LayerKind, LoweredLayer]:
        """The lowered layer (LAYER or PLAIN_LAYER) of each kind the model has, from the first block of its kind."""
        kinds = layer_kinds(point.model)
        return {kind: self._piece(point, piece, kinds.index(kind)) for kind in dict.fromkeys(kinds)}

    def _piece(self, point: DesignPoint, piece: str, index: int = 0) -> LoweredLayer:
        """The lowered piece (LAYER, PLAIN_LAYER with block `index`; PROLOGUE, EPILOGUE) of the point: a decoding
        layer at a context beyond CONTEXTS from the line through it at those (`scaling`), and at each context by
        `_at_batch`."""
        w = point.workload
        if w.mode == "decode" and piece in (LAYER, PLAIN_LAYER) and w.seq_len > CONTEXTS[1]:
            at = (point.model_copy(update={"workload": w.model_copy(update={"seq_len": c})}) for c in CONTEXTS)
            low, high = (self._at_batch(p, piece, index) for p in at)
            scaled = along(low, high, w.seq_len, CONTEXTS, "keys")
            if scaled is not None:
                return scaled
        return self._at_batch(point, piece, index)

    def _at_batch(self, point: DesignPoint, piece: str, index: int) -> LoweredLayer:
        """The piece at the point's micro-batch: captured up to the larger of its `capture_batches`, beyond that
        scaled from the captures at those where they agree in structure (`scaling`), else captured at it."""
        batch, batches = point.workload.micro_batch, _capture_batches(point, piece, index)
        if batch <= batches[1]:
            return self._captured(point, batch, piece, index)
        low, high = (self._captured(point, b, piece, index) for b in batches)
        scaled = along(low, high, batch, batches)
        return scaled if scaled is not None else self._captured(point, batch, piece, index)

    def _captured(self, point: DesignPoint, batch: int, piece: str, index: int = 0) -> LoweredLayer:
        """The piece captured at micro-batch `batch`, kept by its capture key (the ends' without the recompute
        policy, which only a layer is captured under; the plain layer's is the layer's without recompute) in this
        process and on disk (`disk_cache`, with the model's sources), where another process finds it."""
        p, w = point.parallel, point.workload
        layer = piece in (LAYER, PLAIN_LAYER)
        recompute = p.recompute if piece == LAYER else "none"  # the ends are never recomputed
        ep = p.ep if layer else 1  # the ends hold no experts
        # a decoding step's ends see one token per sequence and no cache: one capture serves every context
        context = None if w.mode == "decode" and not layer else w.seq_len
        name, model = factory_name(point.model), point.model.model_dump_json()
        key = (LAYER if layer else piece, name, model, index, p.tp, p.sp and p.tp > 1, ep)
        key += (batch, context, w.kernels == "fused", recompute, w.mode, w.routing.imbalance if layer else None)
        lowered = self._pieces.get(key) or disk_cache.load(key)
        if lowered is None:
            start = time.perf_counter()
            lowered, sources = _capture(point, batch, piece, index, recompute)
            self.last_capture_s += time.perf_counter() - start
            captured = replace(lowered.captured, forward=None, backward=None)  # graphs do not pickle
            disk_cache.store(key, replace(lowered, captured=captured), sources)
            disk_cache.store((BUILT, name, model), True, sources)
        self._pieces.put(key, lowered)
        return lowered

    @staticmethod
    def affinity(point: DesignPoint) -> tuple:
        """The symbolic generator's (a serving point's is its steps'), after the captures' tp, sp and ep."""
        return (point.parallel.tp, point.parallel.sp, point.parallel.ep, *SymbolicGenerator.affinity(point))

    @staticmethod
    def preflight(points: Sequence[DesignPoint]) -> None:
        """Each model factory the points name imports and builds its model (dse.interfaces.PreflightGenerator),
        checked in a child process: a factory that cannot would otherwise fail every point. Not checked again
        when an earlier capture built each model from the same sources (`disk_cache`); while the child runs, this
        process imports what capturing needs (torch, torch.compile: seconds each), which it is about to."""
        models = {(factory_name(p.model), p.model.model_dump_json()) for p in points}
        if all(disk_cache.load((BUILT, *model)) for model in models):
            return
        importing = threading.Thread(target=_import_capturing, name="fx-import", daemon=True)
        importing.start()
        try:
            check(points)
        finally:
            importing.join()


def _import_capturing() -> None:
    """Imports the capture's modules; a failure is left to their import where they are used, which reports it."""
    with contextlib.suppress(Exception):
        for module in ("generators.fx.ends", "generators.fx.lower"):
            importlib.import_module(module)


def _capture(point: DesignPoint, batch: int, piece: str, index: int, recompute: str) -> tuple[LoweredLayer, list[str]]:
    """The piece captured and lowered at micro-batch `batch`, and the source files of the model it came from."""
    # torch, imported only on a capture: a process whose pieces are all on disk never pays its import
    from generators.fx.capture import capture_layer
    from generators.fx.ends import capture_end
    from generators.fx.lower import lower_backward, lower_forward

    p, w = point.parallel, point.workload.model_copy(update={"micro_batch": batch})
    name, fuse, train = factory_name(point.model), w.kernels == "fused", w.mode == "train"
    factory, layer = resolve(name), piece in (LAYER, PLAIN_LAYER)
    if layer:
        captured = capture_layer(factory, name, point.model, w, p.tp, p.dp, p.sp, recompute, train, p.ep, index)
    else:
        captured = capture_end(piece, factory, name, point.model, w, p.tp, p.dp, p.sp, train)
    shape, axes = captured.input_shape, captured.axes
    label = LAYER if layer else piece
    assert captured.forward is not None
    forward = lower_forward(captured.forward, f"{label}.forward", axes, shape, fuse)
    if layer and w.mode == "decode" and not forward.state_bytes:
        raise CaptureError(
            f"model factory '{name}': its block updates no KV cache when decoding; build the model with one "
            "for a decode workload (see generators/fx/factories.py), or use generator symbolic"
        )
    backward = None
    if captured.backward is not None:
        backward = lower_backward(captured.backward, captured.forward, f"{label}.backward", axes, shape, fuse)
    return LoweredLayer(forward, backward, captured), _model_sources(name, point.model, w)


def _model_sources(name: str, model: ModelSpec, workload: WorkloadSpec) -> list[str]:
    """The files the factory's model comes from (`disk_cache.model_sources`): for a training step those of its
    description when this process built it (the same build: `factories.described_sources`), else from the model
    built on meta once per process for each model and mode (a decoding model holds its caches' modules)."""
    if workload.mode == "train":
        request = (name, model.model_dump(mode="json"), described_workload(workload))
        if (described := described_sources(request)) is not None:
            return described
    key = (name, model.model_dump_json(), workload.mode)
    if key not in _SOURCES:
        import torch

        factory = resolve(name)
        with torch.device("meta"):
            _SOURCES[key] = disk_cache.model_sources(factory, factory(model, workload))
    return _SOURCES[key]


_SOURCES: dict[tuple[str, str, str], list[str]] = {}
