"""The core's structural rules, read from the source so that they cannot quietly regress.

1. Nothing under dse/ imports a plugin package (generators, simulators, objectives): the core finds plugins through
   entry points (dse.plugins) and talks to them through dse.interfaces. Every import counts: at module level, inside
   a function, under TYPE_CHECKING, and importlib.import_module / __import__ with a literal name. An import by a
   computed name can hide any of these, so each one must be listed here with what it imports.
2. The modules of dse/ import one another without a circle, function-level imports included: a circle hidden in a
   function is still a layer that knows the one above it (cli -> commands -> nightly -> cli was one).
3. The subpackages are layers (LAYERS), and a module imports only its own layer and those below it.

The graph is built with ast, without importing anything, so a broken module cannot hide an edge.
"""

import ast
from collections.abc import Iterator
from pathlib import Path

from conftest import ROOT

CORE = ROOT / "dse"
PLUGIN_PACKAGES = frozenset({"generators", "simulators", "objectives"})
DYNAMIC_IMPORT_CALLS = frozenset({"import_module", "__import__"})
COMPUTED_IMPORTS: dict[str, str] = {}
"""Core files that import a module by a computed name, and what that name is."""


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def core_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(CORE.rglob("*.py"))}


def imported_names(path: Path) -> Iterator[tuple[str, int]]:
    """Every module name a core file imports, with its line (see names_in)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    yield from names_in(ast.parse(path.read_text(), str(path)), package)


def names_in(tree: ast.Module, package: str) -> Iterator[tuple[str, int]]:
    """Every module name the tree imports anywhere in it: for `from a import b` both a and a.b (b may be a
    submodule), relative imports resolved against package, and the literal argument of import_module/__import__."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield base, node.lineno
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno
        elif _imports_dynamically(node) and isinstance(name := _first_argument(node), str):
            yield name, node.lineno


def computed_imports(tree: ast.Module) -> list[int]:
    """Lines of import_module/__import__ calls whose module name is not a literal string."""
    return [node.lineno for node in ast.walk(tree) if _imports_dynamically(node) and _first_argument(node) is None]


def _imports_dynamically(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in DYNAMIC_IMPORT_CALLS


def _first_argument(call: ast.Call) -> str | None:
    """The call's module name when it is a literal string, else None."""
    argument = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "name"), None)
    is_literal = isinstance(argument, ast.Constant) and isinstance(argument.value, str)
    return argument.value if is_literal else None


def import_graph() -> dict[str, set[str]]:
    """dse module -> the dse modules it imports (the package dse itself left out: every module sits in it)."""
    modules = core_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = {imported for imported, _ in imported_names(path) if imported in modules}
        graph[name] = targets - {name, "dse"}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan), each as a path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(_circle_through(sorted(component)[0], set(component), graph))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _circle_through(start: str, component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """The shortest path from start back to itself inside its component, e.g. [a, b, c, a]."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & component):
                if target == start:
                    return [*paths[node], start]
                if target not in paths:
                    paths[target] = [*paths[node], target]
                    following.append(target)
        frontier = following
    raise AssertionError(f"{start} is in a component it cannot return to")


def test_the_core_imports_no_plugin_package():
    offending = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in core_modules().values()
        for name, line in imported_names(path)
        if name.partition(".")[0] in PLUGIN_PACKAGES
    ]
    assert offending == [], "the core knows plugins only through dse.interfaces and entry points (dse.plugins)"


def test_the_core_imports_by_computed_name_only_where_listed():
    found = {
        str(path.relative_to(ROOT))
        for path in core_modules().values()
        if computed_imports(ast.parse(path.read_text(), str(path)))
    }
    assert found <= COMPUTED_IMPORTS.keys(), "list it in COMPUTED_IMPORTS with what it imports, or import it by name"


def test_the_core_has_no_import_circle():
    graph = import_graph()
    modules = {"dse.cli.main", "dse.cli.commands", "dse.results.nightly", "dse.search.study", "dse.spec", "dse.catalog"}
    assert modules <= graph.keys()
    assert "dse.results.nightly" in graph["dse.cli.commands"], "`from dse.results import nightly` is an edge"
    assert [" -> ".join(circle) for circle in cycles(graph)] == []


LAYERS = ("dse", "dse.point", "dse.search", "dse.results", "dse.cli")
"""The core's layers, lowest first: the domain model, IR and plugin contract (dse's own modules, what plugins
import); one design point; the study loop and its storage; results and reports; the commands."""


def layer(module: str) -> int:
    return max(rank for rank, package in enumerate(LAYERS) if module == package or module.startswith(package + "."))


def test_each_layer_imports_only_layers_below_it_or_itself():
    graph = import_graph()
    assert {layer(module) for module in graph} == set(range(len(LAYERS))), "every layer has modules"
    upward = [
        f"{module} -> {imported}"
        for module, imports in graph.items()
        for imported in imports
        if imported in graph and layer(imported) > layer(module)
    ]
    assert upward == []


def test_the_checks_see_what_they_must_refuse():
    """The rules' own tools catch plugins imported inside a function and by importlib, resolve relative imports,
    see imports by a computed name, and find a circle."""
    probe = ast.parse(
        "import importlib\n\ndef f(name):\n    from simulators.analytical import network\n"
        "    __import__('objectives.metrics')\n    importlib.import_module(name)\n"
        "    return importlib.import_module(name='generators.symbolic')\n"
    )
    names = {name for name, _ in names_in(probe, "dse")}
    assert {"simulators.analytical.network", "objectives.metrics", "generators.symbolic"} <= names
    assert computed_imports(probe) == [6]
    assert {name for name, _ in names_in(ast.parse("from . import study"), "dse")} >= {"dse.study"}
    assert {name for name, _ in names_in(ast.parse("from ..spec import GiB"), "dse.results")} >= {"dse.spec"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    ranks = {"dse.spec": 0, "dse.catalog": 0, "dse.point.points": 1, "dse.results.nightly": 3, "dse.cli": 4}
    assert {module: layer(module) for module in ranks} == ranks
