"""`dse run` on a study with `sweep: true`: every grid point priced in batches (dse.search.sweep), then the same
tables, plots and MLflow parent run as a study's."""

import argparse
import os
import sys
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pandas as pd
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dse import lru
from dse.cli import ui
from dse.cli.outcome import EXIT_INTERRUPTED, report_failures
from dse.results import study_plots, sweep_results, tracking
from dse.search import sweep
from dse.search.space import StudySpec
from dse.search.sweep_grid import SweepGrid
from dse.search.sweep_parts import PartStore, open_manifest

INLINE_POINTS = 10_000
"""A sweep of at most this many points runs in the driver unless --ray or --address says otherwise: at a few
hundred points per CPU-second that is under a minute, about what a local Ray takes to start on a small machine."""

Interrupt = Callable[[threading.Event, Console], AbstractContextManager[None]]
PrintSummary = Callable[[Console, pd.DataFrame, pd.DataFrame, str], None]


def run(
    args: argparse.Namespace,
    spec: StudySpec,
    out: Path,
    uri: str,
    console: Console,
    interrupt: Interrupt,
    show: PrintSummary,
) -> int:
    manifest = open_manifest(spec, out)
    tracking.save_spec(spec, out)
    grid, store = SweepGrid(spec), PartStore(out)
    stop = threading.Event()
    with interrupt(stop, console):
        pool = _pool(args, spec, grid, console)
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        try:
            with Progress(*columns, console=console, transient=True) as progress:
                bar = progress.add_task(f"sweep {spec.name}", total=grid.size, completed=store.rows())
                outcome = sweep.run(spec, store, pool, lambda rows: progress.advance(bar, rows), stop.is_set)
        finally:
            pool.close()
        with console.status("writing the trials table, the Pareto front and the plots"):
            results = sweep_results.write_tables(spec, out)
            if results is not None:
                tracking.write_plots(spec, results, out)
    if results is None:
        console.print(f"sweep {spec.name}: no point priced yet", soft_wrap=True)
        return EXIT_INTERRUPTED
    frame, best = results.frame, results.front
    console.print(
        f"sweep of {grid.size:,} points ({grid.structures:,} structures x {grid.systems:,} systems, "
        f"{pool.workers} workers): this run priced {outcome.priced:,} points in {outcome.seconds:.1f} s "
        f"({outcome.priced / max(outcome.seconds, 1e-9):,.0f} points/s)",
        soft_wrap=True,
    )
    show(console, frame, best, f"Pareto front of {spec.name}")
    with console.status("writing the MLflow run"):
        summary = sweep_results.figures(frame, best, outcome.seconds, outcome.priced)
        error, experiment, parent = sweep_results.log_to_mlflow(uri, spec, out, manifest, results, summary)
    if error:
        print(
            f"warning: MLflow at {uri} failed ({error}); the sweep's results are in {out}: run the same command "
            "again once MLflow is back to log them",
            file=sys.stderr,
        )
    console.print(f"trials table  {out / tracking.PARQUET}", soft_wrap=True)
    if spec.report is not None and spec.report.plots:
        console.print(f"report plots  {out / study_plots.PLOTS_DIR}", soft_wrap=True)
    console.print(f"MLflow        {uri}  (experiment '{spec.name}', one run for the sweep)", soft_wrap=True)
    for line in ui.browse_lines(uri, experiment, parent, out):
        if not line.startswith("browse"):  # the runs-table view lists child runs, which a sweep has none of
            console.print(line, soft_wrap=True)
    if not outcome.complete:
        print(
            f"interrupted; run the same command again to resume the sweep ({len(frame):,} of {grid.size:,} points "
            "are kept)",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    if caches := lru.summary():
        print(caches, file=sys.stderr)  # the points priced in this process (an inline pool), not Ray's workers'
    return report_failures(frame, "points")


def _pool(args: argparse.Namespace, spec: StudySpec, grid: SweepGrid, console: Console) -> sweep.Pool:
    """In this process with --inline or for a small sweep (INLINE_POINTS); else Ray (--address, RAY_ADDRESS, a Ray
    this process joined, or a local one)."""
    ray_module = sys.modules.get("ray")
    joined = args.address or os.environ.get("RAY_ADDRESS") or (ray_module and ray_module.is_initialized())
    if args.inline or not (args.ray or joined or grid.size > INLINE_POINTS):
        return sweep.InlinePool(spec)
    with console.status("starting Ray" if not args.address else f"joining Ray at {args.address}"):
        return sweep.RayPool(spec, grid, spec.workers, args.address)
