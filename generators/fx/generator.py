"""The fx generator: a step whose transformer layers are captured from the model's own PyTorch code.

Only the layers' forward and backward blocks come from the captured graphs (`capture`, `lower`); everything the
graphs do not show is the symbolic generator's, assembled by its builder exactly as for a symbolic point: the
embedding and the head, the data-parallel gradient sync (and ZeRO's), the pipeline stages with their sends and
receives and their schedule, the optimizer step and the model states, and ZeRO-3's weight gathers and gradient
reduce-scatters with FSDP's copies (`fsdp`: fully_shard runs in hooks the graph does not show). The builder traces
its own layer as usual; `_CapturedModules` then swaps that layer's forward and backward blocks for the lowered ones
and its saved activation bytes for the captured forward's, so the schedule keeps those activations alive from each
forward call to its backward (liveness memory) as it does a symbolic layer's.

A capture depends on the factory, the model, the tensor- and expert-parallel degrees and sp, the micro-batch's shape and
whether the layer is recomputed (full recompute: captured under activation checkpointing), not on dp, pp, ZeRO,
the schedule or the global batch; it is kept per process (`CAPTURE_CACHE_SIZE`) and reused by every point that
shares those, so a study pays it once per distinct layer shape. Micro-batches above 3 are scaled from the captures
at 2 and 3 (`scaling`), so a sweep over the micro-batch pays at most three captures.
"""

import time
from collections import OrderedDict
from dataclasses import replace

from dse.errors import InfeasibleError
from dse.modelstats import LayerKind, layer_kinds
from dse.spec import DesignPoint
from dse.workload import Workload
from generators.fx.capture import capture_layer
from generators.fx.factories import factory_name, resolve
from generators.fx.fsdp import with_fsdp
from generators.fx.lower import LoweredLayer, lower_backward, lower_forward
from generators.fx.scaling import HIGH, LOW, along_batch
from generators.symbolic.blocks import LayerKey, Modules, split_weight_gradients
from generators.symbolic.generator import WORKLOAD_CACHE_SIZE, _Builder
from generators.symbolic.skeleton import schedule_affinity
from generators.symbolic.tracing import ModuleTracer

CAPTURE_CACHE_SIZE = 32


def unsupported(point: DesignPoint) -> str | None:
    """What of the point the fx generator does not build yet (its captured layer would not stand for it)."""
    p, m = point.parallel, point.model
    checks = {
        "workload.mode": (point.workload.mode == "decode", "train or prefill"),
        "parallel.cp": (p.cp > 1, "1"),
        "parallel.recompute": (p.recompute not in ("none", "full"), "none or full (activation checkpointing)"),
        "parallel.recompute_every": (p.recompute_every > 1, "1"),
        "parallel.tp_comm_overlap": (p.tp_comm_overlap, "false"),
        "parallel.layer_strategies": (any(s != "tp" for s in p.layer_strategies), "every layer tp"),
        "model.family": (m.ssm is not None or m.mla is not None, "a dense or mixture-of-experts transformer"),
    }
    for field, (bad, fix) in checks.items():
        if bad:
            return f"field '{field}': the fx generator does not build this yet; use {fix}, or generator symbolic"
    if m.n_kv_heads % p.tp:
        return (
            f"field 'parallel.tp': {p.tp} would split model.kv_heads={m.n_kv_heads} key/value heads, and the TP plan "
            "splits whole heads; use a tp that divides kv_heads, or generator symbolic (which replicates them)"
        )
    return None


class _CapturedModules(ModuleTracer):
    """The symbolic tracer whose layer blocks are the captured layers', each of its kind."""

    def __init__(self, point: DesignPoint, layers: dict[LayerKind, LoweredLayer]) -> None:
        super().__init__(point)
        self.captured = layers

    def modules(self, keys: list[LayerKey]) -> Modules:
        modules = super().modules(keys)
        blocks = list(modules.blocks)
        layers = {}
        for key, traced in modules.layers.items():
            layer = self.captured[key[0]]
            forward = layer.forward.block
            backward = None if layer.backward is None else layer.backward.block
            # the forward and backward, and the variants some ZeRO-3 schedules run: a forward that finds the
            # weights still gathered, a backward that leaves its gradients unreduced until the step's last
            variants = ((traced.forward, forward), (traced.held_forward, forward))
            variants += ((traced.backward, backward), (traced.unsynced, backward))
            for index, captured in variants:
                if index is not None and captured is not None:
                    blocks[index] = with_fsdp(blocks[index], captured, blocks[index].name)
            if traced.backward_weight is not None:  # a zero-bubble schedule: the backward as its two halves
                assert traced.backward is not None
                halves = split_weight_gradients(blocks[traced.backward])
                for index, half in zip((traced.backward, traced.backward_weight), halves, strict=True):
                    if half is not None:
                        blocks[index] = replace(half, name=blocks[index].name)
            layers[key] = replace(traced, saved_bytes=layer.forward.saved_bytes)
        return replace(modules, blocks=blocks, layers=layers)


