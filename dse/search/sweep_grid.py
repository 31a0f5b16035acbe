"""The grid of a sweep: every point of a study's space, numbered, split into structures and systems, cut into tasks.

A point's number is its position in the grid as itertools.product enumerates the space's choices in file order (the
first parameter varies slowest), so a row of the sweep's table says which point it is whatever order the tasks
finish in, and a resumed sweep knows which points it has. The parameters split in two: the system's fields (HBM
size, FLOP/s, link bandwidths: `space.is_system_field`) and the rest, the point's structure (model, workload,
parallel layout), which alone decides the generated workload. A task is a run of structures, each on a run of
systems priced with one generated workload (`sweep_pricer`); a feasibility-only system field varies fastest among the
systems, so that the points it resolves from one timing sit in the same task. Structures are grouped when their
systems are few: a task per structure of a serving study's four systems was 6,656 tasks whose Ray calls and Arrow
tables cost the driver more than a fifth of the sweep.
"""

from dataclasses import dataclass
from math import prod

import numpy as np
import pyarrow as pa

from dse.search.space import StudySpec, Value, is_system_field

TASK_SYSTEMS = 16_384
"""Systems per task at most: a task of one structure on this many systems is seconds of pricing (hundreds of
points per CPU-second), short enough to share out and to lose to an interrupt, long enough that a task's fixed cost
(the workload generated, the batch's schedule recorded) stays small."""
TASK_POINTS = 256
"""Points per task at least where a structure has fewer systems: its structures are grouped up to this many
points (a second or two of serving points, tenths of one of training points), so that a task's Ray call and result
table are small beside its pricing, and still hundreds of tasks share out a large grid."""


@dataclass(frozen=True)
class Task:
    """The structures in `structures`, each priced on the systems `first` to `stop` - 1 (indices into the system
    grid)."""

    id: int
    structures: range
    first: int
    stop: int


class SweepGrid:
    """The grid of a study with `sweep: true` (load_study has checked that every parameter has choices)."""

    def __init__(self, spec: StudySpec) -> None:
        self.names = list(spec.space)
        self.choices: dict[str, list[Value]] = {name: list(spec.space[name].choices or ()) for name in self.names}
        self.structure_names = [name for name in self.names if not is_system_field(name)]
        system = [name for name in self.names if is_system_field(name)]
        last = [name for name in system if spec.space[name].feasibility_only]
        self.system_names = [name for name in system if name not in last] + last
        sizes = [len(self.choices[name]) for name in self.names]
        self.size = prod(sizes)
        self.strides = {name: prod(sizes[index + 1 :]) for index, name in enumerate(self.names)}
        self.structures = prod(len(self.choices[name]) for name in self.structure_names)
        self.systems = prod(len(self.choices[name]) for name in self.system_names)

    def _digits(self, index: int, names: list[str]) -> dict[str, int]:
        """The choice index of each of `names` at position `index` of their own product (the first slowest)."""
        out: dict[str, int] = {}
        for name in reversed(names):
            index, out[name] = divmod(index, len(self.choices[name]))
        return out

    def structure_params(self, structure: int) -> dict[str, Value]:
        digits = self._digits(structure, self.structure_names)
        return {name: self.choices[name][digits[name]] for name in self.names if name in digits}

    def system_params(self, system: int) -> dict[str, Value]:
        digits = self._digits(system, self.system_names)
        return {name: self.choices[name][digits[name]] for name in self.names if name in digits}

    def params_of(self, number: int) -> dict[str, Value]:
        """The parameters of the point with this grid number, in the space's order, as a trial's would be."""
        return {name: self.choices[name][number // self.strides[name] % len(self.choices[name])] for name in self.names}

    def numbers(self, structure: int, systems: np.ndarray) -> np.ndarray:
        """The grid numbers of a structure's points on the given systems."""
        base = sum(digit * self.strides[name] for name, digit in self._digits(structure, self.structure_names).items())
        offsets = np.zeros(len(systems), dtype=np.int64)
        rest = np.asarray(systems, dtype=np.int64)
        for name in reversed(self.system_names):
            rest, digit = np.divmod(rest, len(self.choices[name]))
            offsets += digit * self.strides[name]
        return base + offsets

    def tasks(self) -> list[Task]:
        """Every structure on every system: TASK_SYSTEMS systems at most per task, and structures grouped up to
        TASK_POINTS points where they have fewer systems."""
        out: list[Task] = []
        group = max(1, TASK_POINTS // self.systems)
        for start in range(0, self.structures, group):
            structures = range(start, min(start + group, self.structures))
            for first in range(0, self.systems, TASK_SYSTEMS):
                out.append(Task(len(out), structures, first, min(first + TASK_SYSTEMS, self.systems)))
        return out

    def task_numbers(self, task: Task) -> np.ndarray:
        """The grid numbers of a task's points, structure by structure."""
        systems = np.arange(task.first, task.stop)
        return np.concatenate([self.numbers(structure, systems) for structure in task.structures])

    def columns(self, numbers: np.ndarray) -> dict[str, pa.Array]:
        """The parameters of the points with these grid numbers, a typed column per parameter: the choices' own
        type, or strings when they mix types (as the study's trials table has them)."""
        out = {}
        for name in self.names:
            digits = (numbers // self.strides[name]) % len(self.choices[name])
            out[name] = _choices_array(self.choices[name]).take(pa.array(digits))
        return out


def _choices_array(choices: list[Value]) -> pa.Array:
    try:
        return pa.array(choices)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.array([str(choice) for choice in choices])
