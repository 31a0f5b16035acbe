"""The first minutes of a study as a new user meets them: `dse run` of a study file into a fresh folder, as
`make demo` runs the quickstart, timed from outside the process.

Per run it prints the time from the command's start to its first trial told, the search (the first trial's start
to the last trial's end, from the Optuna journal's own timestamps), the work after it (the last trial's end to the
command's exit: the trials table, plots, best points, the MLflow runs still to write, the parent run's artifacts)
and the ratio of the two, whose target is at most 1 for the quickstart. The driver and the MLflow writer process
share this machine's two cores, so each figure is the median of `--repeats` runs.

Usage:

    .venv/bin/python benchmarks/first_minutes.py [STUDY.yaml ...] [--repeats 3]
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import optuna

from dse.space import load_study
from dse.storage import JOURNAL

ROOT = Path(__file__).resolve().parent.parent


def one_run(study: Path) -> tuple[float, float, float]:
    """(seconds to the first trial told, search seconds, seconds after the search) of one fresh run."""
    name = load_study(study).name
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / name
        started = datetime.now()
        begin = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "dse.cli", "run", str(study), "--out", str(out)],
            check=True,
            capture_output=True,
            cwd=ROOT,
        )
        total = time.monotonic() - begin
        storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(out / JOURNAL)))
        trials = optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
    ends = sorted(t.datetime_complete for t in trials if t.datetime_complete)
    first_start = min(t.datetime_start for t in trials if t.datetime_start)
    first_told = (ends[0] - started).total_seconds()
    search = (ends[-1] - first_start).total_seconds()
    after = total - (ends[-1] - started).total_seconds()
    return first_told, search, after


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("studies", nargs="*", type=Path, default=[ROOT / "studies" / "quickstart.yaml"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for study in args.studies:
        runs = [one_run(study) for _ in range(args.repeats)]
        for first, search, after in runs:
            print(f"{study.name}: first trial told {first:5.2f} s, search {search:5.2f} s, after it {after:5.2f} s")
        first, search, after = (statistics.median(column) for column in zip(*runs, strict=True))
        print(
            f"{study.name} median of {len(runs)}: first trial {first:.2f} s, search {search:.2f} s, after the "
            f"search {after:.2f} s, ratio after/search {after / search:.2f} (target <= 1)"
        )


if __name__ == "__main__":
    main()
