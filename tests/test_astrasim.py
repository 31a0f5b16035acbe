"""The ASTRA-sim cost model against the real binary: isolated collectives agree with the analytical closed forms
within 1%, a tiny-llama step runs on every rank, and every way a run can fail is one line naming the cause with
nothing left running."""

import stat
import tempfile
import time
from pathlib import Path

import pytest
from conftest import patience
from helpers import UNIT_ACCELERATOR, make_point, process_running
from pydantic import ValidationError

from dse.errors import DseError
from dse.interfaces import CollectiveCostModel, TimelineCostModel
from dse.point import chakra
from dse.system import NetworkDim, SystemSpec
from dse.workload import Collective, OpKind, Workload, expand
from generators.symbolic import SymbolicGenerator
from simulators.analytical import AnalyticalCostModel
from simulators.astrasim import AstraSimCostModel, AstraSimError, AstraSimOptions
from simulators.astrasim.config import astra_dims, expanded_sizes, system_json
from simulators.astrasim.isolated import collective_workload
from simulators.astrasim.scaling import scaled_world

ANALYTICAL = AnalyticalCostModel()


def one_dim(topology: str, npus: int, latency_ns: float = 1000, **dim: object) -> SystemSpec:
    network = NetworkDim(topology=topology, npus=npus, bandwidth_GBps=100, efficiency=0.8, latency_ns=latency_ns, **dim)
    return SystemSpec(name=f"{topology}{npus}", accelerator=UNIT_ACCELERATOR, network=[network])


def isolated(kind: Collective, size: float, npus: int) -> Workload:
    """A step that is one collective of `size` bytes (nccl-tests convention) over every rank, nothing else."""
    return collective_workload(kind, size, range(npus), npus)


RING4 = one_dim("ring", 4)
SIZES = [4 * 2**10, 2**20, 256 * 2**20]
"""4 KiB: latency is 99% of the time; 1 MiB: both count; 256 MiB: bandwidth is."""


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize(
    "kind",
    [
        Collective.ALL_REDUCE,
        Collective.REDUCE_SCATTER,
        Collective.ALL_GATHER,
    ],
)
@pytest.mark.parametrize("topology", ["ring", "switch"])
def test_isolated_collectives_agree_with_the_closed_forms_within_one_percent(binary, topology, kind, size):
    # A switch's 2000 ns are two hops of 1000: the closed form's one latency per ring step.
    system = one_dim(topology, 8, latency_ns=1000 if topology == "ring" else 2000)
    ours = ANALYTICAL.collective_time(kind, size, range(8), system)
    theirs = AstraSimCostModel(AstraSimOptions(binary=binary)).collective_time(kind, size, range(8), system)
    assert theirs == pytest.approx(ours, rel=0.01)


@pytest.mark.parametrize(
    "system",
    [
        one_dim("torus2d", 16, shape=[4, 4]),
        one_dim("torus3d", 16, shape=[2, 2, 4]),
        one_dim("fully_connected", 8),
        one_dim("switch", 8, algorithm="halving_doubling"),
    ],
    ids=["torus2d", "torus3d", "fully_connected-direct", "switch-halving_doubling"],
)
def test_tori_fully_connected_and_halving_doubling_map_onto_astrasim_alike(binary, system):
    """A torus becomes one ASTRA-sim ring per side; a fully connected dimension splits an NPU's bandwidth over its
    links; halving-doubling through a switch pays one latency per step: each all-reduce agrees within 1%."""
    model = AstraSimCostModel(AstraSimOptions(binary=binary))
    for size in (SIZES[0], SIZES[-1]):
        ours = ANALYTICAL.collective_time(Collective.ALL_REDUCE, size, range(system.npus), system)
        theirs = model.collective_time(Collective.ALL_REDUCE, size, range(system.npus), system)
        assert theirs == pytest.approx(ours, rel=0.01)


