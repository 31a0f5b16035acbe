"""The fx generator: a LLaMA block stack in plain PyTorch (tests/fx_tiny_llama.py) captured on fake tensors under
a fake process group, lowered to the IR, and checked against closed forms and against the symbolic generator on the
same catalog model (tiny-llama)."""

from collections import Counter

import pandas as pd
import pytest
import yaml

pytest.importorskip("torch")

from conftest import ROOT, patience
from helpers import installed_plugin, make_point

from dse.cli.main import main
from dse.errors import DseError, InfeasibleError, PluginError, SpecError
from dse.workload import Block, Collective, OpKind, Workload
from generators import fx
from generators.fx.capture import CaptureError
from generators.fx.generator import LAYER, FxGenerator
from generators.symbolic import SymbolicGenerator, count_parameters
from simulators.analytical import AnalyticalCostModel

FACTORY = {"model.fx_factory": "fx_tiny_llama:llama"}
SEQ, BATCH, HIDDEN = 256, 1, 256
SMALL = yaml.safe_load((ROOT / "studies" / "small.yaml").read_text())
ACTIVATION = BATCH * SEQ * HIDDEN * 2
"""Bytes of one micro-batch's b x s x h bf16 activation: a TP collective's size in the nccl-tests convention."""


@pytest.fixture(scope="module")
def generator() -> FxGenerator:
    """One generator for the module, so that points of one layer shape share a capture as a study's would."""
    return FxGenerator()


def point(factory: dict | None = None, **parallel):
    return make_point(seq_len=SEQ, micro_batch=BATCH, overrides=FACTORY if factory is None else factory, **parallel)


def block(workload: Workload, name: str) -> Block:
    return next(b for b in workload.blocks if b.name == name)


def comm(b: Block) -> Counter:
    """Bytes per collective kind of a block."""
    out: Counter = Counter()
    for op in b.ops:
        if op.kind is OpKind.COLLECTIVE:
            out[op.category] += op.comm_bytes
    return out


def kinds(b: Block) -> Counter:
    return Counter(op.category for op in b.ops if op.kind is OpKind.COLLECTIVE)


def gemm_flops(b: Block) -> float:
    return sum(op.flops for op in b.ops if op.category == "gemm")


def test_tp_with_sp_gathers_and_scatters_each_branch(generator):
    """Megatron SP: per branch an all-gather before the column-parallel GEMMs and a reduce-scatter after the
    row-parallel one, forward and backward, all of b x s x h on the tp axis, and in backward the branch input
    gathered again for the weight gradients (its gathered copy is not kept from the forward: the layer keeps its
    sequence shards); attention one fused op each way."""
    p = point(tp=2, dp=2, sp=True)
    workload = generator.generate(p)
    fwd, bwd = block(workload, "layer.forward"), block(workload, "layer.backward")
    for b, gathers in ((fwd, 2), (bwd, 4)):
        assert kinds(b) == {Collective.ALL_GATHER: gathers, Collective.REDUCE_SCATTER: 2}
        assert comm(b) == {Collective.ALL_GATHER: gathers * ACTIVATION, Collective.REDUCE_SCATTER: 2 * ACTIVATION}
        assert {op.axis for op in b.ops if op.kind is OpKind.COLLECTIVE} == {"tp"}
        (attention,) = [op for op in b.ops if op.category == "attention"]
        assert attention.attention is not None and attention.attention.causal
        assert attention.attention.backward == (b is bwd)
    # the norms, decomposed into elementwise ATen ops, are one norm kernel each; the backward has their backwards
    # (the norms' outputs are kept as their sequence shards, which backward gathers again, as Megatron's SP does)
    assert [sum(op.category == "norm" for op in b.ops) for b in (fwd, bwd)] == [2, 2]
    # what reads a collective's result waits for it, and nothing else does: the overlap the graph allows
    gather = next(i for i, op in enumerate(fwd.ops) if op.category == Collective.ALL_GATHER)
    readers = [op for op in fwd.ops if gather in op.deps]
    assert readers and all(op.category == "gemm" for op in readers[:3])
    assert generator.layer(p).forward.saved_bytes > 0


def test_tp_without_sp_all_reduces_twice_per_layer_each_way(generator):
    workload = generator.generate(point(tp=2, dp=2))
    for name in ("layer.forward", "layer.backward"):
        assert comm(block(workload, name)) == {Collective.ALL_REDUCE: 2 * ACTIVATION}
        assert kinds(block(workload, name)) == {Collective.ALL_REDUCE: 2}


