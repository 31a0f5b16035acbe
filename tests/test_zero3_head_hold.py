"""ZeRO-3's output head under torchtitan's default (issue 35): apply_fsdp_to_decoder shards the final norm and the
output head as one module with reshard_after_forward only under the policy "always", so at pp 1 the head's weights
stay gathered from its forward to its backward (`Sharding.head_hold`): one head all-gather per micro-batch where
the other modules gather twice; the fx generator, which takes its FSDP ops from the symbolic blocks, follows."""

from collections import Counter

import pytest

from dse.workload import Collective
from generators.symbolic import SymbolicGenerator
from generators.symbolic.sharding import Sharding
from tests.helpers import make_point

MICROBATCHES = 2
HEAD = 1024 * 256 + 256
"""The head's weight elements (tiny-llama: the output projection, vocab x hidden, and the final norm)."""


def _point(reshard, pp: int = 1, **overrides):
    overrides = {"parallel.reshard_after_forward": reshard, **overrides}
    return make_point(seq_len=256, global_batch=8, dp=4, pp=pp, zero=3, overrides=overrides)


def head_gathers(generator, point) -> tuple[Counter, float]:
    """Per gather block of the head, its calls in the last stage's step; and the bytes those calls gather."""
    workload = generator.generate(point)
    calls = [workload.blocks[c.block] for c in workload.programs[-1].calls]
    gathers = [b for b in calls if b.name.startswith("head.") and b.name.endswith(".gather")]
    gathered = sum(op.comm_bytes for b in gathers for op in b.ops if op.category == Collective.ALL_GATHER)
    return Counter(b.name for b in gathers), gathered


@pytest.mark.parametrize(
    ("reshard", "pp", "hold", "head_hold"),
    [("auto", 1, "forward", "microbatch"), (True, 1, "forward", "forward"), ("auto", 2, "step", "step"),
     (False, 1, "microbatch", "microbatch"), (2, 1, "shard", "shard")],
)  # fmt: skip
def test_the_heads_hold_is_torchtitans(reshard, pp, hold, head_hold) -> None:
    sharding = Sharding.of(_point(reshard, pp).parallel)
    assert (sharding.hold, sharding.head_hold) == (hold, head_hold)
    assert (sharding.hold_of("head"), sharding.hold_of("embed")) == (head_hold, hold)


@pytest.mark.parametrize(("reshard", "backward"), [("auto", 0), (True, MICROBATCHES)])
def test_the_head_is_gathered_once_per_microbatch_at_pp_1(reshard, backward) -> None:
    """Under auto the head's forward gathers (2 micro-batches, 2 x the head's bf16 bytes) and its backward does not;
    with reshard_after_forward true (policy "always") its backward gathers again."""
    point = _point(reshard)
    assert point.micro_batches == MICROBATCHES
    counts, gathered = head_gathers(SymbolicGenerator(), point)
    assert counts == Counter({"head.forward.gather": MICROBATCHES, "head.backward.gather": backward})  # 0: absent
    assert gathered == (MICROBATCHES + backward) * HEAD * 2


def test_the_held_head_is_kept_from_its_gather_to_its_backward() -> None:
    """The gathered weights are a tensor from the forward's gather call to the end of the same micro-batch's head
    backward."""
    workload = SymbolicGenerator().generate(_point("auto"))
    program = workload.programs[0]
    name = [workload.blocks[c.block].name for c in program.calls]
    held = [(name[t.producer], name[t.consumer], t.bytes) for t in program.tensors if t.name == "head.weights"]
    assert held == [("head.forward.gather", "head.backward", HEAD * 2)] * MICROBATCHES


@pytest.mark.parametrize(("reshard", "copies"), [("auto", []), (True, ["cast_shard", "copy_in", "copy_out"] * 2)])
def test_a_held_heads_backward_runs_no_gather_copies(reshard, copies) -> None:
    """FSDP2's copies around a gather (the fp32 shard cast, copy-in, copy-out; of the projection and the norm) are
    in the head's backward only when it gathers again; its gradients' reduce-scatters and their copies always."""
    workload = SymbolicGenerator().generate(_point(reshard))
    (backward,) = [b for b in workload.blocks if b.name == "head.backward"]
    names = [op.name for op in backward.ops]
    assert [n.rsplit(".", 1)[-1] for n in names if ".all_gather.regather." in n] == copies
    assert sum(n.endswith(".reduce_scatter") for n in names) == 2


def test_the_fx_generator_follows() -> None:
    pytest.importorskip("torch")
    from generators.fx.generator import FxGenerator

    point = _point("auto", **{"model.fx_factory": "fx_tiny_llama:llama"})
    assert head_gathers(FxGenerator(), point) == head_gathers(SymbolicGenerator(), point)
    assert head_gathers(FxGenerator(), point)[0] == Counter({"head.forward.gather": MICROBATCHES})
