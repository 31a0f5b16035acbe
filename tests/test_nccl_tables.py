"""Collectives within a node priced from aiconfigurator-core's NCCL tables (README: Measured kernel tables).

What is pinned: the tables' message_size is elements of the whole nccl-tests buffer (their largest rows read so
agree with nccl-tests' bus bandwidths in ../shared/calibration.md, read as bytes they do not); every measured row is
reproduced exactly; rows held out are predicted from the rest (the figures are printed: `pytest -s
tests/test_nccl_tables.py`); below the smallest size the latency floor, beyond the largest the last doubling's
marginal rate; what the tables did not run keeps the network model; a TP all-reduce on 8 H100s is the table's row
on both the per-point and the batch path; the network model's NVLink efficiencies against the tables.
"""

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml
from helpers import held_out_errors, hold_out, make_point, run_cli

from dse.point.calibration import NCCL_CASES, run_nccl_tables
from dse.system import NetworkDim
from dse.tables.nccl import NCCL_TABLE, OPS, MeasuredCollectives, NcclTable, SizeCurve
from dse.tables.source import KernelTables, NcclTables, table_file
from dse.workload import Collective, OpKind, bus_factor
from generators.symbolic import SymbolicGenerator
from simulators.analytical import AnalyticalCostModel
from simulators.analytical.batch import price_many
from simulators.analytical.network import collective_time, within_node
from simulators.analytical.pricing import BlockPricer

pytest.importorskip("aiconfigurator_core")

H100 = NcclTables(version="2.29.2", bandwidth_GBps=450.0)
A100 = NcclTables(version="2.27.3", bandwidth_GBps=300.0)
GEMMS = {"system": "h100_sxm", "framework": "trtllm", "version": "1.3.0rc20", "peak_tflops": {"bf16": 989.4}}
GEMMS["hbm_bandwidth_GBps"] = 3350.0
NAMES = {name: kind for kind, name in OPS.items()}


def rows(system: str, nccl: NcclTables) -> pd.DataFrame:
    """The collection's half rows, message_size in elements as stored, latency in seconds (repeats' median)."""
    collection = KernelTables.model_construct(system=system, framework="nccl", version=nccl.version)
    table = pq.read_table(table_file(collection, "comm", "nccl_perf", "test")).to_pandas()
    table = table[table["nccl_dtype"] == "half"].assign(latency=lambda t: t["latency"] * 1e-3)
    return table.groupby(["op_name", "num_gpus", "message_size"], as_index=False)["latency"].median()


def test_message_size_is_elements_of_the_whole_nccl_tests_buffer():
    """8 GPUs' all-reduce at the tables' largest size (2^28 elements of half: 512 MiB), as nccl-tests' bus bandwidth
    2 (n-1)/n S / t: read as elements it is near the figures nccl-tests reports (H100 NVLS ~480 GB/s, A100 ~230),
    read as bytes it is half of them. Extended to nccl-tests' 8 GiB by the last doubling's rate: 460 and 229 GB/s."""
    for system, nccl, measured, within in (("h100_sxm", H100, 480, 0.05), ("a100_sxm", A100, 230, 0.01)):
        table = rows(system, nccl)
        row = table[(table["op_name"] == "all_reduce") & (table["num_gpus"] == 8)].iloc[-1]
        assert row["message_size"] == 2**28
        as_elements = bus_factor("all_reduce", 8) * 2 * row["message_size"] / row["latency"] / 1e9
        assert 0.9 < as_elements / measured < 1.0 and as_elements / 2 / measured < 0.5
        extended = MeasuredCollectives(system, nccl).seconds(Collective.ALL_REDUCE, 8, 8 * 2**30)
        bus = bus_factor("all_reduce", 8) * 8 * 2**30 / extended / 1e9
        print(f"{system}: 8-GPU all-reduce bus bandwidth {as_elements:.0f} GB/s at 512 MiB, {bus:.0f} at 8 GiB")
        assert bus == pytest.approx(measured, rel=within)


