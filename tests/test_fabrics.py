"""Today's fabrics (simulators/analytical/fabrics.py): each closed form against a hand computation, every system
preset loads and prices a tiny point, ASTRA-sim agrees on an expressible preset, and refuses a fabric it cannot
express in one line."""

import pytest
from helpers import UNIT_ACCELERATOR, make_point
from pydantic import ValidationError

from dse import catalog
from dse.network import NetworkDim
from dse.point.evaluate import evaluate
from dse.point.points import expand
from dse.system import SystemSpec
from dse.workload import Collective
from generators.symbolic import SymbolicGenerator
from simulators.analytical import AnalyticalCostModel
from simulators.analytical.network import collective_time, group_span, p2p_time
from simulators.astrasim import AstraSimCostModel, AstraSimError, AstraSimOptions
from simulators.astrasim.config import astra_dims

GB = 1e9
S = 2**30
AR, A2A = Collective.ALL_REDUCE, Collective.ALL_TO_ALL


def dim(topology: str = "switch", npus: int = 32, bandwidth: float = 50, **fields: object) -> NetworkDim:
    return NetworkDim(topology=topology, npus=npus, bandwidth_GBps=bandwidth, latency_ns=0, **fields)


def seconds(kind: Collective, ranks: range | list[int], *network: NetworkDim) -> float:
    return collective_time(kind, S, group_span(list(ranks), network))


def test_an_oversubscribed_fat_tree_slows_what_leaves_a_leaf_by_the_rule():
    tree = dim(leaf_npus=8, oversubscription=4)
    ring = 2 * 31 / 32 * S / (50 * GB)
    # A ring over all 32: 8 members a leaf, x = 1/8, x r = 0.5: the line rate.
    assert seconds(AR, range(32), tree) == pytest.approx(ring)
    # One member a leaf (every 8th position): x = 1, 4 times slower.
    assert seconds(AR, range(0, 32, 8), tree) == pytest.approx(2 * 3 / 4 * S / (50 * GB) * 4)
    # All-to-all over all 32: 24 of 31 peers outside the leaf, x r = 4 x 24/31.
    assert seconds(A2A, range(32), tree) == pytest.approx(31 / 32 * S / (50 * GB) * 4 * 24 / 31)
    # Inside one leaf: no taper.
    assert seconds(A2A, range(8), tree) == pytest.approx(7 / 8 * S / (50 * GB))


def test_a_dragonfly_is_bound_by_its_global_links_across_groups():
    fly = dim("dragonfly", 64, 50, group_npus=16, global_bandwidth_GBps=200)
    # All-to-all over 4 groups: x = 48/63 of the traffic leaves, r = 16 x 50 / 200 = 4.
    assert seconds(A2A, range(64), fly) == pytest.approx(63 / 64 * S / (50 * GB) * 4 * 48 / 63)
    # A ring with one member a group: x = 1, r = 16 x 50 / max(200/3, 200/2) = 8.
    assert seconds(AR, range(0, 64, 16), fly) == pytest.approx(2 * 3 / 4 * S / (50 * GB) * 8)
    # Inside a group, a plain switch.
    assert seconds(AR, range(16), fly) == pytest.approx(2 * 15 / 16 * S / (50 * GB))


@pytest.mark.parametrize(
    ("ranks", "links"), [(range(8), 6), (range(4), 4), (range(0, 8, 2), 2), ([0, 4], 2), ([2, 6], 1)]
)
def test_a_cube_mesh_group_runs_the_rings_its_links_allow(ranks, links):
    mesh = dim("hybrid_cube_mesh", 8, 150)
    n = len(ranks)
    assert seconds(AR, ranks, mesh) == pytest.approx(2 * (n - 1) / n * S / (150 * GB * links / 6))


