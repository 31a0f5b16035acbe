"""Collective and p2p times against their closed forms, and which network dimensions a process group spans."""

import pytest

from dse.system import NetworkDim
from dse.workload import RankLayout
from simulators.analytical.network import collective_time, group_span, p2p_time

RING = NetworkDim(topology="ring", npus=8, bandwidth_GBps=100, latency_ns=1000, efficiency=0.8)
SWITCH = NetworkDim(topology="switch", npus=2, bandwidth_GBps=25, latency_ns=5000)
FULL = NetworkDim(topology="fully_connected", npus=4, bandwidth_GBps=50, latency_ns=500)
S = 256 * 2**20
B0, A0 = 80e9, 1e-6
B1, A1 = 25e9, 5e-6


def test_dimension_bandwidth_includes_efficiency():
    assert RING.bandwidth == pytest.approx(B0, rel=1e-15)
    assert RING.latency == pytest.approx(A0, rel=1e-15)


def test_ring_all_reduce_on_eight_ranks():
    expected = 2 * 7 / 8 * S / B0 + 2 * 7 * A0
    assert collective_time("all_reduce", S, [(RING, 8)]) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_to_all"])
def test_ring_one_phase_collectives(kind):
    expected = 7 / 8 * S / B0 + 7 * A0
    assert collective_time(kind, S, [(RING, 8)]) == pytest.approx(expected, rel=1e-12)


def test_broadcast_moves_the_whole_buffer():
    assert collective_time("broadcast", S, [(RING, 8)]) == pytest.approx(S / B0 + 7 * A0, rel=1e-12)


def test_fully_connected_pays_one_latency_per_phase():
    bandwidth = 50e9
    assert collective_time("all_reduce", S, [(FULL, 4)]) == pytest.approx(
        2 * 3 / 4 * S / bandwidth + 2 * 0.5e-6, rel=1e-12
    )
    assert collective_time("all_gather", S, [(FULL, 4)]) == pytest.approx(3 / 4 * S / bandwidth + 0.5e-6, rel=1e-12)


def test_a_group_across_dimensions_runs_rings_bound_by_the_slowest_crossing():
    """f(N) S / min(B0, 8 B1) + each dimension's latency: the 8 members inside a block of the outer dimension each
    cross it on their own link, and the rings cross both dimensions at once."""
    inner_bound = 2 * 15 / 16 * S / min(B0, 8 * B1) + 2 * 7 * A0 + 2 * 1 * A1
    assert min(B0, 8 * B1) == B0
    assert collective_time("all_reduce", S, [(RING, 8), (SWITCH, 2)]) == pytest.approx(inner_bound, rel=1e-12)
    slow = NetworkDim(topology="switch", npus=4, bandwidth_GBps=5, latency_ns=5000)
    outer_bound = 2 * 31 / 32 * S / (8 * 5e9) + 2 * 7 * A0 + 2 * 3 * A1
    assert collective_time("all_reduce", S, [(RING, 8), (slow, 4)]) == pytest.approx(outer_bound, rel=1e-12)
    assert collective_time("reduce_scatter", S, [(RING, 8), (slow, 4)]) == pytest.approx(
        31 / 32 * S / (8 * 5e9) + 7 * A0 + 3 * A1, rel=1e-12
    )


def test_an_all_to_all_across_dimensions_sends_each_share_straight_to_its_member():
    """Of a member's buffer, the shares of the 8 members in its own node cross the inner dimension (7/16 of it,
    its own share stays) and those of the 8 in the other node the outer one (8/16), both at once."""
    expected = max(7 / 16 * S / B0, 8 / 16 * S / B1) + 7 * A0 + A1
    assert collective_time("all_to_all", S, [(RING, 8), (SWITCH, 2)]) == pytest.approx(expected, rel=1e-12)


def test_a_broadcast_across_dimensions_is_a_ring_through_them():
    expected = S / min(B0, 8 * B1) + 7 * A0 + A1
    assert collective_time("broadcast", S, [(RING, 8), (SWITCH, 2)]) == pytest.approx(expected, rel=1e-12)


def test_group_of_one_is_free():
    assert collective_time("all_reduce", S, []) == 0.0


def test_unknown_collective_is_rejected():
    with pytest.raises(ValueError):
        collective_time("gather", S, [(RING, 8)])


def test_group_span_of_tp_and_dp_groups():
    layout = RankLayout((("tp", 8), ("dp", 2)))
    network = [RING, SWITCH]
    assert group_span(layout.group(3, "tp"), network) == [(RING, 8)]
    assert group_span(layout.group(3, "dp"), network) == [(SWITCH, 2)]
    assert group_span(layout.group(3, "tp+dp"), network) == [(RING, 8), (SWITCH, 2)]


def test_group_span_of_a_small_tp_inside_a_wide_dimension():
    layout = RankLayout((("tp", 2), ("dp", 8)))
    network = [RING, SWITCH]
    assert group_span(layout.group(5, "tp"), network) == [(RING, 2)]
    # dp strides by 2: four coordinates of the ring, both of the switch.
    assert group_span(layout.group(5, "dp"), network) == [(RING, 4), (SWITCH, 2)]


def test_group_span_of_a_group_straddling_a_dimension_boundary():
    ring3 = NetworkDim(topology="ring", npus=3, bandwidth_GBps=100, latency_ns=1000)
    switch4 = NetworkDim(topology="switch", npus=4, bandwidth_GBps=25, latency_ns=5000)
    layout = RankLayout((("tp", 2), ("dp", 6)))
    assert group_span(layout.group(2, "tp"), [ring3, switch4]) == [(ring3, 2), (switch4, 2)]
    assert group_span(layout.group(0, "tp"), [ring3, switch4]) == [(ring3, 2)]


def test_p2p_uses_the_outermost_differing_dimension():
    network = [RING, SWITCH]
    assert p2p_time(S, 0, 5, network) == pytest.approx(S / B0 + A0, rel=1e-12)
    assert p2p_time(S, 3, 11, network) == pytest.approx(S / B1 + A1, rel=1e-12)
    assert p2p_time(S, 1, 10, network) == pytest.approx(S / B1 + A1, rel=1e-12)
    assert p2p_time(S, 4, 4, network) == 0.0
