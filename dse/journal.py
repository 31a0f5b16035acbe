"""The study's journal file: Optuna's journal format, kept in memory and followed by its growth.

Optuna's own file backend reopens the file, takes a lock file and re-reads its new lines on every operation,
and fsyncs every line: about 1 ms of the driver's CPU per trial (a trial is ~15 lines: its creation, one line
per parameter, its attributes, its state). This backend keeps one descriptor open, parses each line once, and
only catches up on lines another process appended (one fstat per read). Writers serialise on an flock of the
file itself, and a line a crashed writer left half-written is cut off before the next append (Optuna's reader
would otherwise stop at it). Lines are fsync'd when a study or a trial's state changes: that covers every
earlier line too, so a told trial is on disk; a power loss can only take lines of a still-running trial, which
a resume re-runs anyway. The file stays readable by Optuna's JournalFileBackend and optuna-dashboard.
"""

import fcntl
import json
import os
from collections.abc import Iterable
from typing import Any

from optuna.storages.journal import BaseJournalBackend
from optuna.storages.journal._storage import JournalOperation

DURABLE_OPS = frozenset(
    {JournalOperation.CREATE_STUDY, JournalOperation.DELETE_STUDY, JournalOperation.SET_TRIAL_STATE_VALUES}
)
"""Operations after which the file is fsync'd."""


class JournalFile(BaseJournalBackend):
    def __init__(self, path: str) -> None:
        self._path = path
        self._fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        self._logs: list[dict[str, Any]] = []
        self._offset = 0
        """Bytes of the file parsed into _logs: always at a line's end."""

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)

    def __getstate__(self) -> dict[str, str]:
        return {"path": self._path}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.__init__(state["path"])  # type: ignore[misc]

    def read_logs(self, log_number_from: int) -> Iterable[dict[str, Any]]:
        self._catch_up()
        return self._logs[log_number_from:]

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        lines = [json.dumps(log, separators=(",", ":")) for log in logs]
        data = ("\n".join(lines) + "\n").encode()
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            self._catch_up()
            if os.fstat(self._fd).st_size > self._offset:  # a crashed writer's half line: nobody finishes it
                os.ftruncate(self._fd, self._offset)
            os.write(self._fd, data)
            if any(log["op_code"] in DURABLE_OPS for log in logs):
                os.fsync(self._fd)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._offset += len(data)
        # Replay what a reader of the file would parse (JSON turns tuples into lists, keys into strings).
        self._logs.extend(json.loads(line) for line in lines)

    def _catch_up(self) -> None:
        """Parse the whole lines other processes appended since the last look."""
        size = os.fstat(self._fd).st_size
        if size <= self._offset:
            return
        data = os.pread(self._fd, size - self._offset, self._offset)
        end = data.rfind(b"\n") + 1
        self._logs.extend(json.loads(line) for line in data[:end].splitlines() if line.strip())
        self._offset += end
