"""Capturing the two ends of a user's model: what its forward runs before the first block (the prologue: the token
embedding, positions added, any scaling) and after the last (the epilogue: the final norm, the output projection,
and in training the cross-entropy loss over the vocabulary), as forward and backward ATen graphs like the layer's
(`capture`).

Both run the model's own forward with its block stack replaced by one seam module (`_Seam`), so whatever the
model does around its blocks is captured, not assumed: the prologue returns what reaches the seam, the epilogue
feeds the seam its input and takes the logits; what the other end computes is dead there and pruned from the
graphs. Under tensor parallelism the ends get Megatron's plan, found by structure (`generators.fx.plans`): the
token embedding vocabulary-parallel (RowwiseParallel: each rank looks up its vocabulary shard, partial sums reduced,
scattered over the sequence with `sp`), learned positions cut to the rank's sequence shard with `sp` (a position
table that is no nn.Embedding: the token embedding all-reduced and the sequence cut at the first block, as
Megatron runs learned positions, `capture_end`), the final norm sequence-parallel with `sp`, the output
projection column-parallel over the vocabulary with its logits left sharded, and the loss computed on the shards
(Megatron's vocab-parallel cross-entropy: the max, the sum of exponentials and the target's logit all-reduced per
token). A training forward that takes its targets (nanoGPT's `targets`, `labels`) is given the tokens for them.
"""

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from dse.errors import DseError
from dse.spec import ModelSpec, WorkloadSpec
from generators.fx import plans
from generators.fx.attention import fused_attention
from generators.fx.capture import (
    CapturedLayer,
    CaptureError,
    built_on_meta,
    captured_graphs,
    fake_world,
    mesh_of,
    run_compiled,
    step_inputs,
    what_failed,
)
from generators.fx.pieces import EPILOGUE as EPILOGUE  # the ends' names, kept importable from here
from generators.fx.pieces import PROLOGUE
from generators.fx.recompute import Checkpointed
from generators.fx.routing import FixedCapacity

TARGETS = ("targets", "labels", "target")
"""The names a model's forward may take its training targets by (`_targets`)."""


