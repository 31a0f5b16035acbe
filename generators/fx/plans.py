"""Tensor-parallel plans for any model layout, derived from the model's structure and overridable by the user.

**Derived.** A block is run once, unparallelised, on the meta device with its real arguments, recording the
autograd graph between its nn.Linear modules (each Linear's input walked back to the Linears whose outputs it
reads, through any op that is not a Linear; whether the path crosses an attention op, `scaled_dot_product_attention`
or a softmax). An eager meta run rather than torch.fx or dynamo tracing: it follows whatever Python the block runs
(keyword arguments, Hugging Face's caches and kwargs plumbing, data-independent branches) at the cost of one
forward without any compile, and autograd's graph is the dataflow itself, with no module-call boundaries to
stitch. Megatron's layout follows from it, with no module name read:

- a Linear reading the residual stream (the block's input, through norms and earlier branches' sums) whose output
  only Linears off the stream read is column-parallel; a Linear reading only column-parallel outputs (through the
  branch's own ops: activation, gating, attention) whose output reaches the block's is row-parallel (SwiGLU's gate
  and up, a GeLU MLP's fc, q/k/v or a fused QKV; down, proj, o). Anything else (a router, a lone or chained
  projection) stays replicated;
- column-parallel Linears of an attention branch are split by whole heads (`kv_heads.HeadParallel`): a query
  projection by its heads, a key or value projection of `kv_heads` heads (replicated when the ranks outnumber
  them), a fused QKV of (heads + 2 kv_heads) heads as [q; k; v] per rank; the attention module's own head-count
  and size attributes (and a `config` it reads them from, copied) are set to the rank's, so code that slices the
  fused output by `self.split_size` or `config.num_attention_heads * head_dim` slices the local one;
- torch's nn.MultiheadAttention (nn.TransformerEncoderLayer's), which runs no Linear, is split as a whole by its
  heads (`multihead.MultiheadParallel`);
- each branch's input is made a replicated DTensor once at its entry (Megatron's f: the input gradients of its
  column-parallel Linears summed locally, reduced once): `capture.BranchInput` on the branch's module when one
  norm feeds one branch; when branches share their input (a parallel block with one norm), at that norm's output,
  so the branches share one all-gather (sp) and one input-gradient reduction;
- row-parallel outputs are reduced per branch (an all-reduce, a reduce-scatter under sp); in a parallel block
  (branches side by side, neither reading the other's output: GPT-J, GPT-NeoX, Falcon, PaLM) they are left
  partial sums and the block's residual is a DTensor inside it (`ResidualStream`), so the branches' sum, when
  the code adds them before the residual as those models do, is reduced once (GPT-NeoX's and PaLM's single
  all-reduce; code adding one branch to the residual first gets one reduction per branch, still correct);
- under sp, the block's norms (modules whose parameters are all vectors of the hidden size, outside the branches)
  are sequence-parallel;
- at the ends (`ends_plan`): the token embedding (the largest nn.Embedding: the vocabulary's) vocab-parallel, other
  embeddings (learned positions) sliced along the sequence under sp to meet it, the output head (the Linear onto
  the vocabulary) column-parallel with its logits left sharded, the final norm sequence-parallel under sp.

**The user's.** `model.fx_plan` in the point, and a `TP_PLAN` dict in the factory's module: module-name patterns
(fnmatch, over the model's own names: `layers.*.attn.c_attn`, `*.mlp.c_proj`) -> a style of STYLES. The point's
entries win over the module's; both replace the derived style of the modules they name, and the derived plan
stands for the rest. A style naming what the derived plan already does (colwise on a head-split projection) keeps
the derived refinement; `replicate` leaves a module unsharded. A pattern naming no module of the model is refused.
"""

import copy
import inspect
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from fnmatch import fnmatch
from typing import Any, get_args

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.overrides import TorchFunctionMode

from dse.errors import SpecError
from dse.spec import ModelSpec
from generators.fx.describe import is_norm
from generators.fx.kv_heads import Heads, LocalHeads, ShardedCache
from generators.fx.latent import LatentDown, LocalRows, latent_input
from generators.fx.multihead import multihead_plan

