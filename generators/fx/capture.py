"""Capturing one transformer block of a user's model as forward and backward ATen graphs, without a GPU.

The model is built on the meta device (no weights) and run until the block captured is called, which gives the
block's real arguments (rotary tables, masks); the block is tensor-parallelised with DTensor's `parallelize_module`
(torchtitan's LLaMA plan: column-wise q/k/v and w1/w3, row-wise wo and w2, the norms sequence-parallel with `sp`;
a MoE block's MLP by `moe_plan`) over a DeviceMesh (dp, tp), or (dp, ep, tp) with expert parallelism, of a fake
process group of the step's world size, and compiled with an aot_autograd backend that keeps the forward and the
backward graphs instead of compiling them. Its functional collectives (`_c10d_functional.*`) are in the graphs;
attention stays one op (`attention`). Blocks of one kind are alike, so one of each kind is captured and serves
them all (the generator captures the first of each: a MoE model's dense first layers, then its MoE ones).
"""

import inspect
import logging
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.testing._internal.distributed.fake_pg import FakeStore

from dse.errors import DseError
from dse.limits import MAX_WORLD
from dse.modelstats import layer_kinds
from dse.spec import ModelSpec, WorkloadSpec
from generators.fx.attention import fused_attention
from generators.fx.kv_heads import ReplicatedKeyValue, ShardedCache
from generators.fx.layouts import in_names_of
from generators.fx.models.hf import allocate_cache
from generators.fx.moe_plan import moe_plan
from generators.fx.recompute import Checkpointed, needs_checkpoint

# torch warns once per process that a checkpoint's context_fn must not wrap in-place ops: ours wraps the whole
# model block, captured and never run for real, so the warning would only be noise in every evaluator's log.
logging.getLogger("torch._higher_order_ops.wrap").setLevel(logging.ERROR)

_HERE = os.path.dirname(__file__)
"""Frames in this package's own modules are the capture's, not the model's (its models/ subpackage is a model)."""


class CaptureError(DseError):
    """A model the capture cannot handle (data-dependent control flow, an op without a meta kernel, a block the
    TP plan does not fit): the trial fails with the op and the module named."""


@dataclass(frozen=True)
class CapturedLayer:
    """One block's graphs and what the lowering needs to read them."""

    forward: fx.GraphModule
    backward: fx.GraphModule | None
    """None for an inference capture."""
    input_shape: tuple[int, ...]
    """The block input's local shape: the forward placeholder it is, the backward output that is its gradient."""
    axes: dict[str, str]
    """Process-group name -> mesh axis ("tp", "ep", "dp"), for the collectives' `group_name` argument."""
    parameters: int
    """Parameters of the whole model as the factory built it (unsharded)."""


class _BlockCalled(Exception):
    """Stops the model's forward at the block captured, whose arguments have been kept."""


def fake_world(world: int) -> None:
    """A fake default process group (collectives return at once, nothing is sent) of at least `world` ranks.

    It is made of MAX_WORLD ranks (which costs nothing: a mesh makes groups of its own ranks only) and kept:
    DTensor caches sharding decisions by mesh *equality*, in Python and in its C++ dispatch, so a mesh equal to an
    earlier one can be handed that one's process groups, which must stay alive (`axis_of` tells their axis by
    their ranks). A world replaced by a larger one (a smaller one made elsewhere) destroys them: a later mesh equal
    to one of before failed with "Could not resolve the process group"."""
    if dist.is_initialized():
        if dist.get_backend() != "fake":
            raise CaptureError("the fx generator needs a fake process group, but this process has a real one")
        if dist.get_world_size() >= world:
            return
        dist.destroy_process_group()
        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=max(world, MAX_WORLD))