@pytest.mark.parametrize(
    "parallel",
    [
        {"tp": 1, "dp": 2},
        {"tp": 2, "dp": 2},
        {"tp": 2, "dp": 2, "sp": True},
        {"tp": 1, "dp": 4, "zero": 3},
        {"tp": 2, "dp": 2, "pp": 2, "sp": True, "zero": 3},
        {"tp": 2, "dp": 2, "pp": 2, "sp": True, "pp_schedule": "zb_h1"},
    ],
)
def test_agrees_with_symbolic(generator, parallel):
    """Same catalog model and degrees: GEMM FLOPs and bytes per collective kind exact (ZeRO-3's gathers and
    reduce-scatters are the symbolic ones, synthesised), the rest of the step (DP sync, optimizer) the symbolic
    one's, the step time within 15 % and the peak memory within 5 %."""
    p = point(**parallel)
    fx_workload, symbolic = generator.generate(p), SymbolicGenerator().generate(p)
    names = [b.name for b in symbolic.blocks if b.name.startswith(("layer.forward", "layer.backward"))]
    assert names == [b.name for b in fx_workload.blocks if b.name.startswith(("layer.forward", "layer.backward"))]
    for name in names:
        ours, theirs = block(fx_workload, name), block(symbolic, name)
        assert gemm_flops(ours) == pytest.approx(gemm_flops(theirs), rel=1e-9)
        assert comm(ours) == comm(theirs)
    synced = [b for b in symbolic.blocks if b.name.endswith("grad_sync") or b.name.endswith("post_backward")]
    assert synced == [b for b in fx_workload.blocks if b in synced]
    model = AnalyticalCostModel()
    ours, theirs = model.simulate(fx_workload, p.system), model.simulate(symbolic, p.system)
    assert ours.step_time_s == pytest.approx(theirs.step_time_s, rel=0.15)
    assert ours.peak_memory_bytes == pytest.approx(theirs.peak_memory_bytes, rel=0.05)
    assert generator.layer(p).captured.parameters == count_parameters(p)


def test_eager_kernels_run_each_aten_op_alone(generator):
    """workload.kernels eager prices every elementwise ATen op as its kernel; fused (the default) fuses each run of
    them into one, as inductor does: fewer ops, less HBM traffic, the same FLOPs."""
    fused = block(generator.generate(point(tp=2, sp=True)), "layer.forward")
    eager = block(generator.generate(point({**FACTORY, "workload.kernels": "eager"}, tp=2, sp=True)), "layer.forward")
    assert len(eager.ops) > len(fused.ops)
    assert sum(op.flops for op in eager.ops) == pytest.approx(sum(op.flops for op in fused.ops))
    assert sum(op.bytes for op in eager.ops) > sum(op.bytes for op in fused.ops)


def test_full_recompute_captures_the_block_under_activation_checkpointing(generator):
    """The forward keeps only the layer's input (its sequence shard); the backward runs attention again, and the
    whole forward with it, as Megatron's full recompute does: the last GEMM, whose output nothing reads, and its
    reduce-scatter included, so the backward's GEMM FLOPs and collectives are the symbolic ones exactly."""
    p = point(tp=2, dp=2, sp=True, recompute="full")
    layer = generator.layer(p)
    assert layer.forward.saved_bytes == ACTIVATION / 2
    backward = layer.backward.block
    assert sum(op.category == "attention" for op in backward.ops) == 2
    ours, theirs = generator.generate(p), SymbolicGenerator().generate(p)
    assert gemm_flops(block(ours, "layer.backward")) == pytest.approx(gemm_flops(block(theirs, "layer.backward")))
    assert comm(block(ours, "layer.backward")) == comm(block(theirs, "layer.backward"))
    model = AnalyticalCostModel()
    assert model.simulate(ours, p.system).peak_memory_bytes == pytest.approx(
        model.simulate(theirs, p.system).peak_memory_bytes, rel=0.05
    )


def test_prefill_captures_the_forward_alone(generator):
    """Inference: the block's forward graph without autograd; no backward, and the KV cache the symbolic
    generator holds (the model code writes none: its two cache-write ops are the difference)."""
    p = point({**FACTORY, "workload.mode": "prefill"}, tp=2, dp=2, sp=True)
    ours, theirs = generator.generate(p), SymbolicGenerator().generate(p)
    assert generator.layer(p).backward is None
    assert not any(b.name.startswith("layer.backward") for b in ours.blocks)
    fwd, symbolic_fwd = block(ours, "layer.forward"), block(theirs, "layer.forward")
    assert gemm_flops(fwd) == gemm_flops(symbolic_fwd) and comm(fwd) == comm(symbolic_fwd)
    model = AnalyticalCostModel()
    assert model.simulate(ours, p.system).peak_memory_bytes == pytest.approx(
        model.simulate(theirs, p.system).peak_memory_bytes, rel=0.05
    )


def test_capture_is_reused_across_points_of_one_layer_shape(generator):
    """dp, pp, the global batch and the system leave the layer's graphs as they are: captured once."""
    generator.generate(point(tp=2, dp=2, sp=True))
    for parallel in ({"tp": 2, "dp": 4, "sp": True}, {"tp": 2, "pp": 2, "sp": True}):
        workload = generator.generate(point(**parallel))
        assert generator.last_capture_s == 0.0
        assert AnalyticalCostModel().simulate(workload, make_point().system).step_time_s > 0
    generator.generate(make_point(seq_len=128, overrides=FACTORY, tp=2, sp=True))
    assert generator.last_capture_s > 0


