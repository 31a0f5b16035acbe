"""The journal backend (the same file Optuna's own backend reads, crash-safe appends, several writers) and the
driver's in-memory mirror of it."""

import contextlib
import json
import os

import optuna
import pytest
from optuna.storages.journal import JournalFileBackend, JournalStorage

from dse.errors import DseError
from dse.search.journal import JournalFile, JournalMirror

DIST = {
    "x": optuna.distributions.IntDistribution(0, 100),
    "c": optuna.distributions.CategoricalDistribution(["a", "b"]),
}


def fill(storage, name: str, trials: int, seed: int | None = None) -> optuna.Study:
    study = optuna.create_study(
        storage=storage,
        study_name=name,
        load_if_exists=True,
        directions=["minimize"] * 2,
        sampler=optuna.samplers.RandomSampler(seed),
    )
    for _ in range(trials):
        trial = study.ask(DIST)
        trial.set_user_attr("metrics", {"step_time": trial.params["x"] / 3, "tuple": (1, 2), "nested": {"3": [4.5]}})
        study.tell(trial, [trial.params["x"], 1.0])
    return study


def snapshot(study: optuna.Study) -> list[tuple]:
    return [(t.number, t.state, t.params, t.values, t.user_attrs) for t in study.get_trials(deepcopy=False)]


def test_optunas_own_backend_reads_what_it_writes_and_the_other_way_round(tmp_path):
    path = str(tmp_path / "journal.log")
    ours = fill(JournalStorage(JournalFile(path)), "s", 12)
    theirs = optuna.load_study(study_name="s", storage=JournalStorage(JournalFileBackend(path)))
    assert snapshot(theirs) == snapshot(ours)
    assert snapshot(theirs)[0][4]["metrics"]["tuple"] == [1, 2]  # what a file reader sees, in memory too
    fill(JournalStorage(JournalFileBackend(path)), "s", 3)
    again = optuna.load_study(study_name="s", storage=JournalStorage(JournalFile(path)))
    assert len(again.trials) == 15 and snapshot(again) == snapshot(
        optuna.load_study(study_name="s", storage=JournalStorage(JournalFileBackend(path)))
    )


def test_a_half_written_line_from_a_crash_is_cut_before_the_next_append(tmp_path):
    path = tmp_path / "journal.log"
    fill(JournalStorage(JournalFile(str(path))), "s", 4)
    with open(path, "ab") as f:
        f.write(b'{"op_code":5,"worker_id":"dead","trial_id":')  # the process died inside its write
    resumed = fill(JournalStorage(JournalFile(str(path))), "s", 2)
    assert len(resumed.trials) == 6
    reread = optuna.load_study(study_name="s", storage=JournalStorage(JournalFileBackend(str(path))))
    assert snapshot(reread) == snapshot(resumed)
    assert path.read_bytes().endswith(b"\n")


def test_two_writers_on_one_file_see_each_others_trials(tmp_path):
    path = str(tmp_path / "journal.log")
    first = fill(JournalStorage(JournalFile(path)), "s", 2)
    second = fill(JournalStorage(JournalFile(path)), "s", 2)
    fill(first._storage, "s", 1)
    numbers = [t.number for t in first.get_trials(deepcopy=False)]
    assert numbers == [0, 1, 2, 3, 4] == [t.number for t in second.get_trials(deepcopy=False)]
    assert os.path.getsize(path) > 0


def test_the_mirror_writes_the_journal_optunas_backend_reads(tmp_path):
    path = str(tmp_path / "journal.log")
    ours = fill(JournalMirror(path), "s", 12)
    theirs = optuna.load_study(study_name="s", storage=JournalStorage(JournalFileBackend(path)))
    assert snapshot(theirs) == snapshot(ours)
    assert snapshot(ours)[0][4]["metrics"]["tuple"] == [1, 2]  # in memory as a reader of the file has it
    times = [(t.datetime_start, t.datetime_complete) for t in ours.get_trials(deepcopy=False)]
    assert times == [(t.datetime_start, t.datetime_complete) for t in theirs.get_trials(deepcopy=False)]


def test_the_mirror_writes_the_lines_optunas_journal_storage_writes(tmp_path):
    fill(JournalMirror(str(tmp_path / "ours.log")), "s", 3, seed=1)
    fill(JournalStorage(JournalFile(str(tmp_path / "theirs.log"))), "s", 3, seed=1)

    def logs(name: str) -> list[dict]:
        out = []
        for line in (tmp_path / name).read_text().splitlines():
            log = json.loads(line)
            assert line == json.dumps(log, separators=(",", ":"))  # byte for byte the encoding of its content
            out.append({k: v for k, v in log.items() if k not in ("worker_id", "datetime_start", "datetime_complete")})
        return out

    ours = logs("ours.log")
    assert ours == logs("theirs.log")
    assert {log["op_code"] for log in ours} >= {0, 4, 5, 6, 8}  # study, trial, param, state and user attribute


