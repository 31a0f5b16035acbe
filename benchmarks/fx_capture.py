"""Capture once, reuse after: the FX generator's time per point over a small study's points, printed, not a timed
test (issue 22).

The study's grid (default studies/small.yaml: tp x pp x micro-batch x HBM on 8 NPUs) is walked in order, feasible
points only, in one process. A point whose capture key (the generator's `affinity(point)` where it defines one,
else the parallel shape) is new pays the capture (torch.compile through aot_autograd on fake tensors, and the
lowering); a later point of the same key should pay only the regeneration of sizes. Prints one line per point,
then per capture key the first point's time against the median of the later ones.

    .venv/bin/python benchmarks/fx_capture.py [--study studies/small.yaml] [--points 24] [--generator fx]

Exits 0 without timing anything when the generator is not installed (the FX generator is the optional extra
`fx`: pip install -e '.[fx]').
"""

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Hashable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def study_points(path: str, limit: int) -> list[Any]:
    """The feasible points of the study's grid, in grid order, at most `limit`."""
    from dse.search.decoding import decode
    from dse.search.space import grid, load_study

    spec = load_study(path)
    space = grid(spec)
    points = []
    for values in itertools.product(*space.values()):
        point = decode(spec, dict(zip(space, values, strict=True)))
        if not isinstance(point, str):
            points.append(point)
        if len(points) == limit:
            break
    return points


def capture_key(generator: Any, point: Any) -> Hashable:
    affinity = getattr(generator, "affinity", None)
    if affinity is not None:
        return affinity(point)
    p = point.parallel
    return (point.model.name, p.tp, p.pp, p.dp, p.sp, p.zero)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--study", default=str(ROOT / "studies" / "small.yaml"))
    parser.add_argument("--points", type=int, default=24, help="at most this many feasible points (default 24)")
    parser.add_argument("--generator", default="fx")
    args = parser.parse_args()

    from dse import plugins
    from dse.errors import DseError

    try:
        generator = plugins.generator(args.generator)
    except DseError as exc:
        print(f"generator '{args.generator}' is not available ({exc}); nothing to time")
        return 0
    started = time.perf_counter()
    import torch  # the import alone takes seconds; kept out of the first point's capture

    print(f"import torch {torch.__version__}: {time.perf_counter() - started:.2f} s")
    points = study_points(args.study, args.points)
    times: dict[Hashable, list[float]] = {}
    for i, point in enumerate(points):
        key = capture_key(generator, point)
        started = time.perf_counter()
        try:
            generator.generate(point)
        except DseError as exc:
            print(f"point {i}: {exc}")
            continue
        elapsed = time.perf_counter() - started
        first = key not in times
        times.setdefault(key, []).append(elapsed)
        p = point.parallel
        shape = f"tp{p.tp} pp{p.pp} dp{p.dp} mb{point.workload.micro_batch}"
        print(f"point {i:3d} {shape:<22} {'capture' if first else 'reuse  '} {elapsed * 1e3:10.1f} ms")
    print(f"\n{len(times)} capture keys over {sum(map(len, times.values()))} points:")
    for key, elapsed in times.items():
        later = f"{statistics.median(elapsed[1:]) * 1e3:.1f} ms median of {len(elapsed) - 1}" if elapsed[1:] else "-"
        print(f"  {key}: first {elapsed[0] * 1e3:.1f} ms, later {later}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
