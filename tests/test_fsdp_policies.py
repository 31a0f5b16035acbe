"""ZeRO's gather, reduce and group policies (`parallel.reshard_after_forward`, `grad_reduce`, `dp_shard`) against
closed forms.

tiny-llama (h = 256, ffn 688, vocab V = 1024, untied) in bf16: a layer holds N = 2 h^2 + 2 h^2 / 2 + 3 h f + 2 h
elements, the embedding V h, the head V h + h. On two pipeline stages the first holds the embedding and layers 0
and 1: its weights are W0 = 2 (V h + 2 N) bytes. A layer's forward and backward each read its gathered weights,
the embedding's forward only (its backward scatters into the table without reading it).
"""

from collections import Counter
from dataclasses import replace

import pytest
from helpers import run_cli

from dse.search.decoding import decode
from dse.search.space import load_study
from dse.workload import Collective, TensorKind
from generators.symbolic import SymbolicGenerator
from simulators.analytical import AnalyticalCostModel
from tests.helpers import make_point

H, F, V = 256, 688, 1024
N = 2 * H * H + 2 * H * H // 2 + 3 * H * F + 2 * H
EMBED = V * H
W0 = 2 * (EMBED + 2 * N)
"""Bytes of the first stage's weights, unsharded (bf16)."""
M = 4
"""Micro-batches per step of the points below: global batch 16 over dp 4."""


