"""Megatron-LM's communication overlaps as point fields (overlap_grad_reduce, overlap_param_gather, tp_comm_overlap,
overlap_p2p_comm), each pinned by a closed form on a tiny model whose compute is long beside its communication."""

from itertools import pairwise

import pytest
from helpers import make_point, run_cli

from dse.spec import DesignPoint
from dse.workload import OpKind
from generators.symbolic import SymbolicGenerator
from simulators.analytical import AnalyticalCostModel

GEN = SymbolicGenerator()
MODEL = AnalyticalCostModel()
TIMELINE = AnalyticalCostModel(timeline=True)
RING = {"base": "tiny-ring", "accelerator": {"overlap_slowdown": 0}}
"""Two rings of four H100s on a switch, compute beside communication not slowed: the closed forms are exact."""


def point(**parallel) -> DesignPoint:
    return make_point("tiny-llama", RING, seq_len=4096, global_batch=8, micro_batch=1, **parallel)


def blocks(p: DesignPoint, name: str) -> list:
    return [b for b in GEN.generate(p).blocks if b.name == name]


def comm_time(p: DesignPoint, kind: str, size: float, ranks: range) -> float:
    return MODEL.collective_time(kind, size, list(ranks), p.system)


def events(p: DesignPoint, rank_class: int = 0) -> list:
    result = TIMELINE.simulate(GEN.generate(p), p.system)
    return [e for e in result.timeline if e.rank_class == rank_class]


def step(p: DesignPoint) -> float:
    return TIMELINE.simulate(GEN.generate(p), p.system).step_time_s


# ---- overlap_param_gather ---------------------------------------------------------------------------------------


def test_overlapped_param_gather_moves_the_optimizers_all_gather_to_each_modules_first_forward():
    """The distributed optimizer's all-gather leaves the optimizer block; each module gathers its own weights
    instead, and over the stage's modules (a layer block once per layer) they gather what the optimizer did."""
    off, on = point(dp=8, zero=1), point(dp=8, zero=1, overlap_param_gather=True)
    (optimizer,) = blocks(off, "optimizer")
    gathered = sum(op.comm_bytes for op in optimizer.ops if op.kind is OpKind.COLLECTIVE)
    assert gathered > 0
    assert not [op for b in blocks(on, "optimizer") for op in b.ops if op.kind is OpKind.COLLECTIVE]
    layers = on.model.layers
    per_module = {
        name: sum(op.comm_bytes for b in blocks(on, name) for op in b.ops)
        for name in ("embed.params_gather", "layer.params_gather", "head.params_gather")
    }
    assert per_module["layer.params_gather"] > 0
    total = per_module["embed.params_gather"] + layers * per_module["layer.params_gather"]
    assert total + per_module["head.params_gather"] == pytest.approx(gathered, rel=1e-12)


def test_overlapped_param_gather_is_hidden_but_for_the_first_modules():
    """Each module's gather queues on the data-parallel stream from the step's start, and its first forward waits
    for it. With layer forwards longer than the gathers, only the embedding's gather and the first layer's are
    exposed, less the embedding's own forward (a lookup) that runs beside the latter: the step is the step
    without the optimizer's all-gather, plus those."""
    off, on = point(dp=8, zero=1), point(dp=8, zero=1, overlap_param_gather=True)
    dp = range(8)
    (optimizer,) = blocks(off, "optimizer")
    (ag,) = [op for op in optimizer.ops if op.kind is OpKind.COLLECTIVE]
    after_adam = comm_time(off, "all_gather", ag.comm_bytes, dp)
    embed, layer = (
        comm_time(on, "all_gather", sum(op.comm_bytes for b in blocks(on, name) for op in b.ops), dp)
        for name in ("embed.params_gather", "layer.params_gather")
    )
    lookup = next(e.end_s - e.start_s for e in events(off) if e.name == "embed")
    first = embed + layer - lookup
    assert step(on) == pytest.approx(step(off) - after_adam + first, rel=1e-9)


