"""Search spaces bounded at load: each way a study file could hang, exhaust memory, ask without end, or silently run
a space other than the one it states is refused in one line naming the file, the field and the numbers (or, for a
search that runs out of points that can run, ended with the reason).

Real Optuna, the real plugins and the real CLI; tiny-llama on the 8-NPU tiny-ring prices a point in milliseconds.
"""

import warnings
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState
from test_search_budget import TWELVE_POINTS

from dse.cli.main import main
from dse.errors import SpecError
from dse.limits import MAX_GRID_SEARCH, MAX_LOCAL_VALUES, MAX_RANGE_VALUES, MAX_SEARCHED, MAX_TRIALS
from dse.search import unseen
from dse.search.decoding import decode
from dse.search.executor import InlineExecutor, PluginEvaluation
from dse.search.space import load_study, optuna_distributions, space_size
from dse.search.study import DUPLICATE_OF, evaluations, open_study, run

optuna.logging.set_verbosity(optuna.logging.WARNING)

STUDY = {**TWELVE_POINTS, "name": "bounds", "seed": 5, "sampler": "random"}
"""12 points, every one feasible: tp x ZeRO stage on 8 NPUs, data parallelism taking the rest (dp = world / tp)."""

FOUR_IN_A_MILLION = {"parallel.tp": {"low": 1, "high": 10**6}, "parallel.zero": {"choices": [0, 1, 3]}}
"""The issue's space: of a million tensor-parallel degrees four divide the 8 NPUs (and the heads)."""


def study_file(tmp_path: Path, space: dict | None = None, **changes) -> Path:
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump({**STUDY, "space": {**STUDY["space"], **(space or {})}, **changes}))
    return path


def refused(path: Path) -> str:
    with pytest.raises(SpecError) as error:
        load_study(path)
    message = str(error.value)
    assert message.startswith(f"{path}: field '") and "\n" not in message
    return message


def ten_choices(count: int) -> dict:
    """`count` searched fields of ten choices each (the model's widths): a grid of 10^count points."""
    fields = ["model.hidden", "model.ffn", "model.vocab", "workload.seq_len", "workload.global_batch"]
    fields += ["system.accelerator.hbm_GiB", "system.accelerator.hbm_bandwidth_GBps"]
    return {name: {"choices": [64 * (i + 1) for i in range(10)]} for name in fields[:count]}


# A grid larger than the limit outside a sweep.


def test_a_grid_larger_than_the_limit_outside_a_sweep_is_refused_with_the_sweep_as_the_fix(tmp_path):
    space = {"parallel.tp": {"choices": [1, 2, 4, 8]}, **ten_choices(6)}  # tp x ZeRO stage x 10^6 points
    message = refused(study_file(tmp_path, space, sampler="grid"))
    assert f"the grid has 12,000,000 points, over the limit of {MAX_GRID_SEARCH:,}" in message
    assert "sweep: true" not in message and f"over the sweep limit of {MAX_TRIALS:,} too" in message
    within_a_sweep = {"parallel.zero": {"choices": [0, 1]}, **ten_choices(6)}  # 8 x 10^6 points
    message = refused(study_file(tmp_path, within_a_sweep, sampler="grid"))
    assert "the grid has 8,000,000 points" in message and "sweep: true" in message
    assert load_study(study_file(tmp_path, within_a_sweep, sampler="grid", sweep=True, trials=None)).sweep


def test_dse_check_of_a_space_of_ten_to_the_eleven_points_prints_its_size_without_listing_it(tmp_path, capsys):
    space = {**ten_choices(7), "parallel.tp": {"low": 1, "high": 3333}}
    assert main(["check", str(study_file(tmp_path, space, sampler="tpe"))]) == 0
    assert "99,990,000,000 points in the space" in capsys.readouterr().out  # 3,333 x 3 x 10^7
    grid = {**ten_choices(7), "parallel.tp": {"choices": [1, 2, 4, 8]}}
    assert main(["check", str(study_file(tmp_path, grid, sampler="grid"))]) == 2  # not listed either: refused
    assert "the grid has 120,000,000 points" in capsys.readouterr().err


