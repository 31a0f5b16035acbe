"""Every command's own inputs, as a careless user gives them: each ends in one `error:` line and exit 2 (argparse's
usage errors keep their form and exit 2 too), never a traceback; a run whose every evaluation failed exits 3 with
its reasons; a bug exits 70 naming the file with its traceback (README: Exit codes).

In this process through `helpers.run_cli` (no interpreter start per case); real files, real damage: Parquet tables
cut short or replaced by random bytes, journals with garbage lines, a sqlite store that is not one, sockets that
hold a port. One finished tiny study (studies/small.yaml, 4 evaluations) is made once and copied where a case
damages it.
"""

import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml
from conftest import ROOT
from helpers import run_cli
from optuna.storages.journal._storage import JournalOperation

from dse.cli import arguments, outcome
from dse.cli import main as cli_main
from dse.cli.outcome import EXIT_ALL_FAILED, EXIT_INTERNAL_ERROR, EXIT_USER_ERROR
from dse.plugins import generator
from dse.point import chakra
from dse.point.points import load_point

SMALL = ROOT / "studies" / "small.yaml"
TINY_POINT = """\
model: tiny-llama
workload: {mode: train, seq_len: 512, global_batch: 16, micro_batch: 1}
parallel: {tp: 2, pp: 1, dp: 4}
system: tiny-ring
"""
WORLD_2_20 = """\
model: tiny-llama
workload: {mode: train, seq_len: 512, global_batch: 1048576, micro_batch: 1}
parallel: {tp: 1, pp: 1, dp: 1048576}
system: {base: tiny-ring, network: {1: {npus: 262144}}}
"""


def refused(result: tuple[int, str, str], *fragments: str) -> str:
    """The one `error:` line of a refusal (exit 2, nothing on stdout, no traceback), holding every fragment."""
    code, out, err = result
    assert code == EXIT_USER_ERROR, (code, out, err)
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def usage_error(result: tuple[int, str, str], *fragments: str) -> None:
    """argparse's own refusal of an option value: exit 2, its usage line, then `dse CMD: error: ...`."""
    code, _, err = result
    assert code == EXIT_USER_ERROR and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("dse "), err
    for fragment in fragments:
        assert fragment in err, err


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished study's output folder (studies/small.yaml, 4 evaluations, in this process)."""
    out = tmp_path_factory.mktemp("finished") / "small"
    code, _, err = run_cli("run", str(SMALL), "--trials", "4", "--inline", "--out", str(out))
    assert code == 0, err
    return out


def copy_of(folder: Path, tmp_path: Path) -> Path:
    copy = tmp_path / folder.name
    shutil.copytree(folder, copy)
    return copy


# ---- the safety net in main() --------------------------------------------------------------------------------------


def test_an_argument_holding_a_nul_byte_is_refused(tmp_path):
    refused(run_cli("report", f"{tmp_path}/a\0b"), "NUL byte")
    refused(run_cli("generate", "p.yaml", "--chakra", str(tmp_path), "--prefix", "a\0b"), "NUL byte")


def test_an_os_error_naming_a_file_is_one_error_line(finished, tmp_path):
    """A file where dse makes a folder (here OUT/timelines, where `dse timeline` writes) is the user's
    environment, not a bug: the file and the reason, exit 2."""
    out = copy_of(finished, tmp_path)
    (out / "timelines").write_text("a file, not the timelines folder")
    refused(run_cli("timeline", str(out)), f"{out / 'timelines'}: File exists")


def test_a_bug_is_an_internal_error_naming_its_traceback_file(monkeypatch, tmp_path):
    def broken(args, console):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(cli_main, "_report", broken)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    code, out, err = run_cli("report", str(tmp_path))
    assert code == EXIT_INTERNAL_ERROR and out == ""
    line = err.strip()
    assert line.startswith("internal error in dse report (ZeroDivisionError: a bug), a bug in dse") and "\n" not in line
    files = list(tmp_path.glob("dse-report-*.traceback.txt"))
    assert len(files) == 1 and str(files[0]) in line
    assert 'raise ZeroDivisionError("a bug")' in files[0].read_text()


# ---- dse generate ----------------------------------------------------------------------------------------------------