# ---- overlap_grad_reduce ----------------------------------------------------------------------------------------


def test_unoverlapped_grad_reduce_adds_the_reductions_the_backward_hid():
    """With overlap_grad_reduce each module's all-reduce runs beside the backward of the modules before it, all but
    the last (the embedding's) hidden under a long backward; without, all start when the backward has ended. The
    step grows by exactly the reductions that were hidden."""
    on, off = point(dp=8), point(dp=8, overlap_grad_reduce=False)
    syncs = {
        name: comm_time(on, "all_reduce", sum(op.comm_bytes for op in b.ops), range(8))
        for name in ("layer.grad_sync", "head.grad_sync")
        for b in blocks(on, name)
    }
    # the first layer's reduction is exposed either way, as the embedding's backward (a scatter-add) is short; with
    # the overlap it starts before that backward, without after it
    lookup = next(e.end_s - e.start_s for e in events(on) if e.name == "embed.backward")
    hidden = (on.model.layers - 1) * syncs["layer.grad_sync"] + syncs["head.grad_sync"] + lookup
    assert hidden > 0
    assert step(off) == pytest.approx(step(on) + hidden, rel=1e-9)


def test_unoverlapped_grad_reduce_under_the_distributed_optimizer_reduce_scatters_after_the_backward():
    timeline = events(point(dp=8, zero=1, overlap_grad_reduce=False))
    # the optimizer's passes (gradient clipping, Adam) follow the reductions; the backward ends before them
    backward_end = max(e.end_s for e in timeline if e.stream == "compute" and e.category != "optimizer")
    scatters = [e for e in timeline if e.name.endswith("grad_sync.reduce_scatter")]
    assert len(scatters) == 4 + 2 and min(e.start_s for e in scatters) == pytest.approx(backward_end, rel=1e-12)


# ---- tp_comm_overlap --------------------------------------------------------------------------------------------


def tp_point(overrides: dict | None = None, **parallel) -> DesignPoint:
    """Llama 3 70B's layer on a DGX H100's NVSwitch: GEMMs long beside their TP collectives, as TE's overlap needs.
    The network model prices the collectives (kernel_source: roofline): TE's userbuffers chunks are not NCCL calls,
    and the closed forms below are the model's."""
    accelerator = {"overlap_slowdown": 0, "kernel_source": "roofline"}
    system = {"base": "dgx-h100", "network": {1: {"npus": 1}}, "accelerator": accelerator}
    changes = {"model.layers": 2, **(overrides or {})}
    return make_point("llama3-70b", system, 4096, 8, 1, overrides=changes, tp=4, dp=2, sp=True, **parallel)


def named(timeline: list, name: str):
    (event,) = [e for e in timeline if e.name == name and e.start_s < timeline_first_layer_end(timeline)]
    return event


def timeline_first_layer_end(timeline: list) -> float:
    return next(e.end_s for e in timeline if e.name == "residual2")


def test_tp_comm_overlap_splits_each_collective_into_tp_chunks():
    """Forward of a layer: the two all-gathers as tp - 1 ring steps, the GEMMs they feed (wq, wk, wv; w1, w3) and
    the two GEMMs before a reduce-scatter (wo, w2) in tp chunks, each reduce-scatter in tp chunks."""
    tp = 4
    (plain,) = blocks(tp_point(), "layer.forward")
    (chunked,) = blocks(tp_point(tp_comm_overlap=True), "layer.forward")
    assert len(chunked.ops) == len(plain.ops) + 2 * (tp - 2) + 7 * (tp - 1) + 2 * (tp - 1)
    for category in ("all_gather", "reduce_scatter"):
        size = [sum(op.comm_bytes for op in b.ops if op.category == category) for b in (plain, chunked)]
        assert size[1] == pytest.approx(size[0], rel=1e-12)
    flops = [sum(op.flops for op in b.ops) for b in (plain, chunked)]
    assert flops[1] == pytest.approx(flops[0], rel=1e-12)