class _Seam(nn.Module):
    """The block stack's stand-in: keeps the hidden state that reaches it and hands on `given` when there is one,
    in a tuple of one where the model's blocks return tuples (`tupled`: the model reads their first element)."""

    def __init__(self, tupled: bool, block: nn.Module, cut: DeviceMesh | None = None) -> None:
        """`block`: the first block, whose attributes the seam answers for (torch's nn.TransformerEncoder reads its
        first layer's `self_attn.batch_first`, ...), not a submodule; `cut`: the tp mesh whose rank's sequence
        shard the seam takes of a whole-sequence hidden state (the prologue's under sp when its embedding's output
        was all-reduced: `capture_end`)."""
        super().__init__()
        self.reached: list[torch.Tensor] = []
        self.given: torch.Tensor | None = None
        self.tupled, self.cut = tupled, cut
        self.__dict__["block"] = block

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["block"], name)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor | tuple[torch.Tensor]:
        if self.given is None:  # the rank's shard reaches the blocks; the model's rest, pruned, runs on x
            self.reached.append(x if self.cut is None else self._shard(x, self.cut))
        out = x if self.given is None else self.given  # the epilogue: x, the embedding's output, is pruned
        return (out,) if self.tupled else out

    @staticmethod
    def _shard(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        size = x.shape[-2] // mesh.size()
        return x.narrow(x.dim() - 2, mesh.get_local_rank() * size, size)


class _FirstBlockReached(Exception):
    """Stops the forward `_blocks_return_tuples` runs once the first block has returned."""


def _blocks_return_tuples(model: nn.Module, block: nn.Module, inputs: tuple[torch.Tensor, ...]) -> bool:
    """Whether the model's blocks return a tuple (Falcon's `(hidden, ...)`), which the seam in their place must
    return too: one eager forward on meta, stopped when the first block returns."""
    returned: list[bool] = []

    def look(module: nn.Module, args: Any, out: Any) -> None:
        returned.append(isinstance(out, tuple))
        raise _FirstBlockReached

    handle = block.register_forward_hook(look)
    try:
        with torch.no_grad(), FixedCapacity():  # a first block routing by the data (a MoE's where/nonzero loop)
            model(*inputs)
    except _FirstBlockReached:
        pass
    finally:
        handle.remove()
    return bool(returned and returned[0])


class _Prologue(nn.Module):
    def __init__(self, model: nn.Module, seam: _Seam) -> None:
        super().__init__()
        self.model, self.seam = model, seam

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        self.model(*inputs)
        return self.seam.reached[-1]


class _Epilogue(nn.Module):
    def __init__(self, model: nn.Module, train: bool, tp_group: str | None, inputs: tuple[torch.Tensor, ...]) -> None:
        """`inputs`, the model's (`step_inputs`): its output is looked at once, run eagerly on meta before the
        seam hands on a hidden state, so that an output without logits is refused in our words (an error raised
        while compiling reaches us only as dynamo's)."""
        super().__init__()
        self.model, self.train_loss, self.tp_group = model, train, tp_group
        self.targets = _targets(model, inputs[0]) if train else {}
        with torch.no_grad():
            _whole(logits_of(model(*inputs, **self.targets), type(model).__name__), inputs[0], type(model).__name__)

    def forward(self, hidden: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        """`hidden` is the seam's `given` too, set before the call: a graph input the seam hands on (set here, it
        would be a side effect, which checkpointing refuses); `inputs`, the model's (`step_inputs`)."""
        logits = logits_of(self.model(*inputs, **self.targets), type(self.model).__name__)
        if not self.train_loss:
            return logits
        return cross_entropy(logits, inputs[0], self.tp_group)  # the tokens stand for the targets


def _targets(model: nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """The keyword a training forward takes its targets by (nanoGPT's `forward(idx, targets=None)`, Hugging Face's
    `labels`), given the tokens, which stand for them: a model may compute the logits of the last position alone
    without them (nanoGPT's inference shortcut). Empty when the forward takes none."""
    try:
        names = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {name: tokens for name in TARGETS if name in names}


def _whole(logits: torch.Tensor, tokens: torch.Tensor, model: str) -> None:
    """A CaptureError when the logits are of fewer positions than the tokens (this eager look, on the ends' plan
    with the seam handing on the embedding's output, sees more under sp)."""
    if logits.dim() < 2 or logits.shape[-2] < tokens.shape[-1]:
        raise CaptureError(
            f"{model}.forward(tokens) returned logits {tuple(logits.shape)} for tokens {tuple(tokens.shape)}, not "
            f"one row per position; give its forward a `targets` (or `labels`) parameter under which it computes "
            "the logits of every position, as training does"
        )


def logits_of(out: Any, model: str) -> torch.Tensor:
    """The logits of what a model's forward returned: a tensor, the first of a tuple (a training script's
    `(logits, loss)`), or a mapping's `logits` (a Hugging Face ModelOutput); its loss, computed on the token
    targets, is not the step's (the step's loss is `cross_entropy`), and is pruned from the graphs unread."""
    if isinstance(out, Mapping) and isinstance(out.get("logits"), torch.Tensor):
        return out["logits"]
    if isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor) and out[0].dim() == 3:
        return out[0]
    if isinstance(out, torch.Tensor):
        return out
    what = f"a {type(out).__name__}" + (f" with keys {sorted(map(str, out))}" if isinstance(out, Mapping) else "")
    raise CaptureError(
        f"{model}.forward(tokens) returned {what}; the fx generator needs its logits [batch, seq, vocab]: a tensor, "
        "a tuple (logits, ...) or a mapping with 'logits'"
    )


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, tp_group: str | None) -> torch.Tensor:
    """torchtitan's loss (`cross_entropy_loss`: the logits in fp32, mean over the tokens); on vocabulary shards
    (`tp_group`), Megatron's vocab-parallel cross-entropy (`_VocabParallelCrossEntropy`)."""
    logits, targets = logits.flatten(0, 1).float(), targets.flatten()
    if tp_group is not None:
        return _VocabParallelCrossEntropy.apply(logits, targets, tp_group)
    # log-softmax and nll_loss_forward, as F.cross_entropy decomposes on a GPU: on the meta device F.cross_entropy
    # goes through a kernel without autograd, and its captured backward would be empty
    log_probs = F.log_softmax(logits, dim=-1)
    return torch.ops.aten.nll_loss_forward(log_probs, targets, None, 1, -100)[0]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's cross-entropy over logits split by vocabulary (tensor_parallel/cross_entropy.py), on the rank
    holding the first shard: per token the max, the sum of exponentials and the target's logit all-reduced over tp
    (fp32, one value each); the backward is local (softmax minus the one-hot target), with no collective. It is
    what DTensor's `loss_parallel` computes too, whose handlers capture unreliably after a layer's capture in the
    same process."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, group: str) -> torch.Tensor:
        vocab = logits.shape[-1]
        outside = targets >= vocab  # this rank's shard is the vocabulary's first
        local = targets.masked_fill(outside, 0)
        top = funcol.all_reduce(logits.amax(dim=-1), "max", group)
        picked = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        picked = funcol.all_reduce(picked, "sum", group)
        exp = (logits - top.unsqueeze(-1)).exp()
        total = funcol.all_reduce(exp.sum(dim=-1), "sum", group)
        ctx.save_for_backward(exp / total.unsqueeze(-1), local, outside)
        return (total.log() + top - picked).mean()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        """(softmax - one-hot target) x grad / tokens, the one-hot subtracted in place of a one-hot tensor."""
        probs, local, outside = ctx.saved_tensors
        scale = grad / local.numel()
        hit = (~outside).to(probs.dtype) * -scale
        return (probs * scale).scatter_add(-1, local.unsqueeze(-1), hit.unsqueeze(-1)), None, None


class VocabParallelEmbedding(ParallelStyle):
    """Megatron's VocabParallelEmbedding (tensor_parallel/layers.py), on the rank holding the vocabulary's first
    shard: its weight is its own rows, [ceil(vocab / tp), dim] as DTensor's Shard(0) cuts it; a token outside them
    looks up row 0, its output row is zeroed, and the partial sums are reduced to `output_layout` (all-reduced, or
    reduce-scattered over the sequence with sp). The module's own forward runs on the local rows (a subclass's
    scaling included). Its backward writes the gradient of the rank's rows only.

    DTensor's RowwiseParallel, which this replaces, computes the same forward, but its embedding backward has no
    vocabulary-sharded strategy: it runs on the global token ids with the whole vocabulary's row count, so each rank
    would write the gradient of the whole table (llama3-8b at tp 2: 1.05 GB in place of 0.53 GB)."""

    def __init__(self, output_layout: Placement) -> None:
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise CaptureError(f"a vocabulary-parallel style on a {type(module).__name__}, not an nn.Embedding")
        rows = -(-module.num_embeddings // device_mesh.size())
        local = torch.empty(rows, module.embedding_dim, dtype=module.weight.dtype, device=module.weight.device)
        module.weight = nn.Parameter(local, requires_grad=module.weight.requires_grad)
        module.padding_idx = None  # a row of the whole table; its zero gradient costs nothing to leave out
        lookup, layout = module.forward, self.output_layout

        def forward(tokens: torch.Tensor) -> torch.Tensor:
            outside = tokens >= rows  # this rank's rows are the vocabulary's first
            out = lookup(tokens.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(-1), 0.0)
            summed = DTensor.from_local(out, device_mesh, [Partial()], run_check=False)
            return summed.redistribute(device_mesh, [layout]).to_local()

        module.forward = forward
        return module


def ends_plan(
    model: nn.Module, end: str, sp: bool, user: dict[str, str], gathered: bool = False
) -> dict[str, ParallelStyle]:
    """The plan of the model's embeddings (prologue) or its final norm and output head (epilogue), derived from its
    modules (`generators.fx.plans.derived_ends_plan`; `gathered`: the prologue's as without sp), the `user`'s styles
    over it; a vocabulary-parallel embedding (RowwiseParallel) made Megatron's (`VocabParallelEmbedding`)."""
    plan = plans.derived_ends_plan(model, end == PROLOGUE, sp and not gathered)
    modules = dict(model.named_modules())
    kinds = {n: "embedding" if isinstance(m, nn.Embedding) else "block" for n, m in modules.items()}
    kinds |= {n: "head" for n, style in plan.items() if isinstance(style, ColwiseParallel)}
    # the prologue runs the embeddings, the epilogue the rest: a user's style for each is applied at its own end
    modules = {n: m for n, m in modules.items() if isinstance(m, nn.Embedding) == (end == PROLOGUE)}
    plan = plans.overridden(plan, user, {n: n for n in modules if n}, kinds, sp)
    return {
        name: VocabParallelEmbedding(style.output_layouts[0])
        if isinstance(style, RowwiseParallel) and kinds.get(name) == "embedding"
        else style
        for name, style in plan.items()
    }


def capture_end(
    end: str,
    factory: Callable[..., nn.Module],
    name: str,
    model: ModelSpec,
    workload: WorkloadSpec,
    tp: int,
    dp: int,
    sp: bool,
    train: bool = True,
) -> CapturedLayer:
    """The model's `end` (PROLOGUE or EPILOGUE) of `factory(model, workload)`, tp-way parallel, on a micro-batch of
    the workload; its input_shape is its input's local shape (the tokens', the last block output's).

    A prologue that sp's plan cannot run (one adding to the token embedding's sequence shard a whole-sequence
    tensor that is no nn.Embedding: a position table held as an nn.Parameter or a buffer) is captured as Megatron
    runs learned absolute positions: the embedding's partial sums all-reduced, the rest of the prologue on the
    whole sequence, and the rank's sequence shard cut at the first block (a local split)."""
    try:
        return _capture_end(end, factory, name, model, workload, tp, dp, sp, train, gathered=False)
    except CaptureError as error:
        if end != PROLOGUE or not sp or tp == 1:
            raise
        try:
            return _capture_end(end, factory, name, model, workload, tp, dp, sp, train, gathered=True)
        except CaptureError:
            raise error from None


def _capture_end(
    end: str,
    factory: Callable[..., nn.Module],
    name: str,
    model: ModelSpec,
    workload: WorkloadSpec,
    tp: int,
    dp: int,
    sp: bool,
    train: bool,
    gathered: bool,
) -> CapturedLayer:
    fake_world(dp * tp)
    mesh = mesh_of(tp, dp, 1)
    graphs: dict[str, fx.GraphModule] = {}
    built: nn.Module | None = None
    try:
        built, layers = built_on_meta(factory, model, workload)
        parameters = sum(p.numel() for p in built.parameters())
        inputs = step_inputs(built, name, workload)
        seam = _Seam(_blocks_return_tuples(built, layers[0], inputs), layers[0], mesh["tp"] if gathered else None)
        del layers[1:]
        layers[0] = seam
        if tp > 1:
            parallelize_module(built, mesh["tp"], ends_plan(built, end, sp, plans.user_plan(model, factory), gathered))
        with fused_attention():
            if end == PROLOGUE:
                captured: nn.Module = _Prologue(built, seam)
                local: tuple[int, ...] = tuple(inputs[0].shape)
            else:
                dtype = next(p for p in built.parameters()).dtype
                seq = inputs[0].shape[1] // tp if sp and tp > 1 else inputs[0].shape[1]
                local = (workload.micro_batch, seq, model.hidden)
                hidden = torch.empty(local, dtype=dtype, device="meta", requires_grad=train)
                group = mesh["tp"].get_group().group_name if tp > 1 else None
                captured, inputs = _Epilogue(built, train, group, inputs), (hidden, *inputs)
                seam.given = hidden
                if train:
                    captured = Checkpointed(captured, "none")  # the final norm's output gathered again in backward
            run_compiled(captured, inputs, {}, train, graphs)
    except DseError:
        raise
    except Exception as exc:
        raise CaptureError(f"model factory '{name}', the model's {end}: {what_failed(exc, built)}") from None
    finally:
        torch._dynamo.reset()
    return captured_graphs(graphs, f"model factory '{name}': the model's {end}", train, local, dp, tp, parameters)
