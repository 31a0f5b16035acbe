"""Study throughput on this machine: trials/s with 1 and 2 Ray workers and their ratio, the driver's time per
trial (all of it, and the part on the workers' critical path), and MLflow child runs written per second.

Two spaces, each with the random sampler and MLflow off (child_runs: none), so the figures are the loop's own: the
quickstart's (Llama-3-8B on 64 H100s, a few ms per evaluation with the analytical model, the lightest study we ship,
where Optuna's own bookkeeping per trial weighs most) and planning-70b's (Llama-3-70B on 1024 H100s, a hardware
planning study). MLflow's rate is measured by the background writer alone, into a local sqlite store and through
a real `mlflow server` (the test suite's). A run lasts seconds and this machine's speed drifts by 10% between
runs, so each study runs `--repeats` times with 1 and with 2 workers, and the median ratio is the figure. First it
times each core alone: a VM's cores need not be equally fast (here one ran the evaluations 10% slower than the
other in some hours and as fast in others), and a slower core bounds the ratio below 2 before any cost of the
driver's.
Usage:

    .venv/bin/python benchmarks/study_throughput.py [--trials 1000] [--repeats 5]
"""

import argparse
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna

from dse.results.tracking import Tracker, write_results
from dse.search.executor import Outcome, PluginEvaluation, RayExecutor
from dse.search.space import load_study
from dse.search.study import TIMINGS, open_study, run
from dse.spec import DesignPoint

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "studies" / "quickstart.yaml"
PLANNING = ROOT / "studies" / "planning-70b.yaml"
sys.path.insert(0, str(ROOT / "tests"))
from conftest import MlflowServer  # noqa: E402  (the suite's real server fixture, started by hand here)


class Timed(RayExecutor):
    """The Ray executor, splitting the driver's wall time: inside wait() the driver idles or dispatches; outside
    it, it asks and tells, beside the workers. The critical path is the time from an actor's results arriving to
    that actor's next call, per call: what a worker idles because of the driver."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.waiting = 0.0
        self.critical = 0.0
        self.calls = 0
        self._freed_at: dict[int, float] = {}

    def wait(self, timeout: float | None = None) -> Outcome | None:
        start = time.perf_counter()
        outcome = super().wait(timeout)
        self.waiting += time.perf_counter() - start
        return outcome

    def _collect(self, ref: object) -> None:
        idle = set(self._idle)
        super()._collect(ref)
        now = time.perf_counter()
        for actor in set(self._idle) - idle:
            self._freed_at[actor] = now

    def _take(self, actor: int) -> list:
        freed = self._freed_at.pop(actor, None)
        if freed is not None:
            self.critical += time.perf_counter() - freed
            self.calls += 1
        return super()._take(actor)


def one(study_file: Path, workers: int, trials: int, out: Path) -> dict[str, float]:
    spec = load_study(study_file, trials=trials, workers=workers, sampler="random")
    study = open_study(spec, out)
    executor = Timed(PluginEvaluation(spec.generator, spec.cost_model), workers)
    # Warm up the actors (plugin import, first trace) outside the timed part.
    for number in range(workers):
        executor.submit(-1 - number, _warm_point(spec))
    for _ in range(workers):
        executor.wait()
    executor.waiting = executor.critical = executor.calls = 0
    executor._freed_at.clear()
    start = time.perf_counter()
    run(spec, study, executor, trials)
    wall = time.perf_counter() - start
    executor.close()
    evaluated = sum(TIMINGS in t.user_attrs for t in study.trials)
    return {
        "trials_per_s": trials / wall,
        "evaluations_per_s": evaluated / wall,
        "driver_ms_per_trial": 1000 * (wall - executor.waiting) / trials,
        "critical_ms_per_call": 1000 * executor.critical / max(executor.calls, 1),
        "evaluated": evaluated,
        "wall_s": wall,
    }


def _warm_point(spec) -> DesignPoint:
    from dse.search.decoding import decode

    point = decode(spec, {name: param.first for name, param in spec.space.items()})
    assert isinstance(point, DesignPoint)
    return point


def mlflow_rate(out: Path, trials: int, uri: str) -> float:
    """Child runs per second the background writer puts into the MLflow store at `uri`, from the quickstart study
    in `out`."""
    spec = load_study(QUICKSTART, trials=trials, workers=2, sampler="random")
    study = open_study(spec, out)
    results = write_results(spec, study, out)
    tracker = Tracker(uri, spec, out)
    tracker.start(study)
    tracker.finish(study, results, completed=True)
    return tracker.written / tracker.write_seconds


CORE_SPEED = """
import os, sys, time
os.sched_setaffinity(0, {%d})
sys.path.insert(0, %r)
from evaluate_rate import study_sample
from dse import plugins
from dse.point.evaluate import evaluate
from dse.search.tuning import tune_process
tune_process()
generator, cost_model = plugins.generator("symbolic"), plugins.cost_model("analytical")
sample = study_sample()
start = time.process_time()
for point in sample:
    evaluate(point, generator, cost_model)
