"""torchtitan's tensor-parallel plan for the reference models, as one `parallelize_module` plan keyed by module
path (with `layers.*` wildcards): Megatron's column/row split of attention and MLP, vocabulary-parallel embedding
and head, and with sequence parallelism the norms and residual stream split along the sequence.

It lives beside the models because it is written against their module names; a user's own model brings its own
plan. The head's logits stay split over the vocabulary (a DTensor, `Shard(-1)`) for a loss-parallel cross-entropy,
as torchtitan's and the symbolic generator's head do, instead of all-gathering batch x seq x vocab logits.
"""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from generators.fx.models.transformer import Transformer


class ExpertTensorParallel(ParallelStyle):
    """The experts' inner width split over the TP ranks (w1/w3 by rows, w2 by columns: Megatron's MLP split, per
    expert), the router left whole. Each expert then needs every rank's tokens: with sequence parallelism the
    dispatched slots [experts, slots, hidden] are all-gathered over TP before the experts and their partial sums
    reduce-scattered back to each rank's own slots after (Megatron's all-to-all dispatcher with TP experts, as the
    symbolic generator has it); without it every rank holds the same slots and the sums are all-reduced."""

    def __init__(self, sequence_parallel: bool) -> None:
        super().__init__()
        self.slots = Shard(1) if sequence_parallel else Replicate()

    @staticmethod
    def _split(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for weight, dim in (("w1", 1), ("w3", 1), ("w2", 2)):
            param = getattr(module, weight, None)
            if param is not None:
                module.register_parameter(weight, nn.Parameter(distribute_tensor(param, mesh, [Shard(dim)])))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def slots_in(_module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            local = DTensor.from_local(inputs[0], mesh, (self.slots,), run_check=False)
            return (local.redistribute(mesh, (Replicate(),)),)

        def sums_out(_module: nn.Module, out: DTensor, mesh: DeviceMesh) -> object:
            return out.redistribute(mesh, (self.slots,)).to_local()

        return distribute_module(module, device_mesh, self._split, slots_in, sums_out)


class ReplicaOnTokenShards(ParallelStyle):
    """A module kept whole on every TP rank but run on each rank's own tokens (with sequence parallelism the MoE's
    router and shared experts see only the rank's sequence shard): its weights become replicated DTensors, so their
    gradients, partial sums over the ranks' tokens, are all-reduced over TP as a norm's are under SP. Input and
    outputs stay plain tensors of the rank's tokens [tokens, ...]."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def tokens_in(_module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            return (DTensor.from_local(inputs[0], mesh, (Shard(0),), run_check=False),)

        def tokens_out(_module: nn.Module, out: object, mesh: DeviceMesh) -> object:
            return tuple(t.to_local() for t in out) if isinstance(out, tuple) else out.to_local()

        return distribute_module(module, device_mesh, None, tokens_in, tokens_out)


def tensor_parallel_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The plan for a `Transformer` of this package: attention and dense MLPs split as Megatron does, MoE experts
    by their width (`ExpertTensorParallel`); routers and shared experts stay whole on every TP rank (under sequence
    parallelism as `ReplicaOnTokenShards`)."""
    if not isinstance(model, Transformer):
        raise TypeError(f"{type(model).__name__} is not a reference Transformer; give parallelize_module your own plan")
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "output": ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=residual),
    }
    if sequence_parallel:
        plan |= {
            "norm": SequenceParallel(),
            "layers.*.attention_norm": SequenceParallel(),
            "layers.*.ffn_norm": SequenceParallel(),
            "layers.*.attention": PrepareModuleInput(
                input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
            ),
        }
    for i, block in enumerate(model.layers):
        if block.moe_enabled:
            plan[f"layers.{i}.moe.experts"] = ExpertTensorParallel(sequence_parallel)
            if sequence_parallel:  # each TP rank routes the tokens of its own sequence shard
                plan[f"layers.{i}.moe"] = PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True
                )
                plan[f"layers.{i}.moe.router"] = ReplicaOnTokenShards()
                if block.moe.shared_experts is not None:
                    plan[f"layers.{i}.moe.shared_experts"] = ReplicaOnTokenShards()
            continue
        plan |= {
            f"layers.{i}.feed_forward.w1": ColwiseParallel(),
            f"layers.{i}.feed_forward.w3": ColwiseParallel(),
            f"layers.{i}.feed_forward.w2": RowwiseParallel(output_layouts=residual),
        }
        if sequence_parallel:
            plan[f"layers.{i}.feed_forward"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
    return plan
