"""Scheduling choices as point fields (issue 22's graph passes): `parallel.grad_bucket_mb`, the data-parallel gradient
reduction in buckets that span modules as Megatron's and PyTorch's DDP pack them, and `parallel.fsdp_prefetch`,
how many modules ahead ZeRO-3's weight all-gathers are issued. Closed forms on tiny-llama (h 256, kv 128, ffn 688,
vocab 1024, 4 layers, bf16, untied), the fx generator's agreement, studies searching them, bad input."""

import pytest
from helpers import make_point, run_cli

from dse.workload import Program, Workload
from generators.symbolic import SymbolicGenerator, count_parameters
from generators.symbolic.blocks import layer_keys
from generators.symbolic.buckets import MIB
from generators.symbolic.recording import trace_structure
from generators.symbolic.skeleton import schedule_affinity
from simulators.analytical import AnalyticalCostModel

GEN = SymbolicGenerator()
MODEL = AnalyticalCostModel()
H, KV, FFN, VOCAB, LAYERS, ITEM = 256, 128, 688, 1024, 4, 2
MATRICES = [H * H, H * KV, H * KV, H * H, H * FFN, H * FFN, H * FFN]
"""Elements of a layer's weight matrices (wq, wk, wv, wo, w1, w2, w3); its two norms have H each."""
LAYER_BYTES = (sum(MATRICES) + 2 * H) * ITEM
HEAD_BYTES, EMBED_BYTES = (VOCAB * H + H) * ITEM, VOCAB * H * ITEM
"""The output layer with the final norm, and the token table."""
TOTAL = LAYERS * LAYER_BYTES + HEAD_BYTES + EMBED_BYTES


def point(**parallel):
    return make_point("tiny-llama", "tiny-ring", 256, 16, **parallel)


def sync_calls(workload: Workload, program: Program) -> list[tuple[int, float]]:
    """(call, bytes) of the gradient collectives a program issues (the tied weight's exchange is a p2p)."""
    out = []
    for c, call in enumerate(program.calls):
        b = workload.blocks[call.block]
        if "grad_sync" in b.name:
            out.append((c, sum(op.comm_bytes for op in b.ops)))
    return out


def backward_calls(workload: Workload, program: Program) -> dict[tuple[int, int], int]:
    """Per (module, micro-batch), the last backward call (the weight half under zero bubble) of the module."""
    last = {}
    for c, call in enumerate(program.calls):
        name = workload.blocks[call.block].name
        if ".backward" in name and not name.endswith(".gather"):
            last[(call.layer, call.microbatch)] = c
    return last


# ---- grad_bucket_mb -----------------------------------------------------------------------------------------


def test_closed_forms_of_the_buckets_one_per_module_per_parameter_and_one_for_the_model():
    """Unset: one collective per module, each its module's bytes. A bucket smaller than every weight matrix but
    larger than a norm: one per matrix (7 a layer, the output layer, the token table), each norm packed with the
    matrix after it. A bucket larger than the model: one collective of every gradient, after the last backward
    (the embedding's). The bytes reduced are the model's gradients whatever the bucket size."""
    assert count_parameters(point(dp=8)) * ITEM == TOTAL
    expected = {None: [HEAD_BYTES] + [LAYER_BYTES] * LAYERS + [EMBED_BYTES]}
    for mb, count in ((None, LAYERS + 2), (2 * H * ITEM / MIB, 7 * LAYERS + 2), (1000.0, 1)):
        p = point(dp=8, zero=1, grad_bucket_mb=mb)
        workload = GEN.generate(p)
        program = workload.programs[0]
        calls = sync_calls(workload, program)
        assert len(calls) == count
        assert sum(size for _, size in calls) == TOTAL
        if mb in expected:
            assert [size for _, size in calls] == expected[mb]
        if mb is not None:
            assert all(size >= mb * MIB for _, size in calls[:-1])
    # the one bucket of the whole model: after the embedding's backward of the last micro-batch, the last one
    ((c, _),) = calls
    backward = backward_calls(workload, program)
    assert program.calls[c].inputs == (backward[(-1, p.micro_batches - 1)],) and c > max(backward.values())


@pytest.mark.parametrize("mb", [0.2, 0.6, 1.0, 2.5])
def test_a_bucket_closes_at_the_parameter_that_fills_it_and_starts_after_its_last_module(mb):
    """Every bucket but the last holds at least the bucket size and less than that plus one parameter (the
    largest is w1's, H x FFN); each starts as the backward of the module that completed it ends, waiting for
    that backward alone; with ZeRO 2 reducing per micro-batch, every micro-batch's backward fills them."""
    largest = H * FFN * ITEM
    for fields, microbatches in ((dict(zero=1), 1), (dict(zero=2, grad_reduce="per_microbatch"), 2)):
        p = point(dp=8, grad_bucket_mb=mb, **fields)
        workload = GEN.generate(p)
        program = workload.programs[0]
        calls = sync_calls(workload, program)
        assert sum(size for _, size in calls) == TOTAL * microbatches
        backward = backward_calls(workload, program)
        per_step = len(calls) // microbatches
        for i, (c, size) in enumerate(calls):
            call = program.calls[c]
            assert call.inputs == (backward[(call.layer, call.microbatch)],)
            if (i + 1) % per_step:
                assert mb * MIB <= size < mb * MIB + largest


