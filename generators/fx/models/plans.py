"""torchtitan's tensor-parallel plan for the reference models, as one `parallelize_module` plan keyed by module
path (with `layers.*` wildcards): Megatron's column/row split of attention and MLP, vocabulary-parallel embedding
and head, and with sequence parallelism the norms and residual stream split along the sequence.

It lives beside the models because it is written against their module names; a user's own model brings its own
plan. The head's logits stay split over the vocabulary (a DTensor, `Shard(-1)`) for a loss-parallel cross-entropy,
as torchtitan's and the symbolic generator's head do, instead of all-gathering batch x seq x vocab logits.
"""

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.nn import Module

from generators.fx.models.transformer import Transformer


def tensor_parallel_plan(model: Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The plan for a `Transformer` of this package. MoE layers get their attention split only: their router and
    experts stay whole on every TP rank (an expert-width split is not written yet), which is not what the
    symbolic generator does with tp > 1 on an MoE, so their figures will not agree there."""
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
            if sequence_parallel:  # each TP rank routes the tokens of its own sequence shard
                plan[f"layers.{i}.moe"] = PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True
                )
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