PLAN_FIELD = "model.fx_plan"
STYLES: tuple[str, ...] = get_args(get_args(get_args(ModelSpec.model_fields["fx_plan"].annotation)[0])[1])
"""The style names a user plan may give (the field's)."""
STREAM = ""
"""The block's input in a Linear's feeds: the residual stream."""
MODULE_PLAN = "TP_PLAN"
"""The name of a factory module's plan (a dict of module-name patterns -> styles) beside the factory."""
ATTENTION_OPS = ("scaled_dot_product_attention", "attention.default", "softmax")
"""What an attention computes by (`generators.fx.attention`'s fused op under capture), by the function's name."""


class PlanError(SpecError):
    """A user plan that cannot apply: a style or pattern that names nothing."""


def _under(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(f"{p}.") for p in prefixes)


def _common(names: Iterable[str]) -> str:
    """The deepest module holding all the named ones ('' for the root)."""
    split = [n.split(".")[:-1] for n in names]
    common: list[str] = []
    for parts in zip(*split, strict=False):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    return ".".join(common)


class _Attentions(TorchFunctionMode):
    """Records the autograd nodes of the attention ops' outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes: set[Any] = set()

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") in ATTENTION_OPS and isinstance(out, torch.Tensor) and out.grad_fn:
            self.nodes.add(out.grad_fn)
        return out


@dataclass
class Dataflow:
    """Between a block's Linears, by module name (block-relative)."""

    linears: dict[str, nn.Linear]
    feeds: dict[str, dict[str, bool]] = field(default_factory=dict)
    """Linear -> the Linears whose outputs it reads directly (STREAM: the block's input) -> whether through an
    attention op."""
    exits: set[str] = field(default_factory=set)
    """The Linears whose outputs reach the block's output directly."""
    source: dict[str, str | None] = field(default_factory=dict)
    """Linear -> the (non-Linear) module whose output is its input; '' the block's input; None: neither."""
    attention: bool = False
    """Whether the block computes attention (an op of ATTENTION_OPS ran)."""


def dataflow(block: nn.Module, args: tuple, kwargs: dict, skip: Iterable[str]) -> Dataflow:
    """The block's Linears (but those under `skip`) and the dataflow between them, from one eager run on meta."""
    skip = tuple(skip)
    linears = {n: m for n, m in block.named_modules() if isinstance(m, nn.Linear) and not _under(n, skip)}
    flow = Dataflow(linears)
    outputs: dict[Any, str] = {}
    inputs: dict[str, torch.Tensor] = {}

    def kept_output(name: str, module: nn.Module, given: tuple, out: Any) -> None:
        first = out[0] if isinstance(out, tuple) and out else out
        if isinstance(first, torch.Tensor) and first.grad_fn is not None:
            outputs.setdefault(first.grad_fn, name)  # the innermost module's name: its hook runs first

    def kept_input(name: str, module: nn.Module, given: tuple) -> None:
        inputs[name] = given[0]

    hooks = [m.register_forward_hook(_named(kept_output, n)) for n, m in block.named_modules() if n]
    hooks += [m.register_forward_pre_hook(_named(kept_input, n)) for n, m in linears.items()]
    x = args[0].detach().requires_grad_(True)
    try:
        with torch.enable_grad(), _Attentions() as attentions:
            out = block(x, *args[1:], **copy.deepcopy(kwargs))
    finally:
        for hook in hooks:
            hook.remove()
    out = out[0] if isinstance(out, tuple) else out
    by_node = {node: name for node, name in outputs.items() if name in linears}
    for name, given in inputs.items():
        flow.feeds[name] = {STREAM: False} if given is x else _fed_by(given.grad_fn, by_node, attentions.nodes, x)
        flow.source[name] = "" if given is x else outputs.get(given.grad_fn) if given.grad_fn else None
    flow.exits = set(_fed_by(out.grad_fn, by_node, attentions.nodes, x)) - {STREAM}
    flow.attention = bool(attentions.nodes)
    return flow


