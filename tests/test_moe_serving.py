"""MoE physics of a serving step (issue 33): the experts' grouped GEMMs read the weights of the experts that receive
tokens, not of every expert held, and a routing skew makes the busiest expert-parallel rank set the layer's time."""

import pytest
from helpers import make_point

from dse import plugins
from dse.errors import InfeasibleError, SpecError
from dse.point.feasibility import infeasibility
from dse.routing import active_experts
from dse.workload import Workload
from generators.symbolic import SymbolicGenerator

GEN, COST = SymbolicGenerator(), plugins.cost_model("analytical")
EXPERTS, HIDDEN, WIDTH = 256, 256, 512
"""tiny-moe (hidden 256, expert width 512) with DeepSeek-V3's 256 routed experts."""
SKEW = {"imbalance": 1.5, "source": "a test's skew"}


def point(top_k: int, ep: int, mode: str = "decode", micro_batch: int = 1, seq_len: int = 64, **overrides):
    moe = {"model.moe": {"experts": EXPERTS, "top_k": top_k, "expert_ffn": WIDTH}, "workload.mode": mode}
    return make_point(
        "tiny-moe",
        seq_len=seq_len,
        micro_batch=micro_batch,
        global_batch=8 * micro_batch,
        overrides=moe | overrides,
        dp=8,
        ep=ep,
    )


def experts_ops(workload: Workload, direction: str = "forward") -> list:
    block = next(b for b in workload.blocks if b.name == f"layer.attn.moe.{direction}")
    return [op for op in block.ops if op.name.startswith("experts.w") and op.gemm is not None]


def weight_bytes_read(op) -> float:
    """An expert GEMM's bytes less its activations' (its input [batch, m, k] and output [batch, m, n], bf16)."""
    batch, m, n, k = op.gemm
    return op.bytes - 2 * batch * m * (k + n)


@pytest.mark.parametrize(
    ("copies", "top_k", "ep", "mode", "micro_batch", "seq_len", "held_read"),
    [
        (1, 1, 1, "decode", 1, 64, 1.0),  # one token to one expert
        (8, 8, 1, "decode", 1, 64, 256 * (1 - (255 / 256) ** 8)),  # 7.89 of 256 experts on one rank
        (8, 1, 8, "decode", 1, 64, 256 * (1 - (255 / 256) ** 8) / 8),  # the same spread over 8 ranks
        (2**20, 8, 1, "prefill", 32, 4096, 256.0),  # 1e6 copies reach every expert
    ],
)
def test_a_step_reads_the_weights_of_the_experts_its_tokens_reach(
    copies, top_k, ep, mode, micro_batch, seq_len, held_read
):
    """E (1 - (1 - 1/E)^T) experts of T = tokens x top_k copies over the EP group receive a token; the rank reads
    its share of them (E/ep of the 256 held), each h x r weights of 2 bytes per GEMM. The FLOPs are the copies'."""
    p = point(top_k, ep, mode, micro_batch, seq_len)
    assert p.workload.micro_batch * (1 if mode == "decode" else seq_len) * ep * top_k == copies
    assert active_experts(EXPERTS, copies) / ep == pytest.approx(held_read, rel=1e-12)
    for op in experts_ops(GEN.generate(p)):
        assert weight_bytes_read(op) == pytest.approx(held_read * HIDDEN * WIDTH * 2, rel=1e-9)
        assert op.flops == pytest.approx(2 * copies / ep * HIDDEN * WIDTH, rel=1e-12)


def test_memory_holds_every_expert_whatever_a_step_reads():
    """The parameters held are E/ep experts' in a one-token decode (reading 1) as in a prefill reading all."""
    few, all_of_them = point(1, 2), point(1, 2, "prefill", 32, 4096)
    held = [COST.simulate(GEN.generate(p), p.system).classes[0].memory_at_peak["parameter"] for p in (few, all_of_them)]
    assert held[0] == held[1]


def test_training_reads_every_expert():
    """A training micro-batch's copies reach all experts (and backward differentiates the weights as held)."""
    ops = experts_ops(GEN.generate(point(1, 2, "train", 1, 64)))
    assert all(weight_bytes_read(op) == pytest.approx(EXPERTS / 2 * HIDDEN * WIDTH * 2) for op in ops)


def alltoall_bytes(workload: Workload, direction: str) -> float:
    block = next(b for b in workload.blocks if b.name == f"layer.attn.moe.{direction}")
    return sum(op.comm_bytes for op in block.ops if op.category == "all_to_all")


@pytest.mark.parametrize("mode", ["train", "decode"])
def test_the_busiest_rank_routes_the_imbalance_times_the_mean(mode):
    """imbalance 1.5: the traced (busiest) rank's expert GEMM FLOPs and its all-to-all bytes are 1.5 times the
    uniform routing's, forward and (training) backward; the step is longer."""
    uniform = point(2, 2, mode, 4, 64)
    skewed = point(2, 2, mode, 4, 64, **{"workload.routing": SKEW})
    pair = [GEN.generate(p) for p in (uniform, skewed)]
    for direction in ("forward", "backward") if mode == "train" else ("forward",):
        flops = [sum(op.flops for op in experts_ops(w, direction)) for w in pair]
        assert flops[1] == pytest.approx(1.5 * flops[0], rel=1e-12)
        sent = [alltoall_bytes(w, direction) for w in pair]
        assert sent[1] == pytest.approx(1.5 * sent[0], rel=1e-12) and sent[0] > 0
    times = [COST.simulate(w, p.system).step_time_s for w, p in zip(pair, (uniform, skewed), strict=True)]
    assert times[1] > times[0]


def test_an_imbalance_beyond_the_ep_group_is_infeasible_in_one_line():
    with pytest.raises(InfeasibleError, match=r"imbalance 3.0 exceeds parallel.ep=2") as caught:
        GEN.generate(point(2, 2, **{"workload.routing": {"imbalance": 3.0, "source": "x"}}))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("routing", "fragment"),
    [({"imbalance": 1.5}, "needs routing.source"), ({"source": "x"}, r"imbalance is 1 \(uniform\); remove it")],
)
def test_an_imbalance_comes_with_its_source(routing, fragment):
    with pytest.raises(SpecError, match=fragment) as caught:
        point(2, 2, **{"workload.routing": routing})
    assert "\n" not in str(caught.value)


def test_a_prefill_pool_whose_ranks_are_not_whole_ep_groups_is_infeasible():
    """A pool's engines step in waves of `ep` ranks, so its `dp` ranks must make whole groups (serving.decode's
    validation says so for the decode pool): DeepSeek-R1's study priced a prefill pool of 4 TP8 ranks with EP 8 and
    crashed in the event simulation of its front (4 engines in waves of 8) instead of refusing it."""
    overrides = {"workload.mode": "serve", "workload.seq_len": None, "workload.global_batch": None}
    serving = {"isl": 64, "osl": 8, "rate_per_s": 1.0, "kind": "disaggregated", "decode": {"tp": 1, "dp": 4}}
    pool = make_point("tiny-moe", overrides=overrides | {"workload.serving": serving}, tp=2, ep=4, dp=2)
    reason = infeasibility(pool)
    assert reason is not None and "parallel.dp = 2" in reason and "parallel.ep = 4" in reason, reason
    whole = make_point("tiny-moe", overrides=overrides | {"workload.serving": serving}, tp=2, ep=2, dp=2)
    assert infeasibility(whole) is None
