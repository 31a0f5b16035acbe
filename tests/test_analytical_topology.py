"""Collective algorithms per dimension, torus dimensions, and bandwidth shared by concurrent collectives.

Closed forms (n NPUs, buffer S, per-NPU bandwidth B, latency a) are written out in each test; the network module's
docstring has the table they come from.
"""

from math import log2

import numpy as np
import pytest
from helpers import UNIT_ACCELERATOR, make_point

from dse.system import NetworkDim, SystemSpec
from dse.workload import Block, Call, Op, OpKind, Program, RankLayout, Workload
from simulators.analytical import AnalyticalCostModel
from simulators.analytical.network import collective_time, torus_shape

S = 64 * 2**20
B, A = 100e9, 2e-6


def dim(topology: str, npus: int, algorithm: str = "auto", **extra) -> NetworkDim:
    return NetworkDim(topology=topology, npus=npus, bandwidth_GBps=100, latency_ns=2000, algorithm=algorithm, **extra)


def test_switch_runs_the_ring_by_default():
    n = 8
    assert collective_time("all_reduce", S, [(dim("switch", n), n)]) == pytest.approx(
        2 * (n - 1) / n * S / B + 2 * (n - 1) * A, rel=1e-12
    )


def test_fully_connected_runs_direct_by_default():
    n = 8
    assert collective_time("reduce_scatter", S, [(dim("fully_connected", n), n)]) == pytest.approx(
        (n - 1) / n * S / B + A, rel=1e-12
    )
    assert collective_time("all_to_all", S, [(dim("fully_connected", n), n)]) == pytest.approx(
        (n - 1) / n * S / B + A, rel=1e-12
    )


def test_direct_on_a_switch_when_asked():
    n = 4
    assert collective_time("all_reduce", S, [(dim("switch", n, "direct"), n)]) == pytest.approx(
        2 * (n - 1) / n * S / B + 2 * A, rel=1e-12
    )


@pytest.mark.parametrize("n", [2, 8, 16])
def test_halving_doubling_pays_log2_latencies(n):
    d = dim("switch", n, "halving_doubling")
    assert collective_time("all_reduce", S, [(d, n)]) == pytest.approx(
        2 * (n - 1) / n * S / B + 2 * log2(n) * A, rel=1e-12
    )
    assert collective_time("all_gather", S, [(d, n)]) == pytest.approx((n - 1) / n * S / B + log2(n) * A, rel=1e-12)


def test_tree_all_reduce_and_broadcast():
    n = 16
    d = dim("switch", n, "tree")
    assert collective_time("all_reduce", S, [(d, n)]) == pytest.approx(2 * (S / B + 4 * A), rel=1e-12)
    assert collective_time("broadcast", S, [(d, n)]) == pytest.approx(S / B + 4 * A, rel=1e-12)
    # NCCL has no tree reduce-scatter: the ring's figure.
    assert collective_time("reduce_scatter", S, [(d, n)]) == pytest.approx((n - 1) / n * S / B + (n - 1) * A)


def test_small_buffers_favour_low_latency_algorithms():
    """At 4 KiB the latency term dominates: halving-doubling and tree beat the ring on 64 NPUs."""
    small, n = 4096, 64
    ring = collective_time("all_reduce", small, [(dim("switch", n, "ring"), n)])
    hd = collective_time("all_reduce", small, [(dim("switch", n, "halving_doubling"), n)])
    tree = collective_time("all_reduce", small, [(dim("switch", n, "tree"), n)])
    assert hd < ring / 5 and tree < ring / 5


def test_torus_shapes():
    assert torus_shape(dim("torus2d", 16)) == [4, 4]
    assert torus_shape(dim("torus2d", 32)) == [4, 8]
    assert torus_shape(dim("torus3d", 64)) == [4, 4, 4]
    assert torus_shape(dim("torus2d", 32, shape=[2, 16])) == [2, 16]


