"""The tensor- and expert-parallel plan of a block's mixture-of-experts MLP in the module layout of
`generators.fx.models.moe` (`router.gate`, `experts.{w1,w2,w3}` stacked per expert, `shared_experts`), wherever in
the block `generators.fx.experts` found it (and laid a user's MoE out so).

It lays the MoE out as the symbolic generator prices it (`generators.symbolic.experts.moe`, Megatron's
all-to-all token dispatcher with expert tensor parallelism), so the two agree collective by collective:

- the router is replicated and runs on the tokens the rank holds (its sequence shard under SP), and so do the
  dispatch into capacity slots and the combine: both are index ops on the rank's own tokens;
- expert parallelism (ep > 1): the experts are split on dim 0 over the ep ranks, and each rank's slots go to the
  ranks holding their experts by an all-to-all over ep (equal splits: every expert has the same slots on every
  rank), and come back by another (torchtitan's ExpertParallel);
- expert tensor parallelism (tp > 1): w1/w3 split on the expert width (column-wise, dim 1 of [e, r, h]), w2
  row-wise (dim 2 of [e, h, r]), so the experts' output is a partial sum over tp (torchtitan's TensorParallel for
  GroupedExperts). Under SP the slots are all-gathered over tp before the experts and their partial sums
  reduce-scattered back to the slots of the rank's own tokens (so each rank combines its own tokens); without SP
  every tp rank routes every token, the partial sums are combined first and all-reduced once at the MoE's output
  (b x s x h, not top_k copies of it), and the slots' input gradient is all-reduced over tp in backward;
- shared experts: a dense tensor-parallel FFN beside the routed ones (its input all-gathered and its output
  reduce-scattered under SP; without SP its partial sums join the routed ones' in the one all-reduce).
"""

from torch import Tensor, nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
)

from generators.fx.experts import find_experts
from generators.fx.models.moe import GroupedExperts

EXPERT_WEIGHTS = {"w1": 1, "w3": 1, "w2": 2}
"""The dim of each stacked expert weight that tensor parallelism splits: the expert width r of [e, r, h] / [e, h, r]."""


class GroupedExpertsParallel(ParallelStyle):
    """Expert parallelism over `ep_mesh` (None: every rank holds every expert) and expert tensor parallelism over
    the mesh it is applied with (of size 1: none) for a GroupedExperts module, whose forward maps slots
    [experts, slots, hidden] to [experts, slots, hidden]."""

    def __init__(self, sp: bool, ep_mesh: DeviceMesh | None) -> None:
        super().__init__()
        self.sp, self.ep_mesh = sp, ep_mesh

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.size() > 1:
            return distribute_module(module, device_mesh, self._partition, self._prepare_input, self._prepare_output)
        # no tensor parallelism: plain local weights and tensors (distribute_module would make the weights
        # replicated DTensors, which the experts' plain input cannot meet)
        self._partition("", module, device_mesh)
        module.register_forward_pre_hook(lambda mod, inputs: self._prepare_input(mod, inputs, device_mesh))
        module.register_forward_hook(lambda mod, inputs, out: self._prepare_output(mod, out, device_mesh))
        return module

    def _partition(self, name: str, module: nn.Module, tp_mesh: DeviceMesh) -> None:
        if name:  # the experts module itself holds the weights
            return
        for weight, dim in EXPERT_WEIGHTS.items():
            param = getattr(module, weight)
            if param is None:
                continue
            if self.ep_mesh is not None:
                param = distribute_tensor(param.detach(), self.ep_mesh, [Shard(0)]).to_local()
            if tp_mesh.size() > 1:
                param = distribute_tensor(param, tp_mesh, [Shard(dim)])
            module.register_parameter(weight, nn.Parameter(param))

    def _prepare_input(self, module: nn.Module, inputs: tuple, tp_mesh: DeviceMesh) -> tuple:
        (slots,) = inputs
        if self.ep_mesh is not None:
            slots = _to_experts(slots, self.ep_mesh)
        if tp_mesh.size() > 1:
            # SP: gather the slots of every tp rank's tokens (backward: reduce-scatter their gradient); without
            # SP every tp rank holds them all, and their gradient, a partial sum over tp, is all-reduced
            layout = Shard(1) if self.sp else Replicate()
            slots = DTensor.from_local(slots, tp_mesh, (layout,), run_check=False).redistribute(
                placements=(Replicate(),)
            )
        return (slots,)

    def _prepare_output(self, module: nn.Module, out: Tensor, tp_mesh: DeviceMesh) -> Tensor:
        if isinstance(out, DTensor) and self.sp:  # a partial sum over tp, to each rank's own slots
            out = out.redistribute(placements=(Shard(1),)).to_local()
        elif isinstance(out, DTensor):  # a partial sum over tp, combined as it is (reduced at the MoE's output)
            out = out.to_local(grad_placements=(Replicate(),))
        if self.ep_mesh is not None:
            out = _from_experts(out, self.ep_mesh)
        return out


