"""The splice argument's checks (`steady._periods`, `steady_reads`) on the point that showed them needed.

Llama-2-13B on eight pipeline stages with ZeRO-3 runs 32 micro-batches, its steady form 12 (p + 4). A rule that took
any distance at which calls recur and only asked the run to span two periods found stage 0's drain (seven backward
calls a period, at the steady period's length) and extended it: 56% off. Here the distance is the calls a step adds
per period, the run must hold every call the spliced calls read back (leaving out the forward activations a backward
also waits on through the next stage's gradient), and the stages' transfers must join their runs.
"""

from dataclasses import replace

import numpy as np
import pytest

from generators.symbolic import SymbolicGenerator
from simulators.analytical import AnalyticalCostModel, steady
from simulators.analytical.calls import call_array
from simulators.analytical.compiled_engine import CompiledScheduler
from simulators.analytical.steady_reads import reads
from tests.helpers import make_point, steady_runs

POINT = dict(
    model="llama2-13b",
    system={"base": "mi300x-8", "network": {1: {"npus": 8}}},
    seq_len=4096,
    global_batch=128,
    tp=2,
    pp=8,
    dp=4,
    sp=True,
    zero=3,
    recompute="selective",
)


@pytest.fixture(scope="module")
def drained():
    point = make_point(**POINT)
    workload = SymbolicGenerator().generate(point)
    _, _, runs = steady_runs(workload, point.system)
    return point, workload, runs


def test_the_step_from_its_steady_form_is_the_whole_step(drained):
    point, workload, runs = drained
    assert workload.steady.microbatches == 12 and runs is not None
    model = AnalyticalCostModel()
    shorter = model.simulate(workload, point.system)
    whole = model.simulate(replace(workload, steady=None, point_key="whole"), point.system)
    assert shorter.step_time_s == pytest.approx(whole.step_time_s, rel=1e-12)
    for s, w in zip(shorter.classes, whole.classes, strict=True):
        for field in ("end_s", "compute_s", "comm_s", "exposed_comm_s"):
            assert getattr(s, field) == pytest.approx(getattr(w, field), rel=1e-12), field


def test_the_distance_is_a_micro_batchs_calls_and_the_reads_leave_out_implied_activations(drained):
    _, workload, runs = drained
    read = reads(workload.blocks, workload.steady.programs)
    for stage, (program, (_, first, distance, _, (lo, hi))) in enumerate(
        zip(workload.steady.programs, runs, strict=True)
    ):
        microbatch = call_array(program, "microbatch")
        assert distance == np.count_nonzero(microbatch == microbatch[first])  # a forward and a backward
        assert read.within(stage, lo, hi)
        if stage == 0:  # a drain backward reads its forward from before the run, but its gradient waits on that
            assert any(i < lo for call in program.calls[hi:] for i in call.inputs)


def test_the_transfers_must_join_the_runs(drained):
    _, workload, runs = drained
    read = reads(workload.blocks, workload.steady.programs)
    lo, hi, distance = (
        np.array([[value] for value in column]) for column in zip(*[(*r[4], r[2]) for r in runs], strict=True)
    )
    assert read.joined(lo, hi, distance)[0]
    later = lo.copy()
    later[1] = hi[1]  # stage 1's run starting where it ends: stage 0's last sends pair with calls before it
    assert not read.joined(later, hi, distance)[0]


def test_the_drain_recurs_at_the_periods_length_but_is_not_taken(drained):
    """Stage 0's drain backwards recur every seven calls (half a micro-batch's), a period's length apart, for more
    than two such distances: a rule that took any recurring distance and asked no more of its run would splice
    drain periods (backwards only) into the step. The distance taken is a micro-batch's calls, and the run the
    drain's."""
    point, workload, runs = drained
    program = workload.steady.programs[0]
    scheduler = CompiledScheduler(replace(workload, programs=workload.steady.programs, steady=None), point.system)
    start, end = steady._Simulated(scheduler, scheduler.drive()).times()[0]
    microbatch, block = call_array(program, "microbatch"), call_array(program, "block")
    half = 7
    twin = (block[:-half] == block[half:]) & (microbatch[:-half] >= 0) & (microbatch[half:] == microbatch[:-half] + 1)
    length, _, distance, _, (_, hi) = runs[0]
    drain_lo, drain_hi = steady._longest_steady(twin, start, end, half, length, steady.TOLERANCE_S)
    assert drain_hi - drain_lo >= 2 * half and drain_lo >= hi  # what the relaxed rule extended
    assert distance == 2 * half and steady._twins(program, 1)[0] == distance
