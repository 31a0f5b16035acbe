"""The parallel layout of a design point: its degrees, and the strategies and framework knobs that decide how the
step runs on them (ZeRO and FSDP, pipeline schedules, recomputation, Megatron's overlaps). Read strictly, as every
section (`dse.fields`); `dse.spec` assembles it into a DesignPoint.
"""

from typing import Annotated, Any, Literal

from annotated_types import Ge, Gt, Le
from pydantic import BeforeValidator, Field
from pydantic_core import PydanticCustomError

from dse.fields import Count, Degree, Layers, Spec, Whole, as_tuple, as_whole, left_out_at_default
from dse.limits import MAX_CAPACITY_GIB, MAX_GLOBAL_BATCH, MAX_LAYERS, MAX_WORLD


def _reshard_value(value: Any) -> Any:
    """parallel.reshard_after_forward: auto, a flag, or a number of ranks, with one message for anything else
    (the union's own errors would list each member's)."""
    if value == "auto" or isinstance(value, bool):
        return value
    number = as_whole(value) if isinstance(value, int | float) else None
    if isinstance(number, int) and 1 <= number <= MAX_WORLD:
        return number
    raise PydanticCustomError(
        "reshard_after_forward", "expected auto, true, false or a whole number of ranks to reshard to after forward"
    )


