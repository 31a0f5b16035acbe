"""Field types for plugins' option models (a study's `cost_model_options`, `--cost-option`): what a path option
must be, what a command's words may hold, and how long a cost model may run.

Options come from a YAML file or a YAML scalar on the command line and are validated when the study or point
loads, so each type says what is wrong with a value before any trial runs: a folder where a file belongs (or the
reverse), a file that is not there, a timeout no run could mean. Whether a program actually runs (it is executable,
its libraries load) is the cost model's pre-flight (`dse.interfaces.PreflightCostModel`), not a field's check.
"""

import os
import tempfile
from pathlib import Path
from typing import Annotated, Any

from annotated_types import Gt, Le
from pydantic import AfterValidator, BeforeValidator, Field

MAX_TIMEOUT_S = 86_400.0
"""The longest a cost model may run for one point (a day): a run that needs longer is hung."""


def _as_path(value: Any) -> Any:
    """A YAML string as a path (`~` expanded); anything but a string or a path is left to the strict check, which
    refuses it (a number, a boolean)."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("is empty; give a path")
        return Path(_no_nul(value)).expanduser()
    return value


def _no_nul(value: str) -> str:
    if "\0" in value:
        raise ValueError("holds a NUL byte, which no path or program argument can; remove it")
    return value


def _existing_file(path: Path) -> Path:
    if path.is_dir():
        raise ValueError(f"{path} is a folder, not a file; give the file itself")
    if not path.exists():
        raise ValueError(f"{path} does not exist; check the path")
    return path


def _folder(path: Path) -> Path:
    """A folder, or one that can be made: no file in its place or on its way, and the first existing folder on its
    way one this process can write in."""
    for above in (path, *path.parents):
        if above.exists():
            if not above.is_dir():
                what = "is a file" if above == path else f"has a file on its way ({above})"
                raise ValueError(f"{path} {what}, not a folder; give a folder (it is created if missing)")
            if not _writable(above):
                what = "is not writable" if above == path else f"cannot be created in {above}, which is not writable"
                raise ValueError(f"{path} {what}; give a folder this user can write")
            return path
    return path


def _writable(folder: Path) -> bool:
    """Whether a folder can be made in `folder`, tried (os.access says yes to root on a read-only or virtual file
    system); the probe is removed at once."""
    try:
        probe = tempfile.mkdtemp(prefix=".dse-probe-", dir=folder)
    except OSError:
        return False
    os.rmdir(probe)
    return True


ExistingFile = Annotated[Path, BeforeValidator(_as_path), AfterValidator(_existing_file)]
"""A file that must be there (a program to run, a table to read); a folder or a missing path is refused."""
Folder = Annotated[Path, BeforeValidator(_as_path), AfterValidator(_folder)]
"""A folder to write into, made if missing; a file in its place is refused."""
Argument = Annotated[str, AfterValidator(_no_nul)]
"""One argument of a program's command line (no NUL byte, which the operating system cannot pass)."""
CommandPart = Annotated[str, Field(min_length=1), AfterValidator(_no_nul)]
"""One word of a command to run (the program, then its arguments): not empty, no NUL byte."""
TimeoutSeconds = Annotated[float, Gt(0), Le(MAX_TIMEOUT_S)]
"""Seconds before a cost model's run is killed as hung: positive and at most MAX_TIMEOUT_S (finite, then)."""
