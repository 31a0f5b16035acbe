"""Reading YAML files with errors a person can act on.

The loader is PyYAML's safe one with four changes, each closing a way a typo turned into silent nonsense or a
crash: a key given twice is an error (YAML 1.1 keeps the last); numbers follow YAML 1.2 (`1e9` is a number, not
the string '1e9'; `017` is 17, not octal 15; `1:20` is text, not 80; dates stay text); nesting deeper than
MAX_NESTING is an error (PyYAML recurses once per level); and a file is read as UTF-8 (or UTF-16/32 with a byte
order mark) with any other byte reported by line, not as a UnicodeDecodeError.
"""

import re
from pathlib import Path
from typing import Any, ClassVar

import yaml
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from dse.errors import SpecError
from dse.limits import MAX_FILE_BYTES, MAX_NESTING, MAX_VALUES

_INT = re.compile(r"^(?:[-+]?[0-9][0-9_]*|0o[0-7_]+|0x[0-9a-fA-F_]+)$")
_FLOAT = re.compile(
    r"^(?:[-+]?(?:\.[0-9][0-9_]*|[0-9][0-9_]*(?:\.[0-9_]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)
_YAML_1_1_ONLY = {f"tag:yaml.org,2002:{tag}" for tag in ("int", "float", "timestamp", "value")}
_BOMS = (  # UTF-32's before UTF-16's: a little-endian UTF-32 mark starts like UTF-16's
    (b"\xef\xbb\xbf", "utf-8-sig"),
    (b"\xff\xfe\x00\x00", "utf-32"),
    (b"\x00\x00\xfe\xff", "utf-32"),
    (b"\xff\xfe", "utf-16"),
    (b"\xfe\xff", "utf-16"),
)


class _Refused(yaml.MarkedYAMLError):
    """Well-formed YAML this loader does not take (a key given twice, nesting too deep); the problem says why."""


class _Loader(yaml.SafeLoader):
    """PyYAML's SafeLoader with YAML 1.2 numbers, no implicit dates, unique keys and bounded nesting."""

    yaml_implicit_resolvers: ClassVar[dict[Any, list[tuple[str, re.Pattern[str]]]]] = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in _YAML_1_1_ONLY]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_NESTING:
                problem = f"nested more than {MAX_NESTING} levels deep, the limit; flatten it"
                raise _Refused(None, None, problem, self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:
                continue  # an unhashable key: SafeConstructor reports it
            if first is not key_node:
                problem = f"key {key!r} is given twice (first at line {first.start_mark.line + 1}); keep one"
                raise _Refused(None, None, problem, key_node.start_mark)
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        text = self.construct_scalar(node).replace("_", "")
        base = {"0o": 8, "0x": 16}.get(text[:2], 10)
        return int(text[2:] if base != 10 else text, base)

    def construct_yaml_float(self, node: yaml.ScalarNode) -> float:
        text = self.construct_scalar(node).replace("_", "").lower()
        return float(text.replace(".inf", "inf").replace(".nan", "nan"))


_Loader.add_implicit_resolver("tag:yaml.org,2002:int", _INT, list("-+0123456789"))
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+.0123456789"))
_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _Loader.construct_yaml_float)


def load_scalar(text: str) -> Any:
    """A command-line value read as the study file would read it (YAML 1.2: `true`, `8`, `1e9`, text); anything
    that is not a scalar (a list, a mapping, malformed YAML) stays the text it was."""
    try:
        value = yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader
    except (yaml.YAMLError, ValueError, OverflowError):
        return text
    return value if isinstance(value, (bool, int, float, str)) else text