def _named(hook: Callable, name: str) -> Callable:
    """The hook with the module's name first."""
    return lambda *a: hook(name, *a)


def _fed_by(start: Any, by_node: dict[Any, str], attentions: set[Any], x: torch.Tensor) -> dict[str, bool]:
    """The Linears whose output nodes the autograd graph reaches from `start` without crossing another one (STREAM
    for the block's input `x`), each with whether some path to it crosses an attention op."""
    found: dict[str, bool] = {}
    stack, seen = [(start, False)], set()
    while stack:
        node, through = stack.pop()
        if node is None or (node, through) in seen:
            continue
        seen.add((node, through))
        reached = STREAM if getattr(node, "variable", None) is x else by_node.get(node) if node is not start else None
        if reached is not None:
            found[reached] = found.get(reached, False) or through
            continue
        through = through or node in attentions
        stack.extend((nxt, through) for nxt, _ in node.next_functions)
    return found


class SharedInput(ParallelStyle):
    """A norm whose output several branches read: sequence-parallel under sp (else, reading a parallel block's
    residual DTensor, its parameters replicated DTensors), its output made a replicated DTensor once (an all-gather
    under sp), which the branches' column-parallel Linears take as it is."""

    def __init__(self, sp: bool, parallel: bool) -> None:
        super().__init__()
        self.sp, self.parallel = sp, parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.sp:
            SequenceParallel()._apply(module, device_mesh)
        elif self.parallel:
            Replicated()._apply(module, device_mesh)

        def replicated(mod: nn.Module, given: tuple, out: torch.Tensor) -> DTensor:
            if isinstance(out, DTensor):
                return out.redistribute(placements=(Replicate(),))
            return DTensor.from_local(out, device_mesh, (Replicate(),), run_check=False)

        module.register_forward_hook(replicated)
        return module


class PartialRowwise(RowwiseParallel):
    """A parallel block's row-parallel output left a partial sum (a Partial DTensor, reduced where the branches'
    sum meets the residual), whose gradient is gathered whole once (the branches' gathers of the one gradient
    alike, so the compiler keeps one) rather than per GEMM of its backward."""

    def __init__(self) -> None:
        super().__init__(output_layouts=Partial(), use_local_output=False)

    @staticmethod
    def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module, out: Any, mesh: Any) -> Any:
        local = out.to_local(grad_placements=(Replicate(),))
        return DTensor.from_local(local, mesh, (Partial(),), run_check=False)


class Replicated(ParallelStyle):
    """A module of a parallel block reading the residual as a replicated DTensor (its norm, without sp): its
    parameters replicated DTensors too."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh)


class ResidualStream(ParallelStyle):
    """A parallel block's residual as a DTensor inside it (sequence-sharded under sp, else replicated): the
    branches' row-parallel outputs, partial sums, added to each other first and then to the residual are reduced
    once, where the sum meets the residual (an all-reduce; a reduce-scatter under sp); the block's output handed
    on as the rank's local tensor. Its input by position, or by keyword (`hidden_states=`, the forward's first
    parameter)."""

    def __init__(self, layout: Any, block: nn.Module) -> None:
        super().__init__()
        self.layout = layout
        self.name = next(iter(inspect.signature(block.forward).parameters), "x")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def distributed(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
                return DTensor.from_local(x, device_mesh, (self.layout,), run_check=False)
            return x

        def left(out: Any) -> Any:
            first = out[0] if isinstance(out, tuple) else out
            if isinstance(first, DTensor):
                first = first.redistribute(placements=(self.layout,)).to_local()
            return (first, *out[1:]) if isinstance(out, tuple) else first

        forward = module.forward

        def distributed_forward(*args: Any, **kwargs: Any) -> Any:
            """In the forward, not in hooks: a compiled block runs its own hooks outside its graph."""
            if args:
                return left(forward(distributed(args[0]), *args[1:], **kwargs))
            return left(forward(**{**kwargs, self.name: distributed(kwargs[self.name])}))

        module.forward = distributed_forward
        return module


class SequenceSlice(ParallelStyle):
    """A learned-position embedding under sp: its output, alike on every rank, cut to the rank's sequence shard
    (dim -2 of [seq, h] or [batch, seq, h]) so it meets the token embedding's sequence-parallel output. A local cut:
    its backward sends nothing, and the position table's gradient is the rank's partial sum, reduced over tp with
    the other replicated weights' of sequence-parallel regions (the norms'), as Megatron does (the symbolic
    generator prices the embedding so)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def sliced(mod: nn.Module, given: tuple, out: torch.Tensor) -> torch.Tensor:
            size = out.shape[-2] // device_mesh.size()
            return out.narrow(out.dim() - 2, device_mesh.get_local_rank() * size, size)

        module.register_forward_hook(sliced)
        return module


