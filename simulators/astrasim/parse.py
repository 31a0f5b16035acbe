"""Reading ASTRA-sim's log: each rank's finish, exposed communication and busy times, or why the run failed.

ASTRA-sim exits 0 even when ranks deadlock or its roofline divides 0 by 0, so success is judged only by the log:
every rank must print `sys[i] finished, N cycles, exposed communication M cycles` (ticks are ns), then its
statistics (`GPU time`, `Comm time`, `Total compute-communication overlap`). A run in which every rank printed
all of that is a success even if the binary then dies: this build corrupts its heap while tearing down some
larger runs (Llama-3-8B TP2 PP2 DP2: every rank's statistics, then `malloc_consolidate(): unaligned fastbin chunk
detected` and SIGABRT), after the figures are out.
"""

import re
from dataclasses import dataclass

from simulators.astrasim.runner import AstraSimError

NS = 1e-9
_FINISHED = re.compile(r"sys\[(\d+)\] finished, (\d+) cycles, exposed communication (\d+) cycles")
_STATISTIC = re.compile(r"sys\[(\d+)\], (GPU time|Comm time|Total compute-communication overlap): (\d+)")
_ERROR = re.compile(r"\[(error|critical)\]|error|exception|abort|terminate|segmentation fault|what\(\)", re.I)
_STATISTICS = {"GPU time": "compute_s", "Comm time": "comm_s", "Total compute-communication overlap": "overlap_s"}
QUOTED_RANKS = 8
"""How many unfinished ranks a message names before it says how many more there are."""


@dataclass
class RankStats:
    """One rank's figures, in seconds."""

    finish_s: float
    exposed_comm_s: float
    compute_s: float = 0.0
    comm_s: float = 0.0
    overlap_s: float = 0.0


def parse_log(text: str, ranks: int, exit_code: int) -> list[RankStats]:
    """Every rank's figures in rank order; AstraSimError quoting the first error line and the ranks that never
    finished when the run did not succeed on every rank."""
    stats: dict[int, RankStats] = {}
    for match in _FINISHED.finditer(text):
        stats[int(match[1])] = RankStats(int(match[2]) * NS, int(match[3]) * NS)
    reported: dict[int, int] = {}
    for match in _STATISTIC.finditer(text):
        if (rank := int(match[1])) in stats:
            setattr(stats[rank], _STATISTICS[match[2]], int(match[3]) * NS)
            reported[rank] = reported.get(rank, 0) + 1
    missing = [rank for rank in range(ranks) if rank not in stats]
    complete = all(reported.get(rank, 0) == len(_STATISTICS) for rank in range(ranks))
    if not missing and (exit_code == 0 or complete):
        return [stats[rank] for rank in range(ranks)]
    error = _first_error(text)
    parts = [f"ASTRA-sim exited with code {exit_code}" if exit_code != 0 else "ASTRA-sim exited 0"]
    if missing:
        named = ", ".join(str(rank) for rank in missing[:QUOTED_RANKS])
        more = f" and {len(missing) - QUOTED_RANKS} more" if len(missing) > QUOTED_RANKS else ""
        parts.append(f"{len(missing)} of {ranks} ranks never finished ({named}{more})")
    parts.append(f"first error line: {error!r}" if error else f"last output line: {_last_line(text)!r}")
    raise AstraSimError("; ".join(parts))


def _first_error(text: str) -> str | None:
    """The first line that reads as an error; an uncaught C++ exception's own message (`what():`) before the
    'terminate called' line that announces it."""
    lines = text.splitlines()
    found = next((line for line in lines if "what():" in line), None)
    found = found or next((line for line in lines if _ERROR.search(line)), None)
    return found.strip()[:300] if found else None


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else "(no output)"
