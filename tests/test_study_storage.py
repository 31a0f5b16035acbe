"""The Optuna storage is a URL: the journal file by default, PostgreSQL and the Redis journal for shared use,
each tested against a real server that the session's fixtures start on loopback."""

import optuna
import pandas as pd
import pytest
from conftest import ROOT
from optuna.trial import TrialState

from dse.cli.main import main
from dse.errors import DseError
from dse.search.storage import open_storage
from dse.search.study import evaluations

SMALL = ROOT / "studies" / "small.yaml"


def run_twice_and_check(url: str, tmp_path, name: str, capsys) -> None:
    """A study into the storage, then a second driver resuming it to a larger budget from the same URL."""
    study_file = tmp_path / f"{name}.yaml"
    study_file.write_text(SMALL.read_text().replace("name: small", f"name: {name}"))
    out = tmp_path / "out"
    assert main(["run", str(study_file), "--inline", "--storage", url, "--out", str(out), "--trials", "6"]) == 0
    first = optuna.load_study(study_name=name, storage=open_storage(url, tmp_path)).trials
    assert len(evaluations(first)) == 6
    assert not (out / "optuna-journal.log").exists(), "the trials went to the URL, not a journal file"

    assert main(["run", str(study_file), "--inline", "--storage", url, "--out", str(out), "--trials", "10"]) == 0
    trials = optuna.load_study(study_name=name, storage=open_storage(url, tmp_path)).trials
    assert len(evaluations(trials)) == 10
    assert [t.params for t in trials[: len(first)]] == [t.params for t in first]
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
    assert len(pd.read_parquet(out / "trials.parquet")) == len(trials)
    assert f"storage: {url}" in (out / "study.yaml").read_text(), "sync and nightly reopen the same storage"
    capsys.readouterr()


def test_postgresql_storage(postgres_url, tmp_path, capsys):
    run_twice_and_check(postgres_url, tmp_path, "small-pg", capsys)


def test_redis_journal_storage(redis_url, tmp_path, capsys):
    run_twice_and_check(redis_url, tmp_path, "small-redis", capsys)


def test_a_plain_path_is_a_journal_file(tmp_path):
    storage = open_storage(str(tmp_path / "shared" / "journal.log"), tmp_path)
    optuna.create_study(storage=storage, study_name="x")
    assert (tmp_path / "shared" / "journal.log").stat().st_size > 0


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("mongodb://127.0.0.1/x", "unknown storage URL scheme 'mongodb'"),
        ("postgresql://dse:secret@127.0.0.1:1/none", "cannot open Optuna storage postgresql://dse:***@127.0.0.1:1"),
    ],
    ids=["unknown-scheme", "unreachable-server"],
)
def test_bad_storage_urls_name_the_field_and_the_fix(tmp_path, url, fragment):
    with pytest.raises(DseError, match="field 'storage'") as error:
        open_storage(url, tmp_path)
    assert fragment in str(error.value)
    assert "secret" not in str(error.value)