def test_larger_micro_batches_are_scaled_from_two_captures(generator):
    """Beyond micro-batch 3 a layer is the line through its captures at 2 and 3: every op, the saved activations
    and the temporaries as a capture at that micro-batch gives them; later micro-batches capture nothing."""
    p = make_point(seq_len=SEQ, micro_batch=4, overrides=FACTORY, tp=2, dp=2, sp=True)
    scaled = generator.layer(p)
    assert generator.last_capture_s > 0
    captured = FxGenerator()._captured(p, 4, LAYER)
    assert scaled.forward == captured.forward and scaled.backward == captured.backward
    generator.layer(make_point(seq_len=SEQ, micro_batch=6, global_batch=12, overrides=FACTORY, tp=2, dp=2, sp=True))
    assert generator.last_capture_s == 0.0


def test_uncapturable_model_fails_with_one_line_naming_the_module(generator):
    with pytest.raises(CaptureError) as caught:
        generator.generate(point({"model.fx_factory": "fx_tiny_llama:branching"}, tp=2))
    message = str(caught.value)
    assert "\n" not in message
    assert "Data-dependent branching" in message and "module 'feed_forward'" in message


def test_what_it_does_not_build_is_named(generator):
    with pytest.raises(InfeasibleError, match=r"field 'parallel\.tp_comm_overlap'"):
        generator.generate(point(tp=2, sp=True, tp_comm_overlap=True))
    with pytest.raises(InfeasibleError, match=r"field 'parallel\.cp'"):
        generator.generate(point(cp=2))


def test_factories_by_name(generator, tmp_path, monkeypatch):
    """A factory registered in `dse.fx_models`, the family's when the model names none, and a one-line error
    naming model.fx_factory for an unknown one."""
    from generators.fx import factories

    entry = "[dse.fx_models]\ntiny-test = fx_tiny_llama:llama\n"
    with installed_plugin(tmp_path, monkeypatch, "fx_tiny", entry, [factories._registered]):
        assert generator.generate(point({"model.fx_factory": "tiny-test"}, tp=2)).blocks
        with pytest.raises(SpecError, match=r"field 'model.fx_factory': no FX model factory 'nope'.*tiny-test"):
            generator.generate(point({"model.fx_factory": "nope"}))


def test_without_torch_choosing_fx_says_how_to_install(monkeypatch):
    monkeypatch.setattr(fx, "find_spec", lambda name: None)
    with pytest.raises(PluginError, match=r"pip install 'dse-orchestrator\[fx\]'") as caught:
        fx.fx_generator()
    assert isinstance(caught.value, DseError)


SPACE = {"parallel.tp": {"choices": [1, 2]}, "parallel.pp": {"choices": [1, 2]}}


def test_a_study_with_the_fx_generator_runs_end_to_end(tmp_path):
    """`generator: fx` on the analytical model: its points priced, and a model it cannot capture fails its trials
    with the module named, the study going on to its end and exiting 3 (no trial has a result)."""
    base = {**SMALL["base"], "model": {"base": "tiny-llama", "fx_factory": "fx_tiny_llama:llama"}}
    study = {**SMALL, "generator": "fx", "trials": 4, "base": base, "space": SPACE}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    assert main(["run", str(path), "--out", str(tmp_path / "out"), "--inline"]) == 0
    frame = pd.read_parquet(tmp_path / "out" / "trials.parquet")
    assert (frame["state"] == "COMPLETE").all() and (frame["step_time_s"] > 0).all()

    base["model"]["fx_factory"] = "fx_tiny_llama:branching"
    path.write_text(yaml.safe_dump({**study, "trials": 2}, sort_keys=False))
    assert main(["run", str(path), "--out", str(tmp_path / "bad"), "--inline"]) == 3
    frame = pd.read_parquet(tmp_path / "bad" / "trials.parquet")
    assert (frame["state"] == "FAIL").all()
    assert frame["reason"].str.contains("Data-dependent branching in module 'feed_forward'").all()


def test_its_chakra_export_runs_in_astrasim(generator, binary):
    """The captured step, exported as Chakra traces, runs to completion in the real ASTRA-sim and agrees with the
    analytical model as a symbolic step does (within 3 %)."""
    from simulators.astrasim import AstraSimCostModel

    p = point(tp=2, dp=2, pp=2, sp=True)
    workload = generator.generate(p)
    astrasim = AstraSimCostModel(options=AstraSimCostModel.Options(binary=str(binary), timeout_s=patience(120)))
    simulated = astrasim.simulate(workload, p.system).step_time_s
    assert simulated == pytest.approx(AnalyticalCostModel().simulate(workload, p.system).step_time_s, rel=0.03)
