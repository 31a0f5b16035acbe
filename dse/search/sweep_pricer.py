"""One sweep task priced: a structure's generated workload on a run of systems, as table rows (`SweepPricer`).

Decoding a point (pydantic validation of every section) costs a millisecond, which a million points cannot afford,
and most of it is shared: a structure's model, workload and parallel sections are the same on every system, and a
system is the same under every structure. So each structure is decoded once per world size (a derived value may use
`world`) and each system once per process (cached), the point of a pair is put together without validating again
(`DesignPoint.model_construct` of validated sections: no validator crosses sections), and only the feasibility
rules, which do cross them, run per point. The workload is generated once per task and priced on all its systems in
one `simulate_many` call where the cost model has one (`dse.interfaces.BatchCostModel`), else point by point.

Every point becomes a row, as a study's trial would: COMPLETE with its metrics, PRUNED with the reason it cannot run
(its decode failed or a feasibility rule refused it), or FAIL with the error its generation or pricing raised.
"""

import math
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import numpy as np
import pyarrow as pa

from dse import plugins
from dse.errors import InfeasibleError, SpecError
from dse.interfaces import BatchCostModel, SimResult
from dse.point.evaluate import evaluate_feasible, metrics_of
from dse.point.feasibility import infeasibility
from dse.search.decoding import decode_point, decode_system, fields_at, point_fields
from dse.search.executor import NODE, _describe
from dse.search.space import SUMMARY_FIELDS, StudySpec, is_system_field
from dse.search.study import POINT_KEY
from dse.search.sweep_grid import SweepGrid, Task
from dse.spec import DesignPoint, canonical, digest, key_sections
from dse.system import SystemSpec

COMPLETE, PRUNED, FAIL = "COMPLETE", "PRUNED", "FAIL"
LEADING_COLUMNS = ("number", "state", "reason", "feasible", POINT_KEY, "evaluation", NODE)
"""The first columns of every row, as the study's trials table has them."""


class _System:
    """A decoded system, its canonical text (for point keys) and its summary fields."""

    def __init__(self, system: SystemSpec, fields: dict[str, Any]) -> None:
        self.system = system
        self.text = canonical(system)
        self.fields = fields


class _Structure:
    """A decoded structure: a point of it (on some system of its world), its sections' texts and summary fields."""

    def __init__(self, point: DesignPoint, fields: dict[str, Any]) -> None:
        self.point = point
        self.texts = {name: canonical(getattr(point, name)) for name in key_sections(point) if name != "system"}
        """The texts of the key's sections but the system's (`DesignPoint.key`), which its points share."""
        self.fields = fields


class _Rows:
    """A task's rows, column by column."""

    def __init__(self) -> None:
        self.columns: dict[str, list[Any]] = {}
        self.count = 0

    def add(self, values: dict[str, Any]) -> None:
        for name, value in values.items():
            column = self.columns.get(name)
            if column is None:
                column = self.columns[name] = [None] * self.count
            column.append(value)
        self.count += 1
        for column in self.columns.values():
            if len(column) < self.count:
                column.append(None)