def _norms(modules: dict[str, nn.Module], hidden: int, outside: Iterable[str]) -> list[str]:
    """Modules whose parameters are all vectors of the hidden size (LayerNorm, RMSNorm), outside `outside`."""
    outside = tuple(outside)
    found = []
    for name, module in modules.items():
        params = list(module.parameters(recurse=False))
        vectors = name and params and all(p.dim() == 1 and p.shape[0] == hidden for p in params)
        if vectors and not _under(name, outside) and not isinstance(module, nn.Linear | nn.Embedding):
            found.append(name)
    return found


def derived_block_plan(
    block: nn.Module,
    args: tuple,
    kwargs: dict,
    heads: Heads,
    sp: bool,
    fixed: dict[str, ParallelStyle],
    branch_input: Callable[[Any, nn.Module], ParallelStyle],
) -> dict[str, ParallelStyle]:
    """The block's plan from its structure (the module docstring), `fixed` (a MoE's, by `moe_plan`) kept and the
    modules under it left to it; `branch_input(layout, module)`: the style making a branch module's input
    replicated."""
    layout = Shard(1) if sp else Replicate()
    fixed = {**fixed, **multihead_plan(block, layout)}  # nn.MultiheadAttention runs no Linear: split as a whole
    flow = dataflow(block, args, kwargs, fixed)
    branches = _branches(flow)
    latent = {exit_: found for exit_, found in _latent(flow).items() if exit_ not in branches}
    covered = branches | {exit_: [*downs, *ups] for exit_, (downs, ups) in latent.items()}
    owners = {exit_: _common([*entries, exit_]) for exit_, entries in covered.items()}
    unsplit = flow.attention and not any(any(flow.feeds[e].values()) for e in covered)
    if unsplit or any(not owners[exit_] for exit_ in latent):  # a latent attention's input is prepared at its module
        raise PlanError(_unsplit_attention(block, flow, branches))
    modules = dict(block.named_modules())
    # branches side by side (no branch reads another's output): their row-parallel outputs left partial sums that
    # meet in the block's sum and are reduced once there
    parallel = len(covered) > 1 and not any(set(flow.feeds[e]) & set(covered) for b in covered.values() for e in b)
    plan: dict[str, ParallelStyle] = dict(fixed)
    for exit_, (downs, ups) in latent.items():  # generators/fx/latent.py
        owner = owners[exit_]
        plan |= _latent_plan(flow, downs, ups, modules, (owner, heads, layout))
        plan[exit_] = PartialRowwise() if parallel else RowwiseParallel(output_layouts=layout)
        plan[owner] = latent_input(branch_input(layout, modules[owner]), layout)
    sources: dict[str | None, list[list[str]]] = {}
    for exit_, entries in sorted(branches.items()):
        owner = owners[exit_]
        attention = any(flow.feeds[exit_].values())
        for entry in entries:
            groups = heads.groups(flow.linears[entry].out_features) if attention else None
            plan[entry] = ColwiseParallel() if groups is None else LocalHeads(groups, modules[owner], heads)
        plan[exit_] = PartialRowwise() if parallel else RowwiseParallel(output_layouts=layout)
        sources.setdefault(_one({flow.source[e] for e in entries}), []).append([owner, *entries])
    for source, readers in sources.items():
        for owner, *entries in readers:
            if len(readers) == 1 and owner and source is not None and not _under(source, [owner]):
                plan[owner] = branch_input(layout, modules[owner])
            elif source:  # one norm feeding several branches: its output replicated once
                plan[source] = SharedInput(sp, parallel)
            else:  # no module to prepare the input at: each Linear takes it as it comes
                for entry in entries:
                    plan[entry].input_layouts = (layout,)
    for name, module in modules.items():  # a decoding block's KV cache module (generators/fx/models/layers.py)
        if name.endswith("cache") and list(module.buffers(recurse=False)) and _under(name, owners.values()):
            plan[name] = ShardedCache(heads.kv_heads)
    for name in _norms(modules, args[0].shape[-1], [*[o for o in owners.values() if o], *fixed]):
        if parallel:  # in a parallel block, the norms read the residual as a DTensor
            plan.setdefault(name, SequenceParallel() if sp else Replicated())
        elif sp:  # a norm of a branch's output (Gemma 2's post-norms) hands the residual add its local shard
            plan.setdefault(name, SequenceParallel(use_local_output=name not in sources))
    if parallel:
        plan[""] = ResidualStream(layout, block)  # a dropout of p 0 between: a no-op (`attention.fused_attention`)
    if not covered:
        raise PlanError(
            f"{PLAN_FIELD}: no column- and row-parallel nn.Linear pairs found in {type(block).__name__} for tensor "
            "parallelism; name its modules' styles (colwise, rowwise, ...) in model.fx_plan"
        )
    return plan