def test_tp_comm_overlap_exposes_one_reduce_scatter_chunk_and_no_ring_step():
    """Without the overlap, the output projection's reduce-scatter runs whole after it; with it, only the last of
    its tp chunks follows the last GEMM chunk. The all-gather's ring steps hide under the GEMM chunks (chunk 0
    reads the rank's own shard and starts at once), so QKV starts as the norm ends."""
    tp = 4
    plain, overlapped = events(tp_point()), events(tp_point(tp_comm_overlap=True))
    (scatter,) = [op for b in blocks(tp_point(), "layer.forward") for op in b.ops if op.name == "wo.reduce_scatter"]
    whole = comm_time(tp_point(), "reduce_scatter", scatter.comm_bytes, range(tp))
    chunk = comm_time(tp_point(), "reduce_scatter", scatter.comm_bytes / tp, range(tp))
    gemm_chunk = named(overlapped, "wo.chunk1")
    assert gemm_chunk.end_s - gemm_chunk.start_s > chunk  # the premise: each chunk's scatter hides under the next
    assert named(plain, "residual1").start_s - named(plain, "wo").end_s == pytest.approx(whole, rel=1e-9)
    exposed = named(overlapped, "residual1").start_s - named(overlapped, f"wo.chunk{tp - 1}").end_s
    assert exposed == pytest.approx(chunk, rel=1e-9)
    assert named(overlapped, "wq.chunk0").start_s == named(overlapped, "ln1").end_s
    steps = [e for e in overlapped if e.name == "ln1.all_gather.ring"][: tp - 1]
    for k, ring_step in enumerate(steps, start=1):
        assert named(overlapped, f"wq.chunk{k}").start_s >= ring_step.end_s
    qkv = [named(overlapped, f"{w}.chunk{k}") for k in range(tp) for w in ("wq", "wk", "wv")]
    assert all(b.start_s == a.end_s for a, b in pairwise(qkv))  # back to back: nothing exposed


def test_tp_comm_overlap_shortens_the_step_by_the_hidden_tp_communication():
    plain, overlapped = (
        MODEL.simulate(GEN.generate(p), p.system) for p in (tp_point(), tp_point(tp_comm_overlap=True))
    )
    assert overlapped.step_time_s < plain.step_time_s
    exposed = [sum(c.exposed_comm_s for c in r.classes) for r in (plain, overlapped)]
    assert exposed[1] < exposed[0] / 2


def test_a_chunked_gemm_is_a_gemm_of_its_share_of_the_tokens():
    """TE splits a GEMM beside its ring exchange or pipelined reduce-scatter along the tokens: each chunk is a GEMM
    of m / tp rows, which is the shape the measured kernel tables (the catalog H100's default) price it by; read at
    the whole GEMM's shape, tp chunks would cost tp whole GEMMs."""
    plain, overlapped = (GEN.generate(p) for p in (tp_point(), tp_point(tp_comm_overlap=True)))
    tables = {"system.accelerator.kernel_source": "tables"}
    priced = [
        MODEL.simulate(GEN.generate(p), p.system).step_time_s
        for p in (tp_point(overrides=tables), tp_point(tp_comm_overlap=True, overrides=tables))
    ]
    assert priced[1] < priced[0]
    whole = {op.name: op.gemm for block in plain.blocks for op in block.ops if op.gemm is not None}
    chunks = [op for block in overlapped.blocks for op in block.ops if op.gemm is not None and ".chunk" in op.name]
    assert chunks
    for op in chunks:
        batch, m, n, k = whole[op.name.rsplit(".chunk", 1)[0]]
        assert op.gemm == (batch, m / 4, n, k) and op.flops == pytest.approx(2 * batch * m / 4 * n * k)


# ---- overlap_p2p_comm -------------------------------------------------------------------------------------------


def pipeline_point(**parallel) -> DesignPoint:
    return point(pp=2, dp=4, **parallel)


