"""A group over several dimensions priced flat, hierarchical or pipelined (`NetworkDim.collectives`), with in-network
reduction inside (NVLS) and across (InfiniBand SHARP): the closed forms of simulators/analytical/network.py by hand,
a point's step time following the choice, and ASTRA-sim's dimension-after-dimension runs agreeing with the
hierarchical form on the real binary."""

import pytest
from helpers import UNIT_ACCELERATOR, make_point

from dse.point.evaluate import evaluate
from dse.point.points import expand
from dse.system import NetworkDim, SystemSpec
from dse.workload import Collective
from generators.symbolic import SymbolicGenerator
from simulators.analytical import AnalyticalCostModel
from simulators.analytical.network import collective_time, group_span
from simulators.astrasim import AstraSimCostModel, AstraSimOptions

S = 2**26
"""64 MiB: both terms count."""
RING = {"topology": "ring", "npus": 4, "bandwidth_GBps": 100, "latency_ns": 1000}
SWITCH = {"topology": "switch", "npus": 4, "bandwidth_GBps": 25, "latency_ns": 2000}


def system(*dims: dict, collectives: str = "flat") -> SystemSpec:
    """These dimensions, every one past the first with `collectives`."""
    network = [NetworkDim(**dim, collectives=collectives if index else "flat") for index, dim in enumerate(dims)]
    return SystemSpec(name="test", accelerator=UNIT_ACCELERATOR, network=network)


def whole(kind: Collective, spec: SystemSpec, size: float = S) -> float:
    return collective_time(kind, size, group_span(range(spec.npus), spec.network))


def test_hierarchical_and_pipelined_all_reduce_are_their_phases_summed_or_overlapped():
    # Ring of 4 at 100 GB/s, 1 us; switch of 4 at 25 GB/s, 2 us: the switch carries the ring's shard S/4.
    inner, outer = 2 * 3 / 4 * S / 100e9, 2 * 3 / 4 * (S / 4) / 25e9
    latency = 2 * 3 * 1e-6 + 2 * 3 * 2e-6
    ar = Collective.ALL_REDUCE
    assert whole(ar, system(RING, SWITCH, collectives="hierarchical")) == pytest.approx(inner + outer + latency)
    assert whole(ar, system(RING, SWITCH, collectives="pipelined")) == pytest.approx(max(inner, outer) + latency)
    # Flat: every dimension at once, 2(N-1)/N S over the slower of the ring (100) and the switch's four NICs (100).
    assert whole(ar, system(RING, SWITCH)) == pytest.approx(2 * 15 / 16 * S / 100e9 + latency)


@pytest.mark.parametrize("kind", [Collective.REDUCE_SCATTER, Collective.ALL_GATHER])
def test_a_reduce_scatter_goes_inward_and_an_all_gather_outward_at_the_same_cost(kind):
    hierarchical = system(RING, SWITCH, collectives="hierarchical")
    expected = 3 / 4 * S / 100e9 + 3 / 4 * (S / 4) / 25e9 + 3 * 1e-6 + 3 * 2e-6
    assert whole(kind, hierarchical) == pytest.approx(expected)


def test_only_a_marked_dimension_cuts_a_phase():
    """Three dimensions, the outermost hierarchical: the inner two run flat on S, the third on S/16."""
    third = {"topology": "switch", "npus": 2, "bandwidth_GBps": 10, "latency_ns": 4000}
    network = [NetworkDim(**RING), NetworkDim(**SWITCH), NetworkDim(**third, collectives="hierarchical")]
    spec = SystemSpec(name="three", accelerator=UNIT_ACCELERATOR, network=network)
    inner_two = system(RING, SWITCH)
    expected = whole(Collective.ALL_REDUCE, inner_two) + 2 * 1 / 2 * (S / 16) / 10e9 + 2 * 4e-6
    assert whole(Collective.ALL_REDUCE, spec) == pytest.approx(expected)