class _FxBuilder(_Builder):
    def __init__(self, point: DesignPoint, layers: dict[LayerKind, LoweredLayer]) -> None:
        super().__init__(point)
        self.tracing = _CapturedModules(point, layers)


class FxGenerator:
    """Workloads from a model's PyTorch code (see the module docstring); `last_capture_s` is the capture time of
    the last generation that captured (0 when it reused one), for benchmarks."""

    name = "fx"

    def __init__(self) -> None:
        self._layers: OrderedDict[tuple, LoweredLayer] = OrderedDict()
        self._workloads: OrderedDict[str, Workload] = OrderedDict()
        self.last_capture_s = 0.0

    def generate(self, point: DesignPoint) -> Workload:
        reason = unsupported(point)
        if reason is not None:
            raise InfeasibleError(reason)
        workload = self._workloads.get(point.workload_key)
        if workload is None:
            workload = _FxBuilder(point, self.layers(point)).build()
            self._workloads[point.workload_key] = workload
            if len(self._workloads) > WORKLOAD_CACHE_SIZE:
                self._workloads.popitem(last=False)
        return replace(workload, point_key=point.key)

    def layers(self, point: DesignPoint) -> dict[LayerKind, LoweredLayer]:
        """The lowered layer of each kind the model has (a MoE model's dense first layers and its MoE ones), each
        from the first block of its kind."""
        kinds = layer_kinds(point.model)
        layers, spent = {}, 0.0
        for kind in dict.fromkeys(kinds):
            layers[kind] = self.layer(point, kinds.index(kind))
            spent += self.last_capture_s
        self.last_capture_s = spent
        return layers

    def layer(self, point: DesignPoint, index: int = 0) -> LoweredLayer:
        """The lowered block `index` of the point: captured at its micro-batch up to HIGH, beyond that scaled from
        the captures at LOW and HIGH where they agree in structure (`scaling`), else captured at it."""
        self.last_capture_s = 0.0
        batch = point.workload.micro_batch
        if batch <= HIGH:
            return self._captured(point, batch, index)
        scaled = along_batch(self._captured(point, LOW, index), self._captured(point, HIGH, index), batch)
        return scaled if scaled is not None else self._captured(point, batch, index)

    def _captured(self, point: DesignPoint, batch: int, index: int = 0) -> LoweredLayer:
        """Block `index` captured at micro-batch `batch`, kept by its capture key."""
        p, w = point.parallel, point.workload.model_copy(update={"micro_batch": batch})
        name = factory_name(point.model)
        fuse, recompute, train = w.kernels == "fused", p.recompute == "full", w.mode == "train"
        sp = p.sp and p.tp > 1
        key = (name, point.model.model_dump_json(), index, p.tp, sp, p.ep, batch, w.seq_len, fuse, recompute, train)
        layer = self._layers.get(key)
        if layer is None:
            start = time.perf_counter()
            captured = capture_layer(
                resolve(name), name, point.model, w, p.tp, p.dp, p.sp, recompute, train, p.ep, index
            )
            shape, axes = captured.input_shape, captured.axes
            forward = lower_forward(captured.forward, "layer.forward", axes, shape, fuse)
            backward = None
            if captured.backward is not None:
                backward = lower_backward(captured.backward, captured.forward, "layer.backward", axes, shape, fuse)
            layer = self._layers[key] = LoweredLayer(forward, backward, captured)
            self.last_capture_s += time.perf_counter() - start
            if len(self._layers) > CAPTURE_CACHE_SIZE:
                self._layers.popitem(last=False)
        return layer

    @staticmethod
    def affinity(point: DesignPoint) -> tuple:
        return (point.parallel.tp, point.parallel.sp, point.parallel.ep, *schedule_affinity(point))
