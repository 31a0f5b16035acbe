"""The optimizer side of a training step: each module's gradient sync over the data-parallel ranks, the exchange
of a tied weight's gradient between the first and last pipeline stages, and per stage the Adam step with ZeRO's
sharding and the memory of weights, gradients and optimizer states."""

from collections import defaultdict
from dataclasses import replace

from dse.fields import DTYPE_BYTES
from dse.lru import MIB, ByteBoundedLru
from dse.spec import DesignPoint
from dse.workload import BLOCK_INPUT, Block, Op, OpKind, TensorKind
from generators.symbolic.blocks import GradPiece, Traced, add_block, block_of, made_block
from generators.symbolic.dist import DUP, Dist, Partition, gradient_layout
from generators.symbolic.emitter import Emitter
from generators.symbolic.graph import Tracer
from generators.symbolic.sharding import Sharding
from generators.symbolic.tensors import STensor

OPTIMIZER_STATE_BYTES = 12
"""fp32 master weights, Adam momentum and variance per parameter (ZeRO paper's K = 12)."""
ADAM_FLOPS = 12
ADAM_BYTES = 28
"""Per parameter: read the bf16 gradient and the three fp32 states, write the states and the bf16 weight."""
SHARD_AXES = ("cp", "dp", "ep")
"""The axes whose ranks hold the same weights and reduce their gradients, over which ZeRO shards the model
states: the data-parallel ranks and the cp ranks (which split the sequence of the same batch). Megatron-LM
reduces gradients and shards its distributed optimizer over the data-parallel group with context parallelism
(megatron/core/distributed/distributed_data_parallel.py at d98e8a6, ll. 147-149 and 284-290: the buffers of
dense parameters on `intra_dp_cp_group`, from `get_data_parallel_group(with_context_parallel=True)` in
megatron/core/process_groups_config.py ll. 373-378; param_and_grad_buffer.py ll. 701-731 reduce-scatter or
all-reduce each bucket over it), and its expert data-parallel group folds cp in too (parallel_state.py ll.
880-895: world / (expert tp x ep x pp) ranks, cp=1). torchtitan's FSDP mesh is dp_shard x cp
(torchtitan/distributed/parallel_dims.py at b5bcd76, ll. 225-228 and 281, `fsdp = dp_shard * cp`; older
releases named it dp_shard_cp), its routed experts' efsdp = dp_shard x cp x tp / ep."""
TIED_SYNC_TAG = 0
"""The tied-weight gradient exchange's p2p tag: pipeline transfers' tags start at 1 (`Placement.tag`)."""


def is_expert(param: STensor) -> bool:
    d = param.dist("ep")
    return isinstance(d, Partition) and d.dim == "e" and param.name.startswith("experts.")


def gradient_sync(
    tracer: Tracer, name: str, grads: list[tuple[STensor, STensor]], zero: int, synced: set[int]
) -> tuple[Emitter | None, tuple[GradPiece, ...]]:
    """One bucket per collective and axis: the gradient reduction of every parameter of the module (those not in
    `synced`, the ids of parameters a module traced before reduces: a tied weight's), or None if there is none;
    and the same reductions parameter by parameter, in the order backward makes the gradients (`grads`' order),
    for `parallel.grad_bucket_mb`'s buckets.

    Dense weights reduce over every data-parallel rank (dp x ep) and cp, whose tokens also differ; expert
    weights over the ranks that hold the same experts (dp / ep, and cp). With ZeRO the reduction is one
    reduce-scatter over that joint group (`SHARD_AXES`)."""
    tr = tracer
    tr.begin_block([g for _, g in grads])
    for param, grad in grads:
        if id(param) in synced:
            continue
        synced.add(id(param))
        target: dict[str, Dist] = {"tp": gradient_layout(param.dist("tp"))}
        for axis in SHARD_AXES:
            if axis == "ep" and is_expert(param):
                target[axis] = param.dist(axis)
            else:
                target[axis] = DUP if zero == 0 else Partition(param.dims[0])
        tr.redistribute(grad, target, record=False)
    ops = tr.end_block().ops
    pieces = tuple(GradPiece(op.category, op.axis, op.comm_bytes) for op in ops)
    buckets: dict[tuple[str, str], float] = defaultdict(float)
    for op in ops:
        buckets[(op.category, op.axis)] += op.comm_bytes
    if not buckets:
        return None, ()
    merged = Emitter()
    for (category, axis), size in sorted(buckets.items()):
        merged.emit(
            Op(
                f"{name}.grad_sync.{category}",
                OpKind.COLLECTIVE,
                category,
                comm_bytes=size,
                axis=axis,
                deps=(BLOCK_INPUT,),
            )
        )
    return merged, pieces