class SweepPricer:
    """Prices sweep tasks in one process (a Ray actor's, or the driver's with --inline), keeping its plugins and
    its decoded systems and structures across tasks."""

    def __init__(self, spec_data: dict[str, Any], source: str, node: str | None = None) -> None:
        self.spec = StudySpec.model_validate(spec_data)
        self.spec._source = source
        self.grid = SweepGrid(self.spec)
        self.node = node
        self.summary_paths = [*self.spec.derived, *SUMMARY_FIELDS]
        self._systems: dict[int, _System | str] = {}
        self._structures: dict[tuple[int, int], _Structure | str] = {}

    @cached_property
    def _plugins(self) -> tuple[Any, Any]:
        spec = self.spec
        return plugins.generator(spec.generator), plugins.cost_model(spec.cost_model, spec.cost_model_options)

    def price(self, task: Task) -> pa.Table:
        """The task's rows as a table."""
        rows = _Rows()
        for structure in task.structures:
            self._price_structure(rows, structure, task.first, task.stop)
        return self._table(rows)

    def _price_structure(self, rows: _Rows, structure: int, first: int, stop: int) -> None:
        """Rows of one structure on the systems `first` to `stop` - 1, priced world by world."""
        indices = np.arange(first, stop)
        numbers = self.grid.numbers(structure, indices)
        structure_params = self.grid.structure_params(structure)
        worlds: dict[int, list[tuple[int, _System]]] = {}
        first_of_world: dict[int, int] = {}
        for number, index in zip(numbers.tolist(), indices.tolist(), strict=True):
            system = self._system(index)
            if isinstance(system, str):
                rows.add(self._row(number, PRUNED, system))
            else:
                worlds.setdefault(system.system.npus, []).append((number, system))
                first_of_world.setdefault(system.system.npus, index)
        for world, members in worlds.items():
            decoded = self._structure(structure, structure_params, first_of_world[world])
            self._price_world(rows, decoded, members)

    def _system(self, index: int) -> _System | str:
        """The decoded system at an index of the system grid, or why it cannot be decoded."""
        cached = self._systems.get(index)
        if cached is None:
            params = self.grid.system_params(index)
            try:
                system = decode_system(self.spec, params)
            except SpecError as exc:
                cached = str(exc)
            else:
                paths = [path for path in self.summary_paths if is_system_field(path)]
                cached = _System(system, fields_at({"system": system.model_dump(mode="json")}, paths))
            self._systems[index] = cached
        return cached

    def _structure(self, structure: int, params: dict[str, Any], system_index: int) -> _Structure | str:
        """The decoded structure on the world of the system at `system_index` (decoded once per world), or why
        its points cannot be decoded."""
        system = self._systems[system_index]
        assert not isinstance(system, str)
        key = (structure, system.system.npus)
        cached = self._structures.get(key)
        if cached is None:
            try:
                point = decode_point(self.spec, {**params, **self.grid.system_params(system_index)}, system.system)
            except SpecError as exc:
                point = str(exc)
            if isinstance(point, str):
                cached = point
            else:
                paths = [path for path in self.summary_paths if not is_system_field(path)]
                cached = _Structure(point, point_fields(point, paths))
            self._structures[key] = cached
        return cached

    def _price_world(self, rows: _Rows, structure: _Structure | str, members: list[tuple[int, _System]]) -> None:
        """Rows of one structure on the systems of one world: pruned, failed, or priced together."""
        if isinstance(structure, str):
            for number, _ in members:
                rows.add(self._row(number, PRUNED, structure))
            return
        priced: list[tuple[int, _System, DesignPoint]] = []
        for number, system in members:
            point = _with_system(structure.point, system.system)
            reason = infeasibility(point)
            if reason:
                rows.add(self._row(number, PRUNED, reason))
            else:
                priced.append((number, system, point))
        if not priced:
            return
        generator, cost_model = self._plugins
        if structure.point.workload.mode == "serve":
            for number, system, point in priced:
                rows.add(self._served(number, structure, system, point))
            return
        try:
            workload = generator.generate(priced[0][2])
        except Exception as exc:
            for number, system, _ in priced:
                rows.add(self._row(number, FAIL, _describe(exc), self._key(structure, system), structure, system))
            return
        results = _simulate(cost_model, workload, [system.system for _, system, _ in priced])
        for (number, system, point), result in zip(priced, results, strict=True):
            key = self._key(structure, system)
            if isinstance(result, str):
                rows.add(self._row(number, FAIL, result, key, structure, system))
                continue
            rows.add(self._priced(number, key, structure, system, *metrics_of(point, workload, result)))

    def _served(self, number: int, structure: _Structure, system: _System, point: DesignPoint) -> dict[str, Any]:
        """A serving point's row: its steps are generated and priced as it is (`dse.serving`), from the process's
        priced steps of its layout and system, which the points differing only in their load share."""
        key = self._key(structure, system)
        generator, cost_model = self._plugins
        try:
            found = evaluate_feasible(point, generator, cost_model)
        except InfeasibleError as exc:
            return self._row(number, PRUNED, str(exc), key, structure, system)
        except Exception as exc:
            return self._row(number, FAIL, _describe(exc), key, structure, system)
        return self._priced(number, key, structure, system, found.metrics, found.violations)

    def _priced(
        self,
        number: int,
        key: str,
        structure: _Structure,
        system: _System,
        metrics: dict[str, Any],
        violations: dict[str, float],
    ) -> dict[str, Any]:
        """A priced point's row: COMPLETE with its metrics and feasibility, or FAIL if an objective is not finite."""
        values = [metrics.get(metric, math.nan) for metric in self.spec.metrics]
        bad = [m for m, v in zip(self.spec.metrics, values, strict=True) if not math.isfinite(v)]
        state, reason = COMPLETE, None
        if bad:
            state, reason = FAIL, f"objective metric {bad[0]} is {metrics.get(bad[0])}, not a finite number"
        row = self._row(number, state, reason, key, structure, system)
        if state == COMPLETE:
            row["feasible"] = all(violations.get(c.name, math.inf) <= 0 for c in self.spec.constraint_list)
        row.update({name: value if isinstance(value, bool) else float(value) for name, value in metrics.items()})
        return row

    def _key(self, structure: _Structure, system: _System) -> str:
        """The point key (`DesignPoint.key`) from the sections' texts, each made once."""
        return digest(dict(sorted({**structure.texts, "system": system.text}.items())))

    def _row(
        self,
        number: int,
        state: str,
        reason: str | None,
        key: str | None = None,
        structure: _Structure | None = None,
        system: _System | None = None,
    ) -> dict[str, Any]:
        """A row's identity, state and reason, and for a decoded point its key and summary fields."""
        row: dict[str, Any] = {"number": number, "state": state, "reason": reason, "feasible": None, POINT_KEY: key}
        row["evaluation"] = state != PRUNED
        row[NODE] = self.node if state != PRUNED else None
        if structure is not None and system is not None:
            row.update(structure.fields)
            row.update(system.fields)
        return row

    def _table(self, rows: _Rows) -> pa.Table:
        """The rows with the point's parameters as typed columns (from the grid, as the study's table has them)."""
        columns = rows.columns
        arrays = {name: pa.array(columns.pop(name, [None] * rows.count)) for name in LEADING_COLUMNS}
        arrays.update(self.grid.columns(np.asarray(arrays["number"].to_numpy(zero_copy_only=False), dtype=np.int64)))
        arrays.update({name: pa.array(values) for name, values in columns.items() if name not in arrays})
        return pa.table(arrays)


