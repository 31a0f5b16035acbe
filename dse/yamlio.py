"""Reading YAML files with errors a person can act on."""

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from dse.errors import SpecError


def load_yaml(path: str | Path) -> Any:
    """Parse one YAML file; a missing or malformed file raises SpecError naming the file and the line."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SpecError(f"{path}: file not found; check the path") from None
    except OSError as exc:
        raise SpecError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise SpecError(f"{path}: malformed YAML{where}: {problem}; fix the syntax") from None


def load_mapping(path: str | Path) -> dict[str, Any]:
    """Parse a YAML file whose top level must be a mapping."""
    data = load_yaml(path)
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected a mapping of fields at the top level, got {type(data).__name__}")
    return data


def describe_validation_error(exc: ValidationError, source: str) -> str:
    """One line naming the first offending field (as a dotted path) and what is wrong with it.

    Unknown fields come first: a misspelt required field is both unknown and missing, and only the unknown one
    names what to fix."""
    errors = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
    err = errors[0]
    field = ".".join(str(part) for part in err["loc"]) or "(top level)"
    kind = err["type"]
    if kind == "extra_forbidden":
        msg = "unknown field; check its spelling against the documented fields"
    elif kind == "missing":
        msg = "required field is missing"
    else:
        msg = err["msg"]
        if "input" in err and not isinstance(err["input"], dict | list):
            msg += f" (got {err['input']!r})"
    more = len(errors) - 1
    tail = f" (+{more} more)" if more else ""
    return f"{source}: field '{field}': {msg}{tail}"
