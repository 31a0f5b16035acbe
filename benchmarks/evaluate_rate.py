"""Design points per second per core, generate + simulate, for Llama-3-70B on 1024 H100s.

The issue's reference configuration (TP8, PP8, DP16, 1F1B, global batch 1024, seq 8192), varied over
micro-batch size, recompute and ZeRO stage so that no result is reused. Prints the rate (the mean over all points
in one process, as a study's evaluator actor sees them), the split between generation and simulation, the median
and slowest point, and the garbage collector's share; then the rate over the same points evaluated again from
scratch but for what is kept per schedule shape (4 shapes here, each built on its first point) and per traced
structure (9 here: recompute x ZeRO stage, each recorded on its first point and replayed for the other micro-batch
size), as a study's evaluator actor sees them after its first visits. Then, for a hardware-planning sweep, the
rate over 18 systems for one parallel configuration (HBM size x InfiniBand x NVLink bandwidth): there the generated
workload is reused and only the simulation runs. Last, in a fresh process, a study-like sample: the 18 parallel
configurations on 12 systems, 216 points in a shuffled order, every one priced (no result is reused; a workload is,
when its configuration comes round again while the generator still holds it), so that the first visits are paid
as a study pays them, once per shape and structure and not once per point.
Run: .venv/bin/python benchmarks/evaluate_rate.py
"""

import gc
import itertools
import random
import statistics
import subprocess
import sys
import time

from dse import plugins
from dse.point.evaluate import evaluate
from dse.point.points import assign, build_point, expand
from dse.search.tuning import tune_process
from simulators.analytical import cost_model as analytical_cost_model

BASE = {
    "model": "llama3-70b",
    "workload": {"seq_len": 8192, "global_batch": 1024},
    "parallel": {"tp": 8, "pp": 8, "dp": 16, "sp": True, "pp_schedule": "1f1b"},
    "system": {"base": "dgx-h100", "network": {1: {"npus": 128}}},
}


def configurations():
    """The 18 parallel configurations (micro-batch size x recompute x ZeRO stage), as fresh point data."""
    for micro_batch, recompute, zero in itertools.product([1, 2], ["none", "selective", "full"], [0, 1, 2]):
        raw = expand(BASE)
        raw["workload"]["micro_batch"] = micro_batch
        raw["parallel"].update(recompute=recompute, zero=zero)
        yield raw


def points():
    for raw in configurations():
        yield build_point(raw, "benchmark")


def systems():
    for hbm, ib, nvlink in itertools.product([80, 141], [25, 50, 100], [300, 450, 900]):
        raw = expand(BASE)
        raw["workload"]["micro_batch"] = 1
        raw["parallel"].update(recompute="selective", zero=1)
        yield build_point(_on_system(raw, hbm, ib, nvlink), "benchmark")


def study_sample() -> list:
    """Every configuration on 12 systems, shuffled (seeded)."""
    sample = [
        build_point(_on_system(raw, hbm, ib, nvlink), "benchmark")
        for hbm, ib, nvlink in itertools.product([80, 141], [25, 50, 100], [450, 900])
        for raw in configurations()
    ]
    random.Random(0).shuffle(sample)
    return sample


def _on_system(raw: dict, hbm: float, ib: float, nvlink: float) -> dict:
    for path, value in (
        ("system.accelerator.hbm_GiB", hbm),
        ("system.network.1.bandwidth_GBps", ib),
        ("system.network.0.bandwidth_GBps", nvlink),
    ):
        assign(raw, path, value)
    return raw


def main() -> None:
    tune_process()  # as in a study's evaluator actors
    generator, cost_model = plugins.generator("symbolic"), plugins.cost_model("analytical")
    plugins.objectives()  # found once per process (3-4 ms scanning entry points), like the two plugins above
    batch = list(points())
    gen = sim = 0.0
    per_point = []
    collecting = _GarbageCollectionClock()
    start = time.process_time()
    for point in batch:
        began = time.process_time()
        result = evaluate(point, generator, cost_model)
        per_point.append(time.process_time() - began)
        gen += result.generate_s
        sim += result.simulate_s
    cpu = time.process_time() - start
    collecting.stop()
    print(f"llama3-70b on 1024 H100 (TP8 PP8 DP16 1F1B, GBS 1024, seq 8192): {len(batch)} points")
    print(f"  points per second per core: {len(batch) / cpu:.1f}")
    print(f"  mean generate: {1e3 * gen / len(batch):.1f} ms, mean simulate: {1e3 * sim / len(batch):.1f} ms")
    # The first point of each schedule shape (micro-batch count, ZeRO-2 or not: 4 here) builds its schedule and
    # segment layout from scratch; later points of that shape reuse them.
    print(
        f"  per point: median {1e3 * statistics.median(per_point):.1f} ms, slowest {1e3 * max(per_point):.1f} ms; "
        f"garbage collection {100 * collecting.seconds / cpu:.0f}% of the CPU time"
    )
    # Again, as an evaluator actor meets these shapes later in a study: a fresh generator and no cached result, so
    # every point is generated and priced anew; only what is kept per schedule shape and traced structure is reused.
    generator, cost_model = plugins.generator("symbolic"), plugins.cost_model("analytical")
    analytical_cost_model._RESULTS.clear()
    start = time.process_time()
    for point in batch:
        evaluate(point, generator, cost_model)
    cpu = time.process_time() - start
    print(f"  the same points again, their schedule shapes known: {len(batch) / cpu:.1f} points per second per core")
    sweep = list(systems())
    start = time.process_time()
    steps = [evaluate(point, generator, cost_model).metrics["step_time_s"] for point in sweep]
    cpu = time.process_time() - start
    print(
        f"hardware sweep of one configuration (TP8 PP8 DP16, selective, ZeRO-1) over {len(sweep)} systems: "
        f"{len(sweep) / cpu:.1f} points per second per core (step {min(steps):.2f}-{max(steps):.2f} s)"
    )
    study = subprocess.run([sys.executable, __file__, "--study"], capture_output=True, text=True, check=True)
    print(study.stdout, end="")


def study() -> None:
    """The study-like sample's rate, in this (fresh) process."""
    tune_process()
    generator, cost_model = plugins.generator("symbolic"), plugins.cost_model("analytical")
    plugins.objectives()
    sample = study_sample()
    start = time.process_time()
    keys = {evaluate(point, generator, cost_model).workload.point_key for point in sample}
    cpu = time.process_time() - start
    assert len(keys) == len(sample), "every point of the sample is priced, none reused"
    print(
        f"a study-like sample in a fresh process (the 18 configurations on 12 systems, {len(sample)} points "
        f"shuffled): {len(sample) / cpu:.1f} points per second per core"
    )


class _GarbageCollectionClock:
    """CPU seconds the cyclic garbage collector runs, through gc.callbacks."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._began = 0.0
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.process_time()
        else:
            self.seconds += time.process_time() - self._began

    def stop(self) -> None:
        gc.callbacks.remove(self._tick)


if __name__ == "__main__":
    study() if sys.argv[1:] == ["--study"] else main()
