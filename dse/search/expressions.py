"""Derived values of a study: arithmetic over parameter names and `world`, parsed once and walked, never eval'd.

An expression is bounded before it is parsed (MAX_EXPRESSION_CHARS) and its tree before it is walked
(MAX_EXPRESSION_DEPTH): Python's own parser and any recursive walk run out of memory or stack on 20,000 nested
minus signs long before they would say so politely.
"""

import ast
import operator
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dse.limits import MAX_EXPRESSION_CHARS, MAX_EXPRESSION_DEPTH

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_COMPARE: dict[type, Callable[[Any, Any], bool]] = {ast.Eq: operator.eq, ast.NotEq: operator.ne}
_ALLOWED = (
    "numbers, parameter names, world, + - * / // % and parentheses, and name == 'value' (1 if so, else 0: "
    "(workload.serving.kind == 'disaggregated') * workload.serving.decode.dp)"
)


@dataclass(frozen=True)
class Expression:
    """Arithmetic over dotted names, checked node by node when parsed."""

    text: str
    tree: ast.expr
    names: frozenset[str]
    numeric: frozenset[str]
    """The names used as numbers (in arithmetic), not only compared with a constant."""

    def evaluate(self, env: Mapping[str, float]) -> float | str:
        """The value, or why there is none (division by zero, a result too large for a float) as a string."""
        try:
            return _walk(self.tree, env)
        except ZeroDivisionError:
            return "division by zero"
        except OverflowError:
            return "a result too large for a float"


_INDEX = "_index_"
"""Stands in for a list index in a dotted name: `system.network.0.bandwidth_GBps` is no Python expression, so each
`.0` is read as `._index_0` and turned back by `_dotted`."""
_INDEXED = re.compile(r"(?<=[A-Za-z_])(?:\.\w*)*\.\d+\b")


def _read_indices(text: str) -> str:
    """`400 - system.network.0.bandwidth_GBps` as Python can parse it; numbers (`1.5`) are left alone, since only a
    dot after a name's letter starts a dotted name."""
    return _INDEXED.sub(lambda match: re.sub(r"\.(\d+)\b", rf".{_INDEX}\1", match.group()), text)


def parse_expression(text: str) -> Expression:
    """Parse `world / (parallel.tp * parallel.pp)` or `400 - system.network.0.bandwidth_GBps`; anything beyond
    arithmetic raises ValueError saying so."""
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"{len(text)} characters is over the limit of {MAX_EXPRESSION_CHARS}; shorten it")
    try:
        tree = ast.parse(_read_indices(text), mode="eval").body
    except SyntaxError as exc:
        raise ValueError(f"cannot parse {text!r} ({exc.msg}); use {_ALLOWED}") from None
    except (MemoryError, RecursionError):
        raise ValueError(f"nested too deeply to parse; use at most {MAX_EXPRESSION_DEPTH} levels") from None
    names: set[str] = set()
    compared: set[str] = set()
    _check(tree, names, compared, 0)
    return Expression(text, tree, frozenset(names | compared), frozenset(names))


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr.removeprefix(_INDEX)}"
    return None


def _check(node: ast.expr, names: set[str], compared: set[str], depth: int) -> None:
    if depth > MAX_EXPRESSION_DEPTH:
        raise ValueError(f"nested more than {MAX_EXPRESSION_DEPTH} levels deep, the limit; simplify it")
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        _check(node.left, names, compared, depth + 1)
        _check(node.right, names, compared, depth + 1)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        _check(node.operand, names, compared, depth + 1)
    elif isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE:
        # a parameter's value against a constant (a categorical one's name): what a derived value of one kind of
        # point only (a disaggregated deployment's decode pool) is multiplied by
        left, right = node.left, node.comparators[0]
        if _dotted(left) is None or not isinstance(right, ast.Constant) or isinstance(right.value, bool):
            raise ValueError(f"'{ast.unparse(node)}' is not allowed; compare a parameter name with a constant")
        compared.add(_dotted(left))  # type: ignore[arg-type]
    elif isinstance(node, ast.Constant):
        if not is_number(node.value):
            raise ValueError(f"{node.value!r} is not a number; use {_ALLOWED}")
        if not abs(node.value) <= sys.float_info.max:  # an int is compared exactly: math.isfinite would overflow
            raise ValueError("a number in it is too large for a float; use a smaller one")
    elif isinstance(node, ast.Name | ast.Attribute) and (name := _dotted(node)) is not None:
        names.add(name)
    else:
        raise ValueError(f"'{ast.unparse(node)}' is not allowed; use {_ALLOWED}")


def _walk(node: ast.expr, env: Mapping[str, float]) -> float:
    if isinstance(node, ast.BinOp):
        return _BINARY[type(node.op)](_walk(node.left, env), _walk(node.right, env))
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_walk(node.operand, env))
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Compare):
        same = _COMPARE[type(node.ops[0])](env[_dotted(node.left)], node.comparators[0].value)  # type: ignore[index, attr-defined]
        return 1 if same else 0
    return env[_dotted(node)]  # type: ignore[index]