def weight_elements(tracer: Tracer, w: STensor) -> tuple[float, bool]:
    """Elements of a weight on one rank before ZeRO shards it, and whether it is an expert's."""
    expert = is_expert(w)
    whole = ("dp", "cp") if expert else ("dp", "cp", "ep")  # gathered over them: relayout to DUP on each
    unsharded = STensor(w.name, w.dims, tuple(e for e in w.layout if e[0] not in whole), w.itemsize, w.param)
    return tracer.elems(unsharded), expert


OPTIMIZER_STEP_CACHE_BYTES = 4 * MIB
"""About 1,000 stages' optimizer steps (a key of ~20 weights' sizes, a block of 2-3 ops and a memory dict)."""
OPTIMIZER_STEP_BYTES = 4096
"""A kept step's bytes, estimated: its key's tuples (~20 weights x 4 fields) and the block and dict it keeps."""
_STEPS: ByteBoundedLru[tuple, tuple[Block | None, dict[TensorKind, float]]] = ByteBoundedLru(
    "optimizer_steps", OPTIMIZER_STEP_CACHE_BYTES, lambda _: OPTIMIZER_STEP_BYTES
)
"""Stages' optimizer steps (`ModelStates._step_key`), per process, least recently used out first."""


class ModelStates:
    """The weights, gradients and optimizer states of a point's pipeline stages: their memory, the optimizer step
    over them, and the tied weight's gradient exchange, as blocks added to the workload's `blocks`."""

    def __init__(
        self,
        point: DesignPoint,
        tracer: Tracer,
        itemsize: int,
        blocks: list[Block],
        weights: dict[int, tuple[float, bool]] | None = None,
    ) -> None:
        self.point = point
        self.train = point.workload.mode == "train"
        self.tracer = tracer
        self.itemsize = itemsize
        self.blocks = blocks
        self._weights: dict[int, tuple[float, bool]] = dict(weights or {})
        """By weight id: its elements on one rank before ZeRO shards it, and whether it is an expert's
        (`weight_elements`; those of the traced modules come with them, `Modules.weights`)."""
        self._shared: dict[Block, int] = {}
        """Optimizer blocks added so far: an equal one is reused, so that cost models price it once (the
        optimizer step of pipeline stages that hold alike layers)."""
        self._stages: dict[tuple[tuple[int, int], ...], tuple[int | None, dict[TensorKind, float]]] = {}
        """`optimizer_block`'s answers by the modules asked of (ids and layer counts, in order): the middle stages of
        a pipeline hold the same ones, and summing their weights again is most of a point's optimizer work."""
        self._sizes: dict[int, tuple[tuple[float, bool, type], ...]] = {}
        """By module id: its weights' sizes, with their types (`_step_key`)."""
        self._context: tuple | None = None
        """What of the point shards and prices the weights (`_step_key`), made on first use."""
        p = point.parallel
        self.sharding = Sharding.of(p)
        degrees = {"cp": p.cp, "ep": p.ep, "dp": p.dp // p.ep}
        self._groups = (
            "+".join(a for a in ("cp", "ep", "dp") if degrees[a] > 1),
            "+".join(a for a in ("cp", "dp") if degrees[a] > 1),
        )
        """The groups dense weights (first) and expert weights replicate over, as `_by_group` names them."""

    def _gradient_passes(self) -> list[tuple[str, float, float]]:
        """(name, FLOPs, bytes) per gradient element of the memory-bound passes over the gradient shard before Adam:
        with fp16, unscaling by the loss scale while checking for inf/nan (torch.amp's
        _amp_foreach_non_finite_check_and_unscale_, Megatron's _unscale_main_grads_and_check_for_nan); with
        `workload.grad_clip`, the global norm (a read) and the scaling by the clip coefficient (a read and a
        write). The gradients are read in fp32 there (FSDP's sharded gradients, Megatron's main_grad). The
        all-reduce of the norm over the ranks moves a few bytes and is left out."""
        grad = DTYPE_BYTES["fp32"]
        passes = []
        if self.point.model.dtype == "fp16":
            passes.append(("grad_unscale", 1.0, 2.0 * grad))
        if self.point.workload.grad_clip:
            passes += [("grad_norm", 2.0, grad), ("grad_clip", 1.0, 2.0 * grad)]
        return passes

    def _by_group(self, weights: list[tuple[STensor, int]]) -> dict[str, float]:
        """Elements of the weights (each with the layers that hold it) by the group that replicates them and
        that ZeRO shards them over (`SHARD_AXES`): dense weights over cp x ep x dp, expert weights over cp x dp /
        ep ranks; '' for a group of one rank."""
        by_group: dict[str, float] = defaultdict(float)
        for w, count in weights:
            elems, expert = self._weight(w)
            by_group[self._groups[expert]] += elems * count
        return by_group

    def _emit_param_gathers(
        self, emitter: Emitter, name: str, by_group: dict[str, float], deps: tuple[int, ...]
    ) -> None:
        """ZeRO-1/2's all-gather of the updated weights, one per replica group that has more than one rank."""
        for axis, elems in sorted(by_group.items()):
            if axis:
                emitter.emit(
                    Op(name, OpKind.COLLECTIVE, "all_gather", comm_bytes=elems * self.itemsize, axis=axis, deps=deps)
                )

    def param_gather_blocks(self, modules: list[Traced]) -> dict[int, int]:
        """With `overlap_param_gather` under ZeRO 1 or 2 (Megatron's distributed optimizer), the all-gather of each
        module's updated weights, which Megatron issues bucket by bucket during the next step's forward, just
        ahead of the module that reads them. Priced in one step as its steady state: by the module's forward
        block, a block gathering its weights that the schedule issues ahead of its first forward
        (`walk.walk`); a tied table is gathered once, before its first module (the embedding)."""
        p = self.point.parallel
        if not (self.train and p.overlap_param_gather and p.zero in (1, 2)):
            return {}
        blocks: dict[int, int] = {}
        gathered: set[int] = set()
        for traced in modules:
            weights = [(w, 1) for w in traced.params if id(w) not in gathered]
            gathered |= {id(w) for w, _ in weights}
            emitter = Emitter()
            self._emit_param_gathers(emitter, "params.all_gather", self._by_group(weights), (BLOCK_INPUT,))
            if emitter.ops and traced.forward not in blocks:
                name = self.blocks[traced.forward].name.removesuffix(".forward")
                blocks[traced.forward] = add_block(self.blocks, f"{name}.params_gather", emitter)
        return blocks

    def tied_sync_blocks(self, table: STensor) -> dict[int, int]:
        """With pipeline stages, the first stage's token table and the last stage's LM head are two copies of one
        tied weight: after backward the two stages add up each other's gradient (Megatron's embedding-group
        all-reduce, which over its two ranks moves what one send each way does). By stage, the block doing it."""
        p = self.point.parallel
        if not self.train or p.pp == 1:
            return {}
        size = self._weight(table)[0] * self.itemsize
        blocks = {}
        for stage, peer in ((0, p.pp - 1), (p.pp - 1, 1 - p.pp)):

            def make(peer: int = peer) -> Block:
                emitter = Emitter()
                send = Op(
                    "tied_grad.send", OpKind.SEND, "send", comm_bytes=size, axis="pp", peer=peer, deps=(BLOCK_INPUT,)
                )
                emitter.emit(send)
                emitter.emit(replace(send, name="tied_grad.recv", kind=OpKind.RECV, category="recv", deps=()))
                return block_of("tied_grad_sync", emitter)

            self.blocks.append(made_block(("tied_grad_sync", size, type(size), peer), make))
            blocks[stage] = len(self.blocks) - 1
        return blocks

    def _weight(self, w: STensor) -> tuple[float, bool]:
        """Elements of a weight on one rank before ZeRO shards it, and whether it is an expert's; every layer
        repeats the same weights, and every stage asks of them."""
        found = self._weights.get(id(w))
        if found is None:
            found = self._weights[id(w)] = weight_elements(self.tracer, w)
        return found

    def optimizer_block(self, modules: list[tuple[Traced, int]]) -> tuple[int | None, dict[TensorKind, float]]:
        """The Adam step over this stage's share of the parameters, and the static memory of model states; the
        stage's modules come with how many layers run each (layers of a kind share their weights' STensors).

        A dense weight has dp (x ep) x cp replicas, an expert weight dp / ep x cp; ZeRO shards over the replicas
        (`SHARD_AXES`), or under HSDP over the dp_shard x cp replicas of a shard group. Gradients reduced once per
        step are accumulated unsharded until then (`Sharding.grad_per_step`): the stage holds all of them."""
        key = tuple((id(traced), layers) for traced, layers in modules)
        found = self._stages.get(key)
        if found is None:
            found = self._stages[key] = self._stage_step(modules)
        return found[0], dict(found[1])

    def _stage_step(self, modules: list[tuple[Traced, int]]) -> tuple[int | None, dict[TensorKind, float]]:
        """`optimizer_block` for modules not asked of before in this point: the step made by an earlier point
        whose stage held weights of the same sizes in the same order under the same sharding (`_step_key`), or
        made now; its block added to the workload's (once, `_shared`)."""
        key = self._step_key(modules)
        found = _STEPS.get(key) if key is not None else None
        if found is None:
            found = self._optimizer_block(modules)
            if key is not None:
                _STEPS.put(key, found)
        block, memory = found
        if block is None:
            return None, memory
        index = self._shared.get(block)
        if index is None:
            self.blocks.append(block)
            index = self._shared[block] = len(self.blocks) - 1
        return index, memory

    def _step_key(self, modules: list[tuple[Traced, int]]) -> tuple | None:
        """What a stage's optimizer step follows from: per module, its weights' sizes (with their types) and
        layer count; and what of the point shards and prices them. None when a weight appears twice among the
        modules (a tied table on one stage), which the step counts once: such stages are made each time.

        Points of a study that differ in micro-batch size, recompute or sequence parallelism hold the same
        weights on a rank, and summing them over a stage's modules is most of a point's optimizer work."""
        values = []
        for traced, layers in modules:
            sizes = self._sizes.get(id(traced))
            if sizes is None:
                sizes = tuple([(*found, type(found[0])) for found in map(self._weight, traced.params)])
                self._sizes[id(traced)] = sizes
            values.append((sizes, layers))
        ids = [id(w) for traced, _ in modules for w in traced.params]
        if len(set(ids)) != len(ids):
            return None
        if self._context is None:
            p, sharding = self.point.parallel, self.sharding
            self._context = (
                self.train,
                self.itemsize,
                p.zero,
                p.dp,
                p.ep,
                p.cp,
                p.overlap_param_gather,
                sharding.shard,
                sharding.grad_per_step,
                self._groups,
                tuple(self._gradient_passes()),
            )
        return tuple(values), self._context

    def _optimizer_block(self, modules: list[tuple[Traced, int]]) -> tuple[Block | None, dict[TensorKind, float]]:
        p = self.point.parallel
        sharding = self.sharding
        item = self.itemsize
        local = opt_elems = 0.0
        zero_share = 0.0
        uses: dict[int, list] = {}  # a tied table is one weight of two modules: count each weight once
        for traced, layers in modules:
            for w in traced.params:
                use = uses.get(id(w))
                if use is None:
                    uses[id(w)] = [w, layers]
                else:
                    use[1] += layers
        groups = self._groups
        by_group: dict[str, float] = defaultdict(float)  # `_by_group`, in the same loop
        for w, count in uses.values():
            one, expert = self._weight(w)
            elems = one * count
            local += elems
            zero_share += elems / (p.dp // p.ep if expert else sharding.shard) / p.cp
            by_group[groups[expert]] += elems
        opt_elems = zero_share if p.zero >= 1 else local
        memory = {TensorKind.PARAMETER: (zero_share if p.zero == 3 else local) * item}
        if not self.train:
            return None, memory
        memory[TensorKind.GRADIENT] = (zero_share if p.zero >= 2 and not sharding.grad_per_step else local) * item
        memory[TensorKind.OPTIMIZER_STATE] = opt_elems * OPTIMIZER_STATE_BYTES
        emitter = Emitter()
        ready = (BLOCK_INPUT,)
        for name, flops, nbytes in self._gradient_passes():
            ready = (
                emitter.emit(
                    Op(name, OpKind.COMPUTE, "optimizer", flops=flops * opt_elems, bytes=nbytes * opt_elems, deps=ready)
                ),
            )
        adam = emitter.emit(
            Op(
                "adam",
                OpKind.COMPUTE,
                "optimizer",
                flops=ADAM_FLOPS * opt_elems,
                bytes=ADAM_BYTES * opt_elems,
                deps=ready,
            )
        )
        # ZeRO-1/2: every replica group gathers the updated weights it sharded (experts over dp / ep ranks), here
        # or, overlapped, before each module's first forward of the next step (`param_gather_blocks`)
        if p.zero in (1, 2) and not p.overlap_param_gather:
            self._emit_param_gathers(emitter, "params.all_gather", by_group, (adam,))
        return block_of("optimizer", emitter), memory
