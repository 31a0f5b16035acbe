"""The papers' studies (studies/papers/): each passes `dse check` (no runs: they take minutes each), says how to
run it in its header and draws the kind of plot its paper has."""

import pytest
from conftest import ROOT

from dse.search import preflight
from dse.search.decoding import decode
from dse.search.space import load_study

PAPER_STUDIES = sorted((ROOT / "studies" / "papers").glob("*.yaml"))


@pytest.mark.parametrize("path", PAPER_STUDIES, ids=lambda p: p.name)
def test_paper_study_checks_names_its_paper_and_draws_a_plot(path):
    spec = load_study(path)
    preflight.check_study(spec)
    first = decode(spec, {name: param.first for name, param in spec.space.items()})
    assert not isinstance(first, str), first
    header = path.read_text().split("\nname:")[0]
    assert f"dse run studies/papers/{path.name}" in header, f"{path.name}: the header does not say how to run it"
    assert spec.report is not None and spec.report.plots, f"{path.name}: no report plot"


NIGHTLY_PAPERS = sorted((ROOT / "studies" / "nightly" / "papers").glob("*.yaml"))


def test_the_nightly_papers_suite_has_one_checked_study_per_paper():
    """`dse nightly studies/nightly/papers` runs a reduced study per paper; each passes `dse check` and draws its
    paper's plot."""
    assert [path.stem for path in NIGHTLY_PAPERS] == ["charon", "dfmodel", "flint", "stage"]
    for path in NIGHTLY_PAPERS:
        spec = load_study(path)
        preflight.check_study(spec)
        assert spec.report is not None and spec.report.plots, f"{path.name}: no report plot"
