"""A study file's report plots: each point, cell and bar is the best feasible trial of its group by the metric's
direction (read back from the data each plot was drawn from, against a plain loop over the trials), x in the order
the kind needs, and a plot naming what the table cannot have is refused in one line naming the field."""

import numpy as np
import pandas as pd
import pytest
from helpers import make_point, run_cli

from dse import plugins
from dse.errors import SpecError
from dse.point.evaluate import evaluate
from dse.results import study_plots, tracking
from dse.search.report_spec import EVALUATION_METRICS, known_metrics
from dse.search.space import load_study

STUDY = """\
name: plots
objectives: {step_time: minimize, peak_memory: minimize}
trials: 4
workers: 1
base:
  model: tiny-llama
  workload: {seq_len: 512, global_batch: 16}
  system: tiny-ring
space:
  parallel.tp: {choices: [4, 1, 2]}
  parallel.pp: {choices: [1, 2]}
  parallel.recompute: {choices: [selective, none, full]}
"""
PLOTS = """\
report:
  plots:
    - {kind: line, x: parallel.tp, y: step_time_s, series: parallel.pp, title: "step time by tp"}
    - {kind: heatmap, x: parallel.tp, y: parallel.pp, value: mfu}
    - {kind: bar, x: parallel.recompute, y: step_time_s}
    - {kind: line, x: parallel.tp, y: peak_memory_bytes, series: workload.seq_len}
"""
TP, PP, RECOMPUTE = [4, 1, 2], [1, 2], ["selective", "none", "full"]


def _study(tmp_path, text: str = PLOTS):
    path = tmp_path / "study.yaml"
    path.write_text(STUDY + text)
    return load_study(path)


def _frame() -> pd.DataFrame:
    """120 trials over the grid with random metrics; some infeasible, pruned or failed, whose (often better)
    values no plot may show."""
    rng = np.random.default_rng(3)
    n = 120
    frame = pd.DataFrame(
        {
            "number": range(n),
            "state": rng.choice(["COMPLETE"] * 8 + ["PRUNED", "FAIL"], n),
            "feasible": rng.random(n) < 0.8,
            "reason": None,
            "point_key": [f"k{i}" for i in range(n)],
            "parallel.tp": rng.choice(TP, n),
            "parallel.pp": rng.choice(PP, n),
            "parallel.recompute": rng.choice(RECOMPUTE, n),
            "step_time_s": rng.uniform(1, 2, n).round(2),  # rounded: ties, which the earlier trial wins
            "peak_memory_bytes": rng.uniform(1, 8, n) * 2**30,
            "mfu": rng.uniform(0.1, 0.6, n),
        }
    )
    frame.attrs["objectives"] = {"step_time_s": "minimize", "peak_memory_bytes": "minimize"}
    return frame


def _best(frame: pd.DataFrame, keys: list[str], metric: str, sign: int) -> dict[tuple, tuple[float, int]]:
    """The best (value, trial) per group, by a loop over the rows: the first trial wins a tie."""
    best: dict[tuple, tuple[float, int]] = {}
    for values in frame.to_dict("records"):
        if values["state"] != "COMPLETE" or not values["feasible"]:
            continue
        key = tuple(values[k] for k in keys)
        value = values[metric]
        if key not in best or sign * value < sign * best[key][0]:
            best[key] = (value, values["number"])
    return best


def _drawn(data: pd.DataFrame, keys: list[str], metric: str) -> dict[tuple, tuple[float, int]]:
    return {tuple(r[k] for k in keys): (r[metric], r["number"]) for _, r in data.iterrows()}


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plots")
    frame = _frame()
    return frame, study_plots.draw(_study(tmp), frame, tmp)


def test_a_line_is_the_best_trial_per_x_and_series_with_x_ascending(drawn):
    frame, plots = drawn
    line = plots[0]
    assert line.path.is_file() and line.path.parent.name == study_plots.PLOTS_DIR
    assert _drawn(line.data, ["parallel.pp", "parallel.tp"], "step_time_s") == _best(
        frame, ["parallel.pp", "parallel.tp"], "step_time_s", +1
    )
    for _, rows in line.data.groupby("parallel.pp"):
        assert list(rows["parallel.tp"]) == [1, 2, 4]  # numerically, not in the file's order 4, 1, 2


def test_a_heatmap_cell_is_the_best_trial_of_its_x_and_y_by_the_installed_objectives_direction(drawn):
    frame, plots = drawn
    # mfu is no objective of the study: the installed objective says maximize
    assert _drawn(plots[1].data, ["parallel.tp", "parallel.pp"], "mfu") == _best(
        frame, ["parallel.tp", "parallel.pp"], "mfu", -1
    )
    assert len(plots[1].data) == len(TP) * len(PP)