def _point(pp: int = 2, **parallel):
    return make_point(global_batch=16, dp=8 // pp, pp=pp, zero=3, **parallel)


def _comm(point, category: str, stage: int = 0) -> Counter:
    """Per axis, the bytes of a stage's `category` collectives over one step."""
    workload = SymbolicGenerator().generate(point)
    totals: Counter = Counter()
    for call in workload.programs[stage].calls:
        for op in workload.blocks[call.block].ops:
            if op.category == category:
                totals[op.axis] += op.comm_bytes
    return totals


def _fixed(point, kind: TensorKind, stage: int = 0) -> float:
    program = SymbolicGenerator().generate(point).programs[stage]
    return sum(t.bytes for t in program.tensors if t.kind is kind and (t.producer is None or t.producer < 0))


def test_resharding_after_forward_gathers_a_layer_twice_per_micro_batch_and_keeping_it_once_per_step():
    """True: every micro-batch gathers each layer for its forward and again for its backward, the embedding for
    its forward; False under pipelining: the first micro-batch's forward gathers each module and the weights stay
    gathered for the whole step (torch.distributed.pipelining keeps them after backward); auto is False there."""
    resharded = _comm(_point(reshard_after_forward=True), Collective.ALL_GATHER)
    kept = _comm(_point(reshard_after_forward=False), Collective.ALL_GATHER)
    assert resharded == {"dp": M * (2 * EMBED + 2 * 2 * (2 * N))}
    assert kept == {"dp": W0}
    assert _comm(_point(), Collective.ALL_GATHER) == kept


def test_without_pipelining_auto_reshards_and_false_gathers_once_per_micro_batch():
    """pp 1 (dp 8, two micro-batches): auto is True (torchtitan) but for the head, which torchtitan keeps from its
    forward to its backward; True reshards it too; False keeps the weights from each micro-batch's forward to its
    backward only (reshard_after_backward), so each micro-batch gathers once."""
    weights = 2 * (EMBED + 4 * N + EMBED + H)
    auto = _comm(_point(pp=1), Collective.ALL_GATHER)
    resharded = _comm(_point(pp=1, reshard_after_forward=True), Collective.ALL_GATHER)
    kept = _comm(_point(pp=1, reshard_after_forward=False), Collective.ALL_GATHER)
    assert kept == {"dp": 2 * weights}
    assert auto == {"dp": 2 * (weights + 2 * 4 * N)}  # the layers again for backward
    assert resharded == {"dp": 2 * (weights + 2 * (4 * N + EMBED + H))}  # the layers and the head


def test_weights_kept_under_pipelining_are_held_from_the_first_gather_to_the_last_backward():
    """Each module's forward-gathered weights are one tensor per step, from micro-batch 0's gather to the end of
    the last micro-batch's backward: the whole stage's unsharded weights, W0, are live through the step."""
    workload = SymbolicGenerator().generate(_point(reshard_after_forward=False))
    program = workload.programs[0]
    held = [t for t in program.tensors if t.name.endswith(".weights")]
    assert sum(t.bytes for t in held) == W0 and len(held) == 3
    for t in held:
        producer, consumer = program.calls[t.producer], program.calls[t.consumer]
        assert producer.microbatch == 0 and consumer.microbatch == M - 1
        assert ".backward" in workload.blocks[consumer.block].name


def _copied_out(point, stage: int = 0) -> float:
    """Bytes FSDP2's copy-outs of gathered weights into the parameters read and write over a step."""
    workload = SymbolicGenerator().generate(point)
    ops = (op for call in workload.programs[stage].calls for op in workload.blocks[call.block].ops)
    return sum(op.bytes for op in ops if op.name.endswith(".copy_out"))


def test_a_call_that_finds_its_weights_gathered_runs_no_fsdp_copies():
    """FSDP2 copies each gathered buffer out into the parameters (2 x the gathered bytes, read and written) at
    every gather and only then: once per step for weights kept under pipelining, at every forward and backward
    when resharded."""
    assert _copied_out(_point(reshard_after_forward=False)) == 2 * W0
    assert _copied_out(_point(reshard_after_forward=True)) == 2 * M * (2 * EMBED + 2 * 2 * (2 * N))


def test_resharding_to_n_ranks_gathers_the_backward_over_them_and_holds_a_1_over_n_shard():
    """reshard_after_forward 2 on dp 8: forwards gather over all 8 ranks, backwards over the 2 consecutive ranks
    of the post-forward group (dp_post), and a 1/2 shard of each gathered module is held from its forward to its
    backward."""
    point = _point(pp=1, reshard_after_forward=2)
    gathers = _comm(point, Collective.ALL_GATHER)
    layers_and_head = 4 * N + EMBED + H
    assert gathers == {"dp_post+dp_shard": 2 * 2 * (EMBED + layers_and_head), "dp_post": 2 * 2 * layers_and_head}
    workload = SymbolicGenerator().generate(point)
    assert workload.layout.axes == (("tp", 1), ("cp", 1), ("dp_post", 2), ("dp_shard", 4), ("pp", 1))
    assert workload.layout.group(0, "dp_post") == [0, 1]
    shards = [t for t in workload.programs[0].tensors if t.name.endswith(".weights.resharded")]
    assert sum(t.bytes for t in shards) == 2 * (2 * (EMBED + layers_and_head)) / 2  # two micro-batches, 1/2 each


def test_under_pipelining_a_module_keeps_one_post_forward_shard_for_the_step():
    """FSDP2 keeps one post-forward shard per module, whatever the micro-batches in flight: on two stages with
    reshard_after_forward 2, the first stage holds W0 / 2 from micro-batch 0's forward to the last backward."""
    workload = SymbolicGenerator().generate(_point(reshard_after_forward=2))
    program = workload.programs[0]
    shards = [t for t in program.tensors if t.name.endswith(".weights.resharded")]
    assert len(shards) == 3 and sum(t.bytes for t in shards) == W0 / 2
    for t in shards:
        assert (program.calls[t.producer].microbatch, program.calls[t.consumer].microbatch) == (0, M - 1)


def test_gradients_reduced_per_step_move_a_micro_batch_count_fewer_bytes_and_hold_them_unsharded():
    """per_microbatch reduce-scatters the stage's gradients after every micro-batch, per_step once (auto under
    pipelining); per_step holds the unsharded gradients (W0) where per_microbatch holds their dp-th."""
    every = _point(grad_reduce="per_microbatch")
    once = _point(grad_reduce="per_step")
    assert _comm(every, Collective.REDUCE_SCATTER) == {"dp": M * W0}
    assert _comm(once, Collective.REDUCE_SCATTER) == {"dp": W0}
    assert _comm(_point(), Collective.REDUCE_SCATTER) == {"dp": W0}
    assert _fixed(every, TensorKind.GRADIENT) == W0 / 4
    assert _fixed(once, TensorKind.GRADIENT) == W0


def test_under_pipelining_the_per_step_reduce_scatters_follow_the_stages_last_backward_and_its_send():
    """torch.distributed.pipelining runs FSDP's post-backward (its REDUCE_GRAD action) after the stage's last
    backward and the send of its input gradient: every backward and send call comes before the first
    reduce-scatter, and the optimizer waits for all of them (stage 0: embedding and two layers; stage 1: two
    layers and the head)."""
    workload = SymbolicGenerator().generate(_point(grad_reduce="per_step"))
    for program in workload.programs:
        names = [workload.blocks[call.block].name for call in program.calls]
        reducing = [i for i, call in enumerate(program.calls) if _reduces(workload.blocks[call.block])]
        runs = [i for i in range(len(names)) if i not in reducing]
        earlier = [i for i in runs if names[i].startswith("send") or ".backward" in names[i]]
        assert len(reducing) == 3 and min(reducing) > max(earlier)
        assert set(reducing) <= set(program.calls[-1].inputs)


def _reduces(block) -> bool:
    return any(op.category == Collective.REDUCE_SCATTER for op in block.ops)


def test_reducing_per_step_costs_exactly_the_unsharded_gradients_in_peak_memory():
    """Without pipelining and with one micro-batch, per_step and per_microbatch run the same calls: the peaks
    differ by the gradients held unsharded instead of sharded over dp 8, all layers' and the head's."""
    point = make_point(global_batch=8, dp=8, zero=3)
    per_step = make_point(global_batch=8, dp=8, zero=3, grad_reduce="per_step")
    model = AnalyticalCostModel()
    peaks = [model.simulate(SymbolicGenerator().generate(p), p.system).peak_memory_bytes for p in (point, per_step)]
    unsharded = 2 * (EMBED + 4 * N + EMBED + H)
    fragmentation = point.system.accelerator.fragmentation  # the allocator's share of what the step allocates
    assert peaks[1] - peaks[0] == pytest.approx(unsharded * (1 - 1 / 8) * (1 + fragmentation), rel=1e-9)


def test_hsdp_reduce_scatters_in_the_shard_group_and_all_reduces_the_shard_over_the_replicas():
    """dp_shard 2 of dp 4: weights gathered and gradients reduce-scattered over 2 consecutive dp ranks, each
    reduced shard (W0 / 2) all-reduced over the 2 replicas; weights and gradients sharded over 2 ranks."""
    point = _point(dp_shard=2, grad_reduce="per_step")
    assert _comm(point, Collective.ALL_GATHER) == {"dp_shard": W0}
    assert _comm(point, Collective.REDUCE_SCATTER) == {"dp_shard": W0}
    assert _comm(point, Collective.ALL_REDUCE) == {"dp_rep": W0 / 2}
    assert _fixed(point, TensorKind.PARAMETER) == W0 / 2
    layout = SymbolicGenerator().generate(point).layout
    assert layout.axes == (("tp", 1), ("cp", 1), ("dp_shard", 2), ("dp_rep", 2), ("pp", 2))
    assert (layout.group(0, "dp_shard"), layout.group(0, "dp_rep")) == ([0, 1], [0, 2])
    every = _point(dp_shard=2, grad_reduce="per_microbatch")
    assert _comm(every, Collective.ALL_REDUCE) == {"dp_rep": M * W0 / 2}


def test_points_that_set_none_of_the_fields_keep_their_keys_and_workloads():
    """The fields are left out of a point's dump at their defaults: stored studies keep their keys; and a
    point's workload with the fields at the values auto gives is the auto point's."""
    point = _point()
    assert "reshard_after_forward" not in point.parallel.model_dump()
    explicit = _point(reshard_after_forward=False, grad_reduce="per_step")
    assert point.key != explicit.key
    model = AnalyticalCostModel()
    a = model.simulate(SymbolicGenerator().generate(point), point.system)
    b = model.simulate(SymbolicGenerator().generate(explicit), explicit.system)
    assert (a.step_time_s, a.peak_memory_bytes) == (b.step_time_s, b.peak_memory_bytes)


def test_a_study_searches_the_policies(tmp_path):
    path = tmp_path / "study.yaml"
    path.write_text(
        """\
name: policies
objectives: {step_time: minimize, peak_memory: minimize}
trials: 4
workers: 1
base:
  model: tiny-llama
  workload: {seq_len: 256, global_batch: 16}
  parallel: {dp: 4, pp: 2, zero: 3}
  system: tiny-ring
space:
  parallel.reshard_after_forward: {choices: [auto, true, false, 2]}
  parallel.grad_reduce: {choices: [per_microbatch, per_step]}
  parallel.dp_shard: {choices: [2, 4]}
"""
    )
    spec = load_study(path)
    params = {"parallel.reshard_after_forward": 2, "parallel.grad_reduce": "per_microbatch", "parallel.dp_shard": 4}
    point = decode(spec, params)
    assert not isinstance(point, str)
    assert (point.parallel.reshard_after_forward, point.parallel.grad_reduce, point.parallel.dp_shard) == (
        2,
        "per_microbatch",
        4,
    )
    assert decode(spec, params | {"parallel.dp_shard": 2}) == (
        "parallel.reshard_after_forward=2 must divide the 2 ranks of a ZeRO shard group (parallel.dp_shard or dp) "
        "and lie strictly between 1 and 2 (FSDP2's post-forward group); use true or false"
    )
    assert run_cli("check", str(path))[0] == 0


@pytest.mark.parametrize(
    ("fields", "fragments"),
    [
        ("zero: 3, reshard_after_forward: sometimes", ["field 'parallel.reshard_after_forward'", "auto, true, false"]),
        ("zero: 3, reshard_after_forward: 3", ["parallel.reshard_after_forward=3 must divide the 8 ranks", "{2, 4}"]),
        ("zero: 2, reshard_after_forward: false", ["field 'parallel.reshard_after_forward'", "parallel.zero: 3"]),
        ("zero: 3, grad_reduce: never", ["field 'parallel.grad_reduce'", "'per_microbatch' or 'per_step'"]),
        ("zero: 1, grad_reduce: per_step", ["field 'parallel.grad_reduce'", "parallel.zero 2 or 3"]),
        ("zero: 3, dp_shard: 3", ["parallel.dp_shard=3 must divide parallel.dp=8", "{2, 4, 8}"]),
        ("dp_shard: 2", ["field 'parallel.dp_shard'", "parallel.zero 1, 2 or 3"]),
    ],
)
def test_a_bad_policy_gives_one_line_naming_the_field(tmp_path, fields, fragments):
    path = tmp_path / "p.yaml"
    path.write_text(
        f"model: tiny-llama\nworkload: {{seq_len: 256, global_batch: 16}}\nparallel: {{dp: 8, {fields}}}\n"
        "system: tiny-ring\n"
    )
    code, out, err = run_cli("evaluate", str(path))
    assert (code, out) == (2, ""), err
    assert err.count("\n") == 1 and err.startswith(f"error: {path}: "), err
    for fragment in fragments:
        assert fragment in err


def test_hsdp_with_expert_parallelism_is_refused_with_one_line(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(
        "model: tiny-moe\nworkload: {seq_len: 256, global_batch: 16}\nparallel: {dp: 8, ep: 2, zero: 3, dp_shard: 4}"
        "\nsystem: tiny-ring\n"
    )
    code, _, err = run_cli("evaluate", str(path))
    assert code == 2 and err.count("\n") == 1 and "parallel.dp_shard with parallel.ep=2" in err, err


@pytest.mark.parametrize(
    "fields", [{"dp_shard": 2}, {"reshard_after_forward": 2, "grad_reduce": "per_microbatch"}], ids=["hsdp", "to-2"]
)
def test_the_steady_form_prices_a_policy_as_the_whole_step(fields):
    point = make_point(
        system={"base": "dgx-h100", "network": {1: {"npus": 4}}}, tp=2, pp=4, dp=4, zero=3, global_batch=128, **fields
    )
    workload = SymbolicGenerator().generate(point)
    assert workload.steady is not None
    steady = AnalyticalCostModel().simulate(workload, point.system)
    whole = AnalyticalCostModel().simulate(replace(workload, steady=None, point_key="whole"), point.system)
    assert steady.step_time_s == pytest.approx(whole.step_time_s, rel=1e-9)
    assert steady.peak_memory_bytes == pytest.approx(whole.peak_memory_bytes, rel=1e-12)


def test_weights_kept_over_the_step_are_gathered_from_its_start_before_any_transfer():
    """Under pipelining with the weights kept for the whole step, a stage gathers every module of every model chunk
    at the step's start (torch.distributed.pipelining's UNSHARD ahead of the first forward), before any pipeline
    transfer can hold the link ahead of them; the first forward waits only for its own gathers. With weights
    resharded after forward, a module is gathered as the one before it runs, after the micro-batch's receive."""
    for reshard, gathered_first in ((False, True), (True, False)):
        point = _point(pp=2, reshard_after_forward=reshard, pp_schedule="interleaved", virtual_stages=2)
        workload = SymbolicGenerator().generate(point)
        program = workload.programs[1]
        kinds = []
        for call in program.calls:
            ops = workload.blocks[call.block].ops
            if any(op.category == Collective.ALL_GATHER and op.axis == "dp" for op in ops):
                kinds.append("gather")
            elif any(op.kind.value == "recv" for op in ops):
                kinds.append("recv")
        first_recv = kinds.index("recv")
        gathers = kinds.count("gather")
        assert (kinds[:first_recv].count("gather") == gathers) is gathered_first, (reshard, kinds[:8])
        # the second stage holds layer 1 (chunk 0), layer 3 and the head (chunk 1): three modules, gathered once
        # per step when kept, for each of the M micro-batches' forward and backward when resharded
        assert gathers == (3 if gathered_first else M * 2 * 3), (reshard, gathers)