@pytest.mark.parametrize("kind", [Collective.ALL_TO_ALL, Collective.BROADCAST])
def test_collectives_without_a_shard_stay_flat(kind):
    assert whole(kind, system(RING, SWITCH, collectives="pipelined")) == whole(kind, system(RING, SWITCH))


def dgx_h100(nodes: int, **outer: object) -> SystemSpec:
    return SystemSpec(**expand({"system": {"base": "dgx-h100", "network": {1: {"npus": nodes, **outer}}}})["system"])


SHARP = {"reduction_efficiency": 0.8, "reduction_latency_ns": 11000}
"""The InfiniBand SHARP option of the dgx-h100 preset's comment."""


def test_nvls_inside_and_sharp_across_nodes_pipelined():
    """NCCL's NVLS + SHARP on 16 DGX H100 at 1 GiB: NVLS all-reduces the node's buffer, S / (0.61 x 450 GB/s) +
    25 us (faster than the node's ring), SHARP each GPU's shard S/8 once each way, S/8 / (0.8 x 50 GB/s) + 11 us
    (faster than a ring over 16 nodes), overlapped chunk by chunk or one after the other."""
    size = 2**30
    nvls, sharp = size / (0.61 * 450e9), size / 8 / (0.8 * 50e9)
    ring_across = 2 * 15 / 16 * size / 8 / (0.94 * 50e9)
    assert sharp < ring_across
    spec = dgx_h100(16, collectives="pipelined", **SHARP)
    assert whole(Collective.ALL_REDUCE, spec, size) == pytest.approx(max(nvls, sharp) + 25e-6 + 11e-6)
    hierarchical = dgx_h100(16, collectives="hierarchical", **SHARP)
    assert whole(Collective.ALL_REDUCE, hierarchical, size) == pytest.approx(nvls + sharp + 25e-6 + 11e-6)
    # Two nodes: a ring over two carries the shard once too, at 0.94 of the line rate: it beats SHARP's 0.8.
    two = dgx_h100(2, collectives="hierarchical", **SHARP)
    ring_two = 2 * 1 / 2 * size / 8 / (0.94 * 50e9) + 2 * 5e-6
    assert whole(Collective.ALL_REDUCE, two, size) == pytest.approx(nvls + 25e-6 + ring_two)


def test_the_choice_changes_a_points_step_time_as_its_collectives_do():
    """tiny-llama data-parallel over the test ring's 4 x 2: the gradient all-reduce spans both dimensions; one
    phase after another is slower than flat, overlapped phases faster (the ring carries S, the switch S/4)."""
    times = {}
    for mode in ("flat", "hierarchical", "pipelined"):
        point = make_point(dp=8, overrides={"system.network.1.collectives": mode})
        times[mode] = evaluate(point, SymbolicGenerator(), AnalyticalCostModel()).result.step_time_s
    assert times["pipelined"] < times["flat"] < times["hierarchical"]


@pytest.mark.parametrize(
    "dims",
    [
        (RING, SWITCH),
        ({**RING, "topology": "switch", "npus": 8, "bandwidth_GBps": 400}, {**SWITCH, "bandwidth_GBps": 50}),
    ],
    ids=["ring4-switch4", "switch8-switch4"],
)
@pytest.mark.parametrize("kind", [Collective.ALL_REDUCE, Collective.REDUCE_SCATTER, Collective.ALL_GATHER])
def test_astrasim_runs_the_hierarchical_form(binary, dims, kind):
    """ASTRA-sim runs a group of the whole network dimension after dimension: the hierarchical closed form within
    0.1% (flat is 37% faster on the ring of 4 x switch of 4)."""
    spec = system(*dims, collectives="hierarchical")
    theirs = AstraSimCostModel(AstraSimOptions(binary=binary)).collective_time(kind, S, range(spec.npus), spec)
    assert theirs == pytest.approx(AnalyticalCostModel().collective_time(kind, S, range(spec.npus), spec), rel=1e-3)
