"""Finding the ASTRA-sim binary and running it: in its own process group, with a timeout, leaving nothing behind."""

import os
import re
from pathlib import Path

from dse.errors import DseError
from simulators.astrasim.options import AstraSimOptions
from simulators.external import TimedOut, run_program

ENV_VAR = "ASTRA_SIM_BIN"
BINARY_NAME = {
    "congestion_unaware": "AstraSim_Analytical_Congestion_Unaware",
    "congestion_aware": "AstraSim_Analytical_Congestion_Aware",
}
HOW_TO_SET = f"set {ENV_VAR} or cost_model_options.binary to ASTRA-sim's AstraSim_Analytical_Congestion_Unaware"
LOADER_ERROR = re.compile(r"error while loading shared libraries: (?P<library>[^:\s]+): (?P<reason>[^\n]+)")
"""What the dynamic loader prints when a program's library does not load (glibc's wording)."""
PROBE_TIMEOUT_S = 5.0
"""How long the binary may take to start and refuse to run without arguments (ASTRA-sim takes milliseconds)."""


class AstraSimError(DseError):
    """ASTRA-sim could not price a point: no binary, a crash, a hang, ranks that never finished, output we cannot
    read. The message is one line quoting what matters; the study marks the trial failed and goes on."""


def resolve_binary(options: AstraSimOptions) -> Path:
    """The binary to run for the options' backend: options.binary or $ASTRA_SIM_BIN; for the congestion-aware
    backend, the unaware binary's name stands for the aware binary beside it (CI points ASTRA_SIM_BIN at the
    unaware one, and both ship together)."""
    configured = options.binary or os.environ.get(ENV_VAR)
    if not configured:
        raise AstraSimError(f"no ASTRA-sim binary configured: {HOW_TO_SET}")
    path = Path(configured).expanduser()
    if options.backend == "congestion_aware" and path.name == BINARY_NAME["congestion_unaware"]:
        path = path.with_name(BINARY_NAME["congestion_aware"])
    if not path.is_file():
        raise AstraSimError(f"ASTRA-sim binary {path} does not exist: {HOW_TO_SET}")
    if not os.access(path, os.X_OK):
        raise AstraSimError(f"ASTRA-sim binary {path} is not executable: chmod +x it, or {HOW_TO_SET}")
    return path


def run(command: list[str], cwd: Path, timeout_s: float) -> tuple[int, str]:
    """Run ASTRA-sim; its exit code and its output (stdout then stderr). On timeout the whole process group is
    killed (ASTRA-sim starts no children today, but a wrapper script may) and AstraSimError says so."""
    try:
        code, out, err = run_program(command, timeout_s, cwd=cwd)
    except TimedOut as timed_out:
        last = (timed_out.stdout + timed_out.stderr).strip().splitlines()[-1:] or ["(nothing)"]
        raise AstraSimError(
            f"ASTRA-sim did not finish within {timeout_s:g} s (cost_model_options.timeout_s) and was killed; "
            f"its last output line: {last[0].strip()!r}"
        ) from None
    return code, out + err


def check_loads(binary: Path) -> None:
    """Run the binary without arguments (ASTRA-sim then says that it needs its options and exits at once; a
    wrapper script runs it the same way) and raise AstraSimError if the loader cannot load one of its shared
    libraries: otherwise every evaluation would fail with the same loader error."""
    try:
        _, out, err = run_program([str(binary)], PROBE_TIMEOUT_S)
    except TimedOut:
        return  # it started: its libraries loaded (a wrapper that waits without arguments is not ours to judge)
    except OSError as exc:  # a script whose interpreter is missing, a file that is no program
        raise AstraSimError(f"ASTRA-sim binary {binary} cannot be started ({exc.strerror}): {HOW_TO_SET}") from None
    if (found := LOADER_ERROR.search(out + err)) is not None:
        library, reason = found["library"], found["reason"].strip()
        raise AstraSimError(
            f"ASTRA-sim binary {binary} cannot load its shared library {library} ({reason}); {install_hint(library)}"
        )


def install_hint(library: str) -> str:
    """How to install a shared library by its soname, as Debian and Ubuntu name their packages (libprotobuf.so.32
    is in libprotobuf32)."""
    name, _, version = Path(library).name.partition(".so")
    package = name + version.strip(".").split(".")[0] if version.strip(".") else name
    return f"install the package that provides it (on Debian or Ubuntu: apt-get install {package})"