def test_a_collective_over_some_npus_and_a_send_price_as_the_closed_forms(binary):
    """The capability `dse calibrate` uses (CollectiveCostModel): the NPUs outside the operation idle."""
    system = make_point("tiny-llama", global_batch=8, tp=2, dp=4).system  # ring of 4, switch of 2
    model = AstraSimCostModel(AstraSimOptions(binary=binary))
    assert isinstance(model, CollectiveCostModel)
    for ranks in (range(4), range(0, 8, 4)):
        ours = ANALYTICAL.collective_time(Collective.REDUCE_SCATTER, 2**26, ranks, system)
        assert model.collective_time(Collective.REDUCE_SCATTER, 2**26, ranks, system) == pytest.approx(ours, rel=0.01)
    for src, dst in ((0, 1), (3, 0), (1, 5)):
        ours = ANALYTICAL.p2p_time(2**26, src, dst, system)
        assert model.p2p_time(2**26, src, dst, system) == pytest.approx(ours, rel=0.01)
    with pytest.raises(DseError, match="evenly spaced from 0"):
        model.collective_time(Collective.ALL_REDUCE, 2**20, [1, 2, 3], system)


def test_network_files_in_astrasim_units():
    system = SystemSpec(
        name="mixed",
        accelerator=UNIT_ACCELERATOR,
        network=[
            NetworkDim(topology="fully_connected", npus=4, bandwidth_GBps=300, latency_ns=500),
            NetworkDim(topology="torus2d", npus=6, bandwidth_GBps=50, latency_ns=700, shape=[2, 3]),
            NetworkDim(topology="switch", npus=2, bandwidth_GBps=50, efficiency=0.5, latency_ns=5000, algorithm="tree"),
        ],
    )
    dims = astra_dims(system)
    assert expanded_sizes(system) == [4, 2, 3, 2]
    assert [d.topology for d in dims] == ["FullyConnected", "Ring", "Ring", "Switch"]
    assert [d.bandwidth_GBps * 2**30 for d in dims] == pytest.approx([100e9, 50e9, 50e9, 25e9])
    assert [d.latency_ns for d in dims] == [500, 700, 700, 2500]
    config = system_json(dims, system, "bf16", AstraSimOptions())
    assert config["all-reduce-implementation"] == ["direct", "ring", "ring", "doubleBinaryTree"]
    assert config["all-gather-implementation"] == ["direct", "ring", "ring", "ring"]
    assert (config["roofline-enabled"], config["preferred-dataset-splits"], config["endpoint-delay"]) == (0, 1, 1)
    roofline = system_json(dims, system, "bf16", AstraSimOptions(compute="roofline"))
    assert roofline["roofline-enabled"] == 1
    assert roofline["peak-perf"] == pytest.approx(1.0)  # 1 TFLOP/s x gemm efficiency 1.0
    assert roofline["local-mem-bw"] == pytest.approx(1000.0)  # 1000 GB/s x memory efficiency 1.0
    one_node = system.model_copy(
        update={"network": [*system.network, NetworkDim(topology="switch", npus=1, bandwidth_GBps=50, latency_ns=5000)]}
    )
    assert expanded_sizes(one_node) == [4, 2, 3, 2]  # ASTRA-sim refuses a dimension of one NPU; nothing crosses it


@pytest.fixture(scope="module")
def tiny_llama():
    point = make_point("tiny-llama", global_batch=8, tp=2, dp=4)
    return point, SymbolicGenerator().generate(point)


def test_a_tiny_llama_step_finishes_on_every_rank_with_the_exported_compute(binary, tiny_llama, tmp_path):
    point, workload = tiny_llama
    kept = tmp_path / "runs"
    model = AstraSimCostModel(AstraSimOptions(binary=binary, keep_runs=kept))
    result = model.simulate(workload, point.system)
    [run] = list(kept.iterdir())
    output = (run / "output.txt").read_text()
    assert [f"sys[{rank}] finished" in output for rank in range(8)] == [True] * 8
    [rank_class] = result.classes
    assert rank_class.ranks == 8 and result.step_time_s == rank_class.end_s > 0
    # Compute is the durations the export wrote, summed over a rank's COMP nodes (ticks are ns).
    _, nodes = chakra.read_nodes(run / "traces/trace.0.et")
    exported = sum(n.duration_micros for n in nodes if n.type == chakra.pb.COMP_NODE) * 1e-6
    assert rank_class.compute_s == pytest.approx(exported, abs=1e-9)
    assert 0 < rank_class.exposed_comm_s <= rank_class.comm_s
    assert rank_class.end_s == pytest.approx(rank_class.compute_s + rank_class.exposed_comm_s, abs=1e-9)
    analytical = ANALYTICAL.simulate(workload, point.system)
    assert result.peak_memory_bytes == analytical.peak_memory_bytes  # ASTRA-sim cannot track it: see the model
    # Asked again, the process's cache answers without running ASTRA-sim.
    again = model.simulate(workload, point.system)
    assert again.step_time_s == result.step_time_s and len(list(kept.iterdir())) == 1