def test_torus2d_all_reduce_is_a_ring_per_axis_on_the_shrinking_buffer():
    t = dim("torus2d", 16)
    x = 2 * 3 / 4 * S / B + 2 * 3 * A
    y = 2 * 3 / 4 * (S / 4) / B + 2 * 3 * A
    assert collective_time("all_reduce", S, [(t, 16)]) == pytest.approx(x + y, rel=1e-12)


def test_torus3d_all_gather_and_all_to_all():
    t = dim("torus3d", 8)
    gather = sum(1 / 2 * (S / 2**i) / B + A for i in range(3))
    assert collective_time("all_gather", S, [(t, 8)]) == pytest.approx(gather, rel=1e-12)
    assert collective_time("all_to_all", S, [(t, 8)]) == pytest.approx(3 * (S / 2 / B + A), rel=1e-12)


def test_torus_beats_a_ring_of_the_same_size_on_latency():
    ring = collective_time("all_reduce", 4096, [(dim("ring", 64), 64)])
    torus = collective_time("all_reduce", 4096, [(dim("torus2d", 64), 64)])
    assert torus < ring / 3


def test_a_shape_that_does_not_multiply_to_npus_is_rejected():
    with pytest.raises(ValueError, match="shape"):
        dim("torus2d", 16, shape=[4, 3])
    with pytest.raises(ValueError, match="torus"):
        dim("switch", 16, shape=[4, 4])


def test_a_switch_that_reduces_in_the_network_sends_each_byte_once_each_way():
    """NVLink SHARP: S/(e B_line) + 2a for the all-reduce; the collectives it does not reduce keep the ring."""
    n, e = 8, 0.6
    nvls = dim("switch", n, reduction_efficiency=e)
    assert collective_time("all_reduce", S, [(nvls, n)]) == pytest.approx(S / (e * B) + 2 * A, rel=1e-12)
    assert collective_time("all_gather", S, [(nvls, n)]) == pytest.approx((n - 1) / n * S / B + (n - 1) * A, rel=1e-12)
    # Across nodes its bus bandwidth, 2(n-1)/n e B, bounds the rings where the 8 links out of a node do not.
    outer = dim("switch", 4)
    assert collective_time("all_reduce", S, [(nvls, n), (outer, 4)]) == pytest.approx(
        2 * 31 / 32 * S / (2 * 7 / 8 * e * B) + 2 * A + 2 * 3 * A, rel=1e-12
    )


def test_an_all_reduce_takes_the_faster_of_the_switch_and_the_ring_at_its_size():
    """With the switch path's fixed cost L above the ring's 2(n-1)a, a small all-reduce runs the ring and a large
    one the switch; they cross where 2(n-1)/n S/B + 2(n-1)a = S/(e B_line) + L."""
    n, e, fixed = 8, 0.6, 50e-6
    nvls = dim("switch", n, reduction_efficiency=e, reduction_latency_ns=fixed * 1e9)
    ring = lambda size: 2 * (n - 1) / n * size / B + 2 * (n - 1) * A  # noqa: E731
    switch = lambda size: size / (e * B) + fixed  # noqa: E731
    crossing = (fixed - 2 * (n - 1) * A) / (2 * (n - 1) / n / B - 1 / (e * B))
    for size in (16e3, 0.5 * crossing, 2 * crossing, 1e9):
        expected = min(ring(size), switch(size))
        assert collective_time("all_reduce", size, [(nvls, n)]) == pytest.approx(expected, rel=1e-12)
    assert ring(16e3) < switch(16e3) and switch(1e9) < ring(1e9)
    with pytest.raises(ValueError, match="reduction_latency_ns needs reduction_efficiency"):
        dim("switch", n, reduction_latency_ns=1000)


def test_only_a_switch_reduces_in_the_network_and_others_dump_as_before():
    with pytest.raises(ValueError, match="reduction_efficiency is only for a switch"):
        dim("ring", 8, reduction_efficiency=0.6)
    # Unset, the field stays out of the dump, so points on such networks keep the keys stored studies have (this
    # one changed when the catalog A100 gained sm_count, and again when it gained measured kernel tables: its GEMMs
    # price differently since each; and when the A100 gained its price and dgx-a100 its network hardware, which its
    # cost and energy metrics read).
    assert "reduction_efficiency" not in dim("switch", 8).model_dump(mode="json")
    assert (
        make_point("llama3-8b", "dgx-a100", seq_len=2048, global_batch=32, tp=4, pp=2, dp=2).key == "6b8b44140dbc55d7"
    )


