"""When a point's ZeRO sharding gathers weights and reduces gradients, and over which ranks: FSDP2's
reshard_after_forward, gradient reduction per micro-batch or per step, and HSDP's shard and replicate groups.

PyTorch FSDP2 (torch/distributed/fsdp/_fully_shard/_fully_shard.py, `fully_shard`): reshard_after_forward True
frees a module's gathered weights after its forward and gathers them again for its backward; False keeps them
to the backward, after which they are freed (reshard_after_backward, True by default); an int n keeps a 1/n shard
after forward (the "post-forward mesh", a non-trivial divisor of the shard group, meant to be the ranks of a node)
and gathers the backward over those n ranks. torch.distributed.pipelining (torch/distributed/pipelining/stage.py,
`backward_maybe_with_nosync`) sets reshard_after_backward and requires_gradient_sync False for every backward but
the last micro-batch's, so under pipelining a module kept gathered after forward stays gathered for the whole
step and its gradients are reduce-scattered once, the accumulation kept unsharded: by FSDP's post-backward of the
whole stage module, which the schedule runs as its REDUCE_GRAD action after the stage's last backward and send
(`_PipelineStageBase.perform_reduce_grad`).
torchtitan (torchtitan/distributed/fsdp.py, `apply_fsdp_to_decoder`) passes reshard_after_forward = not
pp_enabled by default ("reshard_after_forward_policy: default"), which is the `auto` here, to the token embedding
and each block; the final norm and the output head, sharded as one module, get reshard_after_forward only under
the policy "always" (here true): their backward runs right after their forward, so the head is kept gathered from
its forward to its backward (`Sharding.head_hold`); at pp 1 that saves its backward's all-gather. (The root module,
wrapped last with FSDP2's own default, no reshard after forward, holds no parameters of its own.)

Left out: under pipelining torch also leaves a module that reshards after forward unsharded after each backward
(reshard_after_backward False), so a forward right after a backward of the same stage would find its weights
gathered; here true and n gather for every forward and backward as they do without pipelining, and a forward
after the first gathers over the whole shard group rather than from the post-forward shard.

HSDP (FSDP2 on a 2-D device mesh, torchtitan's data_parallel_shard_degree below the dp degree) shards over groups
of dp_shard consecutive data-parallel ranks and replicates across them: weights are all-gathered and gradients
reduce-scattered in the shard group, and each reduced shard is then all-reduced over the replicate group.

With context parallelism every ZeRO group also spans the cp ranks, which hold the same weights (torchtitan's FSDP
mesh is dp_shard x cp, `optimizer.SHARD_AXES`): the traced collectives run over cp joined with dp, and the rank
layout puts cp inside the data-parallel axes, so the shard group cp x dp_post x dp_shard is contiguous. Left out
with cp: the post-forward group of an int reshard_after_forward is n data-parallel ranks, where FSDP2 would take
n consecutive ranks of the flattened dp_shard x cp mesh (cp ranks first).
"""

from dataclasses import dataclass, replace
from typing import Literal

from dse.spec import ParallelSpec
from dse.workload import Block, Collective, Op, OpKind

Hold = Literal["forward", "shard", "microbatch", "step"]
"""How long a module's weights gathered for its forward stay gathered: to the end of the forward (reshard after
forward), as a 1/n shard to its backward (reshard to n ranks; one shard per module, so under pipelining to its
last backward of the step), whole to its backward (no reshard, without pipelining), or whole to its last
backward of the step (no reshard, under pipelining)."""


