"""The study's journal file: Optuna's journal format, written by the driver and followed by its growth.

Optuna's own file backend reopens the file, takes a lock file and re-reads its new lines on every operation,
and fsyncs every line: about 1 ms of the driver's CPU per trial (a trial is ~15 lines: its creation, one line
per parameter, its attributes, its state). `JournalFile` keeps one descriptor open, parses each line once, and
only catches up on lines another process appended (one fstat per read). Writers serialise on an flock of the
file itself, and a line a crashed writer left half-written is cut off before the next append (Optuna's reader
would otherwise stop at it). A line is written when its trial is told, so a killed driver loses nothing it told;
when a study's or a trial's state changes the file is also fsync'd, by a thread of its own at most every
FSYNC_INTERVAL_S (`_Syncer`), so that the loop that feeds the workers waits neither for the disk nor for a flush
per trial. A power loss can take the trials told in the last FSYNC_INTERVAL_S, which a resume runs again; the
driver waits for the last flush before it exits. The file stays readable by Optuna's JournalFileBackend and
optuna-dashboard.

`JournalMirror` is the driver's storage over such a file: the study in memory, each change appended as its line.
"""

import atexit
import copy
import fcntl
import json
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from optuna.distributions import BaseDistribution, distribution_to_json
from optuna.storages import InMemoryStorage
from optuna.storages.journal import BaseJournalBackend
from optuna.storages.journal._storage import JournalOperation, JournalStorageReplayResult
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from dse.errors import DseError

DURABLE_OPS = frozenset(
    {JournalOperation.CREATE_STUDY, JournalOperation.DELETE_STUDY, JournalOperation.SET_TRIAL_STATE_VALUES}
)
"""Operations after which the file is fsync'd."""
FLUSHING_OPS = DURABLE_OPS | {JournalOperation.SET_STUDY_USER_ATTR, JournalOperation.SET_STUDY_SYSTEM_ATTR}
"""Operations JournalMirror writes at once, with the lines it holds back: state changes, and the study's own
attributes (rare, and a resume reads them)."""


OP_CODES = frozenset(int(op) for op in JournalOperation)
"""The op_code of every line Optuna's journal format has."""
RECORD_START = b'{"op_code":'
"""How every line of the journal begins, this module's and Optuna's own backend's alike."""
FSYNC_INTERVAL_S = 0.2
"""Least time between the starts of two fsyncs of a journal: requests in between are served by one flush."""


class _Syncer:
    """fsyncs a file descriptor in a thread of its own, on request, at most once per FSYNC_INTERVAL_S (a group
    commit, as a database's WAL writer does): with a flush per told trial on it, the loop that feeds the workers
    spent a quarter of its time in write_lines (sampled, quickstart with 2 workers). `wait` skips the interval.
    The thread starts with the first request and ends with `close`."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._requested = self._synced = 0
        self._closing = self._hurry = False
        self._error: OSError | None = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def request(self) -> None:
        """Have everything written so far reach the disk."""
        with self._cond:
            self._raise()
            self._requested += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="journal-fsync", daemon=True)
                self._thread.start()
            self._cond.notify()

    def wait(self) -> None:
        """Return once everything requested so far is on disk."""
        with self._cond:
            target = self._requested
            self._hurry = True
            self._cond.notify_all()
            while self._synced < target and self._error is None:
                self._cond.wait()
            self._raise()

    def close(self) -> None:
        """Stop the thread once it has flushed what was requested (or failed to: `wait` reports that)."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()

    def _raise(self) -> None:
        if self._error is not None:
            raise DseError(f"could not flush the study journal to disk: {self._error}; check the disk and run again")

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._synced == self._requested and not self._closing:
                    self._cond.wait()
                if self._synced == self._requested:
                    return
                target = self._requested
                started = time.monotonic()
            try:
                os.fsync(self._fd)
            except OSError as exc:
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                return
            with self._cond:
                self._synced = target
                self._cond.notify_all()
                due = started + FSYNC_INTERVAL_S
                while not (self._hurry or self._closing) and (left := due - time.monotonic()) > 0:
                    self._cond.wait(left)
                self._hurry = False