def test_a_trace_set_over_max_bytes_is_refused_in_a_fraction_of_a_second_writing_nothing(tmp_path):
    """A world of 2^20 ranks: about 51 GB of traces. Sized without writing (process CPU time, which a busy
    machine does not stretch), refused with its size and the option that allows it."""
    point = tmp_path / "world.yaml"
    point.write_text(WORLD_2_20)
    folder = tmp_path / "traces"
    started = time.process_time()
    line = refused(run_cli("generate", str(point), "--chakra", str(folder)), "--chakra", "over --max-bytes 20.0 GB")
    assert time.process_time() - started < 1.0
    size = int(line.split("(")[1].split(" bytes")[0].replace(",", ""))
    assert 45e9 < size < 55e9, line
    assert "pass --max-bytes 52G to write it" in line
    assert not folder.exists()


def test_the_trace_size_estimate_is_within_a_few_percent_of_the_files(tmp_path):
    for text in (TINY_POINT, (ROOT / "studies" / "points" / "llama3-8b-fsdp.yaml").read_text()):
        point_file = tmp_path / "p.yaml"
        point_file.write_text(text)
        point = load_point(point_file)
        workload = generator("symbolic").generate(point)
        network = [d.npus for d in point.system.network]
        accelerator = point.system.accelerator
        estimate = chakra.estimate_bytes(workload, network, point.model.dtype_bytes, accelerator)
        folder = tmp_path / f"t{len(text)}"
        chakra.export(workload, folder, network, "trace", point.model.dtype_bytes, accelerator)
        written = sum(path.stat().st_size for path in folder.iterdir())
        assert abs(estimate / written - 1) < 0.05, (estimate, written)


def test_existing_traces_are_refused_and_force_replaces_them(tmp_path):
    point = tmp_path / "p.yaml"
    point.write_text(TINY_POINT)
    folder = tmp_path / "traces"
    assert run_cli("generate", str(point), "--chakra", str(folder))[0] == 0
    assert len(list(folder.glob("trace.*.et"))) == 8
    before = (folder / "trace.0.et").stat().st_mtime_ns
    refused(run_cli("generate", str(point), "--chakra", str(folder)), "holds 9 trace files named trace.*", "--force")
    assert (folder / "trace.0.et").stat().st_mtime_ns == before
    (folder / "notes.txt").write_text("kept")
    four = tmp_path / "four.yaml"
    four.write_text(TINY_POINT.replace("{tp: 2, pp: 1, dp: 4}", "{tp: 4, pp: 1, dp: 2}"))
    assert run_cli("generate", str(four), "--chakra", str(folder), "--force")[0] == 0
    assert len(list(folder.glob("trace.*.et"))) == 8 and (folder / "notes.txt").read_text() == "kept"
    assert run_cli("generate", str(point), "--chakra", str(folder), "--prefix", "other")[0] == 0


@pytest.mark.parametrize(
    ("prefix", "fragment"),
    [
        ("sub/dir", "holds a '/'"),
        ("..", "names a folder"),
        ("", "is empty"),
        ("a\x01b", "control character"),
        ("a" * 300, "too long"),
    ],
    ids=["slash", "dotdot", "empty", "control", "too-long"],
)
def test_a_prefix_that_is_not_a_plain_file_name_is_refused(tmp_path, prefix, fragment):
    point = tmp_path / "p.yaml"
    point.write_text(TINY_POINT)
    refused(run_cli("generate", str(point), "--chakra", str(tmp_path / "t"), "--prefix", prefix), "--prefix", fragment)
    assert not (tmp_path / "t").exists()


def test_a_trace_folder_that_is_a_file_or_under_one_is_refused(tmp_path):
    point = tmp_path / "p.yaml"
    point.write_text(TINY_POINT)
    taken = tmp_path / "taken"
    taken.write_text("a file")
    refused(run_cli("generate", str(point), "--chakra", str(taken)), "a file is in the way")
    refused(
        run_cli("generate", str(point), "--chakra", str(taken / "sub")), "cannot create the folder (Not a directory)"
    )


def test_max_bytes_takes_sizes_with_units_and_refuses_others():
    parse = arguments.byte_size
    assert [parse(t) for t in ("1000", "20G", "20GB", "1.5T", "64GiB", "500m")] == [
        1000,
        20 * 10**9,
        20 * 10**9,
        15 * 10**11,
        64 * 2**30,
        500 * 10**6,
    ]
    for bad in ("0", "-5", "5X", "nan", "inf", "", "1e3G"):
        with pytest.raises(Exception, match="size"):
            parse(bad)
    usage_error(run_cli("generate", "p.yaml", "--max-bytes", "-1"), "--max-bytes")


