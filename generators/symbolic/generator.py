"""Assembling traced blocks and a pipeline schedule into a Workload, and the generator plugin that does it.

Each kind of layer (a mixer and an MLP: attention + dense, MLA + MoE, SSM, ...) is traced once and shared by
every layer, micro-batch and stage that runs it (`tracing`); programs (one per pipeline stage) are sequences of
calls to those blocks in the order of the pipeline schedule (`pipeline`), and each stage holds its model states
and runs its optimizer step (`optimizer`). The trace is recorded once per structure and replayed on the sizes of
later points (`recording`); the pipeline schedule is likewise walked once per shape (`skeleton`).
"""

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import ClassVar, Literal

import numpy as np

from dse.lru import MIB, ByteBoundedLru
from dse.modelstats import model_flops
from dse.serving.steps import step_point
from dse.spec import DesignPoint
from dse.workload import (
    DeferredPrograms,
    ExpertCompute,
    ExpertExchange,
    Program,
    RankLayout,
    Tensor,
    TensorKind,
    Workload,
)
from generators.symbolic.layers import layer_layout
from generators.symbolic.optimizer import ModelStates
from generators.symbolic.pipeline import Pipeline, Stage
from generators.symbolic.skeleton import schedule_affinity
from generators.symbolic.tracing import ModuleTracer


