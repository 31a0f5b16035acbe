"""An execution-strategy sweep: many structures, a dozen systems each (issue 36's 103,680-point sweep).

Llama-3-70B, sequence 8192, global batch 1024, over 8,640 parallel configurations (tp 1-8 x pp 1-8 x cp 1-2 x the
1F1B, interleaved and ZB-H1 schedules x micro-batch 1-16 x recompute none, selective or full x ZeRO 0-2 x sp on or
off, dp taking the rest of the world, two model chunks per stage when interleaved) on 12 systems each (256 or 2,048
H100s x InfiniBand 50 or 100 GB/s x NVLink 450, 900 or 1,800 GB/s): 103,680 points. Unlike a hardware grid
(benchmarks/grid_sweep.py: 96 structures x 10,800 systems), every structure carries only a dozen systems, so what a
structure costs (generating its workload, laying out its schedule) is paid 8,640 times and a batch pricer's
per-structure work is not spread thin. Most points are infeasible (a global batch that dp x micro-batch does not
divide, too few micro-batches for an interleaved pipeline, ...) and pruned before pricing, as a sweep prunes them.

It runs `dse run` on the study with --sweep --ray --workers 2 (a local Ray, two actors) and prints the command's
wall time and points per second. `--quick` sweeps about 1 in 7 of the structures (tp 2 or 8, pp 2 or 8,
micro-batch 1, 4 or 16: 1,296 structures, 15,552 points) for a figure in a few minutes; the issue's target is the
full sweep in under 5 minutes on this 2-core machine.
Run: .venv/bin/python benchmarks/strategy_sweep.py [--quick] [--out DIR]
"""

import argparse
import tempfile
from pathlib import Path

import pandas as pd
from grid_sweep import run_sweep

from dse.search.space import load_study
from dse.search.sweep_grid import SweepGrid

STUDY = {
    "name": "strategy-sweep-llama3-70b",
    "objectives": {"step_time": "minimize", "peak_memory": "minimize"},
    "constraints": ["fits_memory"],
    "sampler": "grid",
    "sweep": True,
    "tracking": {"child_runs": "none"},
    "base": {
        "model": "llama3-70b",
        "workload": {"seq_len": 8192, "global_batch": 1024},
        "system": {"base": "dgx-h100"},
    },
    "space": {
        "parallel.tp": {"choices": [1, 2, 4, 8]},
        "parallel.pp": {"choices": [1, 2, 4, 8]},
        "parallel.cp": {"choices": [1, 2]},
        "parallel.pp_schedule": {"choices": ["1f1b", "interleaved", "zb_h1"]},
        "workload.micro_batch": {"choices": [1, 2, 4, 8, 16]},
        "parallel.recompute": {"choices": ["none", "selective", "full"]},
        "parallel.zero": {"choices": [0, 1, 2]},
        "parallel.sp": {"choices": [True, False]},
        "system.network.1.npus": {"choices": [32, 256]},
        "system.network.1.bandwidth_GBps": {"choices": [50, 100]},
        "system.network.0.bandwidth_GBps": {"choices": [450, 900, 1800]},
    },
    "derived": {
        "parallel.dp": "world / (parallel.tp * parallel.pp * parallel.cp)",
        "parallel.virtual_stages": "1 + (parallel.pp_schedule == 'interleaved')",
    },
}
QUICK = {"parallel.tp": [2, 8], "parallel.pp": [2, 8], "workload.micro_batch": [1, 4, 16]}
LIMIT_S = 5 * 60


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="output folder (default: a fresh temporary one)")
    parser.add_argument("--quick", action="store_true", help="about 1 in 7 of the structures")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="strategy-sweep-")) / "out"
    study_spec = dict(STUDY, space=dict(STUDY["space"]))
    if args.quick:
        for name, choices in QUICK.items():
            study_spec["space"][name] = {"choices": choices}
    study, wall = run_sweep(study_spec, out)
    grid = SweepGrid(load_study(study))
    frame = pd.read_parquet(out / "trials.parquet")
    states = frame["state"].value_counts()
    priced = int(states.get("COMPLETE", 0))
    print(f"points                 {len(frame):,} ({grid.size:,} in the grid, {grid.structures:,} structures)")
    print(f"priced                 {priced:,}; pruned before pricing {states.get('PRUNED', 0):,}")
    print(f"wall time              {wall:.1f} s for the whole command")
    print(f"points per second      {len(frame) / wall:,.0f} ({priced / wall:,.0f} priced)")
    if not args.quick:
        print(f"the issue's target     under {LIMIT_S / 60:.0f} min: {'met' if wall < LIMIT_S else 'NOT met'}")


if __name__ == "__main__":
    main()
