"""Study files: loading with errors that name the file and field, decoding params into points, expressions."""

import pytest
from conftest import ROOT
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from dse.errors import SpecError
from dse.search.decoding import decode
from dse.search.space import load_study, optuna_distributions, parse_expression

SMALL = ROOT / "studies" / "small.yaml"
QUICKSTART = ROOT / "studies" / "quickstart.yaml"

BASE = """\
name: t
objectives: {step_time: minimize, peak_memory: }
trials: 4
workers: 1
base:
  model: tiny-llama
  workload: {seq_len: 512, global_batch: 16}
  system: tiny-ring
"""


def write_study(tmp_path, text: str):
    path = tmp_path / "study.yaml"
    path.write_text(BASE + text)
    return path


def params(tp: int, pp: int, micro_batch: int = 1, hbm: int = 80) -> dict:
    return {
        "parallel.tp": tp,
        "parallel.pp": pp,
        "workload.micro_batch": micro_batch,
        "system.accelerator.hbm_GiB": hbm,
    }


def test_studies_in_the_repository_load():
    quickstart = load_study(QUICKSTART)
    assert quickstart.directions == ["minimize", "minimize"]
    assert quickstart.metrics == ["step_time_s", "peak_memory_bytes"]
    assert [c.name for c in quickstart.constraint_list] == ["fits_memory"]
    assert load_study(SMALL, trials=3).trials == 3


def test_decode_applies_params_then_derived_values():
    spec = load_study(SMALL)
    point = decode(spec, params(tp=2, pp=1, micro_batch=2, hbm=141))
    assert not isinstance(point, str)
    assert (point.parallel.tp, point.parallel.pp, point.parallel.dp) == (2, 1, 4)  # dp = 8 NPUs / (2 * 1)
    assert point.parallel.zero == 1  # from the base
    assert point.workload.micro_batch == 2
    assert point.system.accelerator.hbm_GiB == 141
    assert point.system.accelerator.name == "h100-sxm"


def test_fractional_derived_integer_is_infeasible_with_a_reason_naming_it():
    reason = decode(load_study(SMALL), params(tp=8, pp=2))
    assert reason == (
        "derived parallel.dp = world / (parallel.tp * parallel.pp) = 0.5 "
        "(parallel.pp=2, parallel.tp=8, world=8) is not a whole number"
    )


def test_feasibility_rules_give_the_reason(tmp_path):
    spec = load_study(write_study(tmp_path, "space:\n  parallel.pp: {choices: [1, 8]}\n"))
    reason = decode(spec, {"parallel.pp": 8})
    assert reason == (
        "parallel.pp=8 does not divide model.layers=4; use pp in {1, 2, 4}, "
        "or set parallel.first_stage_layers / last_stage_layers"
    )


def test_division_by_zero_is_a_reason(tmp_path):
    spec = load_study(
        write_study(
            tmp_path,
            "space:\n  parallel.tp: {low: 1, high: 2}\nderived:\n  parallel.dp: world / (parallel.tp - 1)\n",
        )
    )
    assert decode(spec, {"parallel.tp": 1}) == "derived parallel.dp = world / (parallel.tp - 1): division by zero"


def test_a_fractional_value_is_fine_for_a_float_field(tmp_path):
    spec = load_study(
        write_study(
            tmp_path,
            "space:\n  parallel.tp: {choices: [1, 2]}\n"
            "derived:\n  parallel.dp: world // parallel.tp\n  system.accelerator.hbm_GiB: 80 / 3\n",
        )
    )
    point = decode(spec, {"parallel.tp": 2})
    assert point.parallel.dp == 4
    assert point.system.accelerator.hbm_GiB == pytest.approx(26.6667, rel=1e-4)


def test_a_searched_catalog_entry_takes_the_base_files_overrides_on_top(tmp_path):
    """A searched `system.base` is the preset each point runs on, and the base file's own overrides (here the node
    count) apply on top of it: the base's expanded preset used to override the searched one, field by field."""
    path = tmp_path / "s.yaml"
    path.write_text(
        "name: t\nobjectives: {step_time: minimize}\ntrials: 2\nworkers: 1\nbase:\n  model: tiny-llama\n"
        "  workload: {seq_len: 512, global_batch: 32}\n  parallel: {tp: 8}\n"
        "  system: {base: dgx-1, network: {1: {npus: 2}}}\n"
        "space:\n  system.base: {choices: [dgx-1, dgx-2]}\n  model.dtype: {choices: [fp16]}\n"
        "derived:\n  parallel.dp: world / 8\n"
    )
    spec = load_study(path)
    on_dgx2 = decode(spec, {"system.base": "dgx-2", "model.dtype": "fp16"})
    on_dgx1 = decode(spec, {"system.base": "dgx-1", "model.dtype": "fp16"})
    assert on_dgx2.system.name == "dgx-2" and on_dgx1.system.name == "dgx-1"
    assert [dim.npus for dim in on_dgx2.system.network] == [16, 2]
    assert on_dgx2.system.network[0].topology == "switch"
    assert on_dgx1.system.network[0].topology == "hybrid_cube_mesh"
    assert on_dgx2.parallel.dp == 4 and on_dgx1.parallel.dp == 2