def mesh_of(tp: int, dp: int, ep: int) -> DeviceMesh:
    """The capture's mesh, laid out as the symbolic generator's ranks (tp fastest, then ep, then dp / ep: expert
    parallelism carved from dp, so rank 0's ep group is 0, tp, .. (ep - 1) tp); axes (dp, tp), with ep between."""
    if ep == 1:
        return DeviceMesh("cpu", torch.arange(dp * tp).reshape(dp, tp), mesh_dim_names=("dp", "tp"))
    ranks = torch.arange(dp * tp).reshape(dp // ep, ep, tp)
    return DeviceMesh("cpu", ranks, mesh_dim_names=("dp", "ep", "tp"))


def axis_of(group_name: str, dp: int, tp: int, ep: int = 1) -> str:
    """The mesh axis of a process group, by its ranks: rank 0's tp group is 0..tp-1, its ep group 0, tp, ..
    (ep - 1) tp, its dp group 0, ep tp, 2 ep tp, ..."""
    ranks = dist.get_process_group_ranks(_resolve_process_group(group_name))
    if ranks == list(range(tp)):
        return "tp"
    if ep > 1 and ranks == list(range(0, ep * tp, tp)):
        return "ep"
    if ranks == list(range(0, dp * tp, ep * tp)):
        return "dp"
    raise CaptureError(f"a collective on ranks {ranks}, which are not the tp, ep or dp group of rank 0")


def tp_plan(block: nn.Module, sp: bool, kv_heads: int, ep_mesh: DeviceMesh | None = None) -> dict[str, ParallelStyle]:
    """torchtitan's LLaMA tensor-parallel plan for the submodules the block has (Megatron's layout); the block's
    `kv_heads` key/value heads replicated when the tp ranks outnumber them (`ReplicatedKeyValue`); a MoE block's
    MLP by `moe_plan` (expert parallel too over `ep_mesh`)."""
    names = dict(block.named_modules())
    plan: dict[str, ParallelStyle | partial] = {}
    output = Shard(1) if sp else Replicate()
    moe = "moe" in names
    mlp = () if moe else ("feed_forward",)
    for inner in ("attention.wq", *(f"{m}.{w}" for m in mlp for w in ("w1", "w3"))):
        plan[inner] = ColwiseParallel()
    for inner in ("attention.wk", "attention.wv"):
        plan[inner] = ReplicatedKeyValue(kv_heads)
    if "attention.cache" in names:  # a decoding block's KV cache (generators/fx/models/layers.py's KVCache)
        plan["attention.cache"] = ShardedCache(kv_heads)
    for inner in ("attention.wo", *(f"{m}.w2" for m in mlp)):
        plan[inner] = RowwiseParallel(output_layouts=output)
    # Each branch's input made a replicated DTensor at the branch's entry, so that the input gradients of its
    # column-parallel projections are summed locally and reduced once there (Megatron's f operator), not once each.
    for norm, module in (("attention_norm", "attention"), ("ffn_norm", "moe" if moe else "feed_forward")):
        if sp:
            plan[norm] = SequenceParallel()
        if module != "moe":
            plan[module] = partial(BranchInput, Shard(1) if sp else Replicate())  # made for the module, once named
    plan |= moe_plan(block, ep_mesh, tensor_parallel=True, sp=sp)
    plan, missing = in_names_of(plan, names)
    if missing:
        raise CaptureError(
            f"tensor parallelism needs the LLaMA layout in each block; {type(block).__name__} has no {missing[0]}"
        )
    return {name: style(names[name]) if isinstance(style, partial) else style for name, style in plan.items()}


class BranchInput(PrepareModuleInput):
    """A branch's hidden-state input made a replicated DTensor at its entry, whether it comes positionally
    (torchtitan's `attention(x, freqs_cis)`) or by keyword (Hugging Face's `self_attn(hidden_states=...)`, the
    forward's first parameter); its other inputs (rotary tables, masks) left as they are."""

    def __init__(self, layout: Placement, module: nn.Module) -> None:
        name = next(iter(inspect.signature(module.forward).parameters), "x")
        super().__init__(
            input_layouts=(layout,),
            desired_input_layouts=(Replicate(),),
            input_kwarg_layouts={name: layout},
            desired_input_kwarg_layouts={name: Replicate()},
        )

    def _prepare_input_fn(self, inputs: Any, device_mesh: DeviceMesh) -> Any:
        return (*super()._prepare_input_fn(inputs[:1], device_mesh), *inputs[1:]) if inputs else inputs


def step_inputs(built: nn.Module, name: str, workload: WorkloadSpec) -> tuple[torch.Tensor, ...]:
    """The model's arguments for a step of the workload, on meta: its micro-batch's tokens [batch, seq_len]; in
    decode, gpt-fast's decoding call (`generators.fx.factories`): one new token per sequence [batch, 1] and its
    position [1], the last of the seq_len the model's KV caches hold. A CaptureError when the model's forward does
    not take them."""
    batch = workload.micro_batch
    if workload.mode != "decode":
        return (torch.zeros(batch, workload.seq_len, dtype=torch.long, device="meta"),)
    position = torch.full((1,), workload.seq_len - 1, dtype=torch.long, device="meta")
    inputs = torch.zeros(batch, 1, dtype=torch.long, device="meta"), position
    try:
        inspect.signature(built.forward).bind(*inputs)
    except TypeError:
        raise CaptureError(
            f"model factory '{name}': {type(built).__name__}.forward(tokens) does not take a decoding step's "
            "(tokens, input_pos); give it that signature and a KV cache when built for a decode workload (see "
            "generators/fx/factories.py), or use generator symbolic"
        ) from None
    return inputs


def _block_arguments(model: nn.Module, inputs: tuple[torch.Tensor, ...], index: int) -> tuple[tuple, dict]:
    kept: dict[str, Any] = {}

    def keep(module: nn.Module, args: tuple, kwargs: dict) -> None:
        kept["args"], kept["kwargs"] = args, kwargs
        raise _BlockCalled

    hook = model.layers[index].register_forward_pre_hook(keep, with_kwargs=True)
    try:
        model(*inputs)
    except _BlockCalled:
        pass
    finally:
        hook.remove()
    if "args" not in kept:
        raise CaptureError(f"{type(model).__name__}.forward never called model.layers[{index}]")
    return kept["args"], kept["kwargs"]


def built_on_meta(
    factory: Callable[..., nn.Module], model: ModelSpec, workload: WorkloadSpec, blocks: int = 1
) -> tuple[nn.Module, nn.ModuleList]:
    """The factory's model on the meta device (no weights), with its block stack (`layers`, at least `blocks`)."""
    with torch.device("meta"):
        built = factory(model, workload)
    layers = getattr(built, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) < blocks:
        raise CaptureError(f"{type(built).__name__} has no `layers` (an nn.ModuleList of its blocks) of {blocks}")
    return built, layers


def capture_layer(
    factory: Callable[..., nn.Module],
    name: str,
    model: ModelSpec,
    workload: WorkloadSpec,
    tp: int,
    dp: int,
    sp: bool,
    recompute: str = "none",
    train: bool = True,
    ep: int = 1,
    index: int = 0,
) -> CapturedLayer:
    """Block `index` of `factory(model, workload)`'s stack, tp-way parallel (and its experts ep-way), on a
    micro-batch of the workload; trained, under activation checkpointing with the policy of `recompute`
    (`parallel.recompute`, see `generators.fx.recompute`); without `train`, its forward alone (inference)."""
    fake_world(dp * tp)
    mesh = mesh_of(tp, dp, ep)
    ep_mesh = mesh["ep"] if ep > 1 else None
    graphs: dict[str, fx.GraphModule] = {}
    block: nn.Module | None = None
    try:
        built, layers = built_on_meta(factory, model, workload, index + 1)
        parameters = sum(p.numel() for p in built.parameters())
        block = layers[index]
        with fused_attention():
            args, kwargs = _block_arguments(built, step_inputs(built, name, workload), index)
            x = args[0]
            local = (x.shape[0], x.shape[1] // tp, *x.shape[2:]) if sp and tp > 1 else tuple(x.shape)
            plan = tp_plan(block, sp, model.n_kv_heads, ep_mesh) if tp > 1 else moe_plan(block, ep_mesh)
            if ep > 1 and layer_kinds(model)[index][1] == "moe" and "moe.experts" not in plan:
                raise CaptureError(
                    f"expert parallelism needs each block's experts at `moe.experts` (the layout of "
                    f"generators/fx/models/moe.py); {type(block).__name__} has none"
                )
            if plan:
                parallelize_module(block, mesh["tp"], plan)
            heads = max(model.n_kv_heads, tp) // tp
            allocate_cache(kwargs, index, x.new_empty((x.shape[0], heads, 1, model.d_head)))
            x = torch.empty(local, dtype=x.dtype, device="meta", requires_grad=train)
            checkpointed = train and needs_checkpoint(recompute, regather=sp and tp > 1)
            captured = Checkpointed(block, recompute) if checkpointed else block
            run_compiled(captured, (x, *args[1:]), kwargs, train, graphs)
    except DseError:
        raise
    except Exception as exc:
        raise CaptureError(f"model factory '{name}': {what_failed(exc, block)}") from None
    finally:
        torch._dynamo.reset()
    return captured_graphs(graphs, f"model factory '{name}': the block's", train, local, dp, tp, parameters, ep)


def run_compiled(module: nn.Module, args: tuple, kwargs: dict, train: bool, graphs: dict[str, fx.GraphModule]) -> None:
    """Compile `module` keeping its forward (and in training backward) graph in `graphs`, and run it once: trained,
    backward from its output's sum (a loss's own value when it is one)."""
    torch._dynamo.reset()
    compiled = torch.compile(module, backend=_keeping(graphs), fullgraph=True)
    if not train:
        with torch.no_grad():
            compiled(*args, **kwargs)
        return
    out = compiled(*args, **kwargs)
    (out if out.dim() == 0 else out.sum()).backward()


def captured_graphs(
    graphs: dict[str, fx.GraphModule],
    what: str,
    train: bool,
    local: tuple[int, ...],
    dp: int,
    tp: int,
    parameters: int,
    ep: int = 1,
) -> CapturedLayer:
    """The captured piece, with its collectives' process groups told by axis; a CaptureError naming `what` when a
    graph is missing."""
    if set(graphs) != ({"forward", "backward"} if train else {"forward"}):
        raise CaptureError(f"{what} graphs were not captured ({sorted(graphs)})")
    groups = {n.args[-1] for g in graphs.values() for n in g.graph.nodes if "_c10d_functional" in str(n.target)}
    axes = {group: axis_of(group, dp, tp, ep) for group in groups if isinstance(group, str)}
    return CapturedLayer(graphs["forward"], graphs.get("backward"), local, axes, parameters)


def _keeping(graphs: dict[str, fx.GraphModule]) -> Callable:
    def keep(kind: str) -> Callable:
        def compiler(gm: fx.GraphModule, example_inputs: list) -> Callable:
            graphs[kind] = gm
            return gm.forward

        return compiler

    # an inference graph keeps the in-place updates of its inputs (a KV cache's append) as copies into them
    return aot_autograd(
        fw_compiler=keep("forward"),
        bw_compiler=keep("backward"),
        partition_fn=min_cut_rematerialization_partition,
        keep_inference_input_mutations=True,
    )


def what_failed(exc: BaseException, block: nn.Module | None) -> str:
    """One line: the model's own error (the innermost of dynamo's wrappers: 'Observed exception', 'RuntimeError
    when making fake tensor call'), where in the user's code it arose and the submodule that code is in."""
    chain = [exc]
    while (inner := chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 16:
        chain.append(inner)
    innermost = chain[-1]
    message = next((line.strip() for line in str(innermost).splitlines() if line.strip()), type(innermost).__name__)
    frame = next((f for f in map(_user_frame, chain) if f is not None), None)
    if frame is None:
        return message
    path, line, function = frame
    module = _module_at(block, path, line)
    where = f" in module '{module}'" if module else ""
    return f"{message}{where} ({path.rsplit('/', 1)[-1]}:{line}, {function})"


def _user_frame(exc: BaseException) -> tuple[str, int, str] | None:
    """The innermost frame outside torch: from dynamo's user stack when it tells one, else from the traceback."""
    frames = [(f.filename, f.lineno or 0, f.name) for f in getattr(exc, "real_stack", None) or ()]
    frames = frames or [(f.filename, f.lineno or 0, f.name) for f in traceback.extract_tb(exc.__traceback__)]
    for path, line, function in reversed(frames):
        if "/torch/" not in path and os.path.dirname(path) != _HERE:
            return path, line, function
    return None


def _module_at(block: nn.Module | None, path: str, line: int) -> str:
    """The submodule of the block whose forward holds path:line ('' for the block itself)."""
    if block is None:
        return ""
    for name, module in block.named_modules():
        forward = type(module).forward
        try:
            lines, first = inspect.getsourcelines(forward)
            source = inspect.getsourcefile(forward)
        except (OSError, TypeError):
            continue
        if source == path and first <= line < first + len(lines):
            return name or f"layers.0 ({type(module).__name__})"
    return ""