def test_a_bucket_waits_for_the_last_of_its_modules_under_zero_bubble():
    """zb_h1 runs the embedding's backward whole and defers the layers' weight halves: the first stage's one
    bucket (embedding and layers 0-1) starts after the last weight half, not after the embedding's backward."""
    p = point(dp=4, pp=2, zero=1, pp_schedule="zb_h1", grad_bucket_mb=1000.0)
    workload = GEN.generate(p)
    program = workload.programs[0]
    ((c, size),) = sync_calls(workload, program)
    assert size == 2 * LAYER_BYTES + EMBED_BYTES
    backward = backward_calls(workload, program)
    last_mb = p.micro_batches - 1
    ends = [backward[(index, last_mb)] for index in (-1, 0, 1)]
    assert program.calls[c].inputs == (max(ends),) and max(ends) != backward[(-1, last_mb)]


def test_buckets_per_model_chunk_and_with_tp_norm_reductions():
    """Interleaved stages: a bucket per model chunk (Megatron wraps each chunk in a DDP of its own). With tp and
    sp the norms' gradients are all-reduced over tp: a stream of its own, packed by the same rule."""
    p = point(dp=4, pp=2, zero=1, pp_schedule="interleaved", virtual_stages=2, grad_bucket_mb=1000.0)
    workload = GEN.generate(p)
    assert [len(sync_calls(workload, program)) for program in workload.programs] == [2, 2]
    p = point(dp=4, tp=2, sp=True, zero=1, grad_bucket_mb=1000.0)
    workload = GEN.generate(p)
    ops = [
        (op.category, op.axis)
        for c, _ in sync_calls(workload, workload.programs[0])
        for op in workload.blocks[workload.programs[0].calls[c].block].ops
    ]
    assert sorted(ops) == [("all_reduce", "tp"), ("reduce_scatter", "dp")]


def test_smaller_buckets_cost_latency():
    """Each collective pays the network's latency: a bucket per matrix takes longer than one per module."""
    times = [
        MODEL.simulate(GEN.generate(p), p.system).step_time_s for p in (point(dp=8), point(dp=8, grad_bucket_mb=0.01))
    ]
    assert times[1] > times[0]


# ---- fsdp_prefetch ------------------------------------------------------------------------------------------


def test_each_more_module_of_prefetch_holds_one_more_layers_weights_and_none_exposes_the_gathers():
    """Depth d: d + 1 gathers issued before the first module runs, up to d + 1 modules' weights gathered at once,
    so the peak (at the backward's start, layers ahead) rises by one layer's gathered weights per module of depth
    (and the allocator's fragmentation share of them). Without prefetch each module waits for its own gather: the
    step is longer and the peak lower."""
    results, firsts = [], []
    for depth in (0, 1, 2, 3):
        p = point(dp=8, zero=3, fsdp_prefetch=depth)
        workload = GEN.generate(p)
        program = workload.programs[0]
        names = [workload.blocks[call.block].name for call in program.calls]
        firsts.append(names.index("embed.forward"))
        results.append(MODEL.simulate(workload, p.system))
    assert firsts == [1, 2, 3, 4]
    share = 1 + p.system.accelerator.fragmentation
    peaks = [r.peak_memory_bytes for r in results]
    for depth in (1, 2):
        assert peaks[depth + 1] - peaks[depth] == pytest.approx(LAYER_BYTES * share, rel=1e-9)
    assert peaks[1] - peaks[0] >= LAYER_BYTES * share
    assert results[0].step_time_s > results[1].step_time_s
    assert results[0].exposed_comm_time_s > results[1].exposed_comm_time_s


# ---- caches, keys, the fx generator, studies -----------------------------------------------------------------


def test_the_knobs_share_recordings_but_not_schedules_and_stay_out_of_default_keys():
    base, bucketed = point(dp=8, zero=1), point(dp=8, zero=1, grad_bucket_mb=25.0)
    fsdp, deeper = point(dp=8, zero=3), point(dp=8, zero=3, fsdp_prefetch=2)
    keys = layer_keys([("attn", "dense")] * LAYERS, base.parallel)
    assert trace_structure(base, keys) == trace_structure(bucketed, keys)
    assert trace_structure(fsdp, keys) == trace_structure(deeper, keys)
    assert schedule_affinity(base) != schedule_affinity(bucketed)
    assert schedule_affinity(fsdp) != schedule_affinity(deeper)
    assert fsdp.key == point(dp=8, zero=3, fsdp_prefetch=1).key and "prefetch" not in fsdp.parallel.model_dump_json()
    assert "bucket" not in base.parallel.model_dump_json()