def test_params_and_attributes_stored_together_write_what_storing_them_one_by_one_writes(tmp_path):
    """The driver's grouped writes (a trial's params held through its ask, its results' attributes in one call)
    leave the file and the memory as the one-by-one calls do, also for a distribution the study has not seen."""

    def run(storage, grouped: bool) -> optuna.Study:
        study = optuna.create_study(
            storage=storage, study_name="s", directions=["minimize"] * 2, sampler=optuna.samplers.RandomSampler(1)
        )
        for number in range(3):
            trial = study.ask()
            # the third trial's "c" is an equal distribution but another object: stored through Optuna's check
            dists = DIST if number < 2 else {**DIST, "c": optuna.distributions.CategoricalDistribution(["a", "b"])}
            with storage.params_together(trial._trial_id) if grouped else contextlib.nullcontext():
                for name, dist in dists.items():
                    trial._suggest(name, dist)
            attrs = {"point_key": f"k{number}", "metrics": {"step_time": trial.params["x"] / 3, "tuple": (1, 2)}}
            if grouped:
                storage.set_trial_user_attrs(trial._trial_id, attrs)
            else:
                for key, value in attrs.items():
                    trial.set_user_attr(key, value)
            study.tell(trial, [trial.params["x"], 1.0])
        return study

    grouped = run(JournalMirror(str(tmp_path / "grouped.log")), grouped=True)
    one_by_one = run(JournalStorage(JournalFile(str(tmp_path / "one.log"))), grouped=False)
    assert snapshot(grouped) == snapshot(one_by_one)
    assert snapshot(grouped)[2][4]["metrics"]["tuple"] == [1, 2]  # in memory as a reader of the file has it
    reread = optuna.load_study(
        study_name="s", storage=JournalStorage(JournalFileBackend(str(tmp_path / "grouped.log")))
    )
    assert snapshot(reread) == snapshot(grouped)

    def logs(name: str) -> list[dict]:
        return [
            {k: v for k, v in json.loads(line).items() if k not in ("worker_id", "datetime_start", "datetime_complete")}
            for line in (tmp_path / name).read_text().splitlines()
        ]

    assert logs("grouped.log") == logs("one.log")
    assert [log["op_code"] for log in logs("grouped.log")].count(8) == 6  # one user-attribute line per attribute


def test_the_mirror_resumes_a_journal_whose_ids_are_not_its_own(tmp_path):
    """A deleted study keeps its trials' ids in the file; the mirror numbers from zero and writes the file's."""
    path = str(tmp_path / "journal.log")
    fill(JournalStorage(JournalFile(path)), "gone", 3)
    fill(JournalStorage(JournalFile(path)), "s", 2)
    optuna.delete_study(study_name="gone", storage=JournalStorage(JournalFile(path)))
    mirror = JournalMirror(path)
    study = optuna.load_study(study_name="s", storage=mirror)
    study.enqueue_trial({"x": 7, "c": "b"})
    fill(mirror, "s", 2)
    reread = optuna.load_study(study_name="s", storage=JournalStorage(JournalFileBackend(path)))
    assert snapshot(reread) == snapshot(study)
    assert [t.number for t in reread.trials] == [0, 1, 2, 3] and reread.trials[2].params == {"x": 7, "c": "b"}
    assert optuna.get_all_study_names(JournalStorage(JournalFileBackend(path))) == ["s"]


def test_the_mirror_refuses_to_write_over_another_processs_lines(tmp_path):
    path = str(tmp_path / "journal.log")
    mirror = JournalMirror(path)
    fill(mirror, "s", 1)
    fill(JournalStorage(JournalFile(path)), "s", 1)  # a second driver on the same file
    with pytest.raises(DseError, match="another process wrote to the study journal"):
        fill(mirror, "s", 1)


def test_told_trials_are_written_at_once_and_flushed_to_disk_together(tmp_path, monkeypatch):
    """A told trial's lines are in the file when tell returns (a killed driver loses nothing it told); the fsyncs
    run on the journal's own thread, one for all the trials told within FSYNC_INTERVAL_S, and `sync` returns
    once the last told trial is on disk."""
    flushed: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        flushed.append(os.fstat(fd).st_size)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    path = tmp_path / "journal.log"
    mirror = JournalMirror(str(path))
    study = fill(mirror, "s", 50)
    told = path.stat().st_size
    assert [t.number for t in JournalStorage(JournalFileBackend(str(path))).get_all_trials(0)] == list(range(50))
    mirror.sync()
    assert flushed[-1] == told, "sync returned before the last told trial was flushed"
    assert len(flushed) < 10, f"{len(flushed)} fsyncs for 51 state changes made at once"
    assert len(study.trials) == 50


def test_a_journal_that_cannot_be_flushed_says_so(tmp_path, monkeypatch):
    def broken(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", broken)
    mirror = JournalMirror(str(tmp_path / "journal.log"))
    optuna.create_study(storage=mirror, study_name="s")
    with pytest.raises(DseError, match=r"could not flush the study journal to disk: .*Input/output error"):
        mirror.sync()


def test_a_damaged_line_is_named_by_its_number_counting_blank_lines(tmp_path):
    """A line that is not JSON, and a well-formed line Optuna's replay cannot apply, each named by the file's own
    line number (blank lines count, as an editor shows them) with the reason, never a JSONDecodeError."""
    path = tmp_path / "journal.log"
    fill(JournalMirror(str(path)), "s", 3)
    lines = path.read_text().splitlines()
    for bad, reason in (("{not json", "not JSON"), ('{"op_code": 4, "worker_id": "w"}', "KeyError: 'study_id'")):
        path.write_text("\n".join([lines[0], "", bad, *lines[1:]]) + "\n")
        with pytest.raises(DseError) as error:
            JournalMirror(str(path))
        assert str(error.value).startswith(f"{path}: line 3 is not an Optuna journal record (")
        assert reason in str(error.value) and "delete that line" in str(error.value)
    path.write_text("\n".join([lines[0], "", *lines[1:]]) + "\n")
    assert len(JournalMirror(str(path)).get_all_trials(0)) == 3, "a blank line alone is no damage"
