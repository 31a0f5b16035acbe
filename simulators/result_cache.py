"""Results a cost model priced in this process, by point key and settings: an optimizer may propose a point
again, and a refinement re-prices points a screen already saw.

An entry serves only a workload equal to the one it priced (`contents`), so a workload built otherwise under the
same key, or edited since, is priced afresh. Every cost model plugin keeps its own, least recently used out first
when its entries' bytes (`_bytes`) pass RESULT_CACHE_BYTES (dse.lru).
"""

import sys
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from dse.calls import ShapeCalls
from dse.interfaces import ClassResult, SimResult
from dse.lru import MIB, ByteBoundedLru
from dse.workload import Call, DeferredPrograms, Program, TableTensors, Tensor, Workload

RESULT_CACHE_BYTES = 64 * MIB
"""About 500 configurations of GPT-3 175B on 1,024 GPUs at pp 16 (~130 KB each), five times issue 36's study."""
SNAPSHOT_BYTES_PER_CALL = 16
"""A snapshot's bytes per call it lists: tracemalloc measured 63,248 B for 4,140 calls (pp 8) and 126,136 B for
9,332 (pp 16) of benchmarks/vs_calculon.py's workloads, with the result's copy."""
CLASS_BYTES = 1024
"""A rank class's figures in a result (two small dicts and a dataclass); an estimate, not measured."""


class ResultCache:
    def __init__(self, budget_bytes: int = RESULT_CACHE_BYTES) -> None:
        self._entries: ByteBoundedLru[Hashable, tuple[tuple, SimResult]] = ByteBoundedLru(
            "results", budget_bytes, _bytes
        )

    def priced(self, key: Hashable, workload: Workload, price: Callable[[], SimResult]) -> SimResult:
        """The cached result of an equal workload under this key, else `price()`'s, kept; a copy either way."""
        snapshot = contents(workload)
        cached = self._entries.get(key)
        if cached is not None and _unedited(cached[0]) and cached[0] == snapshot:
            return _copy(cached[1])
        result = price()
        self._entries.put(key, (snapshot, _copy(result)))
        return result

    def clear(self) -> None:
        self._entries.clear()


def _bytes(entry: tuple[tuple, SimResult]) -> int:
    """An entry's estimated bytes: its snapshot's calls and its result's classes and timeline events, the events
    sized by the first one's shallow size."""
    snapshot, result = entry
    programs = snapshot[-1]
    listed = programs[-1] if programs and programs[0] == "steady" else programs
    calls = sum(len(program[2]) for program in listed)
    events = len(result.timeline) * sys.getsizeof(result.timeline[0]) if result.timeline else 0
    return SNAPSHOT_BYTES_PER_CALL * calls + CLASS_BYTES * len(result.classes) + events


def contents(workload: Workload) -> tuple:
    """What a workload is made of, with every list copied: their items are immutable, so this stays equal to the
    workload as it was. Programs generated from one skeleton share their calls and their table of activation
    tensors, so two such snapshots compare by identity, item by item, and by the tensors' sizes. Programs still
    to be built (DeferredPrograms) cannot have been edited, and the generator builds them alike for workloads
    whose steady forms are alike."""
    w = workload
    if isinstance(w.programs, DeferredPrograms) and not w.programs.built and w.steady is not None:
        programs: tuple = ("steady", w.steady.microbatches, w.steady.repeats, _programs(w.steady.programs))
    else:
        programs = _programs(w.programs)
    return (w.point_key, w.layout, w.tokens, w.model_flops, w.dtype, _classes(w.class_of), list(w.blocks), programs)


def _classes(class_of: np.ndarray) -> tuple:
    """The ranks' classes as bytes with their type and shape: equal exactly when the arrays are, and a thousand
    ranks' bytes are copied in a fraction of the time a list of them takes."""
    return class_of.dtype.str, class_of.shape, class_of.tobytes()


def _programs(programs: Sequence[Program]) -> tuple:
    return tuple((p.rank_class, p.name, _calls(p.calls), _tensors(p.tensors)) for p in programs)


def _calls(calls: list[Call]) -> list[Call]:
    """The calls as they are: an unedited ShapeCalls held itself (it notes any edit, which `_unedited` reads;
    copying a pp 16 step's 9,332 calls cost 40 us a point), any other list copied."""
    return calls if type(calls) is ShapeCalls and not calls.edited else list(calls)


def _unedited(snapshot: tuple) -> bool:
    """Whether the calls a snapshot holds by reference are as they were when it was taken."""
    programs = snapshot[-1]
    listed = programs[-1] if programs and programs[0] == "steady" else programs
    return not any(type(program[2]) is ShapeCalls and program[2].edited for program in listed)


def _tensors(tensors: Sequence[Tensor]) -> object:
    return tensors.snapshot() if isinstance(tensors, TableTensors) else list(tensors)


def _copy(result: SimResult) -> SimResult:
    """A copy the caller may change without changing the cached result."""
    classes = [
        ClassResult(
            c.name,
            c.ranks,
            c.end_s,
            c.compute_s,
            c.comm_s,
            c.exposed_comm_s,
            c.peak_memory_bytes,
            dict(c.memory_at_peak),
            dict(c.time_by_category),
        )
        for c in result.classes
    ]
    return SimResult(result.step_time_s, classes, list(result.timeline))