# -- bandwidth sharing in the schedule ----------------------------------------------------------------------


def _two_collectives(axes: tuple[str, str], layout: RankLayout, network: list[NetworkDim]) -> float:
    ops = tuple(Op(f"ar{i}", OpKind.COLLECTIVE, "all_reduce", comm_bytes=1e6, axis=axis) for i, axis in enumerate(axes))
    program = Program(0, "all")
    program.add(Call(0))
    workload = Workload("unit", layout, [Block("b", ops)], [program], np.zeros(layout.world, int), 1, 1.0)
    system = SystemSpec(name="unit", accelerator=UNIT_ACCELERATOR, network=network)
    return AnalyticalCostModel().simulate(workload, system).step_time_s


def test_two_concurrent_collectives_on_one_dimension_take_twice_as_long():
    """tp and dp groups of 2 both inside one 4-NPU switch: their all-reduces share its links."""
    layout = RankLayout((("tp", 2), ("dp", 2)))
    one = 2 * 1 / 2 * 1e6 / 1e9
    network = [NetworkDim(topology="switch", npus=4, bandwidth_GBps=1, latency_ns=0)]
    assert _two_collectives(("tp", "tp"), layout, network) == pytest.approx(2 * one, rel=1e-12)
    assert _two_collectives(("tp", "dp"), layout, network) == pytest.approx(2 * one, rel=1e-12)


def test_collectives_on_different_dimensions_run_concurrently():
    layout = RankLayout((("tp", 2), ("dp", 2)))
    network = [NetworkDim(topology="switch", npus=2, bandwidth_GBps=1, latency_ns=0)] * 2
    assert _two_collectives(("tp", "dp"), layout, network) == pytest.approx(1e6 / 1e9, rel=1e-12)


def _pipeline(stage0: tuple[Op, ...], stage1: tuple[Op, ...]) -> float:
    """Two pipeline stages (pp=2) of two dp ranks each, all four NPUs on one 1 GB/s switch."""
    layout = RankLayout((("dp", 2), ("pp", 2)))
    programs = []
    for index in range(2):
        program = Program(index, f"stage{index}")
        program.add(Call(index, tag=1))
        programs.append(program)
    blocks = [Block("s0", stage0), Block("s1", stage1)]
    workload = Workload("unit", layout, blocks, programs, np.array([0, 0, 1, 1]), 1, 1.0)
    network = [NetworkDim(topology="switch", npus=4, bandwidth_GBps=1, latency_ns=0)]
    return (
        AnalyticalCostModel()
        .simulate(workload, SystemSpec(name="u", accelerator=UNIT_ACCELERATOR, network=network))
        .step_time_s
    )


def _p2p(kind: OpKind, peer: int) -> Op:
    return Op(kind.value, kind, kind.value, comm_bytes=1e6, axis="pp", peer=peer)


def test_a_send_and_a_collective_on_one_dimension_share_it():
    """A 1 ms send and a 1 ms all-reduce leave the same NIC: 2 ms, not 1."""
    all_reduce = Op("ar", OpKind.COLLECTIVE, "all_reduce", comm_bytes=1e6, axis="dp")
    step = _pipeline((all_reduce, _p2p(OpKind.SEND, +1)), (_p2p(OpKind.RECV, -1),))
    assert step == pytest.approx(2e-3, rel=1e-12)


def test_links_are_full_duplex_for_opposite_transfers():
    """Stage 0 sends forward while stage 1 sends backward: each NIC sends one and receives one, 1 ms."""
    stage0 = (_p2p(OpKind.SEND, +1), _p2p(OpKind.RECV, +1))
    stage1 = (_p2p(OpKind.RECV, -1), _p2p(OpKind.SEND, -1))
    assert _pipeline(stage0, stage1) == pytest.approx(1e-3, rel=1e-12)