def test_a_timeline_is_astrasims_schedule_of_each_rank_class(binary, tiny_llama):
    point, workload = tiny_llama
    model = AstraSimCostModel(AstraSimOptions(binary=binary))
    assert isinstance(model, TimelineCostModel)
    result = model.with_timeline().simulate(workload, point.system)
    [rank_class] = result.classes
    compute = [e for e in result.timeline if e.stream == "compute"]
    ops = [flat.op for flat in expand(workload, workload.programs[0])]
    assert len(compute) == sum(op.kind is OpKind.COMPUTE for op in ops)
    assert sum(e.end_s - e.start_s for e in compute) == pytest.approx(rank_class.compute_s, abs=1e-9)
    assert {e.stream for e in result.timeline} >= {"compute", "comm:tp", "comm:dp"}
    assert max(e.end_s for e in result.timeline) == pytest.approx(rank_class.end_s, abs=1e-9)
    assert rank_class.time_by_category["gemm"] > 0 and rank_class.time_by_category["all_reduce"] > 0
    trace = model.chrome_trace(result)["traceEvents"]
    assert sum(e["ph"] == "X" for e in trace) == len(result.timeline)


def test_a_tiny_llama_step_runs_on_astrasims_own_roofline(binary, tiny_llama):
    point, workload = tiny_llama
    options = AstraSimOptions(binary=binary, compute="roofline", timeout_s=patience(60))
    [rank_class] = AstraSimCostModel(options).simulate(workload, point.system).classes
    assert rank_class.ranks == 8 and rank_class.compute_s > 0 and rank_class.end_s >= rank_class.compute_s


def test_run_folders_are_deleted_unless_kept(binary, tmp_path, monkeypatch):
    made = []
    mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda **kw: made.append(mkdtemp(**kw)) or made[-1])
    model = AstraSimCostModel(AstraSimOptions(binary=binary))
    model.simulate(isolated(Collective.ALL_REDUCE, 3e6, 4), RING4)
    assert len(made) == 1 and not Path(made[0]).exists()


def test_the_congestion_aware_backend_is_the_binary_beside_the_unaware_one(binary):
    options = AstraSimOptions(binary=binary, backend="congestion_aware")
    if not (binary.parent / "AstraSim_Analytical_Congestion_Aware").is_file():
        pytest.skip(f"no AstraSim_Analytical_Congestion_Aware beside {binary}")
    system = one_dim("ring", 8)
    ours = ANALYTICAL.collective_time(Collective.ALL_REDUCE, SIZES[-1], range(8), system)
    theirs = AstraSimCostModel(options).simulate(isolated(Collective.ALL_REDUCE, SIZES[-1], 8), system).step_time_s
    assert theirs == pytest.approx(ours, rel=0.01)
    two_dims = make_point("tiny-llama", global_batch=8, tp=2, dp=4).system
    with pytest.raises(AstraSimError, match="congestion-aware backend simulates 1-D networks only"):
        AstraSimCostModel(options).simulate(isolated(Collective.ALL_REDUCE, 1e6, 8), two_dims)


# -- failures: each one line, nothing left running -------------------------------------------------------------


def fake_binary(tmp_path: Path, script: str, executable: bool = True) -> Path:
    path = tmp_path / "fake-astrasim"
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755 if executable else 0o644)
    return path


def failure(binary: Path | None, timeout_s: float | None = None) -> str:
    """The one-line error of a simulation; `timeout_s` when the timeout is what is tested, else a hang guard."""
    options = AstraSimOptions(binary=binary, timeout_s=timeout_s or patience(60))
    with pytest.raises(AstraSimError) as caught:
        AstraSimCostModel(options).simulate(isolated(Collective.ALL_REDUCE, 1e6, 4), RING4)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_no_binary_configured_says_how_to_set_one(monkeypatch):
    monkeypatch.delenv("ASTRA_SIM_BIN", raising=False)
    assert "set ASTRA_SIM_BIN or cost_model_options.binary" in failure(None)