def _branches(flow: Dataflow) -> dict[str, list[str]]:
    """Row-parallel Linear -> its column-parallel ones: a column-parallel Linear reads the residual stream (the
    block's input, through norms and earlier branches' sums) and only row-parallel Linears read its output; a
    row-parallel one reads only column-parallel outputs (through the branch's own ops: activation, attention) and
    its output reaches the block's."""
    users = _users(flow)
    column = {n for n, feeds in flow.feeds.items() if STREAM in feeds and users[n]}
    row = {n for n, feeds in flow.feeds.items() if feeds and STREAM not in feeds and n in flow.exits}
    while True:  # whole pairs only: a column-parallel output read by anything else would meet it sharded
        kept_column = {n for n in column if users[n] <= row}
        kept_row = {n for n in row if set(flow.feeds[n]) <= kept_column}
        if (kept_column, kept_row) == (column, row):
            return {exit_: sorted(flow.feeds[exit_]) for exit_ in sorted(row)}
        column, row = kept_column, kept_row


def _users(flow: Dataflow) -> dict[str, set[str]]:
    """Linear -> the Linears reading its output directly."""
    users: dict[str, set[str]] = {n: set() for n in flow.linears}
    for name, feeds in flow.feeds.items():
        if STREAM not in feeds:
            for fed in feeds:
                users[fed].add(name)
    return users


def _latent(flow: Dataflow) -> dict[str, tuple[list[str], list[str]]]:
    """Row-parallel Linear -> the down and up projections of the latent attention before it (`latent`): it reads,
    through an attention op, up projections and down projections only (the shared RoPE key, past any Linear); an
    up projection reads down projections only and only it reads the up projection; a down projection reads the
    residual stream, some up projection reads it, and only they and it do. (A per-head projection from the stream
    straight to the attention, DeepSeek-V2-Lite's query without q_lora_rank, is none of these: refused.)"""
    users, found = _users(flow), {}
    for exit_ in sorted(flow.exits):
        feeds = flow.feeds.get(exit_, {})
        ups = sorted(n for n in feeds if n != STREAM and STREAM not in flow.feeds[n])
        downs = sorted({d for up in ups for d in flow.feeds[up]} | {n for n in feeds if n != STREAM} - set(ups))
        shaped = ups and any(feeds.values()) and STREAM not in feeds
        upward = all(users[up] == {exit_} and set(flow.feeds[up]) <= set(downs) for up in ups)
        downward = all(
            set(flow.feeds[d]) == {STREAM} and users[d] & set(ups) and users[d] <= {*ups, exit_} for d in downs
        )
        if shaped and upward and downward:
            found[exit_] = (downs, ups)
    return found


