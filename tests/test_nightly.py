"""`dse nightly` on the real suite (studies/nightly/), three nights in a row: the first sets the baseline, the
second finds no change (from MLflow), the third runs at half the SM clock (the catalog's h100-sxm overridden in
each study's base: clock_share slows its kernel tables and its roofline alike) against a fresh MLflow store, so its
baseline comes from the trials tables of the second night, and it reports the regression and exits non-zero."""

import shutil

import pandas as pd
import yaml
from conftest import ROOT
from mlflow import MlflowClient

from dse.cli.commands import EXIT_CHANGED
from dse.cli.main import main
from dse.results.nightly import EXPERIMENT, NIGHT_TAG

SUITE = ROOT / "studies" / "nightly"


def nightly(suite, root, night: str, uri: str, address: str) -> tuple[int, str]:
    code = main(
        ["nightly", str(suite), "--root", str(root), "--night", night, "--tracking-uri", uri, "--address", address]
    )
    return code, (root / night / "report.md").read_text()


def test_nightly_twice_says_no_change_then_reports_a_catalog_regression(ray_address, tmp_path, capsys):
    suite = tmp_path / "suite"
    shutil.copytree(SUITE, suite)
    root = tmp_path / "nights"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    names = sorted(yaml.safe_load(path.read_text())["name"] for path in suite.glob("*.yaml"))
    assert len(names) == 2

    code, first = nightly(suite, root, "n1", uri, ray_address)
    assert code == 0, first
    assert "first night" in first

    code, second = nightly(suite, root, "n2", uri, ray_address)
    assert code == 0, second
    assert "no change" in second.splitlines()[2]
    assert second.count("baseline: MLflow run") == 2 and "(night n1)" in second
    assert "REGRESSION" not in second and second.count("| no change |") >= 2 * 3
    client = MlflowClient(uri)
    for name in names:
        experiment = client.get_experiment_by_name(name).experiment_id
        nights = client.search_runs([experiment], filter_string=f"tags.`{NIGHT_TAG}` = 'n2'")
        assert len(nights) == 1 and nights[0].data.metrics["nightly.best.step_time_s"] > 0
    reports = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id])
    assert sorted(r.data.tags[NIGHT_TAG] for r in reports) == ["n1", "n2"]

    for path in suite.glob("*.yaml"):
        spec = yaml.safe_load(path.read_text())
        system = spec["base"]["system"]
        base = system if isinstance(system, str) else system["base"]
        spec["base"]["system"] = {
            "base": base,
            "accelerator": {"base": "h100-sxm", "clock_share": 0.5},
        }
        path.write_text(yaml.safe_dump(spec))
    capsys.readouterr()
    code, third = nightly(suite, root, "n3", f"sqlite:///{tmp_path / 'fresh.db'}", ray_address)
    assert code == EXIT_CHANGED, third
    assert "**2 of 2 studies changed**" in third
    assert third.count("baseline: trials table of night n2") == 2, "the fallback when MLflow lacks the history"
    regressions = [line for line in third.splitlines() if line.endswith("| REGRESSION |")]
    assert any(line.startswith("| best.step_time_s |") for line in regressions)
    assert third in capsys.readouterr().out


def test_a_night_run_again_resumes_a_changed_study_is_refused_and_force_runs_it_afresh(ray_address, tmp_path, capsys):
    """Nothing is deleted without --force: the same night again resumes its (finished) studies with the same
    figures; a study file changed in what decides its trials is refused, naming both files; --force reruns it."""
    suite = tmp_path / "suite"
    suite.mkdir()
    spec = yaml.safe_load((SUITE / "dense-tiny.yaml").read_text()) | {"trials": 6}
    study = suite / "tiny.yaml"
    study.write_text(yaml.safe_dump(spec))
    root, uri = tmp_path / "nights", f"sqlite:///{tmp_path / 'mlflow.db'}"
    code, first = nightly(suite, root, "n1", uri, ray_address)
    assert code == 0, first
    out = root / "n1" / spec["name"]
    trials = len(pd.read_parquet(out / "trials.parquet"))

    code, again = nightly(suite, root, "n1", uri, ray_address)
    assert code == 0 and again == first
    assert len(pd.read_parquet(out / "trials.parquet")) == trials, "resumed: nothing left to run"

    spec["space"]["parallel.zero"] = {"choices": [0, 1, 2]}
    study.write_text(yaml.safe_dump(spec))
    capsys.readouterr()
    args = ["nightly", str(suite), "--root", str(root), "--night", "n1", "--tracking-uri", uri]
    assert main([*args, "--address", ray_address]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"error: {study}: field 'space.parallel.zero.choices': --out {out} holds study")
    assert "--force to replace it" in error and len(pd.read_parquet(out / "trials.parquet")) == trials

    assert main([*args, "--address", ray_address, "--force"]) == 0
    assert pd.read_parquet(out / "trials.parquet")["evaluation"].sum() == 6