# ---- dse ui ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("port", ["0", "-1", "70000", "http"])
def test_a_port_outside_1_to_65535_is_refused(finished, port):
    usage_error(run_cli("ui", str(finished), "--port", port), "argument --port", "TCP port")


def test_a_host_that_is_not_this_machine_is_refused(finished):
    refused(run_cli("ui", str(finished), "--host", "nonsense.invalid"), "--host nonsense.invalid", "127.0.0.1")
    refused(run_cli("ui", str(finished), "--host", "192.0.2.1"), "--host 192.0.2.1", "Cannot assign")


def test_a_port_in_use_is_refused(finished):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        refused(run_cli("ui", str(finished), "--port", str(port)), f"--port {port}", "Address already in use")


def test_a_damaged_mlflow_store_is_refused_by_every_command_that_uses_it(finished, tmp_path):
    """Refused at once: MLflow itself would retry such a file for about 100 s. The copied folder's own store is
    the one its `dse sync` and `dse run` use, not the store at the path the study first ran in."""
    out = copy_of(finished, tmp_path)
    for name in ("mlflow.db-wal", "mlflow.db-shm"):
        (out / name).unlink(missing_ok=True)
    (out / "mlflow.db").write_bytes(os.urandom(4096))
    for argv in (["ui", str(out)], ["sync", str(out)], ["run", str(SMALL), "--inline", "--out", str(out)]):
        refused(run_cli(*argv), "mlflow.db: not a readable MLflow store (file is not a database)", "move it aside")


def test_an_mlflow_store_shorter_than_sqlites_header_is_refused(finished, tmp_path):
    """SQLite itself reads such a file (one NUL byte) as an empty database, and the UI would start on it."""
    out = copy_of(finished, tmp_path)
    for name in ("mlflow.db-wal", "mlflow.db-shm"):
        (out / name).unlink(missing_ok=True)
    (out / "mlflow.db").write_bytes(b"\x00")
    refused(run_cli("ui", str(out)), "mlflow.db: not a readable MLflow store (file is not a database)")


# ---- output folders as the reading commands find them ---------------------------------------------------------------

READERS = [("report", []), ("compare", ["{finished}"]), ("timeline", []), ("sync", []), ("ui", [])]


@pytest.mark.parametrize(("command", "more"), READERS, ids=[c for c, _ in READERS])
def test_an_output_folder_that_is_missing_a_file_or_a_study_file_is_named(finished, tmp_path, command, more):
    extra = [arg.format(finished=finished) for arg in more]
    refused(run_cli(command, str(tmp_path / "none"), *extra), "no such folder", "dse run --out")
    taken = tmp_path / "taken.txt"
    taken.write_text("x")
    refused(run_cli(command, str(taken), *extra), "a file, not a study's output folder")
    line = refused(run_cli(command, str(SMALL), *extra), "a study file, not a study's output folder")
    assert f"`dse run {SMALL}` writes one (runs/small" in line and "--out " + str(SMALL) not in line


@pytest.mark.parametrize(
    ("damage", "fragments"),
    [
        (lambda path: path.write_bytes(path.read_bytes()[:-40]), ["not a readable Parquet file", "magic bytes"]),
        (lambda path: path.write_bytes(b""), ["not a readable Parquet file (0 bytes"]),
        (lambda path: path.write_bytes(os.urandom(5000)), ["not a readable Parquet file (5,000 bytes"]),
        (lambda path: pd.DataFrame({"x": [1, 2]}).to_parquet(path), ["not a dse trials table (no column 'number')"]),
    ],
    ids=["truncated", "zero-bytes", "random-bytes", "wrong-schema"],
)
def test_a_trials_table_that_cannot_be_read_is_named_with_the_reason(finished, tmp_path, damage, fragments):
    out = copy_of(finished, tmp_path)
    damage(out / "trials.parquet")
    for argv in (["report", str(out)], ["compare", str(finished), str(out)], ["timeline", str(out)]):
        refused(run_cli(*argv), f"{out / 'trials.parquet'}: ", *fragments, f"`dse sync {out}` writes it again")