@pytest.mark.parametrize(
    "system, nccl",
    [("h100_sxm", H100), ("a100_sxm", A100), ("h100_sxm", H100.model_copy(update={"version": "2.27.3"}))],
)
def test_every_measured_row_is_reproduced_exactly(system, nccl):
    """h100_sxm's nccl 2.27.3 holds every row twice: the median of the two is the row."""
    measured = MeasuredCollectives(system, nccl)
    for row in rows(system, nccl).itertuples():
        found = measured.seconds(NAMES[row.op_name], row.num_gpus, 2.0 * row.message_size)
        assert found == row.latency, row


@pytest.mark.parametrize("system, nccl", [("h100_sxm", H100), ("a100_sxm", A100)])
def test_held_out_rows_are_predicted_from_the_rest(system, nccl):
    table = rows(system, nccl)
    table = table.assign(message_size=2.0 * table["message_size"])
    kept, out = hold_out(table)
    grid = NcclTable.from_rows(kept)
    predicted = np.array([grid.seconds(NAMES[r.op_name], r.num_gpus, r.message_size) for r in out.itertuples()])
    median, _, worst = held_out_errors(f"{system} nccl {nccl.version}", predicted, out["latency"].to_numpy())
    # Today's figures with a little room: the median is interpolation; the worst rows are NCCL's protocol and
    # algorithm switches (LL to LL128 to Simple) at one size, which no curve through their neighbours foresees.
    assert median < 0.04 and worst < 0.40


def test_below_the_smallest_size_the_floor_and_beyond_the_largest_the_last_doubling():
    curve = SizeCurve((512.0, 1024.0, 2048.0), (10e-6, 11e-6, 15e-6))
    assert curve.at(1.0) == curve.at(0.0) == curve.at(512.0) == 10e-6
    assert curve.at(724.0770) == pytest.approx(10e-6 * 1.1**0.5, rel=1e-6)  # log-log: halfway between 512 and 1024
    assert curve.at(4096.0) == pytest.approx(15e-6 + 2048 * 4e-6 / 1024, rel=1e-12)
    faster = SizeCurve((512.0, 1024.0), (12e-6, 11e-6))  # a noisy last doubling: the largest run back to back
    assert faster.at(4096.0) == pytest.approx(4 * 11e-6, rel=1e-12)


def dgx_dim(**changes) -> NetworkDim:
    """The first dimension of the catalog's DGX H100 (NVLink4 through NVSwitch, NVLS for all-reduce)."""
    return make_point(system={"base": "dgx-h100", "network": {0: changes} if changes else {}}, dp=8).system.network[0]


def test_what_the_tables_did_not_run_keeps_the_network_model():
    node, dim, size = MeasuredCollectives("h100_sxm", H100), dgx_dim(), 2.0**24
    for count in (3, 5, 6, 7):
        assert collective_time("all_reduce", size, [(dim, count)], node) == collective_time(
            "all_reduce", size, [(dim, count)]
        )
    assert collective_time("broadcast", size, [(dim, 8)], node) == collective_time("broadcast", size, [(dim, 8)])
    outer = [(dim, 8), (dgx_dim(npus=4, bandwidth_GBps=50), 4)]
    assert collective_time("all_reduce", size, outer, node) == collective_time("all_reduce", size, outer)
    assert within_node(node, (0,)) is node and within_node(node, (1,)) is None and within_node(node, (0, 1)) is None
    assert collective_time("all_reduce", size, [(dim, 8)], node) != collective_time("all_reduce", size, [(dim, 8)])


