"""Running an external program for a cost model (ASTRA-sim, an emulator): in a run folder of its own, in a
process group of its own, with a timeout, leaving nothing running behind it."""

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path


class TimedOut(Exception):
    """The program ran past its timeout and was killed; what it wrote until then."""

    def __init__(self, stdout: str, stderr: str) -> None:
        super().__init__("timed out")
        self.stdout, self.stderr = stdout, stderr


def run_program(
    argv: Sequence[str], timeout_s: float, cwd: Path | None = None, env: Mapping[str, str] | None = None
) -> tuple[int, str, str]:
    """Run argv in its own session (its children share its process group) and return its exit code, stdout and
    stderr. The whole group is killed on timeout (TimedOut) and after the program exits: a wrapper's or an
    emulator's stray children must not outlive the trial. Popen's own errors (a missing or non-executable
    program) propagate."""
    with subprocess.Popen(
        list(argv),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        text=True,
        errors="replace",
        env=None if env is None else dict(env),
    ) as process:
        try:
            out, err = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(process.pid)
            out, err = process.communicate()
            raise TimedOut(out, err) from None
        finally:
            _kill_group(process.pid)  # whatever it started and left behind, and itself on an interrupt
    return process.returncode, out, err


def _kill_group(pgid: int) -> None:
    """SIGKILL the process group: the program and anything it started."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


OWNER = ".owner"
"""In a temporary run folder: the id of the process that made it, so that a later run can tell it was orphaned."""


def run_folder(keep_runs: str | Path | None, point_key: str, kind: str) -> Path:
    """A new folder of its own for one run (evaluations run side by side): a temporary `dse-<kind>-*` (the orphans
    of killed runs removed first), or inside keep_runs one named after the point, to be kept."""
    if keep_runs is None:
        remove_orphans(kind)
        folder = Path(tempfile.mkdtemp(prefix=f"dse-{kind}-"))
        (folder / OWNER).write_text(str(os.getpid()))
        return folder
    root = Path(keep_runs)
    root.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^\w.+-]", "_", point_key)[:48] or "point"
    return Path(tempfile.mkdtemp(prefix=f"{stem}-", dir=root))


def remove_orphans(kind: str) -> None:
    """Delete the temporary run folders of this kind whose process is gone. A run killed with SIGKILL (a Ray worker
    the pool replaced, the kernel's out-of-memory killer, a timeout's kill) never reaches its cleanup, and its
    traces of thousands of ranks take gigabytes: left behind they filled a shared disk. A folder without an owner
    (another program's, or one being made) is left alone."""
    for folder in Path(tempfile.gettempdir()).glob(f"dse-{kind}-*"):
        try:
            owner = int((folder / OWNER).read_text())
        except (OSError, ValueError):
            continue
        if not _alive(owner):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True