def test_a_missing_binary_is_named(tmp_path, monkeypatch):
    """In the options it is refused when they are read; through ASTRA_SIM_BIN, by the run (and the pre-flight)."""
    with pytest.raises(ValidationError, match=f"{tmp_path / 'nowhere'} does not exist"):
        AstraSimOptions(binary=tmp_path / "nowhere")
    with pytest.raises(ValidationError, match=f"{tmp_path} is a folder, not a file"):
        AstraSimOptions(binary=str(tmp_path))
    monkeypatch.setenv("ASTRA_SIM_BIN", str(tmp_path / "nowhere"))
    message = failure(None)
    assert f"{tmp_path / 'nowhere'} does not exist" in message and "ASTRA_SIM_BIN" in message


def test_a_binary_that_is_not_executable_is_named(tmp_path):
    path = fake_binary(tmp_path, "exit 0\n", executable=False)
    assert f"{path} is not executable" in failure(path)
    assert not path.stat().st_mode & stat.S_IXUSR


def test_a_crash_quotes_its_error_line(tmp_path):
    script = 'echo "[info] reading $1"\necho "[critical] cannot parse network.yml: bad topology" >&2\nexit 3\n'
    message = failure(fake_binary(tmp_path, script))
    assert "exited with code 3" in message
    assert "4 of 4 ranks never finished (0, 1, 2, 3)" in message
    assert "cannot parse network.yml: bad topology" in message


def test_ranks_that_never_finish_are_named_even_when_the_exit_code_is_zero(tmp_path):
    script = 'echo "sys[0] finished, 100 cycles, exposed communication 5 cycles."\necho "garbage ~~~"\n'
    message = failure(fake_binary(tmp_path, script))
    assert "exited 0" in message and "3 of 4 ranks never finished (1, 2, 3)" in message
    assert "garbage ~~~" in message


def test_a_crash_after_every_rank_reported_keeps_the_figures(tmp_path):
    # As this build dies tearing down some runs: every rank's figures are out, then the heap is found corrupt.
    lines = "".join(
        f"sys[{r}] finished, 100 cycles, exposed communication 5 cycles.\nsys[{r}], GPU time: 90\n"
        f"sys[{r}], Comm time: 10\nsys[{r}], Total compute-communication overlap: 5\n"
        for r in range(4)
    )
    options = AstraSimOptions(
        binary=fake_binary(tmp_path, f"printf '{lines}'\necho 'malloc_consolidate(): unaligned'\nkill -ABRT $$\n")
    )
    result = AstraSimCostModel(options).simulate(isolated(Collective.ALL_REDUCE, 1e6, 4), RING4)
    assert result.step_time_s == pytest.approx(100e-9)
    truncated = lines.rsplit("sys[3], Total", 1)[0]
    (tmp_path / "cut").mkdir()  # another binary path: the process's cache keys results by the options
    options = AstraSimOptions(binary=fake_binary(tmp_path / "cut", f"printf '{truncated}'\nkill -ABRT $$\n"))
    with pytest.raises(AstraSimError, match="exited with code -6"):
        AstraSimCostModel(options).simulate(isolated(Collective.ALL_REDUCE, 1e6, 4), RING4)


def test_garbage_output_is_a_failure_not_a_zero_step(tmp_path):
    message = failure(fake_binary(tmp_path, "head -c 300 /dev/urandom | base64\n"))
    assert "4 of 4 ranks never finished" in message


def test_a_hang_is_killed_with_its_whole_process_group(tmp_path):
    pids = tmp_path / "pids"
    script = f'sleep 300 &\necho $! > {pids}\necho $$ >> {pids}\necho "[info] simulating"\nwait\n'
    started = time.monotonic()
    message = failure(fake_binary(tmp_path, script), timeout_s=2)
    assert time.monotonic() - started < patience(30)
    assert "did not finish within 2 s" in message and "[info] simulating" in message
    for pid in map(int, pids.read_text().split()):
        assert not process_running(pid), f"process {pid} outlived the timeout"


# -- large worlds: fewer data-parallel replicas, the same step ---------------------------------------------------

WIDE_TINY_RING = {"base": "tiny-ring", "network": {1: {"npus": 8}}}
"""tiny-ring with 8 groups of 4 on the switch: 32 NPUs."""


