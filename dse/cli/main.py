"""The `dse` command: its arguments, and the dispatch to the module that runs each command (dse.cli.run: run and
report; dse.cli.evaluate; dse.cli.commands: sync, compare, timeline, nightly; dse.cli.check, ui, generate;
dse.point.calibration).

Every command's arguments are defined here, from light modules only, and each command's module is imported by the
function that runs it (`_run`, `_evaluate`, ...), not at the top: a command pays for the libraries it uses and for
no other's (`dse evaluate` imports neither Optuna's samplers nor MLflow's results; `dse --help`, nothing beyond
argparse and the plugin registry).

Errors a user can cause print as one `error:` line on stderr with exit code 2, never a traceback; an interrupted
study says how to resume it and exits with 130.
"""

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

from rich.console import Console

from dse import plugins
from dse.cli import outcome
from dse.cli.arguments import (
    DEFAULT_MAX_BYTES,
    DEMO_OUT,
    MAX_TRIAL_NUMBER,
    PORT,
    bounded_int,
    byte_size,
    human,
    night_name,
)
from dse.cli.outcome import EXIT_INTERRUPTED, EXIT_USER_ERROR, RESUME_HINT
from dse.errors import DseError
from dse.limits import MAX_WORKERS

PIPED_WIDTH = 160
"""Columns of tables printed to a file or a pipe."""
Handler = Callable[[argparse.Namespace, Console], int]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dse",
        description="Design-space exploration of distributed AI training: search parallelism and hardware "
        "with Optuna, evaluate points on Ray, track results in MLflow and Parquet.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser(
        "run",
        help="run (or resume) a study",
        description="Run a study: Optuna proposes design points, Ray actors evaluate them, every trial lands in "
        "OUT/trials.parquet and MLflow, and the Pareto front is printed. Running the same study into the same "
        "OUT again resumes it: its evaluations count toward --trials and only the rest run.",
    )
    run.add_argument("study", type=Path, metavar="STUDY.yaml", help="study file, e.g. studies/quickstart.yaml")
    run.add_argument(
        "--trials",
        type=int,
        help="the budget: distinct evaluations, including those already in OUT (default: the file's); trials that "
        "repeat an evaluated point or are pruned before evaluation do not count",
    )
    run.add_argument("--workers", type=int, help="evaluations in flight at once (default: the file's)")
    where = run.add_mutually_exclusive_group()  # where evaluations run: README's [--address ADDR | --ray | --inline]
    where.add_argument(
        "--address",
        help="Ray cluster to join, e.g. auto or ray://head:10001 (default: this process, and a local Ray once the "
        "study's remaining work pays for its start)",
    )
    run.add_argument("--out", type=Path, help="output folder (default: runs/<study name>)")
    run.add_argument(
        "--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///OUT/mlflow.db)"
    )
    where.add_argument(
        "--inline", action="store_true", help="evaluate in this process only, never start Ray (debugging)"
    )
    where.add_argument(
        "--ray",
        action="store_true",
        help="start the local Ray pool at once (default without --address: evaluate in this process first and "
        "start Ray only when the study's remaining work pays for its start)",
    )
    run.add_argument(
        "--sweep",
        action="store_true",
        help="price every point of the grid in batches, without an Optuna trial per point (as `sweep: true` in the "
        "file; needs sampler grid and no trials)",
    )
    run.add_argument(
        "--storage",
        help="Optuna storage URL: postgresql://..., redis://..., sqlite:///... or a journal file "
        "(default: the file's storage, else OUT/optuna-journal.log)",
    )
    run.add_argument(
        "--force",
        action="store_true",
        help="replace the results of another study in --out (without it, a folder holding another study's "
        "results is refused)",
    )

    evaluate = commands.add_parser(
        "evaluate",
        help="evaluate one design point",
        description="Generate and price one design point (a file like studies/points/*.yaml) and print its metrics.",
    )
    evaluate.add_argument("point", type=Path, metavar="POINT.yaml", help="design point file")
    evaluate.add_argument("--json", action="store_true", help="print the metrics as one JSON object, nothing else")
    plugins.add_arguments(evaluate)
    evaluate.add_argument(
        "--trace", type=Path, metavar="FILE", help="also write the simulated timeline as Chrome/Perfetto trace JSON"
    )

    report = commands.add_parser(
        "report",
        help="summarise a finished study",
        description="Print the trial counts, the most common infeasibility reasons and the Pareto front of a "
        "study's output folder (from OUT/trials.parquet alone).",
    )
    report.add_argument("out", type=Path, metavar="OUT_DIR", help="a study's output folder, e.g. runs/quickstart")
    _add_study_commands(commands)
    _add_point_commands(commands)
    return parser