def test_a_damaged_saved_study_file_is_named(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    (out / "study.yaml").write_text("name: [unclosed\n")
    for command in ("sync", "timeline"):
        refused(run_cli(command, str(out)), f"{out / 'study.yaml'}: malformed YAML", "the copy `dse run` saved")


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("garbage line", "not JSON"),
        ("[1, 2, 3]", "a JSON list, not an object"),
        ('{"op_code": 99, "worker_id": "x"}', "op_code 99 is none of Optuna's"),
        ('{"op_code": 5, "worker_id": "x"}', "KeyError: 'trial_id'"),
    ],
    ids=["not-json", "not-an-object", "unknown-op", "missing-field"],
)
def test_a_journal_line_that_is_not_a_journal_record_is_named_by_its_number(finished, tmp_path, line, reason):
    out = copy_of(finished, tmp_path)
    journal = out / "optuna-journal.log"
    number = journal.read_text().count("\n") + 1
    with journal.open("a") as file:
        file.write(line + "\n")
    table = (out / "trials.parquet").read_bytes()
    for command in ("sync", "timeline"):
        message = refused(run_cli(command, str(out)), f"{journal}: line {number} is not an Optuna journal record")
        assert reason in message and "server is up" not in message
    refused(run_cli("run", str(SMALL), "--trials", "5", "--inline", "--out", str(out)), f"line {number}")
    assert (out / "trials.parquet").read_bytes() == table


