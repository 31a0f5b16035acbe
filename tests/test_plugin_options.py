"""Plugin option models (a study's cost_model_options, refine's, `--cost-option`): strict, finite, bounded, paths
of the right kind, checked when the point or study loads; and the settings that would change nothing refused."""

import re
import types
import typing
from pathlib import Path

import pytest
import yaml
from helpers import run_cli
from pydantic import BaseModel

from dse import plugins

POINT = {
    "model": "tiny-llama",
    "workload": {"seq_len": 256, "global_batch": 8, "micro_batch": 1},
    "parallel": {"tp": 2, "dp": 4},
    "system": "tiny-ring",
}
STUDY = {
    "name": "options",
    "trials": 2,
    "sampler": "random",
    "objectives": {"step_time": "minimize"},
    "base": POINT,
    "space": {"parallel.zero": {"choices": [0, 1]}},
}


def option_models() -> dict[str, type[BaseModel]]:
    """Each installed cost model's Options, found as dse finds the cost models."""
    found = {
        name: getattr(plugins.load("cost model", name), "Options", None) for name in plugins.available("cost model")
    }
    return {name: schema for name, schema in found.items() if schema is not None}


def write(tmp_path: Path, name: str, data: dict) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def refused(outcome: tuple[int, str, str], *fragments: str) -> None:
    """Exit 2, nothing on stdout, one `error:` line holding every fragment."""
    code, out, err = outcome
    assert code == 2 and out == "", outcome
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


WRONG_NUMBERS = [
    ("astrasim", "timeout_s=.inf", "Input should be a finite number"),
    ("emulator", "timeout_s=.inf", "Input should be a finite number"),
    ("emulator", "timeout_s=-.inf", "Input should be a finite number"),
    ("astrasim", "timeout_s=.nan", "Input should be a finite number"),
    ("emulator", "timeout_s=1e400", "Input should be a finite number"),
    ("astrasim", "timeout_s='5'", "Input should be a valid number (got '5')"),
    ("emulator", "timeout_s=true", "Input should be a valid number (got True)"),
    ("astrasim", "active_chunks_per_dimension=true", "expected a number, not a boolean"),
    ("astrasim", "preferred_dataset_splits=2.5", "Input should be a valid integer"),
    ("astrasim", "max_npus=4194304", "must be at most 1048576"),
    ("emulator", "timeout_s=100000", "must be at most 86400"),
    ("emulator", "timeout_s=0", "must be above 0"),
    ("analytical", "exact=1", "Input should be a valid boolean (got 1)"),
    ("analytical", "exact='true'", "Input should be a valid boolean (got 'true')"),
]


@pytest.mark.parametrize("model, option, message", WRONG_NUMBERS, ids=[f"{m}-{o}" for m, o, _ in WRONG_NUMBERS])
def test_a_non_finite_quoted_or_boolean_number_on_the_command_line_is_one_line_exit_2(tmp_path, model, option, message):
    """`--cost-option timeout_s=.inf` was a traceback for the emulator; every wrong value is now one line."""
    point = write(tmp_path, "point.yaml", POINT)
    key = option.partition("=")[0]
    code, out, err = run_cli("evaluate", str(point), "--json", "--cost-model", model, "--cost-option", option)
    refused((code, out, err), f"--cost-option: field 'cost_model_options.{key}'", message)


@pytest.mark.parametrize("where", ["cost_model_options", "refine"])
def test_a_quoted_or_boolean_number_in_a_study_file_is_refused_when_it_loads(tmp_path, where):
    options = {"timeout_s": "60", "active_chunks_per_dimension": True}
    section = {"cost_model": "astrasim", "cost_model_options": options}
    study = {**STUDY, **section} if where == "cost_model_options" else {**STUDY, "refine": section}
    path = write(tmp_path, "study.yaml", study)
    field = "cost_model_options" if where == "cost_model_options" else "refine.cost_model_options"
    for command in (["check", str(path)], ["run", str(path), "--inline", "--out", str(tmp_path / "out")]):
        refused(run_cli(*command), f"{path}: field '{field}.", "(got ")
    assert not (tmp_path / "out").exists(), "refused before the output folder was made"


def test_a_file_where_a_folder_belongs_or_a_folder_that_cannot_be_made_is_refused(tmp_path):
    file = tmp_path / "file.txt"
    file.write_text("x")
    point = write(tmp_path, "point.yaml", POINT)
    cases = {
        str(file): f"{file} is a file, not a folder",
        f"{file}/x": f"{file}/x has a file on its way ({file}), not a folder",
        "/proc/dse-runs": "/proc/dse-runs cannot be created in /proc, which is not writable",  # even for root
    }
    for model in ("astrasim", "emulator"):
        for folder, message in cases.items():
            flags = ["--cost-model", model, "--cost-option", f"keep_runs={folder}"]
            refused(run_cli("evaluate", str(point), *flags), "field 'cost_model_options.keep_runs'", message)
    assert not list(tmp_path.glob(".dse-probe-*")) and not Path("/proc/dse-runs").exists()