def load_yaml(path: str | Path) -> Any:
    """Parse one YAML file; a missing, oversized, undecodable or malformed file raises SpecError naming the file
    and, where there is one, the line."""
    path = Path(path)
    data = _read(path)
    text = _decode(path, data)
    try:
        loaded = yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader
    except yaml.reader.ReaderError as exc:
        line, column = _position(text, exc.position)
        raise SpecError(
            f"{path}: character {exc.character:#06x} at line {line}, column {column} is not allowed in YAML; "
            "remove it (is this a text file?)"
        ) from None
    except _Refused as exc:
        mark = exc.problem_mark
        raise SpecError(f"{path}: line {mark.line + 1}, column {mark.column + 1}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise SpecError(f"{path}: malformed YAML{where}: {problem}; fix the syntax") from None
    except (ValueError, OverflowError) as exc:  # an explicit tag whose text it cannot hold: !!float abc
        raise SpecError(f"{path}: malformed YAML value ({exc}); fix the value") from None
    _count_values(path, loaded)
    return loaded


def _read(path: Path) -> bytes:
    try:
        if path.is_file() and path.stat().st_size > MAX_FILE_BYTES:
            raise SpecError(
                f"{path}: {path.stat().st_size:,} bytes is over the limit of {MAX_FILE_BYTES:,} for a point or "
                "study file; is this the right file?"
            )
        with path.open("rb") as handle:
            data = handle.read(MAX_FILE_BYTES + 1)  # a pipe or device has no size to check beforehand
    except FileNotFoundError:
        raise SpecError(f"{path}: file not found; check the path") from None
    except IsADirectoryError:
        raise SpecError(f"{path}: is a folder, not a file; give the YAML file inside it") from None
    except OSError as exc:
        raise SpecError(f"{path}: cannot read ({exc.strerror}); check the path and its permissions") from None
    if len(data) > MAX_FILE_BYTES:
        raise SpecError(f"{path}: more than {MAX_FILE_BYTES:,} bytes, the limit for a point or study file")
    return data


def _decode(path: Path, data: bytes) -> str:
    """UTF-8, or UTF-16/32 with a byte order mark (Windows editors and PowerShell write those)."""
    encoding = next((name for bom, name in _BOMS if data.startswith(bom)), "utf-8")
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise SpecError(
            f"{path}: byte {data[exc.start]:#04x} at line {line}, column {column} is not {encoding.upper()} text; "
            "save the file as UTF-8"
        ) from None


def _position(text: str, index: int) -> tuple[int, int]:
    line = text.count("\n", 0, index) + 1
    return line, index - (text.rfind("\n", 0, index) + 1) + 1


def _count_values(path: Path, data: Any) -> None:
    """Raise if the document, its aliases expanded, holds more than MAX_VALUES values or refers to itself.

    An alias is one shared object in memory, but anything that copies or walks the data (merging overrides,
    validation, dumping) expands it: ten nested aliases of ten make 10**10 values."""
    sizes: dict[int, int] = {}
    open_ids: set[int] = set()

    def size(node: Any, depth: int) -> int:
        if not isinstance(node, dict | list):
            return 1
        if depth > MAX_NESTING:
            raise SpecError(f"{path}: YAML aliases nest values more than {MAX_NESTING} levels deep; flatten them")
        known = sizes.get(id(node))
        if known is not None:
            return known
        if id(node) in open_ids:
            raise SpecError(f"{path}: a YAML alias refers to the mapping or list that holds it; write the values out")
        open_ids.add(id(node))
        children = [*node.keys(), *node.values()] if isinstance(node, dict) else node
        total = 1
        for child in children:
            total += size(child, depth + 1)
            if total > MAX_VALUES:
                raise SpecError(
                    f"{path}: more than {MAX_VALUES:,} values once its YAML aliases are expanded, the limit for a "
                    "point or study file; use fewer aliases"
                )
        open_ids.discard(id(node))
        sizes[id(node)] = total
        return total

    size(data, 0)


def load_mapping(path: str | Path) -> dict[str, Any]:
    """Parse a YAML file whose top level must be a mapping."""
    data = load_yaml(path)
    if not isinstance(data, dict):
        shown = "an empty file" if data is None else f"a {type(data).__name__}"
        raise SpecError(f"{path}: expected a mapping of fields at the top level, got {shown}")
    return data


def describe_validation_error(exc: ValidationError, source: str) -> str:
    """One line naming the first offending field (as a dotted path) and what is wrong with it.

    Unknown fields come first: a misspelt required field is both unknown and missing, and only the unknown one
    names what to fix."""
    errors = sorted(_merge_unions(exc.errors()), key=lambda e: e["type"] != "extra_forbidden")
    more = len(errors) - 1
    tail = f" (+{more} more)" if more else ""
    return f"{source}: field '{error_field(errors[0]) or '(top level)'}': {error_message(errors[0])}{tail}"


_UNION_MEMBERS = {"bool": "a boolean", "int": "a whole number", "float": "a number", "str": "a string"}


def _merge_unions(errors: list[ErrorDetails]) -> list[ErrorDetails]:
    """One error per field of a union type (a study choice is a boolean, a number or a string): pydantic gives
    one per member, at a location that ends in the member's type ('choices.0.bool'), which is no field."""
    out: list[ErrorDetails | tuple] = []
    members: dict[tuple, list[str]] = {}
    for err in errors:
        *loc, last = err["loc"] or ("",)
        if last not in _UNION_MEMBERS:
            out.append(err)
        elif tuple(loc) in members:
            members[tuple(loc)].append(_UNION_MEMBERS[str(last)])
        else:
            members[tuple(loc)] = [_UNION_MEMBERS[str(last)]]
            out.append((tuple(loc), err["input"]))
    return [
        item
        if not isinstance(item, tuple)
        else ErrorDetails(type="union", loc=item[0], msg=f"expected {_either(members[item[0]])}", input=item[1])
        for item in out
    ]


def _either(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def error_field(err: ErrorDetails) -> str:
    """The dotted path of a pydantic error's field."""
    return ".".join(str(part) for part in err["loc"])


_BOUNDS = {"less_than_equal": ("at most", "le"), "less_than": ("below", "lt")}
_FLOORS = {"greater_than_equal": ("at least", "ge"), "greater_than": ("above", "gt")}


def error_message(err: ErrorDetails) -> str:
    """What is wrong with the field, with the value given and, for a bound, the accepted range."""
    kind = err["type"]
    if kind == "extra_forbidden":
        return "unknown field; check its spelling against the documented fields"
    if kind == "missing":
        return "required field is missing"
    if kind == "model_type":  # pydantic says 'a valid dictionary or instance of ModelSpec'
        return f"expected a mapping of fields{_catalog_hint(err)}{_got(err)}"
    if kind in _BOUNDS or kind in _FLOORS:
        words, key = (_BOUNDS | _FLOORS)[kind]
        return f"must be {words} {err['ctx'][key]}{_got(err)}; see the README's Limits for the accepted range"
    return f"{err['msg'].removeprefix('Value error, ')}{_got(err)}"


def _got(err: ErrorDetails) -> str:
    got = err.get("input")
    return "" if isinstance(got, dict | list) else f" (got {_short(got)})"


def _catalog_hint(err: ErrorDetails) -> str:
    field = error_field(err)
    kind = {"model": "models", "system": "systems", "system.accelerator": "accelerators"}.get(field)
    return f" or the name of a catalog entry (dse/catalog/{kind})" if kind else ""


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}...({len(text)} characters)"