class ParallelSpec(Spec):
    """Degrees and strategies; ranks are laid out tp innermost, then cp, dp, pp (Megatron order)."""

    dp: Degree = 1
    tp: Degree = 1
    pp: Degree = 1
    cp: Degree = 1
    sp: bool = Field(False, description="Megatron sequence parallelism on the TP group")
    zero: Annotated[Literal[0, 1, 2, 3], BeforeValidator(as_whole)] = Field(
        0,
        description="ZeRO stage; 3 = FSDP. ZeRO shards over the dp x cp ranks, which hold the same weights "
        "(Megatron's data-parallel group with context parallelism, torchtitan's FSDP mesh dp_shard x cp)",
    )
    fsdp: Literal["fsdp1", "fsdp2"] = Field(
        "fsdp2",
        description="with zero 3, the PyTorch FSDP whose buffer copies are priced: fsdp2 (fully_shard, PyTorch's "
        "current one, torchtitan's): shards copied into the all-gather input, the gathered buffer copied out into "
        "the parameters at every gather, gradients copied into the reduce-scatter input; fsdp1 "
        "(FullyShardedDataParallel with flat parameters, fms-fsdp's): views instead of the copy-out, the flat "
        "gradient concatenated and divided before the reduce-scatter",
    )
    fsdp_reduce_dtype: Literal["bf16", "fp32"] = Field(
        "bf16",
        description="with zero 3, the dtype gradients are reduce-scattered in (FSDP's MixedPrecision.reduce_dtype)",
    )
    reshard_after_forward: Annotated[Literal["auto"] | bool | Degree, BeforeValidator(_reshard_value)] = (
        left_out_at_default(
            "auto",
            description="with zero 3, FSDP2's fully_shard(reshard_after_forward): true frees each module's gathered "
            "weights after its forward and gathers them again for its backward; false keeps them from the forward to "
            "the backward (under pp > 1 for the whole step, as torch.distributed.pipelining keeps them unsharded "
            "after backward too); an int n keeps a 1/n shard after forward and gathers the backward over n ranks; "
            "auto: false when pp > 1, else true but for the output head (with the final norm), kept gathered from its "
            "forward to its backward (torchtitan's rule)",
        )
    )
    grad_reduce: Literal["auto", "per_microbatch", "per_step"] = left_out_at_default(
        "auto",
        description="with zero >= 2, when gradients are reduce-scattered: after every micro-batch's backward, or "
        "once after the last one with the accumulation kept unsharded in between (FSDP2's "
        "set_requires_gradient_sync(False)); auto: per_step when pp > 1 (torch.distributed.pipelining), else "
        "per_microbatch (torchtitan, DeepSpeed ZeRO-2)",
    )
    dp_shard: Degree | None = left_out_at_default(
        None,
        description="HSDP: ZeRO shards over groups of dp_shard consecutive data-parallel ranks (times the cp ranks) "
        "and replicates across the dp / dp_shard groups (gradients reduce-scattered in the group, then all-reduced "
        "across); unset: over all dp (x cp) ranks",
    )
    grad_bucket_mb: Annotated[float, Gt(0), Le(MAX_CAPACITY_GIB * 1024)] | None = left_out_at_default(
        None,
        description="with zero 0, 1 or 2 in training, the data-parallel gradient reduction in buckets of this many "
        "MiB (PyTorch DDP's bucket_cap_mb; Megatron's bucket_size counts elements): parameters' gradients, in the "
        "order backward makes them, are packed into one collective until it holds at least this much, per collective "
        "and group (expert gradients on their own), and a bucket's collective starts once the backward of every module "
        "in it has ended; a module larger than a bucket fills several, split at its parameters as Megatron splits "
        "them; unset: one bucket per module. ZeRO 3 reduce-scatters each module's gradients in FSDP's post-backward "
        "instead (fsdp_prefetch is its scheduling knob)",
    )
    fsdp_prefetch: Annotated[Whole, Ge(0), Le(MAX_LAYERS)] = left_out_at_default(
        1,
        description="with zero 3 in training, how many modules ahead each module's weight all-gather is issued, in "
        "forward and backward (FSDP2's set_modules_to_forward_prefetch / set_modules_to_backward_prefetch with that "
        "many modules; 1 is FSDP's implicit prefetch): up to this many + 1 modules' gathered weights are alive at "
        "once; 0: each module's gather issued as it is about to run, exposed. Weights kept gathered over the step "
        "(reshard_after_forward false under pp > 1) are all gathered at its start whatever the depth",
    )
    pp_schedule: Literal["1f1b", "gpipe", "interleaved", "zb_h1", "dualpipev"] = Field(
        "1f1b",
        description="pipeline schedule: 1f1b, gpipe, interleaved (Megatron's interleaved 1F1B, with "
        "virtual_stages), zb_h1 (Qi et al. 2023's zero-bubble H1: 1F1B with each backward split into its input- and "
        "weight-gradient halves, weight gradients deferred into the bubbles, 1F1B's peak memory), dualpipev "
        "(DeepSeek-V3's DualPipe in its V form: two chunks per rank, virtual stages s and 2pp-1-s, backward split as "
        "zb_h1's; its forward-and-backward pairs run one after the other, without DualPipe's comm overlap)",
    )
    recompute: Literal["none", "selective", "full", "selective_op"] = Field(
        "none",
        description="activation recomputation: selective = Megatron's (core attention), selective_op = "
        "torchtitan's per-op policy (keeps matmul outputs but every second one, and attention's; recomputes the "
        "rest), full = whole layers",
    )
    ep: Degree = Field(1, description="expert parallelism: experts split over ep ranks carved from dp")
    virtual_stages: Layers = Field(1, description="model chunks per pipeline rank (interleaved 1F1B)")
    microbatch_group: Annotated[Count, Le(MAX_GLOBAL_BATCH)] | None = left_out_at_default(
        None,
        description="interleaved 1F1B: micro-batches a stage runs through one model chunk before the next "
        "(Megatron's microbatch_group_size_per_vp_stage); between pp and the micro-batches per step, leaving a last "
        "group of 0 or at least pp micro-batches; unset: pp, Megatron's default",
    )
    cp_algorithm: Literal["allgather", "ring"] = Field(
        "allgather",
        description="context parallelism: all-gather K/V over cp, or pass K/V chunks around the cp ring beside "
        "the attention of the chunk held (zigzag causal balance: rank r holds chunks r and 2cp-1-r)",
    )
    layer_strategies: Annotated[tuple[Literal["tp", "dp"], ...], BeforeValidator(as_tuple)] = Field(
        (),
        max_length=MAX_LAYERS,
        description="per layer, cycled: tp uses the tp ranks for tensor parallelism, dp as more data-parallel "
        "ranks (batch split, weights replicated, gradients reduced over tp and dp); empty: every layer tp",
    )
    recompute_every: Layers = Field(
        1,
        description="apply `recompute` to every n-th layer only (torchtitan's layer-level selective checkpointing, "
        "the FSDP blog's checkpointing of every n-th block); the other layers keep all their activations",
    )
    # Megatron-LM's communication overlaps (megatron/core/distributed, TransformerEngine userbuffers): their defaults
    # are the step as priced before they existed.
    overlap_grad_reduce: bool = left_out_at_default(
        True,
        description="data-parallel gradients reduced module by module as the last micro-batch's backward fills "
        "them, beside the rest of that backward (Megatron's --overlap-grad-reduce, whose own default is false; "
        "PyTorch DDP and FSDP always do, hence true here); false: every reduction (the all-reduce, or the "
        "distributed optimizer's reduce-scatter under zero 1 and 2) starts once the whole backward has ended, a "
        "blocking phase before the optimizer",
    )
    overlap_param_gather: bool = left_out_at_default(
        False,
        description="with zero 1 or 2 (Megatron's distributed optimizer), the updated parameters are all-gathered "
        "during the next step's forward, each module's just ahead of its first forward (Megatron's "
        "--overlap-param-gather, default false); false: one all-gather after the optimizer step, ending the step",
    )
    tp_comm_overlap: bool = left_out_at_default(
        False,
        description="with sp, TransformerEngine userbuffers (Megatron's --tp-comm-overlap, default false): the TP "
        "all-gathers feeding a GEMM run as a ring exchange of tp chunks beside the GEMM's chunks, and the "
        "reduce-scatters after a GEMM as tp chunks each following its GEMM chunk; the GEMMs run slower beside them "
        "by the accelerator's overlap_slowdown",
    )
    overlap_p2p_comm: bool = left_out_at_default(
        True,
        description="pipeline sends and receives run on their own streams beside the compute; false: each stage "
        "waits for its batched sends and receives before its next compute (Megatron's --no-overlap-p2p-"
        "communication; its flag defaults to overlapping, but Megatron turns it off for non-interleaved "
        "schedules, whose 1F1B runs batched, blocking p2p)",
    )
    first_stage_layers: Layers | None = left_out_at_default(
        None,
        description="layers on the first pipeline stage, which also holds the embedding (Megatron's "
        "decoder_first_pipeline_num_layers); unset: an even share",
    )
    last_stage_layers: Layers | None = left_out_at_default(
        None,
        description="layers on the last pipeline stage, which also holds the output layer and the loss (Megatron's "
        "decoder_last_pipeline_num_layers; Llama 3 405B ran 126 layers on 16 stages as 7, 8 x 14, 7); unset: an "
        "even share",
    )

    def layer_strategy(self, layer: int) -> str:
        return self.layer_strategies[layer % len(self.layer_strategies)] if self.layer_strategies else "tp"

    def stage_layers(self, layers: int) -> list[int]:
        """Layers per pipeline stage: first_stage_layers and last_stage_layers where set, the others an even share
        of the rest (`feasibility` checks that it divides)."""
        counts: list[int | None] = [None] * self.pp
        if self.first_stage_layers is not None:
            counts[0] = self.first_stage_layers
        if self.last_stage_layers is not None:
            counts[-1] = self.last_stage_layers
        unset = counts.count(None)
        share = (layers - sum(c for c in counts if c is not None)) // unset if unset else 0
        return [share if c is None else c for c in counts]

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp
