"""The gloo replay: a 4-process dense TP+DP step run for real on loopback, beside the analytical model priced on
the loopback link measured just before; and a deadlocked rank that ends by its timeout."""

import tempfile
import time
from importlib.util import find_spec
from pathlib import Path

import pytest
from chakra.src.third_party.utils.protolib import encodeMessage as encode_message

from dse import plugins
from dse.point import chakra
from dse.point.evaluate import evaluate
from generators.symbolic import SymbolicGenerator
from simulators.analytical import AnalyticalCostModel
from simulators.emulator import EmulatorCostModel, EmulatorError
from simulators.emulator.contract import write_inputs
from simulators.emulator.linkbench import measure_loopback
from simulators.emulator.plan import load_plan
from simulators.emulator.run import run_emulator
from tests.helpers import make_point

pytestmark = pytest.mark.skipif(
    find_spec("torch") is None, reason="the gloo replay needs torch: pip install 'dse-orchestrator[fx]'"
)

AGREEMENT = 3.0
"""Replay and model communication times must agree within this factor. Generous because loopback gloo on this
2-core machine, shared with other work, is scheduler-bound: 4 rank processes (and gloo's threads) time-share 2
cores, so a hop costs what it takes the receiver to be scheduled: 0.4 to 0.75 ms per hop of a 4-rank ring measured
minutes apart, 0.1 ms for an idle pair's send. The replay also runs the TP and DP groups' collectives at once,
which the 4-rank benchmark does not. Seen over 5 runs: replay/model 0.82 to 1.79."""


LOOPBACK_GUESS = {"topology": "ring", "npus": 4, "bandwidth_GBps": 1.0, "latency_ns": 500_000}
"""Where a test does not compare with the model: a link of about this machine's loopback."""


def point_on(dim):
    system = {"name": "loopback", "accelerator": "h100-sxm", "network": [dim]}
    return make_point("tiny-llama", system=system, seq_len=128, global_batch=4, tp=2, dp=2)


def test_replay_of_a_tp_dp_step_beside_the_model_on_the_measured_loopback():
    start = time.monotonic()
    link = measure_loopback(ranks=4, large_bytes=4 << 20, repeats=5)
    dim = link.network_dim()
    point = point_on(dim.model_dump())
    workload = SymbolicGenerator().generate(point)
    replayed = EmulatorCostModel(EmulatorCostModel.Options(timeout_s=120)).simulate(workload, point.system)
    modelled = AnalyticalCostModel().simulate(workload, point.system)
    print(
        f"\nloopback gloo, 4 processes: all-reduce busbw {link.all_reduce_busbw / 1e9:.3f} GB/s, "
        f"tiny all-reduce {link.all_reduce_tiny_s * 1e6:.0f} us, send {link.p2p_tiny_s * 1e6:.0f} us "
        f"-> ring {dim.bandwidth_GBps} GB/s, {dim.latency_ns / 1e3:.0f} us per hop"
    )
    print(f"{'ms':>10} {'replay':>9} {'model':>9}")
    for name in ("step_time_s", "comm_time_s", "exposed_comm_time_s", "compute_time_s"):
        print(f"{name[:-2]:>10} {getattr(replayed, name) * 1e3:9.2f} {getattr(modelled, name) * 1e3:9.2f}")
    print(f"took {time.monotonic() - start:.1f} s")
    # Compute is slept on a planned clock: exactly the trace's durations, whatever the loop's overhead.
    planned = sum(step.seconds for step in load_plan_of(workload, point.system)[0])
    assert replayed.compute_time_s == pytest.approx(planned, rel=1e-3)
    assert replayed.comm_time_s > 0
    assert replayed.step_time_s >= max(replayed.comm_time_s, replayed.compute_time_s)
    assert 1 / AGREEMENT < replayed.comm_time_s / modelled.comm_time_s < AGREEMENT


def load_plan_of(workload, system):
    with tempfile.TemporaryDirectory() as folder:
        write_inputs(Path(folder), workload, system)
        return load_plan(folder).ranks


def test_a_deadlocked_rank_ends_by_the_timeout(tmp_path):
    """Ranks 0 and 1 each end with a recv from the other that nobody sends: both wait, alive, until --timeout-s."""
    point = point_on(LOOPBACK_GUESS)
    workload = SymbolicGenerator().generate(point)
    folder = tmp_path / "run"
    write_inputs(folder, workload, point.system)
    for rank, peer in ((0, 1), (1, 0)):
        meta, nodes = chakra.read_nodes(folder / f"trace.{rank}.et")
        recv = chakra.pb.Node(id=len(nodes) + 100, name="never_sent", type=chakra.pb.COMM_RECV_NODE)
        recv.attr.extend(
            chakra.pb.AttributeProto(name=name, int32_val=value)
            for name, value in (("comm_src", peer), ("comm_dst", rank), ("comm_size", 64), ("comm_tag", 7))
        )
        with open(folder / f"trace.{rank}.et", "wb") as f:
            for message in (meta, *nodes, recv):
                encode_message(f, message)
    argv = EmulatorCostModel(EmulatorCostModel.Options(args=["--timeout-s", "3"])).argv(folder)
    start = time.monotonic()
    with pytest.raises(
        EmulatorError, match=r"(?i)exited 1; stderr: replay: rank [01] failed: .*(timed out|timeout|deadlock)"
    ) as error:
        run_emulator(argv, folder, 60, "stdout")
    print(f"\n{error.value} ({time.monotonic() - start:.1f} s)")
    assert 3 < time.monotonic() - start < 45


def test_replay_across_the_nodes_of_a_ray_cluster(ray_cluster, tmp_path):
    """The 4 ranks as Ray actors, two on each of the cluster's two nodes, talking gloo over the nodes' network."""
    point = point_on(LOOPBACK_GUESS)
    workload = SymbolicGenerator().generate(point)
    write_inputs(tmp_path, workload, point.system)
    argv = EmulatorCostModel(EmulatorCostModel.Options(args=["--ray", ray_cluster.address])).argv(tmp_path)
    metrics = run_emulator(argv, tmp_path, 240, "stdout", env={**ray_cluster.env, "GLOO_SOCKET_IFNAME": "lo"})
    nodes = [rank.node for rank in metrics.ranks]
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3]
    assert metrics.comm_time_s > 0
    planned = sum(step.seconds for step in load_plan(tmp_path).ranks[0])
    assert metrics.compute_time_s == pytest.approx(planned, rel=1e-3)


def test_a_study_evaluates_a_point_with_the_emulator_plugin_and_its_default_replay():
    if "emulator" not in plugins.available("cost model"):
        pytest.skip("the emulator entry point is not installed in this environment: pip install -e '.[dev,fx]'")
    point = point_on(LOOPBACK_GUESS)
    evaluation = evaluate(point, plugins.generator("symbolic"), plugins.cost_model("emulator"))
    metrics = evaluation.metrics
    assert metrics["step_time_s"] >= metrics["comm_time_s"] > 0
    assert 0 <= metrics["overlap_ratio"] <= 1
    assert (
        metrics["peak_memory_bytes"]
        == AnalyticalCostModel().simulate(evaluation.workload, point.system).peak_memory_bytes
    )


def test_replay_of_a_pipeline_step_matches_every_send_with_its_recv(tmp_path):
    """PP2 DP2: activations and gradients cross stages by isend/irecv (matched by the trace's peer and tag) while
    the DP all-reduces run in their groups."""
    point = make_point(
        "tiny-llama",
        system={"name": "loopback", "accelerator": "h100-sxm", "network": [LOOPBACK_GUESS]},
        seq_len=128,
        global_batch=8,
        pp=2,
        dp=2,
    )
    workload = SymbolicGenerator().generate(point)
    write_inputs(tmp_path, workload, point.system)
    plan = load_plan(tmp_path)
    assert {s.kind for s in plan.ranks[0]} >= {"send", "recv", "collective"}
    argv = EmulatorCostModel(EmulatorCostModel.Options(args=["--timeout-s", "60"])).argv(tmp_path)
    metrics = run_emulator(argv, tmp_path, 120, "stdout")
    assert [r.rank for r in metrics.ranks] == [0, 1, 2, 3]
    for rank in metrics.ranks:
        assert rank.compute_s == pytest.approx(sum(s.seconds for s in plan.ranks[rank.rank]), rel=1e-3)
        assert rank.end_s >= rank.comm_s > 0