def test_a_bucket_plan_replayed_on_other_sizes_is_that_sizes_own():
    """Points of one structure share a recording and, where their bucket plans agree, a schedule skeleton; a
    wider model packs other buckets, whose calls are its own (every bucket but the last at least the size)."""
    for hidden in (256, 512, 256):
        p = make_point(
            "tiny-llama",
            "tiny-ring",
            256,
            16,
            dp=8,
            zero=1,
            grad_bucket_mb=0.6,
            overrides={"model.hidden": hidden} if hidden != H else None,
        )
        workload = GEN.generate(p)
        calls = sync_calls(workload, workload.programs[0])
        assert sum(size for _, size in calls) == count_parameters(p) * ITEM
        assert all(size >= 0.6 * MIB for _, size in calls[:-1])


@pytest.mark.parametrize(
    "fields",
    [dict(tp=2, dp=4, sp=True, zero=1, grad_bucket_mb=0.3), dict(tp=2, dp=4, sp=True, zero=3, fsdp_prefetch=2)],
    ids=["buckets", "prefetch"],
)
def test_the_fx_generator_issues_the_same_collectives(fields):
    pytest.importorskip("torch")
    from generators.fx.generator import FxGenerator

    p = make_point(seq_len=256, overrides={"model.fx_factory": "fx_tiny_llama:llama"}, **fields)
    workloads = [FxGenerator().generate(p), SymbolicGenerator().generate(p)]

    def scheduled(workload: Workload) -> list[tuple]:
        out = []
        for program in workload.programs:
            for call in program.calls:
                b = workload.blocks[call.block]
                if "grad_sync" in b.name or b.name.endswith(".gather"):
                    out.append((b.name, call.layer, call.microbatch, call.inputs, b.ops))
        return out

    ours, theirs = (scheduled(w) for w in workloads)
    assert ours == theirs and ours


def test_a_study_searches_the_knobs(tmp_path):
    study = tmp_path / "s.yaml"
    study.write_text(
        "name: knobs\nobjectives: {step_time: minimize, peak_memory: minimize}\ntrials: 4\n"
        "base:\n  model: tiny-llama\n  workload: {mode: train, seq_len: 256, global_batch: 16}\n"
        "  parallel: {dp: 8}\n  system: tiny-ring\n"
        "space:\n"
        "  parallel.zero: {choices: [1, 3]}\n"
        "  parallel.grad_bucket_mb: {choices: [25, 40.5, 200]}\n"
        "  parallel.fsdp_prefetch: {low: 0, high: 3}\n"
    )
    code, out, err = run_cli("check", str(study))
    assert code == 0, err
    assert "24 points in the space" in out


@pytest.mark.parametrize(
    ("fields", "fragments"),
    [
        ("dp: 8, grad_bucket_mb: -25", ["field 'parallel.grad_bucket_mb'", "above 0"]),
        ("dp: 8, grad_bucket_mb: 0", ["field 'parallel.grad_bucket_mb'", "above 0"]),
        ("dp: 8, zero: 3, grad_bucket_mb: 25", ["field 'parallel.grad_bucket_mb'", "parallel.zero 0, 1 or 2"]),
        ("dp: 8, zero: 3, fsdp_prefetch: -1", ["field 'parallel.fsdp_prefetch'", "at least 0"]),
        ("dp: 8, zero: 3, fsdp_prefetch: 1.5", ["field 'parallel.fsdp_prefetch'", "integer"]),
        ("dp: 8, zero: 1, fsdp_prefetch: 2", ["field 'parallel.fsdp_prefetch'", "parallel.zero: 3"]),
        ("dp: 8, zero: 3, fsdp_prefetch: 0", ["field 'parallel.fsdp_prefetch'", "workload.mode: train"]),
        ("dp: 8, grad_bucket_mb: 25", ["field 'parallel.grad_bucket_mb'", "workload.mode: train"]),
    ],
    ids=[
        "bucket-negative",
        "bucket-zero",
        "bucket-under-fsdp",
        "prefetch-negative",
        "prefetch-fraction",
        "prefetch-without-fsdp",
        "prefetch-in-prefill",
        "bucket-in-prefill",
    ],
)
def test_bad_knobs_give_one_line_naming_the_field(tmp_path, fields, fragments):
    mode = "prefill" if "workload.mode: train" in fragments else "train"
    path = tmp_path / "p.yaml"
    path.write_text(
        f"model: tiny-llama\nworkload: {{mode: {mode}, seq_len: 256, global_batch: 16}}\n"
        f"parallel: {{{fields}}}\nsystem: tiny-ring\n"
    )
    code, out, err = run_cli("evaluate", str(path), "--json")
    assert (code, out) == (2, ""), err
    assert err.count("\n") == 1 and err.startswith(f"error: {path}: "), err
    for fragment in fragments:
        assert fragment in err
