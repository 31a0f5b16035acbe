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
from simulators.analytical.tape import ClassTape, Tape, record
from simulators.analytical.tape_program import TapeProgram
from simulators.result_cache import contents

KEPT_BYTES = 96 * MIB
"""What the structures kept may weigh, least recently used out first: about 1.1 million nodes, more than the 256 MiB
this cache had when a structure held Python lists (380 B per node): the steady and longer forms of
benchmarks/vs_calculon.py's GPT-3 configurations together (up to 560k nodes), or the largest tape measured then
(848k)."""
BYTES_PER_NODE = 90
"""A structure's bytes per node of its tape, the most measured: tracemalloc put `structure` at 76 to 89 B per node
on GPT-3 175B's steady and longer forms (89k to 406k nodes): arrays of node ids, int32, and little else (the busy
intervals' calls, 8 to 10 of those bytes)."""


@dataclass(frozen=True, slots=True)
class Reads:
    """The rows of the program's values one rank class's figures read (`TapeProgram.row_of` of its nodes)."""

    call_start: np.ndarray
    call_end: np.ndarray
    transfer_start: np.ndarray
    transfer_end: np.ndarray

    @classmethod
    def of(cls, recorded: ClassTape, row_of: np.ndarray) -> "Reads":
        transfers = recorded.transfers
        return cls(row_of[recorded.call_start], row_of[recorded.call_end], row_of[transfers[2]], row_of[transfers[3]])


@dataclass(frozen=True, slots=True)
class Structure:
    tape: Tape
    program: TapeProgram
    spans: list[Spans]
    """Per rank class, in rows of the program's values."""
    reads: list[Reads]
    """Per rank class."""
    liveness: list[Liveness]


_kept: ByteBoundedLru[tuple, tuple[tuple, Structure]] = ByteBoundedLru(
    "structures", KEPT_BYTES, lambda entry: BYTES_PER_NODE * entry[1].tape.size
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
        reads=[Reads.of(recorded, program.row_of) for recorded in tape.classes],
        liveness=[Liveness.of(p, workload.blocks) for p in workload.programs],
    )
    _kept.put(key, (snapshot, built))
    return built


def forget() -> None:
    """Drop every kept structure (a benchmark measuring the recording)."""
    _kept.clear()


def _read(tape: Tape) -> np.ndarray:
    """Every node the figures read."""
    parts = []
    for recorded in tape.classes:
        parts += [recorded.call_start, recorded.call_end, recorded.compute[[0, 2]].ravel(), recorded.comm.ravel()]
        parts.append(recorded.transfers[2:].ravel())
    return np.concatenate(parts).astype(np.intp) if parts else np.zeros(0, dtype=np.intp)
