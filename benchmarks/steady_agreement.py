"""How the steady-state pricing of the analytical model agrees with simulating the whole step, over a study's space.

For every point of the space (or a sample of it) that decodes to a feasible point with a steady form, the cost
model prices it from the steady form (the default) and from the whole programs, and the script prints how many
points used the steady form, how many fell back to the whole step (their timeline did not repeat), the largest
relative difference in step time, peak memory and exposed communication, and the CPU time of each path.
Run: .venv/bin/python benchmarks/steady_agreement.py [studies/planning-70b.yaml] [--sample 64]
"""

import argparse
import itertools
import random
import time
from dataclasses import replace
from pathlib import Path

from dse import plugins
from dse.search.decoding import decode
from dse.search.space import load_study
from dse.spec import DesignPoint
from simulators.analytical import AnalyticalCostModel
from simulators.analytical.steady import schedule_steady

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", nargs="?", default=str(ROOT / "studies" / "planning-70b.yaml"))
    parser.add_argument("--sample", type=int, default=64, help="points drawn from the space (all if fewer)")
    args = parser.parse_args()
    spec = load_study(Path(args.study))
    names = list(spec.space)
    grid = list(itertools.product(*(spec.space[name].choices or () for name in names)))
    random.Random(0).shuffle(grid)
    generator = plugins.generator(spec.generator)
    steady_s = whole_s = 0.0
    used = fell_back = 0
    worst = {"step_time_s": 0.0, "peak_memory_bytes": 0.0, "exposed_comm_time_s": 0.0}
    for values in grid[: args.sample]:
        point = decode(spec, dict(zip(names, values, strict=True)))
        if not isinstance(point, DesignPoint):
            continue
        workload = generator.generate(point)
        if workload.steady is None:
            continue
        began = time.process_time()
        steady = AnalyticalCostModel().simulate(workload, point.system)
        steady_s += time.process_time() - began
        if schedule_steady(workload, point.system) is None:
            fell_back += 1
        else:
            used += 1
        began = time.process_time()
        whole = AnalyticalCostModel().simulate(replace(workload, steady=None, point_key="whole"), point.system)
        whole_s += time.process_time() - began
        for metric in worst:
            a, b = getattr(steady, metric), getattr(whole, metric)
            worst[metric] = max(worst[metric], abs(a - b) / abs(b) if b else abs(a))
    print(
        f"{Path(args.study).name}: {used + fell_back} points with a steady form; {used} priced from it, "
        f"{fell_back} whole"
    )
    print("  largest relative difference from the whole step: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    print(
        f"  CPU: {1e3 * steady_s / max(used + fell_back, 1):.1f} ms per point (steady form, with its check), "
        f"{1e3 * whole_s / max(used + fell_back, 1):.1f} ms (whole step)"
    )


if __name__ == "__main__":
    main()
