"""Capturing one transformer block of a user's model as forward and backward ATen graphs, without a GPU.

The model is built on the meta device (no weights) and run until the block captured is called, which gives the
block's real arguments (rotary tables, masks); the block is tensor-parallelised with DTensor's `parallelize_module`
(the plan `generators.fx.plans` derives from the block's structure, Megatron's layout: column-parallel Linears
before a nonlinearity or attention, row-parallel after, split by heads, the norms sequence-parallel with `sp`;
a MoE block's MLP by `moe_plan`; the user's styles over it) over a DeviceMesh (dp, tp), or (dp, ep, tp) with
expert parallelism, of a fake process group of the step's world size, and compiled with an aot_autograd backend
that keeps the forward and the backward graphs instead of compiling them. Its functional collectives
(`_c10d_functional.*`) are in the graphs; attention stays one op (`attention`). Blocks of one kind are alike, so
one of each kind is captured and serves them all (the generator captures the first of each: a MoE model's dense
first layers, then its MoE ones).
"""

import contextlib
import inspect
import logging
import os
import sysconfig
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor, Placement, Replicate
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInput, parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore

from dse.errors import DseError
from dse.limits import MAX_WORLD
from dse.modelstats import layer_kinds
from dse.spec import ModelSpec, WorkloadSpec
from generators.fx import plans
from generators.fx.attention import fused_attention
from generators.fx.describe import block_stack
from generators.fx.experts import lay_out_experts, user_routing
from generators.fx.models.hf import allocate_cache
from generators.fx.moe_plan import moe_plan
from generators.fx.pieces import CapturedLayer, CaptureError
from generators.fx.recompute import Checkpointed, rerun_whole_forward
from generators.fx.routing import FixedCapacity, compiled_with

# torch warns once per process that a checkpoint's context_fn must not wrap in-place ops: ours wraps the whole
# model block, captured and never run for real, so the warning would only be noise in every evaluator's log.
logging.getLogger("torch._higher_order_ops.wrap").setLevel(logging.ERROR)
# A model's op that fails on fake tensors is logged by torch with its whole traceback before it is raised; the
# capture reports it in one line naming the model's code (`what_failed`), so the log is only a duplicate.
logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)

_HERE = os.path.dirname(__file__)
"""Frames in this package's own modules are the capture's, not the model's (its models/ subpackage is a model)."""


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


def tp_plan(
    built: nn.Module,
    block: nn.Module,
    model: ModelSpec,
    sp: bool,
    args: tuple,
    kwargs: dict,
    user: dict[str, str],
    ep_mesh: DeviceMesh | None = None,
) -> dict[str, ParallelStyle]:
    """The block's tensor-parallel plan (`generators.fx.plans`): derived from its structure with its real arguments,
    a MoE block's MLP by `moe_plan` (expert parallel too over `ep_mesh`), the `user`'s styles over both."""
    plans.check_patterns(user, built)
    fixed = moe_plan(block, ep_mesh, tensor_parallel=True, sp=sp)
    plan = plans.derived_block_plan(block, args, kwargs, plans.Heads.of(model), sp, fixed, BranchInput)
    prefix = next(name for name, module in built.named_modules() if module is block)
    names = {name: f"{prefix}.{name}" if name else prefix for name, _ in block.named_modules()}
    return plans.overridden(plan, user, names, {}, sp)


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


def _block_arguments(
    model: nn.Module, layers: nn.ModuleList, inputs: tuple[torch.Tensor, ...], index: int
) -> tuple[tuple, dict]:
    kept: dict[str, Any] = {}

    def keep(module: nn.Module, args: tuple, kwargs: dict) -> None:
        kept["args"], kept["kwargs"] = args, kwargs
        raise _BlockCalled

    hook = layers[index].register_forward_pre_hook(keep, with_kwargs=True)
    try:
        model(*inputs)
    except _BlockCalled:
        pass
    finally:
        hook.remove()
    if "args" not in kept:
        raise CaptureError(f"{type(model).__name__}.forward never called its block {index}")
    return kept["args"], kept["kwargs"]