print(len(sample) / (time.process_time() - start))
"""


def core_speeds() -> dict[int, float]:
    """Points per CPU second of benchmarks/evaluate_rate.py's study-like sample in a process pinned to each CPU in
    turn: a VM's cores need not be equally fast, and two workers can then give at most the sum of the two cores'
    rates over the rate of the core one worker runs on."""
    speeds = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        code = CORE_SPEED % (cpu, str(ROOT / "benchmarks"))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
        speeds[cpu] = float(out.stdout.split()[-1])
    return speeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5, help="runs of each study with 1 and with 2 workers")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    speeds = core_speeds()
    print(
        "this machine's cores, evaluations per CPU second pinned to each: "
        + ", ".join(f"cpu{cpu} {rate:.1f}" for cpu, rate in speeds.items())
    )
    if len(speeds) == 2:
        slow, fast = sorted(speeds.values())
        print(
            f"  2 workers over 1 can reach at most {(slow + fast) / fast:.2f}x if the single worker runs on the faster "
            f"core, {(slow + fast) / slow:.2f}x on the slower, before the driver's own share of the CPUs"
        )
    import ray

    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for study_file in (QUICKSTART, PLANNING):
            print(f"{study_file.name}:")
            ratios = []
            for repeat in range(args.repeats):
                figures = {}
                for workers in (1, 2):
                    out = folder / study_file.stem / f"r{repeat}w{workers}"
                    f = figures[workers] = one(study_file, workers, args.trials, out)
                    print(
                        f"  {workers} worker(s): {f['trials_per_s']:.1f} trials/s ({f['evaluations_per_s']:.1f} "
                        f"evaluations/s, {f['evaluated']} of {args.trials} trials evaluated, {f['wall_s']:.1f} s); "
                        f"driver {f['driver_ms_per_trial']:.2f} ms/trial in all, {f['critical_ms_per_call']:.2f} "
                        f"ms per call on the critical path"
                    )
                ratios.append(figures[2]["trials_per_s"] / figures[1]["trials_per_s"])
                print(f"  speed-up 2 vs 1 workers: {ratios[-1]:.2f}x")
            print(f"  median speed-up over {args.repeats} runs: {statistics.median(ratios):.2f}x (target >= 1.7x)")
        quickstart = folder / QUICKSTART.stem / "r0w2"
        rate = mlflow_rate(quickstart, args.trials, f"sqlite:///{folder / 'mlflow.db'}")
        print(f"MLflow child runs written per second (background writer), local sqlite: {rate:.1f}")
        server = MlflowServer(folder / "server")
        (folder / "server").mkdir()
        server.start()
        try:
            rate = mlflow_rate(quickstart, args.trials, server.uri)
        finally:
            server.stop()
        print(f"MLflow child runs written per second (background writer), through `mlflow server`: {rate:.1f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
