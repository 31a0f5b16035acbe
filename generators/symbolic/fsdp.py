"""The memory-bound copies PyTorch FSDP runs around its ZeRO-3 collectives (`parallel.fsdp`).

Mixed precision keeps the sharded parameters in fp32 (MASTER_ITEMSIZE) and gathers them in the model's dtype.
FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel, a FlatParameter per wrapped module, use_orig_params False
as fms-fsdp ran it; torch 2.2 _runtime_utils.py and _flat_param.py):
- before each all-gather, the fp32 shard is cast into the low-precision shard (`_use_low_precision_shard`), which
  the all-gather reads; the gathered flat parameter is used through views, so nothing is copied out;
- the module's parameters are views split from the flat parameter, so autograd's split backward concatenates
  their gradients into one unsharded flat gradient; `_reduce_grad` divides it in place by the predivide factor
  before the reduce-scatter and the shard by the postdivide factor after (`_get_gradient_predivide_factor`), and
  the shard is cast to the fp32 parameter dtype (`_cast_grad_to_param_dtype`).
FSDP2 (fully_shard; _fsdp_collectives.py, _fsdp_param.py):
- copy-in: each shard cast to the parameter dtype (`all_gather_inputs`), then copied into the all-gather input
  buffer (`_foreach_copy_`);
- copy-out: the gathered buffer split into per-parameter tensors (`split_with_sizes_copy`), the whole unsharded
  size, on the compute stream each time a module is gathered (forward and backward);
- the unsharded gradients are concatenated into the reduce-scatter input (`foreach_reduce_scatter_copy_in`, cast
  to the reduce dtype on the way); bf16 and fp32 reductions average inside NCCL (ReduceOp.AVG, no division
  kernels); a reduced shard not in fp32 is cast to it.
Every copy is priced as a compute-stream kernel (those on FSDP's own streams take the same SMs and HBM). The
copies after a reduce-scatter run on the reduce-scatter stream, beside the next module's backward: they follow
it in the backward block with no dependency on it, so they do not hold the compute stream. A prefetched
gather's copy-in is priced in the block that reads the weights (see `Emitter.emit_param_gather`).
"""

from dataclasses import dataclass, replace
from math import prod

from dse.fields import DTYPE_BYTES
from dse.workload import Op, OpKind

MASTER_ITEMSIZE = DTYPE_BYTES["fp32"]
"""FSDP's sharded parameters and their gradients: fp32 (mixed precision casts them to the model's dtype)."""


def divide_factors(world: int) -> tuple[int, int]:
    """FSDP1's gradient predivide and postdivide factors: the predivide factor doubles while it divides the world
    and stays below world / factor (about sqrt(world)), so neither sum overflows in low precision."""
    factor = 1
    while world % factor == 0 and world / factor > factor:
        factor *= 2
    return factor, world // factor


def copy_op(name: str, read: float, written: float) -> Op:
    """A memory-bound copy or cast: read and written bytes, no arithmetic worth counting."""
    return Op(name, OpKind.COMPUTE, "elementwise", bytes=read + written, out_bytes=written)


def chained(ops: list[Op], first: tuple[int, ...], offset: int) -> list[Op]:
    """The ops with each depending on the one before, the first on `first`; offset: the first one's index."""
    return [replace(op, deps=first if i == 0 else (offset + i - 1,)) for i, op in enumerate(ops)]


@dataclass(frozen=True)
class FsdpCopies:
    """The copies of one point's FSDP version around its parameter all-gathers and gradient reduce-scatters."""

    version: str
    degrees: dict[str, int]
    itemsize: int
    """The model's (parameter and gradient) dtype."""
    reduce_itemsize: int
    """The dtype gradients are reduce-scattered in."""
    shard: int | None = None
    """Under HSDP, the ranks of a shard group, which the traced 'dp' axis stands for here (`Sharding`)."""

    def group(self, axis: str) -> int:
        return prod(self.shard if a == "dp" and self.shard else self.degrees.get(a, 1) for a in axis.split("+"))

    def _shard_elems(self, unsharded_bytes: float, axis: str, itemsize: int) -> float:
        return unsharded_bytes / itemsize / self.group(axis)

    def gather_in(self, gather: Op) -> list[Op]:
        """The copies that make a shard the all-gather input (gather.comm_bytes: the gathered bytes)."""
        shard = self._shard_elems(gather.comm_bytes, gather.axis, self.itemsize)
        ops = []
        if self.itemsize != MASTER_ITEMSIZE:
            ops.append(copy_op(f"{gather.name}.cast_shard", MASTER_ITEMSIZE * shard, self.itemsize * shard))
        if self.version == "fsdp2":
            ops.append(copy_op(f"{gather.name}.copy_in", self.itemsize * shard, self.itemsize * shard))
        return ops

    def gather_out(self, gather: Op) -> Op | None:
        """FSDP2's copy-out of the gathered buffer into the parameters; FSDP1 uses views."""
        if self.version != "fsdp2":
            return None
        return copy_op(f"{gather.name}.copy_out", gather.comm_bytes, gather.comm_bytes)

    def reduce_scatter(self, name: str, unsharded_bytes: float, axis: str) -> tuple[list[Op], list[Op]]:
        """The copies before and after reducing `unsharded_bytes` of gradients (in the model's dtype)."""
        n = unsharded_bytes / self.itemsize
        shard = n / self.group(axis)
        r = self.reduce_itemsize
        after = []
        if self.version == "fsdp2":
            before = [copy_op(f"{name}.copy_in", self.itemsize * n, r * n)]
        else:
            before = [copy_op(f"{name}.flat_grad_cat", self.itemsize * n, self.itemsize * n)]
            if r != self.itemsize:
                before.append(copy_op(f"{name}.cast_to_reduce_dtype", self.itemsize * n, r * n))
            pre, post = divide_factors(self.group(axis))
            if pre > 1:
                before.append(copy_op(f"{name}.predivide", r * n, r * n))
            if post > 1:
                after.append(copy_op(f"{name}.postdivide", r * shard, r * shard))
        if r != MASTER_ITEMSIZE:
            after.append(copy_op(f"{name}.grad_to_fp32", r * shard, MASTER_ITEMSIZE * shard))
        return before, after
