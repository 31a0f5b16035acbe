"""The fx generator: a step whose transformer layers are captured from the model's own PyTorch code.

Only the layers' forward and backward blocks come from the captured graphs (`capture`, `lower`); everything the
graphs do not show is the symbolic generator's, assembled by its builder exactly as for a symbolic point: the
embedding and the head, the data-parallel gradient sync (and ZeRO's), the pipeline stages with their sends and
receives and their schedule, the optimizer step and the model states, and ZeRO-3's weight gathers and gradient
reduce-scatters with FSDP's copies (`fsdp`: fully_shard runs in hooks the graph does not show). The builder traces
its own layer as usual; `_CapturedModules` then swaps that layer's forward and backward blocks for the lowered ones
and its saved activation bytes for the captured forward's, so the schedule keeps those activations alive from each
forward call to its backward (liveness memory) as it does a symbolic layer's.

A capture depends on the factory, the model, the tensor-parallel degree and sp, the micro-batch's shape and
its recompute policy (captured under activation checkpointing with that policy, `recompute`), not on dp, pp, ZeRO,
the schedule or the global batch; it is kept per process (`CAPTURE_CACHE_SIZE`) and reused by every point that
shares those, so a study pays it once per distinct layer shape. Micro-batches above 3 are scaled from the captures
at 2 and 3 (`scaling`), so a sweep over the micro-batch pays at most three captures.
"""

import time
from collections import OrderedDict
from dataclasses import replace

from dse.errors import InfeasibleError
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
        "parallel.ep": (p.ep > 1, "1"),
        "parallel.recompute_every": (p.recompute_every > 1, "1"),
        "parallel.tp_comm_overlap": (p.tp_comm_overlap, "false"),
        "parallel.layer_strategies": (any(s != "tp" for s in p.layer_strategies), "every layer tp"),
        "model.family": (m.moe is not None or m.ssm is not None or m.mla is not None, "a dense transformer"),
    }
    for field, (bad, fix) in checks.items():
        if bad:
            return f"field '{field}': the fx generator does not build this yet; use {fix}, or generator symbolic"
    return None


class _CapturedModules(ModuleTracer):
    """The symbolic tracer whose layer blocks are the captured layer's."""

    def __init__(self, point: DesignPoint, layer: LoweredLayer) -> None:
        super().__init__(point)
        self.layer = layer

    def modules(self, keys: list[LayerKey]) -> Modules:
        modules = super().modules(keys)
        blocks = list(modules.blocks)
        layers = {}
        forward = self.layer.forward.block
        backward = None if self.layer.backward is None else self.layer.backward.block
        for key, traced in modules.layers.items():
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
            layers[key] = replace(traced, saved_bytes=self.layer.forward.saved_bytes)
        return replace(modules, blocks=blocks, layers=layers)


class _FxBuilder(_Builder):
    def __init__(self, point: DesignPoint, layer: LoweredLayer) -> None:
        super().__init__(point)
        self.tracing = _CapturedModules(point, layer)


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
            workload = _FxBuilder(point, self.layer(point)).build()
            self._workloads[point.workload_key] = workload
            if len(self._workloads) > WORKLOAD_CACHE_SIZE:
                self._workloads.popitem(last=False)
        return replace(workload, point_key=point.key)

    def layer(self, point: DesignPoint) -> LoweredLayer:
        """The lowered layer of the point: captured at its micro-batch up to HIGH, beyond that scaled from the
        captures at LOW and HIGH where they agree in structure (`scaling`), else captured at it."""
        self.last_capture_s = 0.0
        batch = point.workload.micro_batch
        if batch <= HIGH:
            return self._captured(point, batch)
        scaled = along_batch(self._captured(point, LOW), self._captured(point, HIGH), batch)
        return scaled if scaled is not None else self._captured(point, batch)

    def _captured(self, point: DesignPoint, batch: int) -> LoweredLayer:
        """The layer captured at micro-batch `batch`, kept by its capture key."""
        p, w = point.parallel, point.workload.model_copy(update={"micro_batch": batch})
        name = factory_name(point.model)
        fuse, recompute, train = w.kernels == "fused", p.recompute, w.mode == "train"
        key = (name, point.model.model_dump_json(), p.tp, p.sp and p.tp > 1, batch, w.seq_len, fuse, recompute, train)
        layer = self._layers.get(key)
        if layer is None:
            start = time.perf_counter()
            captured = capture_layer(resolve(name), name, point.model, w, p.tp, p.dp, p.sp, recompute, train)
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
        return (point.parallel.tp, point.parallel.sp, *schedule_affinity(point))