def _to_experts(slots: Tensor, ep_mesh: DeviceMesh) -> Tensor:
    """[e, slots, h] of this rank's tokens -> [e / ep, ep * slots, h] of this rank's experts, by one all-to-all
    over ep: the slots of the experts rank j holds are the j-th of ep equal chunks."""
    e, count, h = slots.shape
    ep = ep_mesh.size()
    received = all_to_all_single_autograd(slots.reshape(e * count, h), None, None, ep_mesh)
    return received.view(ep, e // ep, count, h).transpose(0, 1).reshape(e // ep, ep * count, h)


def _from_experts(out: Tensor, ep_mesh: DeviceMesh) -> Tensor:
    """The inverse of `_to_experts`: each source rank's slots back to it."""
    local, slots, h = out.shape
    ep = ep_mesh.size()
    count = slots // ep
    sent = out.view(local, ep, count, h).transpose(0, 1).reshape(ep * local * count, h)
    return all_to_all_single_autograd(sent, None, None, ep_mesh).view(ep * local, count, h)


def moe_plan(
    block: nn.Module, ep_mesh: DeviceMesh | None, tensor_parallel: bool = False, sp: bool = False
) -> dict[str, ParallelStyle]:
    """The plan entries (block-relative names) for the block's MoE as `generators.fx.experts` found and laid it out
    (its GroupedExperts at `<moe>.experts`, or `<moe>.experts.experts` in a SlottedExperts): expert parallel over
    `ep_mesh` (None: not), tensor parallel over the mesh the plan is applied with when `tensor_parallel` (sp: the
    MoE's input and output sequence-split); none for a block without one in that layout."""
    found = find_experts(block)
    if found is None or not isinstance(block.get_submodule(found.experts), GroupedExperts):
        return {}
    moe, experts = found.moe, found.experts
    if not tensor_parallel:
        return {} if ep_mesh is None else {experts: GroupedExpertsParallel(False, ep_mesh)}
    plan: dict[str, ParallelStyle] = {experts: GroupedExpertsParallel(sp, ep_mesh)}
    if sp:
        # the router, dispatch and combine run on the rank's sequence shard, as plain tensors
        plan[moe] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
    else:
        # routed (and shared) experts' partial sums, combined, reduced once (backward: nothing to reduce)
        plan[moe] = PrepareModuleOutput(output_layouts=(Partial(),), desired_output_layouts=(Replicate(),))
    names = dict(block.named_modules())
    shared = f"{moe}.shared_experts"
    if names.get(shared) is not None:
        # flattened tokens [b * s, h]: the rank's rows under SP
        rows = Shard(0) if sp else Replicate()
        plan[shared] = PrepareModuleInput(input_layouts=(rows,), desired_input_layouts=(Replicate(),))
        linears = [n for n, m in names[shared].named_modules() if isinstance(m, nn.Linear)]
        # by structure, whatever their names (w1, w3, w2; gate_proj, up_proj, down_proj): the Linears from the hidden
        # size column-parallel, the one back to it row-parallel
        down = [n for n in linears if names[f"{shared}.{n}"].in_features != found.hidden] or linears[-1:]
        for inner in linears:
            plan[f"{shared}.{inner}"] = (
                ColwiseParallel() if inner not in down else RowwiseParallel(output_layouts=rows if sp else Partial())
            )
    return plan