def test_a_first_dimension_of_another_bandwidth_scales_the_measured_time():
    """At the measured line rate the table's time as it is; at twice it, scaled by the model's two times (so a
    large buffer's time nearly halves and a small one's, all latency, stays)."""
    node, size = MeasuredCollectives("h100_sxm", H100), 2.0**28
    table = node.seconds(Collective.ALL_GATHER, 8, size)
    assert collective_time("all_gather", size, [(dgx_dim(), 8)], node) == table
    fast = dgx_dim(bandwidth_GBps=900)
    ratio = collective_time("all_gather", size, [(fast, 8)]) / collective_time("all_gather", size, [(dgx_dim(), 8)])
    assert collective_time("all_gather", size, [(fast, 8)], node) == pytest.approx(table * ratio, rel=1e-12)
    assert 0.5 < ratio < 0.51
    small = node.seconds(Collective.ALL_GATHER, 8, 1024.0)
    assert collective_time("all_gather", 1024.0, [(fast, 8)], node) == pytest.approx(small, rel=0.01)


def h100_node(nccl: NcclTables | None, overrides: dict | None = None, **parallel):
    """tiny-llama on one DGX H100 node, GEMMs from the H100 tables, collectives within the node from `nccl`."""
    tables = {**GEMMS, **({} if nccl is None else {"nccl": nccl.model_dump()})}
    overrides = {"system.accelerator.kernel_source": "tables", "system.accelerator.kernel_tables": tables} | (
        overrides or {}
    )
    system = {"base": "dgx-h100", "network": {1: {"npus": 1}}}
    return make_point(system=system, global_batch=8, overrides=overrides, **parallel)


def test_a_tp_all_reduce_on_8_h100s_is_the_tables_row():
    """tiny-llama's TP all-reduces on 8 H100s (the activations, 256 tokens x 256 wide in bf16, and the loss's 256
    fp32 figures: 64 Ki and 512 half elements, measured sizes) are the table's rows, not the model's, on the
    per-point path, the batch path and the cost model's collective_time."""
    point, modelled = h100_node(H100, tp=8), h100_node(None, tp=8)
    workload = SymbolicGenerator().generate(point)
    pricer, network = BlockPricer(workload, point.system), BlockPricer(workload, modelled.system)
    table = rows("h100_sxm", H100)
    all_reduce = table[(table["op_name"] == "all_reduce") & (table["num_gpus"] == 8)].set_index("message_size")
    sizes = set()
    for index, block in enumerate(workload.blocks):
        priced = zip(block.ops, pricer.durations(index, 0), network.durations(index, 0), strict=True)
        for op, seconds, model in priced:
            if op.kind is OpKind.COLLECTIVE and op.category == "all_reduce" and op.axis == "tp":
                assert seconds == all_reduce["latency"][op.comm_bytes / 2] != model
                sizes.add(op.comm_bytes)
    assert sizes == {2.0**10, 2.0**17}
    exact = AnalyticalCostModel(exact=True)
    with_tables, without = exact.simulate(workload, point.system), exact.simulate(workload, modelled.system)
    assert with_tables.step_time_s > without.step_time_s  # NCCL's ~20 us floor against the model's 700 ns hops
    # The batch path prices collectives per network and NCCL tables: two systems of one network, each its own.
    batch = price_many(workload, [point.system, modelled.system])
    assert batch[0].step_time_s == pytest.approx(with_tables.step_time_s, rel=1e-9)
    assert batch[1].step_time_s == pytest.approx(without.step_time_s, rel=1e-9)
    alone = AnalyticalCostModel().collective_time(Collective.ALL_REDUCE, 2.0**17, range(8), point.system)
    assert alone == all_reduce["latency"][2**16]
    # The timeline names what priced each collective: the tables, or (no source) the network model.
    for system, source in ((point.system, NCCL_TABLE), (modelled.system, "")):
        events = AnalyticalCostModel(timeline=True).simulate(workload, system).timeline
        assert {e.source for e in events if e.category == "all_reduce"} == {source}


