"""Running an emulator's command: argument list, own process group, timeout, nothing left behind."""

import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

from simulators.emulator.contract import EmulatorError, Metrics, parse_metrics
from simulators.external import TimedOut, run_program

FOLDER_PLACEHOLDER = "{folder}"
STDERR_LINES = 3


def command_line(command: Sequence[str], args: Sequence[str], folder: Path) -> list[str]:
    """`command + args` with `{folder}` replaced by the run folder, or the folder appended where no argument
    holds the placeholder."""
    argv = [*command, *args]
    if any(FOLDER_PLACEHOLDER in part for part in argv):
        return [part.replace(FOLDER_PLACEHOLDER, str(folder)) for part in argv]
    return [*argv, str(folder)]


def run_emulator(
    argv: Sequence[str], folder: Path, timeout_s: float, metrics: str, env: Mapping[str, str] | None = None
) -> Metrics:
    """Run argv in its own session (so its children share its process group), kill that whole group on timeout
    and after it exits (an emulator's stray children must not outlive the trial), and read its metrics."""
    name = argv[0]
    try:
        returncode, stdout, stderr = run_program(argv, timeout_s, env=env)
    except FileNotFoundError:
        raise EmulatorError(f"emulator command '{name}' not found; set cost_model_options.command") from None
    except PermissionError:
        raise EmulatorError(f"emulator command '{name}' is not executable; chmod +x it or fix command") from None
    except TimedOut as timed_out:
        raise EmulatorError(
            f"emulator '{name}' ran past its timeout of {timeout_s:g} s and was killed{_tail(timed_out.stderr)}"
        ) from None
    if returncode != 0:
        how = f"was killed by signal {-returncode}" if returncode < 0 else f"exited {returncode}"
        raise EmulatorError(f"emulator '{name}' {how}{_tail(stderr)}")
    try:
        if metrics == "stdout":
            return parse_metrics(stdout, "stdout")
        path = folder / metrics
        if not path.is_file():
            raise EmulatorError(f"emulator '{name}' wrote no metrics file {metrics} in its folder")
        return parse_metrics(path.read_text(errors="replace"), metrics)
    except EmulatorError as error:
        raise EmulatorError(f"emulator '{name}': {error}{_tail(stderr)}") from None


def _tail(stderr: str) -> str:
    """The last lines of stderr, on one line, to quote in an error."""
    lines = [line.strip() for line in (stderr or "").splitlines() if line.strip()]
    return f"; stderr: {' | '.join(lines[-STDERR_LINES:])}" if lines else ""


def unrunnable(program: str) -> str | None:
    """Why `program` (a command's first argument: a path, or a name looked up on PATH) cannot be started, or None:
    not found, a folder, not executable, or a script whose `#!` interpreter is not there."""
    found = program if os.sep in program else shutil.which(program)
    if found is None:
        return f"emulator command '{program}' is not found on PATH; give its path, or install it"
    path = Path(found)
    if not path.exists():
        return f"emulator command '{program}' does not exist; check the path"
    if path.is_dir():
        return f"emulator command '{program}' is a folder, not a program; give the program inside it"
    if not os.access(path, os.X_OK):
        return f"emulator command '{program}' is not executable; chmod +x it or fix command"
    try:
        with path.open("rb") as handle:
            first = handle.readline(256)
    except OSError:
        return None  # executable but not readable here: only running it can tell
    if first.startswith(b"#!"):
        words = first[2:].decode(errors="replace").split()
        interpreter = words[0] if words else ""
        named = words[-1] if Path(interpreter).name == "env" and len(words) > 1 else None
        if not (shutil.which(named) if named else interpreter and os.access(interpreter, os.X_OK)):
            return (
                f"emulator command '{program}' is a script whose interpreter ({' '.join(words) or 'none'}, its #! "
                "line) is not there; fix its first line or install the interpreter"
            )
    return None
