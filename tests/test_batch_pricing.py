"""The batch's op seconds (`BatchPricer`, network.py's closed forms over arrays of networks) against the per-point
pricer (`BlockPricer`), float for float, on random systems: each network's rates, latencies and algorithms drawn,
and its structure too (collectives, in-network reduction, rails, leaves, a ring or torus first dimension), so one
batch mixes groups of networks priced together with the measured NCCL tables' scaling and a cube-mesh left to the
scalar code."""

import random

import pytest

from dse.system import SystemSpec
from dse.tables.deepep import DEEPEP_TABLE
from generators.symbolic import SymbolicGenerator
from simulators.analytical.batch import _timing_key
from simulators.analytical.batch_pricing import BatchPricer
from simulators.analytical.pricing import BlockPricer
from tests.helpers import make_point

DGX = {"base": "dgx-h100", "network": {1: {"npus": 2}}}
CASES = {
    "tp2-pp2-dp2-sp-zero1": dict(tp=2, pp=2, dp=2, sp=True, zero=1, global_batch=16),
    "dp8-zero3": dict(dp=8, zero=3, global_batch=16),
    "tp4-cp2-ring-dp2": dict(tp=4, cp=2, dp=2, cp_algorithm="ring", global_batch=16),
}


def _structure(rng: random.Random) -> dict:
    """A network's structure: what decides its formulas."""
    first = rng.choice(["switch", "switch", "ring", "torus2d", "fully_connected", "hybrid_cube_mesh"])
    structure = {
        "system.network.0.topology": first,
        "system.network.0.algorithm": rng.choice(["auto", "ring", "tree", "direct", "halving_doubling"]),
        "system.network.1.collectives": rng.choice(["flat", "hierarchical", "pipelined"]),
        "system.network.1.reduction_efficiency": rng.choice([None, 0.8]),
        "system.network.1.rails": rng.choice([False, True]),
    }
    if first != "switch":
        structure |= {"system.network.0.reduction_efficiency": None, "system.network.0.reduction_latency_ns": None}
    if not structure["system.network.1.rails"] and rng.random() < 0.3:
        structure |= {"system.network.1.leaf_npus": 1, "system.network.1.oversubscription": 2.0}
    return structure


def _system(case: dict, structure: dict, rng: random.Random) -> SystemSpec:
    """A system of this structure, its rates and latencies drawn (the NVLink rate often the measured node's)."""
    overrides = structure | {
        "system.accelerator.peak_tflops.bf16": rng.choice([400, 1000, 2500]),
        "system.network.0.bandwidth_GBps": rng.choice([450, 450, rng.uniform(20, 1800)]),
        "system.network.0.latency_ns": rng.uniform(100, 10000),
        "system.network.0.efficiency": rng.choice([0.82, rng.uniform(0.5, 1)]),
        "system.network.1.bandwidth_GBps": rng.uniform(2, 400),
        "system.network.1.latency_ns": rng.uniform(500, 30000),
    }
    return make_point(**case, system=DGX, overrides=overrides).system


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_batch_prices_every_op_as_the_per_point_pricer_does(case):
    rng = random.Random(len(case))
    structures = [_structure(rng) for _ in range(6)]
    systems = [_system(CASES[case], rng.choice(structures), rng) for _ in range(60)]
    workload = SymbolicGenerator().generate(make_point(**CASES[case], system=DGX))
    batch = BatchPricer(workload, systems, [_timing_key(system) for system in systems])
    pricers = [BlockPricer(workload, system) for system in systems]
    classes = range(len(workload.programs))
    for block in range(len(workload.blocks)):
        for rank_class in classes:
            seconds = batch.seconds(block, rank_class)
            for index, pricer in enumerate(pricers):
                assert seconds[:, index].tolist() == pricer.durations(block, rank_class)


def test_the_batch_scales_the_deepep_tables_as_the_per_point_pricer_does():
    """A serving step's MoE all-to-alls read from the DeepEP tables, scaled to each network's line rates (the
    measured ones among them), in one group of networks."""
    rng = random.Random(1)
    moe = {"model.hidden": 7168, "model.moe": {"experts": 256, "top_k": 8, "expert_ffn": 256}}
    fixed = moe | {"workload.mode": "decode", "system.network.1.npus": 2}
    point = make_point("tiny-moe", "dgx-h200", 128, 16, 1, fixed, dp=16, ep=16)
    systems = [
        make_point(
            "tiny-moe",
            "dgx-h200",
            128,
            16,
            1,
            fixed
            | {
                "system.network.0.bandwidth_GBps": rng.choice([point.system.network[0].bandwidth_GBps, 900, 200]),
                "system.network.1.bandwidth_GBps": rng.choice([point.system.network[1].bandwidth_GBps, 12.5, 100]),
                "system.network.1.latency_ns": rng.uniform(500, 30000),
            },
            dp=16,
            ep=16,
        ).system
        for _ in range(12)
    ]
    workload = SymbolicGenerator().generate(point)
    batch = BatchPricer(workload, systems, [_timing_key(system) for system in systems])
    pricers = [BlockPricer(workload, system) for system in systems]
    block = next(i for i, b in enumerate(workload.blocks) if b.name == "layer.attn.moe.forward")
    ops = workload.blocks[block].ops
    assert any(op.is_comm and pricers[0].source(block, i, 0) == DEEPEP_TABLE for i, op in enumerate(ops))
    for block in range(len(workload.blocks)):
        seconds = batch.seconds(block, 0)
        for index, pricer in enumerate(pricers):
            assert seconds[:, index].tolist() == pricer.durations(block, 0)
