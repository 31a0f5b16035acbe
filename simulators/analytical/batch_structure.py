"""What a batch reads of a workload apart from any system's timing, built once and kept for the workloads priced last.

A sweep prices one workload on many systems, often over several calls (a grid cut into batches, a screen that
comes back for more): the reference schedule's tape (`tape.record`), the program that evaluates it
(`tape_program`), each rank class's busy intervals (`batch_busy.Spans`) and memory events (`memory.Liveness`)
depend on the workload and the network's shape only. Recording them is a third of a 1,000-system call on
Llama-3-70B, so they are kept, for a workload equal to the one they were built for (`result_cache.contents`, as the
result cache checks) under the same point key and network shape.
"""

from dataclasses import dataclass

import numpy as np

from dse.lru import MIB, ByteBoundedLru
from dse.system import SystemSpec
from dse.workload import Workload
from simulators.analytical.batch_busy import Spans
from simulators.analytical.memory import Liveness
from simulators.analytical.tape import Tape, record
from simulators.analytical.tape_program import TapeProgram
from simulators.result_cache import contents

KEPT_BYTES = 256 * MIB
"""What the structures kept may weigh, least recently used out first: as much as the four structures of Llama-3-70B's
whole step (65 MB each, measured with tracemalloc) the cache held before it was bounded in bytes."""
BYTES_PER_NODE = 380
"""A structure's bytes per node of its tape, the most measured: tracemalloc put `structure` at 287-378 B per node
over 14 of benchmarks/vs_calculon.py's configurations (39,352 to 848,500 nodes, 14 to 244 MB)."""


@dataclass(frozen=True, slots=True)
class Structure:
    tape: Tape
    program: TapeProgram
    spans: list[Spans]
    """Per rank class, in rows of the program's values."""
    liveness: list[Liveness]


_kept: ByteBoundedLru[tuple, tuple[tuple, Structure]] = ByteBoundedLru(
    "structures", KEPT_BYTES, lambda entry: BYTES_PER_NODE * len(entry[1].tape.kind)
)


def structure(workload: Workload, system: SystemSpec) -> Structure:
    """The structure of the workload's step on systems of this one's network shape."""
    calls = tuple(len(program.calls) for program in workload.programs)  # a steady form's shorter step, or the whole
    key = (workload.point_key, tuple(dim.npus for dim in system.network), calls)
    snapshot = contents(workload)
    found = _kept.get(key)
    if found is not None and found[0] == snapshot:
        return found[1]
    tape = record(workload, system)
    program = TapeProgram.of(tape, _read(tape))
    built = Structure(
        tape=tape,
        program=program,
        spans=[Spans.of(tape, recorded).rows(program.row_of) for recorded in tape.classes],
        liveness=[Liveness.of(p, workload.blocks) for p in workload.programs],
    )
    _kept.put(key, (snapshot, built))
    return built


def forget() -> None:
    """Drop every kept structure (a benchmark measuring the recording)."""
    _kept.clear()


def _read(tape: Tape) -> np.ndarray:
    """Every node the figures read."""
    read: list[int] = []
    for recorded in tape.classes:
        read += recorded.call_start + recorded.call_end
        read += [node for first, _, last in recorded.compute for node in (first, last)]
        read += [node for interval in recorded.comm for node in interval]
        read += [node for _, _, start, stop in recorded.transfers for node in (start, stop)]
    return np.array(read, dtype=np.intp)