def _latent_plan(
    flow: Dataflow, downs: list[str], ups: list[str], modules: dict[str, nn.Module], split: tuple[str, Heads, Any]
) -> dict[str, ParallelStyle]:
    """A latent attention's down and up projections (`_latent`; `split`: the attention's module, its heads and the
    sequence's layout). A latent only up projections read, through norms at most (DeepSeek's query latent), is
    under sp Megatron's sequence-parallel pair: the down projection and the norm replicated DTensor modules on the
    rank's shard, the up projection column-parallel by heads gathering its input (and regathering it in backward,
    as Megatron's column-parallel Linear does). Without sp (where DTensor would reduce the pair's input gradient
    at the hidden state, not at the latent), and for a latent read otherwise too (the kv latent, whose shared RoPE
    key the attention reads past any Linear), the latent is gathered whole at the down projection (`LatentDown`),
    its up projections the rank's rows (`LocalRows`)."""
    owner, heads, layout = split
    users, plan = _users(flow), {}
    for down in downs:
        readers = [up for up in ups if down in flow.feeds[up]]
        between = {flow.source[up] for up in readers} - {down}
        alone = users[down] <= set(readers) and all(n and is_norm(modules[n]) for n in between)
        paired = alone and isinstance(layout, Shard)
        plan |= {down: Replicated(), **dict.fromkeys(between, Replicated())} if paired else {down: LatentDown()}
        for up in readers:
            if paired:
                plan[up] = LocalHeads((heads.heads,), modules[owner], heads, widths=False)
                plan[up].input_layouts = (layout,)
            else:
                plan[up] = LocalRows((heads.heads,), modules[owner], heads, widths=False)
    return plan


def _unsplit_attention(block: nn.Module, flow: Dataflow, branches: dict[str, list[str]]) -> str:
    """The refusal of a block whose attention no column- then row-parallel pair surrounds (DeepSeek's latent
    attention: low-rank down projections, replicated in Megatron, before the per-head up projections), naming the
    attention's module and where its class is written; a tensor-parallel capture would run it unsplit on the
    rank's sequence shard."""
    paired = {name for exit_, entries in branches.items() for name in (exit_, *entries)}
    unpaired = sorted(name for name in flow.linears if name not in paired)
    owner = block.get_submodule(_common(unpaired)) if unpaired else block
    try:
        where = f"{os.path.relpath(inspect.getsourcefile(type(owner)) or '?')}:{inspect.getsourcelines(type(owner))[1]}"
    except (OSError, TypeError):
        where = type(owner).__module__
    return (
        f"{type(owner).__name__} ({where}): its attention's projections ({', '.join(unpaired)}) are not "
        "column- then row-parallel pairs around it (low-rank or latent projections), which the fx generator does "
        "not split over tensor-parallel ranks yet; use parallel.tp 1, or generator symbolic"
    )


def _one(values: set[str | None]) -> str | None:
    return next(iter(values)) if len(values) == 1 else None


def derived_ends_plan(model: nn.Module, prologue: bool, sp: bool) -> dict[str, ParallelStyle]:
    """The ends' plan (the module docstring): for the prologue the embeddings, for the epilogue the head and norm."""
    modules = dict(model.named_modules())
    embeddings = {n: m for n, m in modules.items() if isinstance(m, nn.Embedding)}
    if not embeddings:
        raise PlanError(f"{PLAN_FIELD}: {type(model).__name__} has no nn.Embedding for its tokens to split")
    token = max(embeddings, key=lambda n: embeddings[n].num_embeddings)
    vocab, hidden = embeddings[token].num_embeddings, embeddings[token].embedding_dim
    sequence = Shard(1) if sp else Replicate()
    if prologue:
        plan: dict[str, ParallelStyle] = {token: RowwiseParallel(input_layouts=Replicate(), output_layouts=sequence)}
        if sp:
            plan |= {n: SequenceSlice() for n in embeddings if n != token}
        return plan
    heads = [n for n, m in modules.items() if isinstance(m, nn.Linear) and m.out_features == vocab]
    if len(heads) != 1:
        raise PlanError(
            f"{PLAN_FIELD}: {type(model).__name__} has {len(heads)} nn.Linear onto its vocabulary of {vocab}, not "
            "one output head; name the head's style (colwise) in model.fx_plan"
        )
    plan = {heads[0]: ColwiseParallel(input_layouts=sequence, output_layouts=Shard(-1))}
    if sp:
        plan |= {n: SequenceParallel() for n in _norms(modules, hidden, ())}
    return plan