# Asks without a new point to evaluate.


def test_a_search_without_new_points_to_evaluate_stops_after_a_bounded_number_of_asks(tmp_path, monkeypatch):
    monkeypatch.setattr(unseen, "BARREN_ASKS", 300)
    spec = load_study(study_file(tmp_path, FOUR_IN_A_MILLION))
    study = open_study(spec, tmp_path / "out")
    ending = run(spec, study, InlineExecutor(PluginEvaluation(spec.generator, spec.cost_model)), spec.trials)
    assert ending is not None and ending.startswith("no new point to evaluate in the last 300 asks")
    assert "300 could not run (the last: derived parallel.dp = world / parallel.tp" in ending
    trials = study.get_trials(deepcopy=False)
    done = evaluations(trials)
    after = [t for t in trials if not done or t.number > done[-1].number]
    assert len(after) == 300 and all(t.state == TrialState.PRUNED for t in after)
    assert len(trials) <= 300 * (len(done) + 1), "each run of barren asks is bounded: the journal too"


def test_a_search_stopped_for_want_of_points_exits_0_with_the_reason_and_its_results(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(unseen, "BARREN_ASKS", 100)
    out = tmp_path / "out"
    assert main(["run", str(study_file(tmp_path, FOUR_IN_A_MILLION)), "--out", str(out), "--inline"]) == 0
    printed = capsys.readouterr().out
    assert "stopped before 10 evaluations: no new point to evaluate in the last 100 asks" in printed
    assert (out / "trials.parquet").is_file()


def test_barren_asks_are_also_bounded_in_driver_time(tmp_path, monkeypatch):
    """No timing is measured: with a bound of 0 s the first ask that evaluates nothing ends the search."""
    monkeypatch.setattr(unseen, "BARREN_ASK_S", 0.0)
    spec = load_study(study_file(tmp_path, FOUR_IN_A_MILLION))
    study = open_study(spec, tmp_path / "out")
    ending = run(spec, study, InlineExecutor(PluginEvaluation(spec.generator, spec.cost_model)), spec.trials)
    assert ending is not None and "in the last 1 ask " in ending


def test_a_sampler_that_repeats_evaluated_points_is_steered_to_new_ones_not_stopped(tmp_path, monkeypatch):
    """TPE proposes evaluated points again and again on 12 points; each repeat is a barren ask, but after STALL_ASKS
    of them the loop draws an untried point, so even a bound of STALL_ASKS + 1 barren asks lets it evaluate all 12
    (without the draws it stops at 10)."""
    monkeypatch.setattr(unseen, "BARREN_ASKS", unseen.STALL_ASKS + 1)
    spec = load_study(study_file(tmp_path, sampler="tpe", trials=12))
    study = open_study(spec, tmp_path / "out")
    ending = run(spec, study, InlineExecutor(PluginEvaluation(spec.generator, spec.cost_model)), spec.trials)
    assert len(evaluations(study.trials)) == 12
    assert ending is None or "exhausted" in ending
    assert any(DUPLICATE_OF in t.user_attrs for t in study.trials), "TPE did repeat evaluated points"


# Steps that do not fit their ranges.


def test_a_step_larger_than_its_range_is_refused(tmp_path):
    message = refused(study_file(tmp_path, {"parallel.tp": {"low": 1, "high": 4, "step": 8}}))
    assert "'space.parallel.tp': step 8 is larger than the range 1..4" in message
    assert "use a step of at most 3" in message
    message = refused(study_file(tmp_path, {"system.accelerator.hbm_GiB": {"low": 10.0, "high": 11.0, "step": 2.5}}))
    assert "step 2.5 is larger than the range 10.0..11.0" in message
    message = refused(study_file(tmp_path, {"parallel.tp": {"low": 4, "high": 4, "step": 2}}))
    assert "the range 4..4 holds one value, so it takes no step" in message


def test_a_range_that_is_not_a_whole_number_of_steps_is_refused_with_its_numbers(tmp_path):
    message = refused(study_file(tmp_path, {"parallel.tp": {"low": 1, "high": 10, "step": 4}}))
    assert "the range 1..10 is not a whole number of steps of 4, so its values would stop at 9" in message
    assert "end it at 9 or 13, or use a step that divides 9" in message
    hbm = {"system.accelerator.hbm_GiB": {"low": 10.0, "high": 100.5, "step": 0.7}}
    message = refused(study_file(tmp_path, hbm))
    assert "the range 10.0..100.5 is not a whole number of steps of 0.7, so its values would stop at 100.3" in message


def test_a_fractional_step_of_a_whole_number_field_is_refused_naming_the_step(tmp_path):
    """The issue: the error quoted low and high (1 and 8), which are whole, not the fractional step."""
    message = refused(study_file(tmp_path, {"parallel.tp": {"low": 1, "high": 8, "step": 2.5}}))
    assert (
        "parallel.tp holds whole numbers, so a range of it needs whole low and high (and step), not step 2.5" in message
    )
    message = refused(study_file(tmp_path, {"parallel.tp": {"low": 1.5, "high": 8}}))
    assert "not low 1.5;" in message


def test_a_float_step_too_fine_for_its_range_is_refused_not_a_traceback(tmp_path):
    """Optuna's own check of the step raised decimal.InvalidOperation on this range."""
    hbm = {"system.accelerator.hbm_GiB": {"low": 1e-300, "high": 1e5, "step": 1e-300}}
    message = refused(study_file(tmp_path, hbm))
    assert f"cuts the range 1e-300..100000.0 into 1e+305 values, over the limit of {MAX_RANGE_VALUES:,}" in message


def test_steps_that_fit_their_ranges_raise_no_optuna_warning(tmp_path):
    """Optuna's warning that it shrank a range must never be what a user sees instead of ours."""
    space = {
        "parallel.tp": {"low": 1, "high": 7, "step": 2},
        "system.accelerator.hbm_GiB": {"low": 0.1, "high": 0.7, "step": 0.2},
        "system.accelerator.hbm_bandwidth_GBps": {"low": 1000, "high": 3000.0, "step": 0.5},
        "system.accelerator.memory_efficiency": {"low": 0.1, "high": 0.3, "step": 0.2},  # 0.3 - 0.1 < 0.2 in floats
    }
    spec = load_study(study_file(tmp_path, space, derived={}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        distributions = optuna_distributions(spec)
    assert (distributions["parallel.tp"].high, distributions["system.accelerator.hbm_GiB"].high) == (7, 0.7)


# Duplicate choices.


def test_duplicate_choices_are_searched_once_with_a_one_line_warning(tmp_path, capsys):
    space = {
        "parallel.tp": {"choices": [1, 1.0, 2, 2, 4, 8]},
        "parallel.sp": {"choices": [True, False, True]},
        "parallel.recompute": {"choices": ["none", "full", "none", "selective"]},
    }
    path = study_file(tmp_path, space)
    spec = load_study(path)
    assert spec.space["parallel.tp"].choices == [1, 2, 4, 8]
    assert spec.space["parallel.sp"].choices == [True, False]
    assert spec.space["parallel.recompute"].choices == ["none", "full", "selective"]
    assert space_size(spec) == 4 * 3 * 2 * 3
    lines = capsys.readouterr().out.splitlines()
    assert lines == [  # in the file's order (yaml.safe_dump sorts the keys)
        f"warning: {path}: field 'space.parallel.recompute': 'none' repeats an earlier choice; each is searched "
        "once: ['none', 'full', 'selective']",
        f"warning: {path}: field 'space.parallel.sp': True repeats an earlier choice; each is searched once: "
        "[True, False]",
        f"warning: {path}: field 'space.parallel.tp': 1.0, 2 repeat earlier choices; each is searched once: "
        "[1, 2, 4, 8]",
    ]
    assert main(["check", str(path)]) == 0
    assert "72 points in the space" in capsys.readouterr().out  # 4 x 3 x 2 x 3, not 6 x 3 x 3 x 4


# Derived values.


def test_a_derived_value_that_sets_a_searched_field_is_refused(tmp_path):
    """The issue: derived tp silently replaced the searched one, and the table showed tp 16 on an 8-NPU system."""
    message = refused(study_file(tmp_path, derived={"parallel.dp": "1", "parallel.tp": "world"}))
    assert "'derived.parallel.tp': parallel.tp is also searched (space.parallel.tp)" in message


def test_a_searched_field_within_another_searched_field_is_refused(tmp_path):
    space = {"system.accelerator.hbm_GiB": {"choices": [40, 80]}, "system.accelerator": {"choices": ["h100-sxm"]}}
    message = refused(study_file(tmp_path, space))
    assert "'space.system.accelerator.hbm_GiB': it lies within space.system.accelerator" in message


@pytest.mark.parametrize(
    ("derived", "message"),
    [
        ("world / 3", "derived parallel.pp = world / 3 = 2.67 (world=8) is not a whole number at every point"),
        ("world / 0", "derived parallel.pp = world / 0: division by zero at every point"),
        ("parallel.tp / 16", "no point of the study can use it (derived parallel.pp = parallel.tp / 16 = 0.0625"),
    ],
)
def test_a_derived_value_no_point_can_use_is_refused(tmp_path, derived, message):
    assert message in refused(
        study_file(tmp_path, derived={"parallel.dp": "world / parallel.tp", "parallel.pp": derived})
    )


def test_a_derived_number_too_large_for_a_float_is_refused_not_a_traceback(tmp_path):
    """math.isfinite raised OverflowError on a 400-digit constant."""
    message = refused(study_file(tmp_path, derived={"parallel.dp": "1" + "0" * 400}))
    assert "'derived.parallel.dp': a number in it is too large for a float" in message


def test_a_derived_value_some_points_can_use_is_kept_and_prunes_the_others(tmp_path):
    spec = load_study(study_file(tmp_path, derived={"parallel.dp": "world / (parallel.tp * (parallel.zero + 1))"}))
    assert decode(spec, {"parallel.tp": 8, "parallel.zero": 0}).parallel.dp == 1
    assert "= 0.5 (parallel.tp=8, parallel.zero=1, world=8) is not a whole number" in decode(
        spec, {"parallel.tp": 8, "parallel.zero": 1}
    )


def test_a_base_value_that_the_space_or_a_derived_value_replaces_is_accepted(tmp_path):
    """A base is often a whole point file: the space and derived values vary it, as README's Study files say."""
    base = {**STUDY["base"], "parallel": {"pp": 1, "tp": 4, "dp": 2}}
    spec = load_study(study_file(tmp_path, base=base))
    point = decode(spec, {"parallel.tp": 8, "parallel.zero": 0})
    assert (point.parallel.tp, point.parallel.dp) == (8, 1)


# Other ways a space could take unbounded time or memory at load.


def test_a_local_search_over_a_neighbourhood_beyond_its_limit_is_refused(tmp_path):
    """The local sampler lists every value of every field and walks them at each ask: 16 million sequence lengths
    took 600 MB before the first trial."""
    message = refused(study_file(tmp_path, {"workload.seq_len": {"low": 1, "high": 2**24}}, sampler="local"))
    assert "'space.workload.seq_len': the local sampler walks every neighbour" in message
    assert f"16,777,223 values (16,777,216 of them here) are over its limit of {MAX_LOCAL_VALUES:,}" in message


def test_a_space_of_more_parameters_than_the_limit_is_refused(tmp_path):
    """Each parameter is assigned in every point decoded, and the load decodes a point per choice."""
    space = {f"model.field{i}": {"choices": [1]} for i in range(MAX_SEARCHED + 1)}
    message = refused(study_file(tmp_path, space))
    assert f"field 'space': {MAX_SEARCHED + 3} entries is over the limit of {MAX_SEARCHED}" in message