def built_on_meta(
    factory: Callable[..., nn.Module], model: ModelSpec, workload: WorkloadSpec, blocks: int = 1
) -> tuple[nn.Module, nn.ModuleList]:
    """The factory's model on the meta device (no weights), with its block stack (`describe.block_stack`: `layers`,
    else the nn.ModuleList of its blocks, nanoGPT's `transformer.h`; at least `blocks`)."""
    with torch.device("meta"):
        built = factory(model, workload)
    layers = block_stack(built)
    if layers is None or len(layers) < blocks:
        raise CaptureError(f"{type(built).__name__} has no nn.ModuleList of its blocks (at least {blocks})")
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
        imbalance = workload.routing.imbalance
        with fused_attention():
            with FixedCapacity(imbalance):  # the blocks before this one may route by the data
                args, kwargs = _block_arguments(built, layers, step_inputs(built, name, workload), index)
            x = args[0]
            local = (x.shape[0], x.shape[1] // tp, *x.shape[2:]) if sp and tp > 1 else tuple(x.shape)
            found = lay_out_experts(block, args, kwargs, tp > 1 or ep > 1, imbalance)
            routing = user_routing(block, args, kwargs, imbalance)
            user = plans.user_plan(model, factory)
            plan = moe_plan(block, ep_mesh)
            if tp > 1:
                plan = tp_plan(built, block, model, sp, args, kwargs, user, ep_mesh)
            if ep > 1 and layer_kinds(model)[index][1] == "moe" and found is None:
                raise CaptureError(
                    f"expert parallelism needs each MoE block's experts: n identical expert MLPs (an nn.ModuleList, "
                    f"or stacked [n, ...] weights) beside a router to n outputs; {type(block).__name__} has none"
                )
            if plan:
                parallelize_module(block, mesh["tp"], plan)
            heads = max(model.n_kv_heads, tp) // tp
            allocate_cache(kwargs, index, x.new_empty((x.shape[0], heads, 1, model.d_head)))
            x = torch.empty(local, dtype=x.dtype, device="meta", requires_grad=train)
            # a trained block is always captured under checkpointing: its policy decides what the block keeps
            captured = Checkpointed(block, recompute) if train else block
            with compiled_with(routing) if routing else contextlib.nullcontext():
                run_compiled(captured, (x, *args[1:]), kwargs, train, graphs)
            if train and recompute == "full":
                rerun_whole_forward(graphs["forward"], graphs["backward"])
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
            return make_boxed_func(gm.forward)  # AOTAutograd's calling convention: unboxed, it warns on each run

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
    detail = ""
    if "on meta tensors" in message:  # an eager run on meta (the plan's, the routing's) read a value: dynamo's words
        message, detail = "Data-dependent branching", f": {message}; the capture sees shapes, not values"
    elif "is invalid for input of size" in message:  # a view by a width a tensor-parallel rank does not hold
        detail = (
            "; under tensor parallelism a rank's projections hold heads / tp of the heads: view by the module's head "
            "count or -1, not by the input's width or a constant, or give a plan of your own (model.fx_plan)"
        )
    frame = next((f for f in map(_user_frame, chain) if f is not None), None)
    if frame is None:
        return message + detail
    path, line, function = frame
    module = _module_at(block, path, line)
    where = f" in module '{module}'" if module else ""
    shown = os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else path
    return f"{message}{where} ({shown}:{line}, in {function}){detail}"


def _user_frame(exc: BaseException) -> tuple[str, int, str] | None:
    """The innermost frame of the model's code: from dynamo's user stack when it tells one, else from the
    traceback."""
    frames = [(f.filename, f.lineno or 0, f.name) for f in getattr(exc, "real_stack", None) or ()]
    frames = frames or [(f.filename, f.lineno or 0, f.name) for f in traceback.extract_tb(exc.__traceback__)]
    return next((frame for frame in reversed(frames) if _is_models(frame[0])), None)


_STDLIB = sysconfig.get_path("stdlib")


def _is_models(path: str) -> bool:
    """Whether a source file is the model's code: not generated (fx's `<eval_with_key>`, `<string>`), not torch's
    (dynamo's frames are), not this package's (its models/ are models), not the standard library's, and in
    transformers only an architecture's own modeling file (not its decorators, masks and attention dispatch)."""
    if path.startswith("<") or f"{os.sep}torch{os.sep}" in path or os.path.dirname(path) == _HERE:
        return False
    if path.startswith(_STDLIB + os.sep) and "site-packages" not in path:
        return False
    parts = path.split(os.sep)
    if "transformers" in parts[:-1]:
        return os.path.basename(path).startswith("modeling_") and "models" in parts
    return True


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