def user_plan(spec: ModelSpec, factory: Callable) -> dict[str, str]:
    """The factory module's TP_PLAN amended by the point's model.fx_plan (the point wins)."""
    module = sys.modules.get(getattr(factory, "__module__", ""), None)
    given = getattr(module, MODULE_PLAN, None) or {}
    where = f"{getattr(module, '__name__', '?')}.{MODULE_PLAN}"
    if not isinstance(given, dict) or any(style not in STYLES for style in given.values()):
        raise PlanError(f"{where}: a dict of module-name patterns to styles, each one of {', '.join(STYLES)}")
    return {**given, **(spec.fx_plan or {})}


def _user_style(style: str, kind: str, sp: bool) -> ParallelStyle | None:
    """The user's style for a module of `kind` ('block', 'head', 'embedding'); None: unsharded."""
    sequence = Shard(1) if sp else Replicate()
    if style in ("colwise", "vocab") and kind == "head":
        return ColwiseParallel(input_layouts=sequence, output_layouts=Shard(-1))
    if style == "vocab" or (style == "colwise" and kind == "embedding"):
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=sequence)
    return {
        "colwise": ColwiseParallel(input_layouts=sequence),
        "rowwise": RowwiseParallel(output_layouts=sequence),
        "sequence_parallel": SequenceParallel() if sp else None,
        "replicate": None,
    }[style]


KINDS = {ColwiseParallel: "colwise", RowwiseParallel: "rowwise", SequenceParallel: "sequence_parallel"}


def overridden(
    plan: dict[str, ParallelStyle], user: dict[str, str], names: dict[str, str], kinds: dict[str, str], sp: bool
) -> dict[str, ParallelStyle]:
    """`plan` with the user's styles for the modules they name (`names`: plan name -> the model's full name;
    `kinds`: plan name -> 'block', 'head' or 'embedding'); a derived style of the same kind is kept (its layouts and
    head split are the derived plan's refinement of it)."""
    out, removed = dict(plan), []
    for name, full in names.items():
        styles = [style for pattern, style in user.items() if fnmatch(full, pattern)]
        if not styles:
            continue
        derived = out.get(name)
        kind = next((k for cls, k in KINDS.items() if isinstance(derived, cls)), None)
        if derived is not None and kind == styles[-1]:
            continue
        style = _user_style(styles[-1], kinds.get(name, "block"), sp)
        if style is None:
            removed.append(name)
            out.pop(name, None)
        else:
            out[name] = style
    # a branch's input prepared for column-parallel Linears the user left unsharded would meet them as a DTensor
    return {name: style for name, style in out.items() if not _unfed(name, style, out, removed)}


def _unfed(name: str, style: ParallelStyle, plan: dict[str, ParallelStyle], removed: list[str]) -> bool:
    """Whether `style` prepares the input of a branch module some of whose Linears the user left unsharded, and
    none column-parallel is left under it."""
    inside = [n for n in plan if _under(n, [name]) and n != name]
    emptied = any(_under(n, [name]) for n in removed)
    kept = any(isinstance(plan[n], ColwiseParallel) for n in inside)
    return isinstance(style, PrepareModuleInput) and emptied and not kept


def check_patterns(user: dict[str, str], model: nn.Module) -> None:
    """A PlanError for the first pattern naming no module of the model."""
    names = [n for n, _ in model.named_modules() if n]
    for pattern in user:
        if not any(fnmatch(n, pattern) for n in names):
            sample = ", ".join(names[:6])
            raise PlanError(
                f"{PLAN_FIELD}: '{pattern}' names no module of {type(model).__name__} (its modules: {sample}, ...)"
            )