def test_a_serving_steps_tp_all_reduce_is_the_faster_of_nccl_and_the_frameworks_own():
    """A decode step runs in a serving framework: its TP all-reduces of one token x 256 wide (256 bf16 elements) on
    8 H100s are TensorRT-LLM's one-shot all-reduce row (3.1 us), not NCCL's (15.6 us); the same all-reduces in a
    training step stay NCCL's, and a size where NCCL is the faster keeps NCCL's."""
    decode = h100_node(H100, tp=8, overrides={"workload.mode": "decode"})
    workload = SymbolicGenerator().generate(decode)
    assert workload.framework_allreduce
    collection = KernelTables.model_validate(GEMMS)
    custom = pq.read_table(table_file(collection, "comm", "custom_allreduce_perf", "test")).to_pandas()
    custom = custom[(custom["num_gpus"] == 8) & (custom["allreduce_dtype"] == "bfloat16")]
    custom = custom.groupby("message_size")["latency"].median() * 1e-3
    nccl = rows("h100_sxm", H100)
    nccl = nccl[(nccl["op_name"] == "all_reduce") & (nccl["num_gpus"] == 8)].set_index("message_size")["latency"]
    pricer = BlockPricer(workload, decode.system)
    sizes = set()
    for index, block in enumerate(workload.blocks):
        for op, seconds in zip(block.ops, pricer.durations(index, 0), strict=True):
            if op.kind is OpKind.COLLECTIVE and op.category == "all_reduce" and op.axis == "tp":
                elements = op.comm_bytes / 2
                assert seconds == min(custom[elements], nccl[elements]) == custom[elements] < nccl[elements]
                sizes.add(elements)
    assert sizes == {256.0}
    nodes = MeasuredCollectives.of(decode.system.accelerator, framework=True)
    assert nodes is not None and nodes.seconds(Collective.ALL_REDUCE, 8, 2 * 2**21) == nccl[2**21] < custom[2**21]
    train = h100_node(H100, tp=8)
    assert not SymbolicGenerator().generate(train).framework_allreduce


def test_the_network_models_nvlink_efficiencies_against_the_tables():
    """`dse calibrate`'s NCCL rows: where bandwidth rules (1 GiB) the catalog's NVLink efficiencies, set from
    nccl-tests at 8 GiB, stay within 10% of the tables; below it the model's 700 ns per hop misses NCCL's ~20 us of
    fixed cost, which the tables carry (the model is optimistic by 15-35% at 64 MiB)."""
    found = run_nccl_tables(AnalyticalCostModel())
    assert isinstance(found, list) and len(found) == 3 * len(NCCL_CASES)
    for row in found:
        node = MeasuredCollectives(*row.case.tables)
        kind = Collective(row.case.collective)
        assert row.table_GBps == bus_factor(kind, 8) * row.size / 1e9 / node.seconds(kind, 8, row.size)
        assert 0 < row.error < (0.10 if row.size == 2**30 else 2.5), (row.case.name, row.size, row.error)


def test_a_collection_without_nccl_tables_is_refused_in_one_line(tmp_path):
    point = {
        "model": "tiny-llama",
        "workload": {"mode": "train", "seq_len": 256, "global_batch": 8},
        "parallel": {"tp": 2, "dp": 4},
        "system": {"base": "tiny-ring", "accelerator": {"base": "h100-sxm", "kernel_source": "tables"}},
    }
    cases = {
        "'9.9'": ("has no nccl_perf for h100_sxm under nccl 9.9", "nccl 2.27.3, nccl 2.29.2"),
        "'2.23'": (
            "field 'system.accelerator.kernel_tables.nccl.version'",
            "no half all_reduce rows",
            "2.27.3, 2.29.2",
        ),
        "9.9": ("kernel_tables.nccl.version'", "write the version in quotes"),
    }
    for version, fragments in cases.items():
        tables = {**GEMMS, "nccl": {"version": yaml.safe_load(version), "bandwidth_GBps": 450.0}}
        accelerator = {**point["system"]["accelerator"], "kernel_tables": tables}
        path = tmp_path / "point.yaml"
        path.write_text(yaml.safe_dump({**point, "system": {**point["system"], "accelerator": accelerator}}))
        code, out, err = run_cli("evaluate", str(path))
        assert code == 2 and out == "" and len(err.splitlines()) == 1, (version, err)
        assert all(fragment in err for fragment in fragments), (version, err)