def test_a_journal_emptied_or_overwritten_is_refused_rather_than_replacing_the_tables(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    journal, table = out / "optuna-journal.log", (out / "trials.parquet").read_bytes()
    journal.write_text("")
    refused(run_cli("sync", str(out)), "optuna-journal.log: holds no study 'small'", "restore the journal")
    noise = os.urandom(3000).replace(b"\n", b"x")  # no line end: not a crashed writer's half line either
    journal.write_bytes(noise)
    for argv in (["sync", str(out)], ["run", str(SMALL), "--trials", "5", "--inline", "--out", str(out)]):
        refused(run_cli(*argv), f"{journal}: line 1 is not an Optuna journal record (not the start of a record")
    assert (out / "trials.parquet").read_bytes() == table and journal.read_bytes() == noise


@pytest.mark.parametrize("number", ["-1", "99999999999999999999", "x"])
def test_a_trial_number_out_of_range_is_refused(finished, number):
    usage_error(run_cli("timeline", str(finished), "--trial", number), "argument --trial")


def test_a_journal_cut_inside_a_trial_the_table_has_complete_is_named(finished, tmp_path):
    """The journal ends after the last trial's first parameter (a crash, a copy taken mid-write): the trial it
    holds is unfinished while the trials table has it complete, and tracing it is refused, naming the storage."""
    out = copy_of(finished, tmp_path)
    journal = out / "optuna-journal.log"
    lines = journal.read_bytes().splitlines(keepends=True)
    ops = [json.loads(line)["op_code"] for line in lines]
    created = max(i for i, op in enumerate(ops) if op == JournalOperation.CREATE_TRIAL)
    first_param = ops.index(JournalOperation.SET_TRIAL_PARAM, created)
    journal.write_bytes(b"".join(lines[: first_param + 1]))
    number = int(pd.read_parquet(out / "trials.parquet")["number"].max())
    refused(
        run_cli("timeline", str(out), "--trial", str(number)),
        f"--trial {number}: the study's storage ({journal}) holds trial {number} without all its parameters",
        f"dse sync {out}",
    )


def test_a_trial_the_study_does_not_have_is_refused(finished):
    refused(run_cli("timeline", str(finished), "--trial", "9999"), "--trial 9999", "has no completed trial 9999")


# ---- output folders as `dse run` claims them ------------------------------------------------------------------------


def variant(tmp_path: Path, *edits: tuple[str, str]) -> Path:
    """studies/small.yaml with some text replaced, as a file of its own."""
    text = SMALL.read_text()
    for old, new in edits:
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / f"variant-{len(list(tmp_path.glob('variant-*')))}.yaml"
    path.write_text(text)
    return path


def test_another_study_into_an_existing_out_is_refused_and_force_replaces_it(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    table = (out / "trials.parquet").read_bytes()
    other = variant(tmp_path, ("name: small", "name: other"))
    refused(
        run_cli("run", str(other), "--inline", "--out", str(out)),
        f"--out {out}: holds study 'small' ({out / 'study.yaml'}), not 'other' ({other})",
        "--force to replace it",
    )
    changed = variant(tmp_path, ("choices: [1, 2]}", "choices: [1, 2, 4]}"))
    refused(
        run_cli("run", str(changed), "--inline", "--out", str(out)),
        f"{changed}: field 'space.workload.micro_batch.choices'",
        "holds study 'small' run with another space.workload.micro_batch.choices",
    )
    assert (out / "trials.parquet").read_bytes() == table and yaml.safe_load((out / "study.yaml").read_text())[
        "name"
    ] == "small"

    code, _, err = run_cli("run", str(other), "--trials", "2", "--inline", "--out", str(out), "--force")
    assert code == 0, err
    frame = pd.read_parquet(out / "trials.parquet")
    assert frame.attrs["study"] == "other" and frame["evaluation"].sum() == 2


def test_a_resume_with_more_trials_other_workers_or_sampler_is_the_same_study(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    resumed = variant(tmp_path, ("sampler: random", "sampler: tpe"), ("seed: 7", "seed: 8"))
    code, _, err = run_cli("run", str(resumed), "--trials", "6", "--workers", "1", "--inline", "--out", str(out))
    assert code == 0, err
    assert pd.read_parquet(out / "trials.parquet")["evaluation"].sum() == 6


def test_results_without_a_study_file_are_not_overwritten(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "trials.parquet").write_bytes(b"someone's table")
    refused(run_cli("run", str(SMALL), "--inline", "--out", str(out)), "no study.yaml saying which study")
    assert (out / "trials.parquet").read_bytes() == b"someone's table"


# ---- dse run: its options and how it ends ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--trials", "0"], ["field 'trials'", "above 0"]),
        (["--trials", "-1"], ["field 'trials'"]),
        (["--trials", "99999999999"], ["field 'trials'", "at most 10000000"]),
        (["--workers", "0"], ["field 'workers'"]),
        (["--workers", "9999999"], ["field 'workers'", "at most 65536"]),
        (["--storage", "garbage://x"], ["field 'storage'", "unknown storage URL scheme 'garbage'"]),
        (["--tracking-uri", "garbage"], ["--tracking-uri garbage", "sqlite:///"]),
        (["--tracking-uri", "file:///tmp/mlruns"], ["--tracking-uri file:///tmp/mlruns"]),
    ],
    ids=["trials-0", "trials-negative", "trials-huge", "workers-0", "workers-huge", "storage", "uri", "file-uri"],
)
def test_a_run_option_out_of_range_is_refused_before_the_folder_is_made(tmp_path, args, fragments):
    out = tmp_path / "out"
    refused(run_cli("run", str(SMALL), "--inline", "--out", str(out), *args), *fragments)
    assert not out.exists()


@pytest.mark.parametrize("address", ["nonsense:::", "head:99999", "ray://:10001", "head:6379x"])
def test_a_malformed_ray_address_is_refused_before_the_folder_is_made(tmp_path, address):
    out = tmp_path / "out"
    refused(run_cli("run", str(SMALL), "--address", address, "--out", str(out)), f"--address {address}", "HOST:PORT")
    assert not out.exists()
    refused(run_cli("nightly", str(ROOT / "studies" / "nightly"), "--root", str(tmp_path), "--address", address))


def test_a_tracking_uri_from_the_environment_is_checked_too(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "./mlruns")
    refused(run_cli("run", str(SMALL), "--inline", "--out", str(tmp_path / "o")), "MLFLOW_TRACKING_URI ./mlruns")


def failing_study(tmp_path: Path, command: list[str], sweep: bool = False) -> Path:
    """studies/small.yaml priced by an emulator command (as a study file names its options)."""
    spec = yaml.safe_load(SMALL.read_text())
    spec |= {"cost_model": "emulator", "cost_model_options": {"command": command, "timeout_s": 60}}
    if sweep:
        spec |= {"sampler": "grid", "sweep": True}
        spec.pop("trials")
        spec["space"] = {"parallel.tp": {"choices": [1, 2]}, "workload.micro_batch": {"choices": [1, 2]}}
        spec["derived"] = {"parallel.dp": "world / parallel.tp"}
    path = tmp_path / "failing.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_run_whose_every_evaluation_fails_exits_3_with_the_reasons(tmp_path):
    study = failing_study(tmp_path, ["/bin/false"])
    code, out, err = run_cli("run", str(study), "--trials", "2", "--inline", "--out", str(tmp_path / "out"))
    assert code == EXIT_ALL_FAILED, err
    assert "Traceback" not in out + err
    head, *reasons = err.strip().splitlines()[-2:]
    assert head.startswith("error: no result: every one of the ") and "evaluated failed" in head
    assert reasons[0].split()[1:] == ["EmulatorError:", "emulator", "'/bin/false'", "exited", "1"]
    frame = pd.read_parquet(tmp_path / "out" / "trials.parquet")
    assert int(reasons[0].split()[0]) == (frame["state"] == "FAIL").sum() >= 2


EMULATOR_FAILING_TP1 = """
import json, pathlib, sys
layout = dict(json.loads((pathlib.Path(sys.argv[1]) / "workload.json").read_text())["layout"])
if layout.get("tp", 1) == 1:
    sys.exit("no tp")
print(json.dumps({"step_time_s": 1.0}))
"""


def test_a_run_in_which_some_evaluations_fail_exits_0_with_a_warning(tmp_path):
    """The emulator fails the points with tp 1 (their layout says so) and prices the rest at 1 s."""
    study = failing_study(tmp_path, [sys.executable, "-c", EMULATOR_FAILING_TP1])
    code, _, err = run_cli("run", str(study), "--trials", "6", "--inline", "--out", str(tmp_path / "out"))
    frame = pd.read_parquet(tmp_path / "out" / "trials.parquet")
    failed = int((frame["state"] == "FAIL").sum())
    assert code == 0, err
    assert failed > 0 and (frame["state"] == "COMPLETE").any(), frame[["state", "reason"]]
    assert f"warning: {failed} of {len(frame)} trials failed; by reason:" in err
    assert "exited 1" in err and "no tp" in err


def test_a_sweep_whose_every_point_fails_exits_3(tmp_path):
    study = failing_study(tmp_path, ["/bin/false"], sweep=True)
    code, _, err = run_cli("run", str(study), "--inline", "--out", str(tmp_path / "out"))
    assert code == EXIT_ALL_FAILED, err
    assert "error: no result: every one of the 4 points evaluated failed; by reason:" in err


# ---- dse nightly: its options, before any study runs ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["{tmp}/none"], ["no study files (*.yaml) here (no such folder)"]),
        (["{tmp}/empty"], ["no study files (*.yaml) here;"]),
        (["{tmp}/taken.txt"], ["a file, not a suite's folder"]),
        (["{tmp}/bad"], ["s.yaml: field 'trails'", "unknown field"]),
        (["{tmp}/twins"], ["field 'name': study 'small' is also"]),
        (["{suite}", "--threshold", "nan"], ["--threshold nan"]),
        (["{suite}", "--threshold", "inf"], ["--threshold inf"]),
        (["{suite}", "--threshold", "-1"], ["--threshold -1.0"]),
        (["{suite}", "--root", "{tmp}/taken.txt"], ["--root", "a file is in the way"]),
    ],
    ids=["missing", "empty", "a-file", "bad-study", "two-of-a-name", "nan", "inf", "negative", "root-a-file"],
)
def test_a_nightly_input_that_cannot_run_is_refused(tmp_path, args, fragments):
    (tmp_path / "empty").mkdir()
    (tmp_path / "taken.txt").write_text("x")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "s.yaml").write_text(SMALL.read_text().replace("trials: 8", "trails: 8"))
    (tmp_path / "twins").mkdir()
    for name in ("a.yaml", "b.yaml"):
        shutil.copy(SMALL, tmp_path / "twins" / name)
    suite = ROOT / "studies" / "nightly"
    argv = [arg.format(tmp=tmp_path, suite=suite) for arg in args]
    if "--root" not in argv:
        argv += ["--root", str(tmp_path / "nights")]
    refused(run_cli("nightly", *argv), *fragments)
    assert not (tmp_path / "nights").exists()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--night", "a/b"], "--night"),
        (["--night", ".."], "--night"),
        (["--workers", "0"], "--workers"),
        (["--workers", "-1"], "--workers"),
        (["--threshold", "x"], "--threshold"),
    ],
    ids=["night-slash", "night-dotdot", "workers-0", "workers-negative", "threshold-text"],
)
def test_a_nightly_option_out_of_range_is_a_usage_error(tmp_path, args, fragment):
    usage_error(run_cli("nightly", str(ROOT / "studies" / "nightly"), "--root", str(tmp_path), *args), fragment)
    assert not any(tmp_path.iterdir())


def test_every_exit_code_is_distinct_and_in_the_readme():
    codes = {name: getattr(outcome, name) for name in dir(outcome) if name.startswith("EXIT_")}
    assert len(set(codes.values())) == len(codes) == 7, codes
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("**Exit codes.**") :].split("\n\n")[1]
    assert [int(line.split("|")[1]) for line in table.splitlines()[2:]] == sorted(codes.values())
