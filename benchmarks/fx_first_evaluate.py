"""The first `dse evaluate --generator fx` of a point, with a cold disk cache of captures and then a warm one
(issue 35: at most 10 s and 3 s on a quiet machine), each a fresh process as a user runs it; printed, not a timed
test (the machine a test runs on may be busy).

Each round empties a temporary cache directory ($DSE_FX_CACHE), runs `dse evaluate POINT --generator fx` (cold: it
describes its model and captures, in this one process), then runs it again (warm: it reads its description and
captures from disk, without importing torch). Also printed: the time of `dse --help` and of importing the modules
`dse evaluate` runs on, which every run pays, and of the capture's modules (torch, torch.compile), which a cold run
pays and a warm one should not; the load average, without which the wall times cannot be read (a shared machine's
runs take several times longer); and each run's CPU time, which a busy machine inflates least.

    .venv/bin/python benchmarks/fx_first_evaluate.py [--point studies/points/llama3-8b-fsdp.yaml] [--rounds 2]

Exits 0 without timing anything when torch is not installed (the fx generator is the optional extra `fx`).
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.util import find_spec
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DSE = [sys.executable, "-m", "dse.cli"]


def timed(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU seconds (user and system, the command's processes together) of a command run to completion;
    the CPU time is what a busy machine inflates least. Its failure is the benchmark's (stderr's tail shown)."""
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    elapsed, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command[2:])} exited {done.returncode}: {done.stderr.strip()[-600:]}")
    return elapsed, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--point", default=str(ROOT / "studies" / "points" / "llama3-8b-fsdp.yaml"))
    parser.add_argument("--rounds", type=int, default=2, help="cold-then-warm rounds (default 2)")
    args = parser.parse_args()
    if find_spec("torch") is None:
        print("torch is not installed (pip install -e '.[fx]'); nothing to time")
        return 0
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}  ({os.cpu_count()} cpus)")
    env = {**os.environ}
    imports = {
        "`dse --help`": [*DSE, "--help"],
        "import of `dse evaluate`'s modules": [sys.executable, "-c", "import dse.cli.main, dse.cli.evaluate"],
        "import of the capture's (torch...)": [sys.executable, "-c", "import generators.fx.ends, generators.fx.lower"],
    }
    for what, command in imports.items():
        wall, cpu = timed(command, env)
        print(f"{what:<38} {wall:6.2f} s wall {cpu:6.2f} s cpu (a process's whole run)")
    evaluate = [*DSE, "evaluate", args.point, "--generator", "fx"]
    cold, warm = [], []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="dse-fx-cache-") as cache:
            env["DSE_FX_CACHE"] = cache
            cold.append(timed(evaluate, env))
            warm.append(timed(evaluate, env))
    name = Path(args.point).name
    print(f"\n`dse evaluate {name} --generator fx`, {args.rounds} rounds (target: 10 s cold, 3 s warm, wall)")
    print(f"{'round':>6} {'cold wall':>10} {'cold cpu':>10} {'warm wall':>10} {'warm cpu':>10}")
    for i, ((cw, cc), (ww, wc)) in enumerate(zip(cold, warm, strict=True)):
        print(f"{i:>6} {cw:>8.2f} s {cc:>8.2f} s {ww:>8.2f} s {wc:>8.2f} s")
    medians = [statistics.median(x[k] for x in runs) for runs in (cold, warm) for k in (0, 1)]
    print(f"{'median':>6} " + " ".join(f"{m:>8.2f} s" for m in medians))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
