"""Run a command as a process group that stops whole: on SIGTERM, SIGINT (Ctrl-C) or SIGHUP to this process, or
when the command exits by itself, every process the command started is stopped, orphans included: SIGTERM to the
group, then SIGKILL for whatever is left after a grace period (at once on a second signal).

A server that forwards a stop signal to some of its children only (as `mlflow ui` does) cannot leak through it.
"""

import os
import signal
import subprocess
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
GRACE_S = 10.0
"""How long the group's processes get to exit on SIGTERM before SIGKILL."""


def serve(command: list[str], env: dict[str, str]) -> int:
    """Run `command` in a process group of its own until it exits or this process is asked to stop; either way
    no process of the group outlives the call. Returns the command's exit code, 0 when asked to stop."""
    requested: list[int] = []
    process: subprocess.Popen[bytes] | None = None

    def stop(signum: int, frame: object) -> None:
        requested.append(signum)
        if process is not None:  # a second signal does not wait for the grace period
            _signal_group(process.pid, signal.SIGKILL if len(requested) > 1 else signal.SIGTERM)

    previous = {number: signal.signal(number, stop) for number in STOP_SIGNALS}
    try:
        process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, process_group=0)
        if requested:  # a signal that came while the command was starting
            _signal_group(process.pid, signal.SIGTERM)
        code = process.wait()
    finally:
        if process is not None:
            _stop_group(process.pid)
        for number, handler in previous.items():
            signal.signal(number, handler)
    return 0 if requested else code


def _signal_group(group: int, number: int) -> bool:
    """Send a signal to a process group; False when no process is left in it."""
    try:
        os.killpg(group, number)
    except ProcessLookupError:
        return False
    return True


def _stop_group(group: int) -> None:
    if not _signal_group(group, signal.SIGTERM):
        return
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline:
        if not _signal_group(group, 0):
            return
        time.sleep(0.1)
    _signal_group(group, signal.SIGKILL)