def test_a_folder_or_nothing_where_a_file_belongs_is_refused(tmp_path):
    study = {**STUDY, "cost_model": "astrasim", "cost_model_options": {"binary": str(tmp_path)}}
    refused(run_cli("check", str(write(tmp_path, "s.yaml", study))), f"{tmp_path} is a folder, not a file")
    study["cost_model_options"]["binary"] = str(tmp_path / "nowhere")
    refused(run_cli("check", str(write(tmp_path, "s.yaml", study))), f"{tmp_path / 'nowhere'} does not exist")


def test_a_metrics_file_outside_the_run_folder_is_refused(tmp_path):
    point = write(tmp_path, "point.yaml", POINT)
    for name in ("..", ".", "a/b", "''"):
        code, out, err = run_cli("evaluate", str(point), "--cost-model", "emulator", "--cost-option", f"metrics={name}")
        refused((code, out, err), "field 'cost_model_options.metrics'", "plain file name inside the run folder")


SHARES = re.compile(r"efficiency|share|scale|utili[sz]ation")
"""Option names that say a fraction of a peak rate: above 1, a kernel or a link would beat its peak."""
RATES = re.compile(r"bandwidth|tflops|flops|gbps")
"""Option names that would set a rate: the system's own figures are the only rates a cost model may use."""


def _bounds(metadata: list[typing.Any]) -> dict[str, float]:
    """The bounds (ge, gt, le, lt) among a field's metadata, the tightest of each kind."""
    found: dict[str, float] = {}
    for meta in metadata:
        for kind in ("ge", "gt", "le", "lt"):
            if (value := getattr(meta, kind, None)) is not None:
                found[kind] = (
                    min(found.get(kind, value), value) if kind in ("le", "lt") else max(found.get(kind, value), value)
                )
    return found


def _number_metadata(annotation: typing.Any) -> list[typing.Any] | None:
    """The metadata of a number inside a field's annotation (through Optional and Annotated), or None if the
    field holds no number."""
    if typing.get_origin(annotation) is typing.Annotated:
        inner = _number_metadata(typing.get_args(annotation)[0])
        return None if inner is None else [*inner, *annotation.__metadata__]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        found = [_number_metadata(arg) for arg in typing.get_args(annotation)]
        return next((meta for meta in found if meta is not None), None)
    return [] if annotation in (int, float) else None


def test_every_option_number_is_strict_finite_bounded_and_no_faster_than_physics():
    """The schema walk: each model is strict and refuses inf and nan; each number has a floor and a ceiling; a
    share of a peak is at most 1 and no option sets a rate of its own."""
    models = option_models()
    assert {"analytical", "astrasim", "emulator"} <= set(models)
    numbers = 0
    for name, schema in models.items():
        config = schema.model_config
        assert config.get("strict") and config.get("extra") == "forbid", name
        for key, info in schema.model_fields.items():
            metadata = _number_metadata(info.annotation)
            if metadata is None:
                continue
            numbers += 1
            assert config.get("allow_inf_nan") is False, name
            bounds = _bounds([*metadata, *info.metadata])
            assert bounds.keys() & {"ge", "gt"} and bounds.keys() & {"le", "lt"}, (name, key, bounds)
            if SHARES.search(key):
                assert min(bounds.get("le", 2), bounds.get("lt", 2)) <= 1, (name, key, bounds)
            assert not RATES.search(key), f"{name}.{key}: a rate of its own could beat the system's figures"
    assert numbers >= 5  # the walk sees the timeouts, chunk counts and max_npus


@pytest.mark.parametrize(
    "screening, refine",
    [
        ({}, {"cost_model": "analytical"}),
        ({}, {"cost_model": "analytical", "cost_model_options": {"exact": False}}),
        ({"cost_model_options": {"exact": True}}, {"cost_model": "analytical", "cost_model_options": {"exact": True}}),
    ],
    ids=["defaults", "defaults-spelt-out", "same-options"],
)
def test_a_refine_that_repeats_the_screening_model_is_refused(tmp_path, screening, refine):
    path = write(tmp_path, "study.yaml", {**STUDY, **screening, "refine": refine})
    refused(run_cli("check", str(path)), f"{path}: field 'refine': it prices with cost model 'analytical'")
    other = {**refine, "cost_model_options": {"exact": not refine.get("cost_model_options", {}).get("exact", False)}}
    assert run_cli("check", str(write(tmp_path, "ok.yaml", {**STUDY, **screening, "refine": other})))[0] == 0


def test_an_fx_factory_under_the_symbolic_generator_is_refused(tmp_path):
    """The symbolic generator never reads model.fx_factory: a point or a study that sets it is refused, naming the
    field, without importing anything (os:system is never looked up)."""
    model = {"base": "tiny-llama", "fx_factory": "os:system"}
    point = write(tmp_path, "point.yaml", {**POINT, "model": model})
    for command in ("evaluate", "check"):
        refused(run_cli(command, str(point)), f"{point}: field 'model.fx_factory': generator 'symbolic' never reads")
    study = write(tmp_path, "study.yaml", {**STUDY, "base": {**POINT, "model": model}})
    refused(run_cli("check", str(study)), f"{study}: field 'base.model.fx_factory'", "use generator fx")
    space = {**STUDY["space"], "model.fx_factory": {"choices": ["llama", "hf"]}}
    searched = write(tmp_path, "searched.yaml", {**STUDY, "space": space})
    refused(run_cli("check", str(searched)), f"{searched}: field 'space.model.fx_factory'", "'llama'")