class JournalFile(BaseJournalBackend):
    def __init__(self, path: str) -> None:
        self._path = path
        self._fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        self._syncer = _Syncer(self._fd)
        self._logs: list[dict[str, Any]] = []
        self._offset = 0
        """Bytes of the file parsed into _logs: always at a line's end."""

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            try:
                self._syncer.close()
            finally:
                os.close(fd)

    def sync(self) -> None:
        """Return once every line written so far that asked for it is on disk."""
        self._syncer.wait()

    def __getstate__(self) -> dict[str, str]:
        return {"path": self._path}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.__init__(state["path"])  # type: ignore[misc]

    def read_logs(self, log_number_from: int) -> Iterable[dict[str, Any]]:
        self._catch_up()
        return self._logs[log_number_from:]

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        lines = self.write(logs)[1]
        # Replay what a reader of the file would parse (JSON turns tuples into lists, keys into strings).
        self._logs.extend(json.loads(line) for line in lines)

    def write(self, logs: list[dict[str, Any]]) -> tuple[int, list[str]]:
        """Append the logs as lines, then fsync'd when one changes a study's or a trial's state; returns how many lines
        other processes had appended since this one last looked, and the lines written. The written lines are
        not replayed into read_logs' list: that is for a writer that keeps its own state (JournalMirror)."""
        lines = [_line(log) for log in logs]
        return self.write_lines(lines, any(log["op_code"] in DURABLE_OPS for log in logs)), lines

    def write_lines(self, lines: list[str], durable: bool) -> int:
        """`write` for lines already serialised, then fsync'd if `durable` (by the syncer's thread: `sync` waits
        for it). Returns the foreign lines' count."""
        data = ("\n".join(lines) + "\n").encode()
        seen = len(self._logs)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            self._catch_up()
            if os.fstat(self._fd).st_size > self._offset:  # a crashed writer's half line: nobody finishes it
                os.ftruncate(self._fd, self._offset)
            os.write(self._fd, data)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        if durable:
            self._syncer.request()
        self._offset += len(data)
        return len(self._logs) - seen

    def _catch_up(self) -> None:
        """Parse the whole lines other processes appended since the last look; a line that is not a journal
        record raises a DseError naming its number."""
        size = os.fstat(self._fd).st_size
        if size <= self._offset:
            return
        data = os.pread(self._fd, size - self._offset, self._offset)
        end = data.rfind(b"\n") + 1
        tail = data[end:].lstrip()
        if tail and not (tail.startswith(RECORD_START) or RECORD_START.startswith(tail)):
            # What follows the last line is cut off before the next append only when a crashed writer left it
            # (the start of a record); anything else is damage, which the cut would silently erase.
            number = os.pread(self._fd, self._offset, 0).count(b"\n") + data.count(b"\n") + 1
            raise self.bad_line(number, "not the start of a record, nor ended by a newline")
        lines = data[:end].splitlines()
        try:
            logs = [json.loads(line) for line in lines if line.strip()]
        except ValueError:  # JSONDecodeError, or UnicodeDecodeError for bytes that are not UTF-8
            logs = None
        if logs is None or not all(type(log) is dict and log.get("op_code") in OP_CODES for log in logs):
            raise self._first_bad_line(lines)
        self._logs.extend(logs)
        self._offset += end

    def _first_bad_line(self, lines: list[bytes]) -> DseError:
        """The error for the first of `lines` (those after the parsed part) that is not a journal record."""
        number = os.pread(self._fd, self._offset, 0).count(b"\n")
        for line in lines:
            number += 1
            if not line.strip():
                continue
            try:
                log = json.loads(line)
            except ValueError as exc:
                return self.bad_line(number, f"not JSON: {exc}")
            if type(log) is not dict:
                return self.bad_line(number, f"a JSON {type(log).__name__}, not an object")
            if log.get("op_code") not in OP_CODES:
                return self.bad_line(number, f"op_code {log.get('op_code')!r} is none of Optuna's")
        return self.bad_line(number, "unreadable")

    def bad_line(self, number: int, reason: str) -> DseError:
        return DseError(
            f"{self._path}: line {number} is not an Optuna journal record ({reason[:200]}); the file is damaged: "
            "restore it from a copy, or delete that line to resume with the rest"
        )

    def line_of(self, index: int) -> int:
        """The file's line number (from 1) of the index-th record (blank lines hold none)."""
        data = os.pread(self._fd, self._offset, 0)
        seen = -1
        for number, line in enumerate(data.splitlines(), 1):
            seen += bool(line.strip())
            if seen == index:
                return number
        return data.count(b"\n")