@dataclass(frozen=True)
class Sharding:
    """One point's ZeRO policy: its groups, how long gathered weights are held, when gradients are reduced."""

    dp: int
    shard: int
    """Data-parallel ranks a ZeRO shard spans: dp_shard under HSDP, else dp (times cp: `cp`)."""
    cp: int
    """The cp ranks, which every ZeRO group spans besides its data-parallel ranks."""
    post_forward: int | None
    """The ranks a module's weights are resharded to after forward (reshard_after_forward an int), if any."""
    hold: Hold
    head_hold: Hold
    """The output head's hold (with the final norm's): under auto, torchtitan's no reshard after forward, whole to
    its backward (to its last of the step under pipelining); else the other modules' `hold`."""
    grad_per_step: bool
    """Gradients are reduced once per step after the last micro-batch, accumulated unsharded until then."""
    reduce_after_stage: bool
    """ZeRO-3 gradients reduced once per step under pipelining: torch.distributed.pipelining runs every backward
    of a stage without gradient sync and then FSDP's post-backward of the whole stage module, so the reduce-
    scatters follow the stage's last backward (and its send) instead of each module's."""

    @staticmethod
    def of(p: ParallelSpec) -> "Sharding":
        reshard = p.reshard_after_forward
        if reshard == "auto":
            reshard = p.pp == 1
        hold: Hold
        if reshard is True:
            hold = "forward"
        elif reshard is False:
            hold = "step" if p.pp > 1 else "microbatch"
        else:
            hold = "shard"
        head: Hold = hold if p.reshard_after_forward != "auto" else "step" if p.pp > 1 else "microbatch"
        per_step = p.grad_reduce == "per_step" or (p.grad_reduce == "auto" and p.pp > 1)
        shard = p.dp_shard if p.dp_shard is not None and p.zero >= 1 else p.dp
        post = reshard if hold == "shard" and p.zero == 3 else None
        per_step = per_step and p.zero >= 2
        after_stage = per_step and p.zero == 3 and p.pp > 1
        if p.zero != 3:
            hold = head = "forward"
        return Sharding(p.dp, shard, p.cp, post, hold, head, per_step, after_stage)

    def hold_of(self, module: object) -> Hold:
        """The hold of a module by its name or layer key ("head", "embed", a LayerKey)."""
        return self.head_hold if module == "head" else self.hold

    @property
    def split(self) -> bool:
        """Whether the dp axis splits into groups of its own in the rank layout (`axes`)."""
        return self.shard < self.dp or self.post_forward is not None

    def axes(self) -> list[tuple[str, int]]:
        """The rank layout's data-parallel axes, innermost first: 'dp' alone, or where the groups split it,
        'dp_post' (the post-forward group), 'dp_shard' (the rest of the shard group) and 'dp_rep' (replicas)."""
        if not self.split:
            return [("dp", self.dp)]
        post = self.post_forward or 1
        pieces = [("dp_post", post), ("dp_shard", self.shard // post), ("dp_rep", self.dp // self.shard)]
        return [(name, size) for name, size in pieces if size > 1]

    def _joined(self, names: tuple[str, ...]) -> str:
        return "+".join(name for name, _ in self.axes() if name in names)

    def regrouped(self, blocks: list[Block], backward_gathers: set[int]) -> list[Block]:
        """The blocks with their data-parallel collectives on the split axes: ZeRO's weight all-gathers and
        gradient reduce-scatters (every all-gather and reduce-scatter over dp, joined with cp) on the shard group,
        a backward's weight gathers (`backward_gathers`, block indices) on the post-forward group if any (dp
        ranks only), every other collective over all of dp; under HSDP each gradient reduce-scatter is followed by
        the all-reduce of its shard (1 / (dp_shard x cp) of it) over the replicas."""
        if not self.split:
            return blocks
        everywhere = self._joined(("dp_post", "dp_shard", "dp_rep"))
        shard = self._joined(("dp_post", "dp_shard"))
        post = self._joined(("dp_post",))
        out = []
        for index, block in enumerate(blocks):
            ops = list(block.ops)
            for i, op in enumerate(block.ops):
                axes = op.axis.split("+")
                if "dp" not in axes:
                    continue
                zero = op.category in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER)
                if zero and index in backward_gathers and post:
                    axis = post  # the post-forward shard's n data-parallel ranks (module doc)
                else:
                    axis = "+".join((shard if zero else everywhere) if a == "dp" else a for a in axes)
                ops[i] = replace(op, axis=axis)
                if op.category == Collective.REDUCE_SCATTER and self.shard < self.dp:
                    shard_ranks = self.shard * (self.cp if "cp" in axes else 1)
                    ops.append(
                        Op(
                            f"{op.name}.replicas_all_reduce",
                            OpKind.COLLECTIVE,
                            Collective.ALL_REDUCE.value,
                            comm_bytes=op.comm_bytes / shard_ranks,
                            axis="dp_rep",
                            deps=(i,),
                        )
                    )
            out.append(replace(block, ops=tuple(ops), output=block.output_index) if ops != list(block.ops) else block)
        return out


def without_ops(block: Block, removed: set[int], name: str) -> Block:
    """The block without the ops at `removed`; an op that waited for a removed one waits for what it waited for."""
    index: dict[int, int] = {}
    deps_of: dict[int, tuple[int, ...]] = {}
    ops: list[Op] = []
    for i, op in enumerate(block.ops):
        deps = tuple(sorted({d for dep in op.deps for d in ((dep,) if dep < 0 else deps_of[dep])}))
        if i in removed:
            deps_of[i] = deps
            continue
        ops.append(replace(op, deps=deps))
        index[i] = len(ops) - 1
        deps_of[i] = (index[i],)
    # a removed output (a backward that hands no gradient on ends with its reduce-scatter): the last op left
    output = index.get(block.output_index, -1)
    return Block(name, tuple(ops), output, block.temp_bytes)
