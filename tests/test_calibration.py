"""The calibration set against the model: which cases hold, and the `dse calibrate` table.

The bounds are what the model reaches today. The rows that recompute whole layers (the blog's 34B and 70B) are
within 10%, as the acceptance asks; the rows that recompute little or nothing (the blog's 7B, 13B, torchtitan's
8B) are 20-32% optimistic: the generator prices every elementwise op and norm as one fused kernel, while these
runs are PyTorch eager (RMSNorm, RoPE and SwiGLU decomposed into several kernels with fp32 intermediates;
torch.compile alone gives torchtitan's 8B 16% more throughput), a cost that weighs most where little else is
recomputed and the hidden size is small. Peak memory of the torchtitan row is within 10%.
"""

import json

import pytest

from dse import plugins
from dse.calibration import CASES, errors, run
from dse.cli import main


@pytest.fixture(scope="module")
def rows():
    return {row.case.name: row for row in run(plugins.generator("symbolic"), plugins.cost_model("analytical"))}


def test_every_case_is_priced_with_its_measurement(rows):
    assert len(rows) == len(CASES) == 9
    assert {row.case.tokens_per_s_per_gpu for row in rows.values()} >= {3700, 1800, 700, 370, 7500, 800, 5762}


@pytest.mark.parametrize("case", [c.name for c in CASES if "AC full" in c.name])
def test_full_recompute_cases_within_ten_percent(rows, case):
    assert abs(rows[case].throughput_error) < 0.10


@pytest.mark.parametrize("case", [c.name for c in CASES if "AC full" not in c.name])
def test_eager_cases_that_recompute_little_are_optimistic_by_at_most_a_third(rows, case):
    assert 0 < rows[case].throughput_error < 0.33


def test_torchtitan_peak_memory_within_ten_percent(rows):
    (row,) = [row for row in rows.values() if row.case.peak_memory_GiB is not None]
    assert abs(row.memory_error) < 0.10


def test_errors_lists_throughput_and_memory(rows):
    figures = errors(list(rows.values()))
    assert len(figures) == 10
    assert all(f >= 0 for f in figures)


def test_dse_calibrate_prints_the_table(capsys):
    assert main(["calibrate", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert [row["case"] for row in table] == [c.name for c in CASES]
    first = table[0]
    assert first["throughput_error"] == pytest.approx(
        first["tokens_per_s_per_gpu"] / first["measured_tokens_per_s_per_gpu"] - 1
    )
    assert main(["calibrate"]) == 0
    out = capsys.readouterr().out + capsys.readouterr().err
    assert "mean |error|" in out