def test_blocking_p2p_runs_no_compute_beside_a_stages_own_transfers():
    """Megatron without overlapped p2p waits for its batched sends and receives before the next compute: on every
    stage, no kernel runs while one of its transfers is in flight; with the overlap some do."""
    for overlap, expected in ((True, True), (False, False)):
        p = pipeline_point(overlap_p2p_comm=overlap)
        beside = False
        for stage in range(2):
            timeline = events(p, stage)
            transfers = [e for e in timeline if e.category in ("send", "recv") and e.end_s > e.start_s]
            kernels = [e for e in timeline if e.stream == "compute" and e.end_s > e.start_s]
            assert transfers
            beside |= any(k.start_s < t.end_s and t.start_s < k.end_s for t in transfers for k in kernels)
        assert beside is expected


def test_blocking_p2p_lengthens_the_step_by_at_most_the_transfers():
    """Each transfer a stage waits for is at most its own length on that stage's critical path."""
    on, off = pipeline_point(), pipeline_point(overlap_p2p_comm=False)
    transfers = sum(e.end_s - e.start_s for e in events(off, 0) if e.category == "send")
    longer = step(off) - step(on)
    assert 0 < longer <= transfers * (1 + 1e-9)


# ---- the step as priced before, studies, bad input --------------------------------------------------------------


KNOBS = {
    "param-gather": dict(overlap_param_gather=True, zero=1),
    "grad-reduce": dict(overlap_grad_reduce=False, zero=1),
    "tp-comm": dict(tp_comm_overlap=True, tp=2, sp=True, dp=2),
    "p2p": dict(overlap_p2p_comm=False),
}
VPP4 = dict(pp_schedule="interleaved", virtual_stages=4)
"""Interleaved over 4 chunks of tiny-llama's 4 layers on 2 stages: chunks without a layer."""


@pytest.mark.parametrize(
    "fields",
    [*KNOBS.values(), *(knob | VPP4 for name, knob in KNOBS.items() if name != "p2p")],
    ids=[*KNOBS, *(f"{name}-vpp4" for name in KNOBS if name != "p2p")],
)
def test_the_fast_path_prices_each_knob_as_the_reference_schedule(fields):
    p = make_point("tiny-llama", RING, seq_len=512, global_batch=64, **({"pp": 2, "dp": 4} | fields))
    workload = GEN.generate(p)
    fast = MODEL.simulate(workload, p.system).step_time_s
    assert fast == pytest.approx(AnalyticalCostModel(exact=True).simulate(workload, p.system).step_time_s, rel=1e-2)


def test_defaults_are_the_step_as_before_and_stay_out_of_the_point_key():
    implicit = point(dp=8, zero=1)
    explicit = point(dp=8, zero=1, overlap_grad_reduce=True, overlap_param_gather=False, tp_comm_overlap=False)
    assert implicit.key == explicit.key
    assert "overlap" not in implicit.parallel.model_dump_json()


def test_a_study_can_search_the_overlaps(tmp_path):
    study = tmp_path / "s.yaml"
    study.write_text(
        "name: overlaps\nobjectives: {step_time: minimize}\ntrials: 4\n"
        "base:\n  model: tiny-llama\n  workload: {mode: train, seq_len: 512, global_batch: 16}\n"
        "  parallel: {tp: 2, pp: 2, dp: 2, sp: true, zero: 1}\n  system: tiny-ring\n"
        "space:\n"
        "  parallel.tp_comm_overlap: {choices: [false, true]}\n"
        "  parallel.overlap_param_gather: {choices: [false, true]}\n"
        "  parallel.overlap_grad_reduce: {choices: [false, true]}\n"
        "  parallel.overlap_p2p_comm: {choices: [false, true]}\n"
    )
    code, out, err = run_cli("check", str(study))
    assert code == 0, err
    assert "16 points in the space" in out