def test_rails_send_a_cross_rail_all_to_all_through_the_scale_up_dimension_first():
    nvlink, plain = dim(npus=8, bandwidth=100), dim(npus=4, bandwidth=50)
    rails = plain.model_copy(update={"rails": True})
    group = range(32)
    # Plain: the NICs bound it, 24/32 of the buffer at 50 GB/s.
    assert seconds(A2A, group, nvlink, plain) == pytest.approx(24 / 32 * S / (50 * GB))
    # PXN: NVLink carries its own 7/32 and 24 x 7/8 / 32 relayed, 28/32 at 100 GB/s: still under the NICs' bound.
    assert seconds(A2A, group, nvlink, rails) == pytest.approx(24 / 32 * S / (50 * GB))
    slow = nvlink.model_copy(update={"bandwidth_GBps": 40})
    assert seconds(A2A, group, slow, rails) == pytest.approx(28 / 32 * S / (40 * GB))
    # A send to another local rank in another node: the NVLink hop's latency is added.
    timed = [nvlink.model_copy(update={"latency_ns": 1000}), rails.model_copy(update={"latency_ns": 5000})]
    assert p2p_time(S, 0, 9, timed) == pytest.approx(S / (50 * GB) + 6e-6)
    assert p2p_time(S, 0, 8, timed) == pytest.approx(S / (50 * GB) + 5e-6)


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"leaf_npus": 4}, "leaf_npus and oversubscription go together"),
        ({"topology": "dragonfly"}, "group_npus and global_bandwidth_GBps"),
        ({"npus": 4, "topology": "hybrid_cube_mesh"}, "joins 8 GPUs"),
        ({"topology": "ring", "rails": True}, "rails is for a switch"),
        ({"topology": "ring", "hardware": {"switch_ports": 64}}, "has direct links and no switches"),
        ({"leaf_npus": 48, "oversubscription": 2, "hardware": {"switch_ports": 64}}, "needs 72 ports, more than"),
    ],
)
def test_a_fabric_field_that_does_not_fit_is_refused(fields, fragment):
    with pytest.raises(ValidationError, match=fragment):
        dim(**{"npus": 8, **fields})


@pytest.mark.parametrize(
    ("outer", "fragment"),
    [({"rails": True}, "network.0.rails"), ({"collectives": "pipelined"}, "network.0.collectives")],
)
def test_what_needs_a_dimension_inside_is_refused_on_the_first(outer, fragment):
    """Rails and a crossing's collectives say how traffic reaches a dimension from the ones inside it: the first
    has none, so they would be ignored there."""
    network = [{**dim(npus=8).model_dump(), **outer}, dim(npus=2).model_dump()]
    with pytest.raises(ValidationError, match=fragment):
        SystemSpec.model_validate({"name": "s", "accelerator": UNIT_ACCELERATOR, "network": network})


PRESETS = ["dgx-1", "dgx-2", "dgx-b200", "gb200-nvl72", "gb300-nvl72", "pcie-h100", "mi300x-8", "tpu-v5p-pod"]
PRESETS += ["dragonfly-h100", "fattree-2to1-h100", "rail-h100", "dgx-a100", "dgx-h100", "dgx-h200"]


def preset(name: str) -> dict:
    """The preset as a point's system, on a stand-in H100 where helper A's accelerator is not in the catalog yet."""
    data = catalog.entry("systems", name)
    if isinstance(data["accelerator"], str) and data["accelerator"] not in catalog.names("accelerators"):
        data["accelerator"] = {"base": "h100-sxm", "kernel_source": "roofline"}
    return data


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_prices_a_tiny_point(name):
    system = expand({"system": preset(name)})["system"]
    first = system["network"][0]["npus"]
    system["network"] = [{**system["network"][0]}, *({**d, "npus": 2} for d in system["network"][1:])]
    npus = first * 2 ** (len(system["network"]) - 1)
    dtype = "bf16" if "bf16" in system["accelerator"]["peak_tflops"] else "fp16"  # V100s have no bf16
    point = make_point(system=system, global_batch=npus, dp=npus, overrides={"model.dtype": dtype})
    result = evaluate(point, SymbolicGenerator(), AnalyticalCostModel())
    assert result.result.step_time_s > 0
    for spec in SystemSpec.model_validate(system).network:
        assert spec.hardware is not None and spec.hardware.sources


def test_astrasim_refuses_a_tapered_fabric_in_one_line():
    system = SystemSpec(name="tree", accelerator=UNIT_ACCELERATOR, network=[dim(leaf_npus=8, oversubscription=2)])
    with pytest.raises(AstraSimError) as error:
        astra_dims(system)
    assert "\n" not in str(error.value) and "system.network.0.oversubscription" in str(error.value)


@pytest.mark.parametrize("name", ["dgx-1", "mi300x-8"])
def test_astrasim_agrees_with_the_closed_forms_on_an_expressible_preset(binary, name):
    whole = expand({"system": preset(name)})["system"]
    network = [NetworkDim.model_validate(whole["network"][0])]  # the network is compared, not the accelerator
    system = SystemSpec(name=name, accelerator=UNIT_ACCELERATOR, network=network)
    model = AstraSimCostModel(AstraSimOptions(binary=binary))
    for kind, size in ((AR, 2**20), (Collective.ALL_GATHER, 256 * 2**20)):
        ours = AnalyticalCostModel().collective_time(kind, size, range(8), system)
        assert model.collective_time(kind, size, range(8), system) == pytest.approx(ours, rel=0.01)