@pytest.mark.parametrize(
    "parallel",
    [
        {"tp": 4, "dp": 8},
        {"tp": 4, "dp": 4, "pp": 2},
        {"tp": 4, "dp": 8, "zero": 1},
    ],
    ids=["dp8", "dp4-pp2", "dp8-zero1"],
)
def test_a_scaled_world_agrees_with_the_full_one(binary, parallel, tmp_path):
    point = make_point("tiny-llama", system=WIDE_TINY_RING, global_batch=16, **parallel)
    workload = SymbolicGenerator().generate(point)
    full = AstraSimCostModel(AstraSimOptions(binary=binary)).simulate(workload, point.system)
    kept = tmp_path / "runs"
    options = AstraSimOptions(binary=binary, max_npus=8 * point.parallel.pp, keep_runs=kept)
    scaled = AstraSimCostModel(options).simulate(workload, point.system)
    [run] = list(kept.iterdir())
    assert len(list((run / "traces").glob("trace.*.et"))) == 8 * point.parallel.pp  # two replicas of four or eight
    assert scaled.step_time_s == pytest.approx(full.step_time_s, rel=0.01)
    assert scaled.exposed_comm_time_s == pytest.approx(full.exposed_comm_time_s, rel=0.01)
    assert [c.ranks for c in scaled.classes] == [c.ranks for c in full.classes]


def test_scaling_keeps_every_replica_collective_s_closed_form_time():
    point = make_point("tiny-llama", system=WIDE_TINY_RING, global_batch=16, tp=4, dp=8, zero=1)
    workload = SymbolicGenerator().generate(point)
    small, system = scaled_world(workload, point.system, 8)
    assert small.layout.axes == (("tp", 4), ("cp", 1), ("dp", 2), ("pp", 1)) and system.npus == 8
    assert [d.npus for d in system.network] == [4, 2]
    resized = 0
    for block, kept in zip(workload.blocks, small.blocks, strict=True):
        for op, new in zip(block.ops, kept.ops, strict=True):
            if op.axis != "dp":
                assert new == op
                continue
            was = ANALYTICAL.collective_time(Collective(op.category), op.comm_bytes, range(0, 32, 4), point.system)
            now = ANALYTICAL.collective_time(Collective(op.category), new.comm_bytes, range(0, 8, 4), system)
            assert now == pytest.approx(was, rel=1e-9) and new.comm_bytes > op.comm_bytes
            resized += 1
    assert resized >= 2  # the gradient reduce-scatter and the parameter all-gather
    assert scaled_world(workload, point.system, 32) == (workload, point.system)  # fits already


def test_a_replica_axis_across_two_dimensions_cannot_be_scaled():
    point = make_point("tiny-llama", system=WIDE_TINY_RING, global_batch=16, tp=2, dp=16)
    with pytest.raises(AstraSimError, match=r"'dp' axis .* does not lie inside one ring, switch or fully connected"):
        scaled_world(SymbolicGenerator().generate(point), point.system, 8)


def test_a_kept_failed_run_names_its_folder(tmp_path):
    options = AstraSimOptions(binary=fake_binary(tmp_path, "exit 1\n"), keep_runs=tmp_path / "runs")
    with pytest.raises(AstraSimError, match=r"exited with code 1; .* run folder .*/runs/all_reduce-1e\+06-4x1-of-4-"):
        AstraSimCostModel(options).simulate(isolated(Collective.ALL_REDUCE, 1e6, 4), RING4)
    [run] = list((tmp_path / "runs").iterdir())
    assert (run / "system.json").exists() and (run / "output.txt").exists()


def test_a_1024_gpu_point_runs_on_two_replicas(binary, tmp_path):
    """Llama-3-8B, TP8 x DP128 on 128 DGX H100 nodes: ASTRA-sim simulates 16 NPUs (about 5 s here), not 1024."""
    system = {"base": "dgx-h100", "network": {1: {"npus": 128}}}
    point = make_point("llama3-8b", system=system, seq_len=8192, global_batch=1024, tp=8, dp=128, sp=True, zero=1)
    workload = SymbolicGenerator().generate(point)
    options = AstraSimOptions(binary=binary, max_npus=16, keep_runs=tmp_path)
    result = AstraSimCostModel(options).simulate(workload, point.system)
    [run] = list(tmp_path.iterdir())
    assert len(list((run / "traces").glob("trace.*.et"))) == 16
    assert sum(c.ranks for c in result.classes) == 1024
    analytical = ANALYTICAL.simulate(workload, point.system)
    assert result.peak_memory_bytes == analytical.peak_memory_bytes
    assert 0 < result.exposed_comm_time_s < result.comm_time_s and result.step_time_s > result.compute_time_s