def _add_study_commands(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """The commands around a study's results (dse.cli.commands)."""
    sync = commands.add_parser(
        "sync",
        help="write a study's missing MLflow runs (after an MLflow outage)",
        description="Write to MLflow exactly the child runs and artifacts a study's output folder has but MLflow "
        "lacks, e.g. after the tracking server was down during `dse run`. Safe to repeat.",
    )
    sync.add_argument("out", type=Path, metavar="OUT_DIR", help="the study's output folder (`dse run --out`)")
    sync.add_argument("--tracking-uri", help="MLflow tracking URI (default: the one the study ran with)")

    compare = commands.add_parser(
        "compare",
        help="diff two studies' Pareto fronts",
        description="Compare two studies' best feasible point per objective and their Pareto fronts (from their "
        "trials tables), e.g. the same study before and after a catalog change.",
    )
    compare.add_argument("a", type=Path, metavar="OUT_A", help="first study's output folder")
    compare.add_argument("b", type=Path, metavar="OUT_B", help="second study's output folder")

    timeline = commands.add_parser(
        "timeline",
        help="write the simulated timelines of a study's Pareto points (Perfetto traces)",
        description="Simulate each Pareto point of a study (or the trials given) again with its timeline kept, write "
        "OUT_DIR/timelines/trial-N.json.gz (open it in ui.perfetto.dev) and attach it to the trial's MLflow child "
        "run. Studies leave this to be done on demand unless their file says `tracking: {timelines: pareto}`.",
    )
    timeline.add_argument("out", type=Path, metavar="OUT_DIR", help="the study's output folder (`dse run --out`)")
    timeline.add_argument(
        "--trial",
        type=bounded_int(0, MAX_TRIAL_NUMBER, "a trial number"),
        action="append",
        metavar="N",
        help="a completed trial to trace instead (repeatable)",
    )
    timeline.add_argument("--tracking-uri", help="MLflow tracking URI (default: the one the study ran with)")

    night = commands.add_parser(
        "nightly",
        help="run a suite of studies and report changes since the last night",
        description="Run every study file in SUITE_DIR into ROOT/NIGHT/<study>, compare each study's best "
        "feasible figures and front with the last successful night (from MLflow, else the trials tables under "
        "ROOT), write ROOT/NIGHT/report.md, log it to MLflow, and exit 1 when a figure moved beyond --threshold.",
    )
    night.add_argument("suite", type=Path, metavar="SUITE_DIR", help="folder of study files, e.g. studies/nightly")
    night.add_argument("--root", type=Path, default=Path("runs/nightly"), help="nights' folder (default: runs/nightly)")
    night.add_argument("--night", type=night_name, default=None, help="this night's name (default: today's date, UTC)")
    night.add_argument("--threshold", type=float, default=0.01, help="relative change that counts (default: 0.01)")
    night.add_argument(
        "--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///ROOT/mlflow.db)"
    )
    night.add_argument("--address", help="Ray cluster to join for every study (default: a local Ray)")
    night.add_argument(
        "--workers",
        type=bounded_int(1, MAX_WORKERS, "a number of workers"),
        help="evaluations in flight per study (default: the study's)",
    )
    night.add_argument(
        "--force",
        action="store_true",
        help="run the night's studies afresh, replacing their results (default: a night run again resumes them)",
    )


def _add_point_commands(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """calibrate, ui, check and generate."""
    calibrate = commands.add_parser(
        "calibrate",
        help="model against published measurements",
        description="Price every case of the calibration set (published tokens/s per GPU and peak memory, and "
        "nccl-tests bus bandwidths where the cost model prices a collective alone) and print model against "
        "measurement with per-case and mean error, the roofline's figure beside the kernel tables' where a case's "
        "accelerator has them; then the held-out Megatron-LM iteration times, which set nothing.",
    )
    plugins.add_arguments(calibrate)
    calibrate.add_argument(
        "--json",
        action="store_true",
        help="print the rows as JSON: {training: [...], held_out: [...], collectives: [...]} (collectives null "
        "when the cost model does not price a collective alone)",
    )
    ui = commands.add_parser(
        "ui",
        help="serve the MLflow UI over a study's local store",
        description="Start the MLflow UI over OUT_DIR/mlflow.db (the store `dse run` writes without "
        "--tracking-uri) and print each study's link: its trials in a table with the objectives as columns. "
        "Ctrl-C or SIGTERM stops the server and every process it started.",
    )
    ui.add_argument(
        "out", type=Path, nargs="?", default=DEMO_OUT, metavar="OUT_DIR", help=f"a study's output folder ({DEMO_OUT})"
    )
    ui.add_argument(
        "--port", type=bounded_int(1, 65535, "a TCP port"), default=PORT, help=f"port to serve on (default: {PORT})"
    )
    ui.add_argument("--host", default="127.0.0.1", help="interface to serve on (default: 127.0.0.1, this machine)")
    check = commands.add_parser(
        "check",
        help="validate a point or study file without running it",
        description="Validate a design point file (fields, limits, feasibility) or a study file (every choice "
        "and range end, the points varying one parameter at a time from the first, the size of the space), "
        "and pre-flight what a run would otherwise find trial by trial (the cost model's binary and its "
        "libraries, an emulator's command, a model factory's import, the storage), without generating or "
        "pricing anything. Exit code 0: valid; 2: the one-line error says what to fix.",
    )
    check.add_argument("file", type=Path, metavar="FILE.yaml", help="a point file or a study file")
    plugins.add_arguments(check)
    generate = commands.add_parser(
        "generate",
        help="generate one design point's workload (Chakra traces, a summary)",
        description="Generate the distributed execution graph of one design point; write it as Chakra execution "
        "traces (one .et file per rank and the communicator groups, for ASTRA-sim) and/or print per rank class "
        "its op counts, FLOPs, communication bytes, parameters and memory.",
    )
    generate.add_argument("point", type=Path, metavar="POINT.yaml", help="design point file")
    generate.add_argument("--chakra", type=Path, metavar="OUT_DIR", help="write OUT_DIR/<prefix>.<rank>.et files")
    generate.add_argument("--prefix", default="trace", help="file name prefix of the traces (default: trace)")
    generate.add_argument(
        "--max-bytes",
        type=byte_size,
        default=DEFAULT_MAX_BYTES,
        metavar="SIZE",
        help=f"refuse a trace set larger than this (default: {human(DEFAULT_MAX_BYTES)}); bytes, or 500M, 50G, 2T",
    )
    generate.add_argument(
        "--force", action="store_true", help="replace trace files of the same prefix already in OUT_DIR"
    )
    generate.add_argument("--summary", action="store_true", help="print the per-rank-class summary")
    plugins.add_arguments(generate, cost_model=False)


def _run(args: argparse.Namespace, console: Console) -> int:
    from dse.cli import run

    return run.run_command(args, console)


def _report(args: argparse.Namespace, console: Console) -> int:
    from dse.cli import run

    return run.report_command(args, console)


def _evaluate(args: argparse.Namespace, console: Console) -> int:
    from dse.cli import evaluate

    return evaluate.evaluate_command(args, console)


def _nightly(args: argparse.Namespace, console: Console) -> int:
    """`dse nightly` (dse.cli.commands), which runs each of its studies as `dse run` does (`run_study`): it is
    handed that rather than importing the CLI."""
    from dse.cli import commands

    return commands.run_nightly(args, console, partial(run_study, console=console))


def _handler(name: str) -> Handler:
    """The function that runs command `name`, its module imported only now (see the module docstring)."""
    own = {"run": _run, "evaluate": _evaluate, "report": _report, "nightly": _nightly}
    if name in own:
        return own[name]
    match name:
        case "sync" | "compare" | "timeline":
            from dse.cli import commands

            return {"sync": commands.sync, "compare": commands.compare, "timeline": commands.timeline}[name]
        case "calibrate":
            from dse.point import calibration

            return calibration.main
        case "ui":
            from dse.cli import ui

            return ui.main
        case "check":
            from dse.cli import check

            return check.main
        case _:
            from dse.cli import generate

            return generate.main


def run_study(study: Path, out: Path, tracking_uri: str, workers: int | None, console: Console) -> int:
    """`dse run STUDY --out OUT --tracking-uri URI [--workers N]` as a call, every other option at its default:
    what `dse nightly` runs each study with (it is handed this, as a nightly.StudyRunner, not importing the CLI)."""
    argv = ["run", str(study), "--out", str(out), "--tracking-uri", tracking_uri]
    return _run(_parser().parse_args(argv + (["--workers", str(workers)] if workers else [])), console)


def main(argv: Sequence[str] | None = None) -> int:
    """The command's exit code (dse.cli.outcome): bad input and the user's environment (an OSError naming a
    file) print one `error:` line, a bug one `internal error` line naming the file that holds its traceback."""
    args = _parser().parse_args(argv)
    to_stderr = args.command == "evaluate" and args.json
    stream = sys.stderr if to_stderr else sys.stdout
    # Piped into a file or a CI log, Rich would cut tables to 80 columns; lay them out whole instead.
    width = None if stream.isatty() or "COLUMNS" in os.environ else PIPED_WIDTH
    # Nothing dse prints is Rich markup, and names and paths from files may look like it ('[/x]' raised MarkupError).
    console = Console(stderr=to_stderr, width=width, markup=False)
    try:
        _refuse_nul_bytes(sys.argv[1:] if argv is None else argv)
        return _handler(args.command)(args, console)
    except DseError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return getattr(exc, "exit_code", EXIT_USER_ERROR)
    except KeyboardInterrupt:
        print(f"\n{RESUME_HINT if args.command == 'run' else 'interrupted'}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # stdout closed early (`dse report OUT | head`): stop quietly, as `cat` does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return outcome.EXIT_BROKEN_PIPE
    except OSError as exc:
        if line := outcome.environment_error(exc):
            print(" ".join(line.split()), file=sys.stderr)
            return EXIT_USER_ERROR
        print(outcome.internal_error(exc, args.command), file=sys.stderr)
        return outcome.EXIT_INTERNAL_ERROR
    except Exception as exc:
        print(outcome.internal_error(exc, args.command), file=sys.stderr)
        return outcome.EXIT_INTERNAL_ERROR


def _refuse_nul_bytes(argv: Sequence[str]) -> None:
    """No path or value holds a NUL byte (a shell cannot even pass one); said, naming its option, before any file
    is touched."""
    for index, argument in enumerate(argv):
        if "\0" in argument:
            if argument.startswith("--") and "=" in argument:
                name, argument = argument.split("=", 1)
            elif index and argv[index - 1].startswith("--"):
                name = argv[index - 1]
            else:
                name = "argument"
            raise DseError(f"{name} {argument!r}: holds a NUL byte, which no path or value may; remove it")


if __name__ == "__main__":
    sys.exit(main())