def test_a_derived_value_may_be_a_bare_number(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(
        BASE + "space:\n  parallel.tp: {choices: [1, 2]}\n"
        "derived:\n  system.network.1.bandwidth_GBps: 50\n  parallel.dp: world / parallel.tp\n"
    )
    point = decode(load_study(path), {"parallel.tp": 2})
    assert point.system.network[1].bandwidth_GBps == 50


def test_world_counts_the_derived_values_before_it(tmp_path):
    """`world` in a derived value is the system as the params and the derived values listed before it left it: a
    derived node count, then `world / tp`."""
    path = tmp_path / "s.yaml"
    path.write_text(
        BASE + "space:\n  parallel.tp: {choices: [1, 4]}\n"
        "derived:\n  system.network.0.npus: 2 * parallel.tp\n  parallel.dp: world / parallel.tp\n"
    )
    point = decode(load_study(path), {"parallel.tp": 4})
    assert point.system.npus == 16 and point.parallel.dp == 4  # 8 x 2, not the preset's 4 x 2


def test_distributions_follow_the_space(tmp_path):
    spec = load_study(
        write_study(
            tmp_path,
            "space:\n"
            "  parallel.tp: {choices: [1, 2]}\n"
            "  workload.micro_batch: {low: 1, high: 4}\n"
            "  system.network.0.bandwidth_GBps: {low: 50.0, high: 400, log: true}\n",
        )
    )
    dists = optuna_distributions(spec)
    assert dists["parallel.tp"] == CategoricalDistribution([1, 2])
    assert dists["workload.micro_batch"] == IntDistribution(1, 4)
    assert dists["system.network.0.bandwidth_GBps"] == FloatDistribution(50.0, 400, log=True)


def test_expression_arithmetic():
    expr = parse_expression("world // (parallel.tp * parallel.pp) % 3 + -1 - 2 / 4")
    assert expr.names == {"world", "parallel.tp", "parallel.pp"}
    assert expr.evaluate({"world": 64, "parallel.tp": 2, "parallel.pp": 4}) == 64 // 8 % 3 - 1 - 0.5


def test_expression_names_a_list_entry_by_its_index():
    """`system.network.0.bandwidth_GBps` names a field of a list entry (Python alone reads `.0` as a number);
    numbers with a fraction stay numbers."""
    expr = parse_expression("400 - system.network.0.bandwidth_GBps * 1.5 + system.network.1.npus")
    assert expr.names == {"system.network.0.bandwidth_GBps", "system.network.1.npus"}
    assert expr.evaluate({"system.network.0.bandwidth_GBps": 120, "system.network.1.npus": 8}) == 400 - 180 + 8


@pytest.mark.parametrize(
    ("text", "offending"),
    [
        ("__import__('os').system('true')", "__import__('os').system('true')"),
        ("abs(parallel.tp)", "abs(parallel.tp)"),
        ("parallel.tp ** 2", "parallel.tp ** 2"),
        ("world[0]", "world[0]"),
        ("parallel.tp if world else 1", "parallel.tp if world else 1"),
        ("parallel.tp < 2", "parallel.tp < 2"),
        ("lambda: 1", "lambda: 1"),
        ("'8'", "'8'"),
        ("True", "True"),
    ],
)
def test_expression_rejects_anything_but_arithmetic(text, offending):
    with pytest.raises(ValueError, match="use numbers, parameter names, world") as err:
        parse_expression(text)
    assert offending in str(err.value)


def test_expression_syntax_error():
    with pytest.raises(ValueError, match=r"cannot parse 'world /'"):
        parse_expression("world /")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "space:\n  parallel.tpp: {choices: [1, 2]}\n",
            "field 'parallel.tpp': unknown field",
        ),
        (
            "space:\n  model.layers.x: {choices: [1, 2]}\n",
            "field 'space.model.layers.x': 'model.layers.x': 'model.layers' is a value",
        ),
        (
            "space:\n  parallel.tp: {choices: [1, 2]}\nderived:\n  parallel.dp: world / len(parallel.tp)\n",
            "field 'derived.parallel.dp': 'len(parallel.tp)' is not allowed",
        ),
        (
            "space:\n  parallel.tp: {choices: [1, 2]}\nderived:\n  parallel.dp: world / parallel.pp\n",
            "field 'derived.parallel.dp': 'parallel.pp' is neither a space parameter",
        ),
        (
            "space:\n  parallel.tp: {low: 1, high: 8}\nsampler: grid\n",
            "field 'space.parallel.tp': the grid sampler needs 'choices'",
        ),
        (
            "space:\n  parallel.tp: {low: 8, high: 1}\n",
            "field 'space.parallel.tp': low=8 is above high=1",
        ),
        (
            "space:\n  parallel.tp: {choices: [1, 2]}\nconstraints: [step_time]\n",
            "field 'constraints.0': 'step_time' is an objective",
        ),
        (
            "space:\n  parallel.tp: {choices: [1, 2]}\nsampler: cmaes\n",
            "field 'sampler'",
        ),
    ],
)
def test_study_errors_name_the_file_and_field(tmp_path, text, message):
    path = write_study(tmp_path, text)
    with pytest.raises(SpecError) as err:
        load_study(path)
    assert str(err.value).startswith(str(path))
    assert message in str(err.value)


def test_unknown_model_names_the_base_field(tmp_path):
    path = tmp_path / "study.yaml"
    path.write_text(BASE.replace("model: tiny-llama", "model: llama9") + "space:\n  parallel.tp: {choices: [1]}\n")
    with pytest.raises(SpecError, match=r"study.yaml: field 'base.model': unknown model 'llama9'; known: "):
        load_study(path)


def test_unknown_objective(tmp_path):
    path = tmp_path / "study.yaml"
    path.write_text(BASE.replace("step_time: minimize", "speed: maximize") + "space:\n  parallel.tp: {choices: [1]}\n")
    with pytest.raises(SpecError, match=r"field 'objectives.speed': unknown objective or constraint 'speed'"):
        load_study(path)


@pytest.mark.parametrize("path", sorted((ROOT / "studies").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_study_loads_and_its_first_point_is_feasible(path):
    spec = load_study(path)
    point = decode(spec, {name: param.first for name, param in spec.space.items()})
    assert not isinstance(point, str), point