class JournalMirror(InMemoryStorage):
    """The driver's storage of a journal file: Optuna's in-memory storage, with every change appended to the file
    as the line Optuna's JournalStorage would have written.

    JournalStorage reads back and replays each line it writes (a JSON round trip, then its replay rules); kept in
    memory, the same ask and tell cost the driver half the CPU, and on a 2-core machine that CPU is what two
    workers lack. The file stays Optuna's journal: JournalStorage, optuna-dashboard and a later `dse run` read it.
    Memory and file number studies and trials their own way (a file's deleted studies keep their trials' ids),
    so writes translate the ids. One process writes at a time: a line another process appended means this
    memory is stale, and the write raises instead of forking the study."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self._pending: list[str] = []  # first: __del__ flushes it even when opening the file fails
        self._durable = False
        """Whether a pending line changes a state (see DURABLE_OPS)."""
        self._holding: int | None = None
        self._held: list[tuple[str, float, BaseDistribution]] = []
        """The trial whose params are held, and those params (see params_together)."""
        self._path = path
        self._file = JournalFile(path)
        self._worker = f"{uuid.uuid4()}-{threading.get_ident()}"
        replay = JournalStorageReplayResult(f"{uuid.uuid4()}-")
        try:
            replay.apply_logs(self._file.read_logs(0))
        except DseError:
            raise
        except Exception as exc:  # a well-formed line Optuna's replay cannot apply (a field missing, a wrong type)
            number = self._file.line_of(replay.log_number_read - 1)
            raise self._file.bad_line(number, f"{type(exc).__name__}: {exc}") from None
        self._study_ids: dict[int, int] = {}
        self._trial_ids: dict[int, int] = {}
        for study in sorted(replay.get_all_studies(), key=lambda s: s._study_id):
            mem = super().create_new_study(study.directions, study.study_name)
            self._study_ids[mem] = study._study_id
            for key, value in study.user_attrs.items():
                super().set_study_user_attr(mem, key, value)
            for key, value in study.system_attrs.items():
                super().set_study_system_attr(mem, key, value)
            for trial in replay.get_all_trials(study._study_id, None):
                self._trial_ids[super().create_new_trial(mem, template_trial=trial)] = trial._trial_id
        self._next_study = replay._next_study_id
        self._next_trial = len(replay._trials)
        self._parameters: dict[str, tuple[BaseDistribution, str, str]] = {}
        self._heads = {op: _line({"op_code": op, "worker_id": self._worker})[:-1] for op in JournalOperation}
        atexit.register(_flush_at_exit, weakref.ref(self))

    def _write(self, op: JournalOperation, fields: dict[str, Any]) -> None:
        """Queue the line; write the queue when the line changes a state or a study attribute. A trial's
        parameters and attributes reach the file with its end, in one write instead of one each (a dozen a
        trial: a tenth of the driver's time per trial on a 2-core machine). A killed driver loses only lines of
        trials still running, which a resume would retry anyway: the file stays a prefix of what it ran."""
        self._queue(op, _line({"op_code": op, "worker_id": self._worker, **fields}))

    def _queue(self, op: JournalOperation, line: str) -> None:
        self._pending.append(line)
        self._durable = self._durable or op in DURABLE_OPS
        if op in FLUSHING_OPS:
            self.flush()

    def __del__(self) -> None:
        self.flush()

    def sync(self) -> None:
        """Return once every state change written so far is on disk (the file's fsyncs run beside the driver)."""
        self._file.sync()

    def flush(self) -> None:
        """Write the queued lines (also when dropped and at exit, for the last trials' leftovers)."""
        with self._lock:
            if not self._pending:
                return
            lines, self._pending = self._pending, []
            durable, self._durable = self._durable, False
            foreign = self._file.write_lines(lines, durable)
        if foreign:
            raise DseError(
                f"another process wrote to the study journal {self._path} while this one ran; run one "
                f"`dse run` per journal at a time, or use a postgresql:// storage for concurrent drivers"
            )

    # Each change: Optuna's in-memory rules first (they raise on an invalid one), then its line, both under the
    # storage's lock so that a second thread (the MLflow writer sets study attributes) cannot interleave them.

    def create_new_study(self, directions: Sequence[StudyDirection], study_name: str | None = None) -> int:
        with self._lock:
            mem = super().create_new_study(directions, study_name)
            name = super().get_study_name_from_id(mem)
            self._write(JournalOperation.CREATE_STUDY, {"study_name": name, "directions": list(directions)})
            self._study_ids[mem] = self._next_study
            self._next_study += 1
            return mem

    def delete_study(self, study_id: int) -> None:
        with self._lock:
            super().delete_study(study_id)
            self._write(JournalOperation.DELETE_STUDY, {"study_id": self._study_ids[study_id]})

    def set_study_user_attr(self, study_id: int, key: str, value: Any) -> None:
        self._set_attr(JournalOperation.SET_STUDY_USER_ATTR, super().set_study_user_attr, study_id, key, value)

    def set_study_system_attr(self, study_id: int, key: str, value: Any) -> None:
        self._set_attr(JournalOperation.SET_STUDY_SYSTEM_ATTR, super().set_study_system_attr, study_id, key, value)

    def create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> int:
        with self._lock:
            mem = super().create_new_trial(study_id, template_trial)
            trial = self._get_trial(mem)
            log: dict[str, Any] = {
                "study_id": self._study_ids[study_id],
                "datetime_start": _stamp(trial.datetime_start),
            }
            if template_trial is not None:
                many = trial.values is not None and len(trial.values) > 1
                log.update(
                    state=trial.state,
                    value=None if many else trial.value,
                    values=trial.values if many else None,
                    distributions={k: distribution_to_json(d) for k, d in trial.distributions.items()},
                    params={k: trial.distributions[k].to_internal_repr(v) for k, v in trial.params.items()},
                    user_attrs=trial.user_attrs,
                    system_attrs=trial.system_attrs,
                    intermediate_values=trial.intermediate_values,
                )
                if trial.datetime_complete is not None:
                    log["datetime_complete"] = _stamp(trial.datetime_complete)
            self._write(JournalOperation.CREATE_TRIAL, log)
            self._trial_ids[mem] = self._next_trial
            self._next_trial += 1
            if template_trial is not None:
                # an enqueued trial (a resume's retry) is a whole line that nothing else will write soon, and
                # the next process to open the study must find it
                self.flush()
            return mem

    def set_trial_param(self, trial_id: int, param_name: str, param_value_internal: float, distribution: Any) -> None:
        with self._lock:
            if trial_id == self._holding:
                self._held.append((param_name, param_value_internal, distribution))
                return
            self._store_params(trial_id, [(param_name, param_value_internal, distribution)])

    @contextmanager
    def params_together(self, trial_id: int) -> Iterator[None]:
        """Within it, the trial's set_trial_param calls are held and stored at its end, the trial replaced once
        for all of them: an ask sets a study's parameters one by one (six in the quickstart), each a copy of the
        trial otherwise. Optuna's Trial samples from its own copy of the params, not from the storage's."""
        with self._lock:
            self._holding = trial_id
        try:
            yield
        finally:
            with self._lock:
                held, self._held, self._holding = self._held, [], None
                if held:
                    self._store_params(trial_id, held)

    def _store_params(self, trial_id: int, params: list[tuple[str, float, BaseDistribution]]) -> None:
        """Params into the trial in memory, each with its line. The distribution objects the study already holds
        for these parameters (every ask of a run passes the same ones) skip InMemoryStorage's compatibility
        check, which compares every choice of a categorical distribution, twice per parameter of every trial."""
        known = self._studies[self._trial_id_to_study_id_and_number[trial_id][0]].param_distribution
        if all(known.get(name) is distribution for name, _, distribution in params):
            trial = self._updatable_copy(trial_id)
            trial.params = {**trial.params}
            trial.distributions = {**trial.distributions}
            for name, value_internal, distribution in params:
                trial.params[name] = distribution.to_external_repr(value_internal)
                trial.distributions[name] = distribution
            self._set_trial(trial_id, trial)
        else:
            for param in params:
                super().set_trial_param(trial_id, *param)
        head = self._head(JournalOperation.SET_TRIAL_PARAM, "trial_id", self._trial_ids[trial_id])
        for name, value_internal, distribution in params:
            # the line _write would make, with the name and the distribution encoded once per parameter
            encoded_name, encoded_distribution = self._encoded_parameter(name, distribution)
            self._queue(
                JournalOperation.SET_TRIAL_PARAM,
                f'{head},"param_name":{encoded_name},"param_value_internal":{_encode(value_internal)},'
                f'"distribution":{encoded_distribution}}}',
            )

    def _encoded_parameter(self, name: str, distribution: BaseDistribution) -> tuple[str, str]:
        """The parameter's name and distribution_to_json as JSON strings, kept per parameter while its
        distribution is the same object: a study asks every trial with the same ones."""
        known = self._parameters.get(name)
        if known is None or known[0] is not distribution:
            known = self._parameters[name] = (distribution, _encode(name), _encode(distribution_to_json(distribution)))
        return known[1], known[2]

    def _head(self, op: JournalOperation, owner_field: str, owner: int) -> str:
        """The start of the line _write makes for an operation on `owner`, up to its last field, unclosed."""
        return f'{self._heads[op]},"{owner_field}":{owner}'

    def set_trial_state_values(self, trial_id: int, state: TrialState, values: Sequence[float] | None = None) -> bool:
        with self._lock:
            if not super().set_trial_state_values(trial_id, state, values):
                return False
            trial = self._get_trial(trial_id)
            log: dict[str, Any] = {"trial_id": self._trial_ids[trial_id], "state": state, "values": values}
            if state == TrialState.RUNNING:
                log["datetime_start"] = _stamp(trial.datetime_start)
            elif state.is_finished():
                log["datetime_complete"] = _stamp(trial.datetime_complete)
            self._write(JournalOperation.SET_TRIAL_STATE_VALUES, log)
            return True

    def set_trial_intermediate_value(self, trial_id: int, step: int, intermediate_value: float) -> None:
        with self._lock:
            super().set_trial_intermediate_value(trial_id, step, intermediate_value)
            self._write(
                JournalOperation.SET_TRIAL_INTERMEDIATE_VALUE,
                {"trial_id": self._trial_ids[trial_id], "step": step, "intermediate_value": intermediate_value},
            )

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        self.set_trial_user_attrs(trial_id, {key: value})

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        self._set_attr(JournalOperation.SET_TRIAL_SYSTEM_ATTR, super().set_trial_system_attr, trial_id, key, value)

    def set_trial_user_attrs(self, trial_id: int, attrs: dict[str, Any]) -> None:
        """set_trial_user_attr for several attributes, the trial replaced once (a trial's results are three or
        four of them). Each still gets its own line: Optuna's reader takes one attribute per line."""
        op = JournalOperation.SET_TRIAL_USER_ATTR
        with self._lock:
            trial = self._updatable_copy(trial_id)
            texts = {key: _encode(value) for key, value in attrs.items()}
            trial.user_attrs = {**trial.user_attrs, **{key: json.loads(text) for key, text in texts.items()}}
            self._set_trial(trial_id, trial)
            for key, text in texts.items():
                self._queue(op, self._attr_line(op, self._trial_ids[trial_id], key, text))

    def _updatable_copy(self, trial_id: int) -> FrozenTrial:
        """A shallow copy of a trial that may still change, to change and put back with _set_trial: trials are
        replaced, not changed, as Optuna does, since readers may hold the old one."""
        trial = self._get_trial(trial_id)
        self.check_trial_is_updatable(trial_id, trial.state)
        return copy.copy(trial)

    def _set_attr(
        self, op: JournalOperation, store: Callable[[int, str, Any], None], owner: int, key: str, value: Any
    ) -> None:
        """An attribute of a study or a trial, as a reader of the file gets it (JSON turns tuples into lists, keys
        into strings), so that the study in memory is the one a resume loads."""
        ids = self._study_ids if _ATTR_OPS[op][0] == "study_id" else self._trial_ids
        with self._lock:
            text = _encode(value)
            store(owner, key, json.loads(text))
            self._queue(op, self._attr_line(op, ids[owner], key, text))

    def _attr_line(self, op: JournalOperation, owner: int, key: str, text: str) -> str:
        """The line _write would make for an attribute, around its value serialised once (metrics and point
        fields are dicts)."""
        owner_field, kind = _ATTR_OPS[op]
        return f'{self._head(op, owner_field, owner)},"{kind}":{{{_encode(key)}:{text}}}}}'


def _flush_at_exit(mirror: "weakref.ref[JournalMirror]") -> None:
    alive = mirror()
    if alive is not None:
        alive.flush()
        alive.sync()


_ATTR_OPS = {
    JournalOperation.SET_STUDY_USER_ATTR: ("study_id", "user_attr"),
    JournalOperation.SET_STUDY_SYSTEM_ATTR: ("study_id", "system_attr"),
    JournalOperation.SET_TRIAL_USER_ATTR: ("trial_id", "user_attr"),
    JournalOperation.SET_TRIAL_SYSTEM_ATTR: ("trial_id", "system_attr"),
}
"""The owner's id field and the attribute field of each attribute operation's line."""


_encode = json.JSONEncoder(separators=(",", ":")).encode
"""json.dumps(value, separators=(",", ":")) without the encoder json.dumps builds for every call with separators of
its own (a dozen lines per trial)."""


def _line(log: dict[str, Any]) -> str:
    return _encode(log)


def _stamp(moment: datetime | None) -> str | None:
    """A naive local datetime (Optuna's in memory) as the journal writes it: UTC, ISO, microseconds."""
    return None if moment is None else moment.astimezone(UTC).isoformat(timespec="microseconds")
