"""Turning point files (and a study's decoded parameters) into validated DesignPoints.

A point names catalog entries or overrides them: `model: llama3-8b`, or `model: {base: llama3-8b, layers: 16}`.
The same holds for `system` and `system.accelerator`. A list is overridden element-wise by a mapping of indices,
e.g. `system: {base: dgx-h100, network: {1: {npus: 16}}}` keeps the NVLink dimension and scales out to 16 nodes,
and a mapping key by key: `system: {base: dgx-h100, accelerator: {hbm_GiB: 141}}` is the preset's H100 with more
HBM, while `accelerator: h200` or `accelerator: {base: h200, ...}` replaces it.
"""

import copy
import json
import os
from contextlib import suppress
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from dse import catalog
from dse.compute import FRAMEWORK_KERNEL, ComputeModel
from dse.errors import InfeasibleError, SpecError
from dse.plugins import DEFAULT_GENERATOR
from dse.point.described import complete_model
from dse.point.feasibility import infeasibility
from dse.spec import DesignPoint, ignored_setting
from dse.system import SystemSpec
from dse.yamlio import describe_validation_error, load_mapping

POINT_FIELDS = ("model", "workload", "parallel", "system")
OPTIONAL_POINT_FIELDS = ("economics",)


def merge(base: Any, override: Any, path: str = "") -> Any:
    """Deep-merge override onto base: mappings key by key, lists replaced or patched by a mapping of indices.
    A mapping with a `base` names its own starting point, so it replaces what it overrides."""
    if isinstance(base, dict) and isinstance(override, dict) and "base" not in override:
        out = dict(base)
        for key, value in override.items():
            out[key] = merge(base[key], value, f"{path}.{key}".lstrip(".")) if key in base else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(override, dict) and all(_is_index(k) for k in override):
        out = list(base)
        for key, value in override.items():
            index = int(key)
            if not 0 <= index < len(out):
                raise SpecError(
                    f"field '{path}.{index}': list index {index} is out of range (the list has {len(out)} "
                    f"entries); use 0 to {len(out) - 1}"
                )
            out[index] = merge(out[index], value, f"{path}.{index}".lstrip("."))
        return out
    return copy.deepcopy(override)


def _is_index(key: Any) -> bool:
    """A list index in a patch of a list: 1, or '1' (JSON has only string keys, and a study's saved copy is JSON's
    data written as YAML)."""
    return (isinstance(key, int) and not isinstance(key, bool)) or (isinstance(key, str) and key.isdigit())


def _resolve(kind: catalog.Kind, ref: Any, field: str) -> Any:
    if isinstance(ref, str):
        return _entry(kind, ref, field)
    if isinstance(ref, dict) and "base" in ref:
        rest = {k: v for k, v in ref.items() if k != "base"}
        if not isinstance(ref["base"], str):
            raise SpecError(f"field '{field}.base': expected a catalog name, got {ref['base']!r}")
        base = _entry(kind, ref["base"], f"{field}.base")
        if kind == "models" and "name" not in rest:
            rest["name"] = f"{ref['base']}*" if rest else ref["base"]
        if kind == "systems" and isinstance(base.get("accelerator"), str):
            base["accelerator"] = catalog.entry("accelerators", base["accelerator"])  # overrides merge into it
        return merge(base, rest, field)
    return ref


def _entry(kind: catalog.Kind, name: str, field: str) -> dict[str, Any]:
    try:
        return catalog.entry(kind, name)
    except SpecError as exc:
        raise SpecError(f"field '{field}': {exc}") from None


def expand(raw: dict[str, Any], where: str = "") -> dict[str, Any]:
    """Replace catalog references with their entries; what is left is plain data for DesignPoint. An error names
    the field, after `where` (e.g. 'base.' in a study)."""
    out = dict(raw)
    if "model" in out:
        out["model"] = _resolve("models", out["model"], f"{where}model")
    if "system" in out:
        system = _resolve("systems", out["system"], f"{where}system")
        if isinstance(system, dict) and "accelerator" in system:
            system = dict(system)
            system["accelerator"] = _resolve("accelerators", system["accelerator"], f"{where}system.accelerator")
        out["system"] = system
    return out