def _simulate(cost_model: Any, workload: Any, systems: Sequence[SystemSpec]) -> list[SimResult | str]:
    """Each system's result, or the one-line error pricing it raised: in one batch where the cost model has one
    (a batch that raises is priced again point by point, so that one bad system fails alone), else one by one."""
    if isinstance(cost_model, BatchCostModel):
        try:
            return [
                r if isinstance(r, SimResult) else _describe(r) for r in cost_model.simulate_many(workload, systems)
            ]
        except Exception:
            pass
    out: list[SimResult | str] = []
    for system in systems:
        try:
            out.append(cost_model.simulate(workload, system))
        except Exception as exc:
            out.append(_describe(exc))
    return out


def _with_system(point: DesignPoint, system: SystemSpec) -> DesignPoint:
    """The point on another system, its sections validated already (no DesignPoint validator crosses sections)."""
    return DesignPoint.model_construct(
        model=point.model, workload=point.workload, parallel=point.parallel, system=system, economics=point.economics
    )


def failed_table(grid: SweepGrid, task: Task, reason: str) -> pa.Table:
    """A task's rows, every one FAIL with the reason, for a task whose pricing as a whole went wrong."""
    numbers = grid.task_numbers(task)
    count = len(numbers)
    arrays = {
        "number": pa.array(numbers),
        "state": pa.array([FAIL] * count),
        "reason": pa.array([reason] * count),
        "feasible": pa.nulls(count, pa.bool_()),
        POINT_KEY: pa.nulls(count, pa.string()),
        "evaluation": pa.array([False] * count),
        NODE: pa.nulls(count, pa.string()),
        **grid.columns(numbers),
    }
    return pa.table(arrays)
