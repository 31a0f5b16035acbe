"""Keeping stdout for a command's contract: `dse evaluate --json` prints one JSON line there and nothing else."""

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """While inside, whatever is written to stdout goes to stderr: Python's prints (a plugin's, a model factory's
    module at import) and, by pointing file descriptor 1 at stderr's file, what a C extension or a child process
    that inherits it writes. stdout is restored on leaving, for the one line that belongs there."""
    sys.stdout.flush()
    saved = os.dup(1)
    python_stdout = sys.stdout
    try:
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        yield
    finally:
        sys.stdout.flush()
        sys.stdout = python_stdout
        os.dup2(saved, 1)
        os.close(saved)