def assign(data: dict[str, Any], path: str, value: Any, owned: set[int] | None = None) -> None:
    """Set a dotted path such as `system.network.1.bandwidth_GBps` (list elements by index) in place.

    owned: copy on write. The ids of the containers `data` owns (data's own among them); a shared one on the path
    is copied into its parent first, and its copy is owned from then on, so data can share everything else with
    a template that stays as it was (cheaper than a deep copy of the template per point)."""
    parts = path.split(".")
    node: Any = data
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        where = ".".join(parts[: depth + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise SpecError(f"'{path}': '{where}' is not an index of a list of {len(node)} entries")
            key: Any = int(part)
        elif isinstance(node, dict):
            key = part
            if not last and key not in node:
                node[key] = {}
        else:
            raise SpecError(f"'{path}': '{'.'.join(parts[:depth])}' is a value, not a mapping or list")
        if last:
            node[key] = value
        else:
            child = node[key]
            if owned is not None and id(child) not in owned and isinstance(child, (dict, list)):
                child = node[key] = dict(child) if isinstance(child, dict) else list(child)
                owned.add(id(child))
            node = child


def build_point(raw: dict[str, Any], source: str) -> DesignPoint:
    """Validate expanded point data; errors name the source and the dotted field."""
    missing = [f for f in POINT_FIELDS if f not in raw]
    if missing:
        raise SpecError(f"{source}: field '{missing[0]}' is missing; a point needs {', '.join(POINT_FIELDS)}")
    unknown = [k for k in raw if k not in POINT_FIELDS + OPTIONAL_POINT_FIELDS]
    if unknown:
        fields = ", ".join(POINT_FIELDS + OPTIONAL_POINT_FIELDS)
        raise SpecError(f"{source}: unknown field '{unknown[0]}'; a point has {fields}")
    system = raw["system"]
    with suppress(ValidationError):  # where it is not valid, the point's own validation names the field
        system = system if isinstance(system, SystemSpec) else validated_system(system)
    try:
        return DesignPoint.model_validate({**raw, "system": system})
    except ValidationError as exc:
        raise SpecError(describe_validation_error(exc, source)) from None


def validated_system(data: Any) -> SystemSpec:
    """A system's data validated (a ValidationError where it is not valid), once per distinct data: a study's points
    share a few systems, and a system's measured kernel tables (thousands of rows) took most of the time of
    validating a point."""
    text = json.dumps(data, sort_keys=True, default=str)
    known = _SYSTEMS.get(text)
    if known is None:
        known = SystemSpec.model_validate(data)
        if len(_SYSTEMS) >= SYSTEMS_KEPT:
            _SYSTEMS.clear()
        _SYSTEMS[text] = known
    return known


SYSTEMS_KEPT = 256
_SYSTEMS: dict[str, SystemSpec] = {}


def load_point(path: str | Path, generator: str = DEFAULT_GENERATOR) -> DesignPoint:
    """A point file as a runnable point for `generator`: valid, setting nothing that would be ignored, its tables
    within physics, and feasible; every error names the file. A relative file path in it is the point file's
    folder's. Under a generator whose model is code (fx), its model is filled from the code and checked against it
    (dse.point.described)."""
    raw = load_mapping(path)
    try:
        expanded = complete_model(with_paths_from(Path(path).parent, expand(raw)), generator)
    except SpecError as exc:
        raise SpecError(f"{path}: {exc}") from None
    point = build_point(expanded, str(path))
    ignored = ignored_setting(point)
    if ignored:
        raise SpecError(f"{path}: {ignored}")
    try:
        check_tables(point)
    except SpecError as exc:
        raise SpecError(f"{path}: {exc}") from None
    reason = infeasibility(point)
    if reason:
        raise InfeasibleError(f"{path}: {reason}")
    return point


FILE_FIELDS = ("system.accelerator.measured_table", "workload.serving.trace")
"""The fields of a point that name a file: a relative path in a point or study file is relative to its folder."""


def with_paths_from(folder: Path, expanded: dict[str, Any]) -> dict[str, Any]:
    """Expanded point data (`expand`) with each relative file path of FILE_FIELDS made absolute against `folder`,
    the folder of the file that names it, so that the point reads the same file from any working directory (and
    on a Ray worker elsewhere). What is not a path is left for validation to name. Sections on the way are copied,
    not changed: they may be a catalog entry's or a study's base."""
    out = expanded
    for field in FILE_FIELDS:
        out = _with_path(out, field.split("."), folder)
    return out


def _with_path(node: Any, parts: list[str], folder: Path) -> Any:
    """`node` with the relative path at `parts` made absolute; the mappings on the way copied, and only if it is."""
    if not isinstance(node, dict) or parts[0] not in node:
        return node
    head, *rest = parts
    value = node[head]
    if rest:
        changed = _with_path(value, rest, folder)
    elif isinstance(value, str) and value and not Path(value).is_absolute():
        changed = file_path_from(folder, value)
    else:
        return node
    return node if changed is value else {**node, head: changed}


def file_path_from(folder: Path, path: str) -> str:
    """`path` as a file named in a file of `folder` reads it: relative to that folder, absolute, normalised."""
    return os.path.normpath(os.path.join(os.path.abspath(folder), path))


def check_tables(point: DesignPoint) -> None:
    """Read the point's measured kernel tables now, not trial by trial: a missing file, a bad row or a row faster
    than the accelerator's peak, a kernel-table collection the installed package lacks (or the package itself) is
    a SpecError naming the field."""
    accelerator, kernel = point.system.accelerator, point.workload.attention_kernel
    if accelerator.measured_table or accelerator.reads_tables or kernel == FRAMEWORK_KERNEL:
        ComputeModel(accelerator, point.model.dtype, attention_kernel=kernel)
