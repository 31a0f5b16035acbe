"""The first minutes of a study as a new user meets them: `dse run` of a study file into a fresh folder, as
`make demo` runs the quickstart, timed from outside the process.

Per run it prints the time from the command's start to its first trial told, the search (the first trial's start
to the last trial's end, from the Optuna journal's own timestamps), and the work after it: until the Pareto front
is printed (the trials table and the best points written) and until the command exits (the plots, the MLflow runs
still to write, the parent run's artifacts), with the ratio of the last to the search, whose target is at most 1
for the quickstart. The driver and the MLflow writer process share this machine's two cores, so each figure is the
median of `--repeats` runs.

Usage:

    .venv/bin/python benchmarks/first_minutes.py [STUDY.yaml ...] [--repeats 3]
"""

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import optuna

from dse.search.space import load_study
from dse.search.storage import JOURNAL

ROOT = Path(__file__).resolve().parent.parent
SUMMARY = re.compile(r"^\d+ trials: ")
"""The summary line `dse run` prints with the Pareto front."""


def one_run(study: Path) -> tuple[float, float, float, float]:
    """(seconds to the first trial told, search seconds, seconds from the search's end to the front printed, and
    to the command's exit) of one fresh run."""
    name = load_study(study).name
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / name
        started = datetime.now()
        begin = time.monotonic()
        command = [sys.executable, "-m", "dse.cli", "run", str(study), "--out", str(out)]
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT) as run:
            assert run.stdout is not None
            printed = next(time.monotonic() - begin for line in run.stdout if SUMMARY.search(line))
            run.stdout.read()
        total = time.monotonic() - begin
        if run.returncode:
            raise SystemExit(f"{' '.join(command)} failed with exit code {run.returncode}")
        storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(out / JOURNAL)))
        trials = optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
    ends = sorted(t.datetime_complete for t in trials if t.datetime_complete)
    first_start = min(t.datetime_start for t in trials if t.datetime_start)
    search_end = (ends[-1] - started).total_seconds()
    return (
        (ends[0] - started).total_seconds(),
        (ends[-1] - first_start).total_seconds(),
        printed - search_end,
        (total - search_end),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("studies", nargs="*", type=Path, default=[ROOT / "studies" / "quickstart.yaml"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for study in args.studies:
        runs = [one_run(study) for _ in range(args.repeats)]
        for first, search, front, after in runs:
            print(
                f"{study.name}: first trial told {first:5.2f} s, search {search:5.2f} s, then the front printed "
                f"after {front:5.2f} s and the command done after {after:5.2f} s"
            )
        first, search, front, after = (statistics.median(column) for column in zip(*runs, strict=True))
        print(
            f"{study.name} median of {len(runs)}: first trial {first:.2f} s, search {search:.2f} s; after the "
            f"search: the front printed {front:.2f} s, done {after:.2f} s; ratio done-after/search "
            f"{after / search:.2f} (target <= 1)"
        )


if __name__ == "__main__":
    main()