def test_bars_are_the_best_trial_per_category_in_the_files_order(drawn):
    frame, plots = drawn
    bar = plots[2]
    assert list(bar.data["parallel.recompute"]) == RECOMPUTE
    assert _drawn(bar.data, ["parallel.recompute"], "step_time_s") == _best(
        frame, ["parallel.recompute"], "step_time_s", +1
    )


def test_names_and_flags_are_drawn_in_the_files_order_numbers_ascending():
    assert study_plots.order(pd.Series(["full", "none", "full", "selective"]), RECOMPUTE) == RECOMPUTE
    assert study_plots.order(pd.Series(["full", "none"])) == ["full", "none"]  # no choices: as the trials had them
    assert study_plots.order(pd.Series([True, False]), [False, True]) == [False, True]
    assert study_plots.order(pd.Series([8, 1, 4.5, None])) == [1, 4.5, 8]


def test_a_base_field_is_one_series(drawn):
    frame, plots = drawn
    data = plots[3].data
    assert set(data["workload.seq_len"]) == {512}
    assert _drawn(data, ["parallel.tp"], "peak_memory_bytes") == _best(frame, ["parallel.tp"], "peak_memory_bytes", +1)


def test_a_study_without_feasible_trials_draws_empty_plots(tmp_path):
    frame = _frame().assign(feasible=False)
    plots = study_plots.draw(_study(tmp_path), frame, tmp_path)
    assert all(plot.data.empty and plot.path.is_file() for plot in plots)


def test_a_metric_no_trial_has_draws_an_empty_plot(tmp_path):
    # tokens_per_dollar: a point whose accelerator has no price has no such column
    spec = _study(tmp_path, "report:\n  plots:\n    - {kind: bar, x: parallel.tp, y: tokens_per_dollar}\n")
    (plot,) = study_plots.draw(spec, _frame(), tmp_path)
    assert plot.data.empty and plot.path.is_file()


@pytest.mark.parametrize(
    ("plot", "message"),
    [
        ("{kind: heatmap, x: parallel.tp, y: parallel.pp}", r"'report.plots.0': a heatmap colours .* give value"),
        ("{kind: line, x: parallel.tp, y: step_time_s, value: mfu}", r"'report.plots.0': value colours .*remove value"),
        ("{kind: heatmap, x: parallel.tp, y: parallel.pp, value: mfu, series: parallel.pp}", r"has no series"),
        ("{kind: heatmap, x: parallel.tp, y: parallel.tp, value: mfu}", r"x and y are both parallel.tp"),
        ("{kind: line, x: parallel.tpp, y: step_time_s}", r"'report.plots.0.x': 'parallel.tpp' is neither a searched"),
        ("{kind: bar, x: parallel.tp, y: step_time, series: parallel.pp}", r"'report.plots.0.y': 'step_time' is nei"),
        ("{kind: line, x: parallel.tp, y: parallel.pp}", r"'report.plots.0.y': 'parallel.pp' is a field, and a line"),
        ("{kind: line, x: parallel.recompute, y: step_time_s}", r"'report.plots.0.x': .*non-numeric.*use kind: bar"),
        ("{kind: bar, x: parallel.tp, y: model_flops}", r"'report.plots.0.direction': .*give direction: minimize"),
        ("{kind: pie, x: parallel.tp, y: step_time_s}", r"'report.plots.0.kind'"),
    ],
)
def test_a_plot_the_table_cannot_draw_is_refused_in_one_line_naming_the_field(tmp_path, plot, message):
    with pytest.raises(SpecError, match=message) as caught:
        _study(tmp_path, f"report:\n  plots:\n    - {plot}\n")
    assert "\n" not in str(caught.value)


def test_a_metric_without_a_direction_plots_with_one_given(tmp_path):
    spec = _study(
        tmp_path, "report:\n  plots:\n    - {kind: bar, x: parallel.tp, y: model_flops, direction: maximize}\n"
    )
    assert spec.report.plots[0].direction == "maximize"


def test_the_report_metrics_are_what_an_evaluation_reports():
    point = make_point("tiny-llama", seq_len=512, global_batch=8, tp=8)
    metrics = set(evaluate(point, plugins.generator("symbolic"), plugins.cost_model("analytical")).metrics)
    assert set(EVALUATION_METRICS) <= metrics
    assert metrics - {"fits_memory"} <= known_metrics()


def test_dse_report_draws_the_saved_studys_plots(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    tracking.save_spec(_study(tmp_path), out)
    tracking.write_parquet(_frame(), out / tracking.PARQUET)
    code, stdout, err = run_cli("report", str(out))
    assert code == 0, err
    names = sorted(path.name for path in (out / study_plots.PLOTS_DIR).iterdir())
    assert names == [
        "plot1-line-step_time_s-by-parallel.tp.png",
        "plot2-heatmap-mfu-by-parallel.tp.png",
        "plot3-bar-step_time_s-by-parallel.recompute.png",
        "plot4-line-peak_memory_bytes-by-parallel.tp.png",
    ]
    assert all(name in stdout for name in names)