class _Builder:
    """Builds the workload of one point; after `build`, `blocks` are the workload's and `layer_traces` the traced
    layers by `layer_keys`."""

    def __init__(self, point: DesignPoint):
        self.point = point
        self.train = point.workload.mode == "train"
        self.tracing = ModuleTracer(point)

    def build(self) -> Workload:
        point = self.point
        p, m = point.parallel, point.model
        layout = layer_layout(point)
        kinds = self.layer_keys = layout.keys
        modules = self.tracing.modules(kinds)
        self.blocks = list(modules.blocks)
        traced, embedding, head = modules.layers, modules.embedding, modules.head
        self.layer_traces = traced
        self.outside = [embedding, head]
        states = ModelStates(point, self.tracing.tracer, self.tracing.module.itemsize, self.blocks, modules.weights)
        tied_sync = states.tied_sync_blocks(modules.table) if not modules.tied and m.tied_embeddings else {}
        gathers = states.param_gather_blocks([embedding, *traced.values(), head])
        pipeline = Pipeline(
            point, self.tracing.module, self.blocks, traced, embedding, head, layout, tied_sync, gathers
        )

        stages: list[Stage] = []
        states_of: dict[int, tuple[int | None, tuple[Tensor, ...]]] = {}
        """A stage's optimizer block and fixed tensors by the first stage alike in what they follow from
        (`StageLayers.alike`): the middle stages of a pipeline share them."""
        for layers, first, last, held_kinds, alike in layout.stages:
            found = states_of.get(alike)
            if found is None:
                held = [(traced[key], count) for key, count in Counter(held_kinds).items()]
                held += [(embedding, 1)] if first else []
                held += [(head, 1)] if last else []
                optimizer, static = states.optimizer_block(held)
                fixed = [Tensor(kind.value, kind, size) for kind, size in static.items()]
                if not self.train:
                    cache = sum(traced[key].cache_bytes for key in held_kinds)
                    if cache:
                        fixed.append(Tensor("kv_cache", TensorKind.KV_CACHE, cache * point.micro_batches))
                found = states_of[alike] = (optimizer, tuple(fixed))
            stages.append(Stage(layers, *found))
        steady = pipeline.steady_form(stages)
        programs: Sequence[Program]
        if steady is None:
            programs = pipeline.programs(stages, point.micro_batches)
        else:
            programs = DeferredPrograms(p.pp, lambda: pipeline.programs(stages, point.micro_batches))

        axes = [("tp", p.tp), ("cp", p.cp)]
        axes += [("ep", p.ep), ("dp", p.dp // p.ep)] if p.ep > 1 else self.tracing.sharding.axes()
        layout = RankLayout((*axes, ("pp", p.pp)))
        self.blocks[:] = self.tracing.sharding.regrouped(self.blocks, self._backward_gathers())
        class_of = np.arange(layout.world) // (p.tp * p.cp * p.dp)
        return Workload(
            point.key,
            layout,
            self.blocks,
            programs,
            class_of,
            point.workload.tokens if point.workload.mode != "decode" else point.workload.global_batch,
            model_flops(m, point.workload),
            m.dtype,
            steady,
            point.workload.attention_kernel,
            framework_allreduce=point.workload.mode != "train",
            expert_exchange=expert_exchange(point),
            expert_compute=expert_compute(point),
        )

    def _backward_gathers(self) -> set[int]:
        """The blocks of the weight all-gathers that backwards read (`Sharding.regrouped`)."""
        traces = [*self.layer_traces.values(), *self.outside]
        traces += [t.unrecomputed for t in traces if t.unrecomputed is not None]
        return {t.gathers[1] for t in traces if t.gathers[1] is not None}


EXCHANGE_KERNELS: dict[str, Literal["low_latency", "normal"]] = {"decode": "low_latency", "prefill": "normal"}
"""The DeepEP kernels a serving framework runs the MoE all-to-alls of a step with (SGLang's --deepep-mode auto). A
training step has none: Megatron's default dispatcher runs NCCL's all-to-all, and no table times DeepEP's
backward."""
DISPATCH, COMBINE = "dispatch.all_to_all", "experts.w2.all_to_all"
"""The tracer's names for the MoE layer's all-to-alls over ep (generators.symbolic.experts.moe): the dispatched
copies, then the experts' output going back."""


def expert_exchange(point: DesignPoint) -> ExpertExchange | None:
    """The MoE dispatch and combine of a serving step over expert parallelism, or None."""
    m, kernel = point.model, EXCHANGE_KERNELS.get(point.workload.mode)
    if m.moe is None or point.parallel.ep == 1 or kernel is None:
        return None
    return ExpertExchange(kernel, m.hidden, m.moe.top_k, m.moe.experts, m.hidden * m.dtype_bytes, DISPATCH, COMBINE)


EXPERTS, GATE = "experts.", "experts.w1"
"""The tracer's names for the routed experts' ops (generators.symbolic.experts.moe) and for their first GEMM."""


def expert_compute(point: DesignPoint) -> ExpertCompute | None:
    """The routed experts of a serving step, or None. Only gated experts (SwiGLU): the tables time the frameworks'
    gated fused MoE for the shapes of the models they serve. A training step keeps its ops' own prices: no table
    times the backward."""
    m = point.model
    if m.moe is None or m.activation != "swiglu" or point.workload.mode not in EXCHANGE_KERNELS:
        return None
    moe = m.moe
    return ExpertCompute(m.hidden, moe.expert_ffn, moe.experts, moe.top_k, point.parallel.ep, EXPERTS, GATE)


WORKLOAD_CACHE_BYTES = 128 * MIB
"""About 500 of GPT-3 175B's workloads on 1,024 GPUs (~270 KB each as generated), five times issue 36's study."""
WORKLOAD_BYTES_PER_CALL = 40
"""A generated workload's bytes per call it holds (its steady form's when it has one): tracemalloc measured
6,532,732 B for 24 of benchmarks/vs_calculon.py's workloads holding 161,664 calls, skeletons and recordings made
on the way included. Programs built later (DeferredPrograms, ~290 B per call) are not counted."""


def workload_bytes(workload: Workload) -> int:
    """A workload's estimated bytes as generated (WORKLOAD_BYTES_PER_CALL)."""
    programs = workload.steady.programs if workload.steady is not None else workload.programs
    return WORKLOAD_BYTES_PER_CALL * sum(len(program.calls) for program in programs)


class SymbolicGenerator:
    """A workload depends on the model, the workload and the parallel layout, never on the system, so a study
    that sweeps HBM sizes, link bandwidths or topologies prices one generated workload many times. Up to
    WORKLOAD_CACHE_BYTES of them are kept per instance, least recently used out first (an evaluator actor keeps
    its instance across trials); a hit is a shallow copy carrying the new point's key. Cost models only read
    workloads."""

    name = "symbolic"
    unread_fields: ClassVar[Mapping[str, str]] = {
        "model.fx_factory": "it names the model's PyTorch code for the fx generator, while this one builds the "
        "model from its fields; remove it, or use generator fx",
        "model.fx_plan": "it is the fx generator's tensor-parallel plan over the model's PyTorch modules, while this "
        "one builds the model from its fields; remove it, or use generator fx",
    }
    """Fields of a point this generator never reads (dse.interfaces.FieldReadingGenerator): setting one is refused."""

    def __init__(self) -> None:
        self._workloads: ByteBoundedLru[str, Workload] = ByteBoundedLru(
            "workloads", WORKLOAD_CACHE_BYTES, workload_bytes
        )

    def generate(self, point: DesignPoint) -> Workload:
        key = point.workload_key
        workload = self._workloads.get(key)
        if workload is None:
            workload = _Builder(point).build()  # carries this point's key already
            self._workloads.put(key, workload)
            return workload
        return replace(workload, point_key=point.key)

    @staticmethod
    def affinity(point: DesignPoint) -> tuple:
        """A serving point's is its steps' (which share the schedule of one micro-batch per instance)."""
        if point.workload.mode == "serve":
            point = step_point(point, "decode", 1, 1)
        return schedule_affinity(point)


def count_parameters(point: DesignPoint) -> int:
    """Parameters of the model as the generated graph holds them (full, unsharded sizes)."""
    builder = _Builder(point)
    builder.build()
    tr, item = builder.tracing.tracer, builder.tracing.module.itemsize
    total = 0.0
    for key, traced in builder.layer_traces.items():
        total += builder.layer_keys.count(key) * sum(tr.full_bytes(w) for w in traced.params) / item
    tied_copy = "lm_head" if point.model.tied_embeddings else None
    for traced in builder.outside:
        total += sum(tr.full_bytes(w) for w in traced.params if w.name != tied_copy) / item
    return round(total)