@pytest.mark.parametrize(
    ("fields", "fragments"),
    [
        ("dp: 8, tp_comm_overlap: true", ["field 'parallel.tp_comm_overlap'", "parallel.sp: true"]),
        ("dp: 8, overlap_param_gather: true", ["field 'parallel.overlap_param_gather'", "parallel.zero 1 or 2"]),
        ("dp: 8, zero: 3, overlap_grad_reduce: false", ["field 'parallel.overlap_grad_reduce'", "0, 1 or 2"]),
        ("dp: 8, overlap_p2p_comm: false", ["field 'parallel.overlap_p2p_comm'", "parallel.pp above 1"]),
        ("dp: 8, tp_comm_overlap: 1", ["field 'parallel.tp_comm_overlap'"]),
        (
            "dp: 4, pp: 2, pp_schedule: interleaved, virtual_stages: 2, overlap_p2p_comm: false",
            ["overlap_p2p_comm=false with parallel.pp_schedule=interleaved is not supported yet", "1f1b or gpipe"],
        ),
    ],
    ids=[
        "tp-comm-without-sp",
        "param-gather-without-zero",
        "grad-reduce-under-fsdp",
        "p2p-without-pp",
        "not-a-flag",
        "blocking-p2p-interleaved",
    ],
)
def test_an_overlap_that_cannot_take_effect_is_one_line_and_exit_2(tmp_path, fields, fragments):
    path = tmp_path / "p.yaml"
    path.write_text(
        f"model: tiny-llama\nworkload: {{seq_len: 256, global_batch: 16}}\nparallel: {{{fields}}}\nsystem: tiny-ring\n"
    )
    code, out, err = run_cli("evaluate", str(path), "--json")
    assert (code, out) == (2, ""), err
    assert err.count("\n") == 1 and err.startswith(f"error: {path}: "), err
    for fragment in fragments:
        assert fragment in err


def test_unoverlapped_grad_reduce_after_a_blocking_last_send_prices_as_the_reference():
    """Without either overlap, the reductions start once the last backward and its blocking send are done (the
    fast path priced the optimizer reading both 2.4% off the reference before they were chained so)."""
    p = make_point("tiny-llama", RING, 256, 6, pp=4, dp=2, overlap_grad_reduce=False, overlap_p2p_comm=False)
    workload = GEN.generate(p)
    fast = MODEL.simulate(workload, p.system).step_time_s
    assert fast == pytest.approx(AnalyticalCostModel(exact=True).simulate(workload, p.system).step_time_s, rel=1e-9)


@pytest.mark.parametrize(
    ("model", "fields"),
    [
        ("tiny-deepseek", dict(cp=2, cp_algorithm="ring", dp=2, ep=2)),
        ("tiny-moe", dict(dp=4, ep=2, recompute="full")),
        ("tiny-hybrid", dict(dp=2, pp=2, layer_strategies=["tp", "dp"])),
    ],
    ids=["mla-moe-ring-cp", "moe-full-recompute", "hybrid-mixed-layers"],
)
def test_tp_comm_overlap_keeps_every_kernel_and_byte_of_any_layer(model, fields):
    """The rewrite splits and reorders, never adds or drops: the same FLOPs and communicated bytes, every op after
    what it reads, and a step the fast path prices as the reference does (a ring's p2p stays paired)."""
    plain, overlapped = (
        make_point(model, RING, 256, 16, tp=2, sp=True, tp_comm_overlap=on, **fields) for on in (False, True)
    )
    workloads = [GEN.generate(p) for p in (plain, overlapped)]
    for what in ("flops", "comm_bytes"):
        totals = [sum(getattr(op, what) for b in w.blocks for op in b.ops) for w in workloads]
        assert totals[1] == pytest.approx(totals[0], rel=1e-12)
    assert all(d < i for b in workloads[1].blocks for i, op in enumerate(b.ops) for d in op.deps)
    fast = MODEL.simulate(workloads[1], overlapped.system).step_time_s
    exact = AnalyticalCostModel(exact=True).simulate(workloads[1], overlapped.system).step_time_s
    assert fast == pytest.approx(exact, rel=1e-2)
