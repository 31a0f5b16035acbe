"""Skipping the steady state of a pipeline schedule: once the whole schedule repeats its last period shifted in
time, the next periods are that period shifted again.

From some call on, a program's calls repeat: call c has the block of call c - P, reads the calls that c - P read
moved by P, and a transfer's tag is the tag of the transfer P calls before plus a fixed step (the next
micro-batch). Where every program repeats, the schedule is a recurrence: if the state of the drive (where each
program stands, which transfers wait and since when, when each stream frees up) equals its state one period
earlier shifted by T, and the earlier times that later calls still read repeat too, then every later period is
the last one shifted by T again, as long as every program keeps repeating. The fast scheduler checks this each
time the first program is about to advance, and then moves every program m periods ahead: the skipped calls get
the last period's times shifted by k T, and the state moves by m T.
"""

from bisect import bisect_left
from collections import Counter, deque
from dataclasses import dataclass
from math import inf

TOLERANCE_S = 1e-12
"""Times that differ by less are the same (floating-point noise of adding the same shifts)."""
MAX_PERIODS = 16
"""How many periods back a repeating state is looked for."""


@dataclass(slots=True, frozen=True)
class Period:
    """Calls c in [first, end) repeat call c - length; a transfer's tag is that call's tag plus tag_step."""

    length: int
    tag_step: int
    first: int
    end: int


def find_period(calls: "list | tuple", segments: list, p2p: frozenset[int]) -> Period | None:
    """The longest run of calls that repeat the calls one period before; the period is the commonest distance
    between two segments of the same structure in a row. None when nothing repeats at least three periods."""
    last: dict[int, int] = {}
    gaps: Counter[int] = Counter()
    for c, segment in enumerate(segments):
        if segment is not None:
            if segment.kind in last:
                gaps[c - last[segment.kind]] += 1
            last[segment.kind] = c
    if not gaps:
        return None
    length = gaps.most_common(1)[0][0]
    best: Period | None = None
    first, step = -1, None
    for c in range(length, len(calls) + 1):
        ok = c < len(calls)
        if ok:
            a, b = calls[c], calls[c - length]
            ok = a.block == b.block and len(a.inputs) == len(b.inputs)
            ok = ok and all(x - y == length for x, y in zip(a.inputs, b.inputs, strict=True))
            if ok and a.block in p2p:
                step = a.tag - b.tag if step is None else step
                ok = a.tag - b.tag == step
            elif ok:
                ok = a.tag == b.tag
        if ok and first < 0:
            first = c
        elif not ok and first >= 0:
            if step is not None and (best is None or c - first > best.end - best.first):
                best = Period(length, step, first, c)
            first, step = -1, None
    if best is None or best.end - best.first < 3 * length:
        return None
    return best


@dataclass(slots=True)
class _Snapshot:
    calls: list[int]
    queue: list[int]
    streams: list[list[float]]
    waiting: dict[tuple, list[tuple[int, int, int, float]]]
    """Per mailbox key, its parked transfers: (program, call, op, ready)."""
    applied: list[int]
    """How many segments each program had applied."""


class Recurrence:
    """Watches a fast scheduler's drive for a repeating state and jumps it ahead (see the module docstring)."""

    def __init__(self, scheduler, runs: list, periods: list[Period], transfers: list[list[int]]) -> None:
        self._scheduler = scheduler
        self._runs = runs
        self._periods = periods
        self._transfers = transfers
        """Per program, the calls that are p2p transfers, in order."""
        self._snapshots: dict[int, _Snapshot] = {}
        self.jumps = 0

    def observe(self) -> None:
        """Called as the first program is about to advance: snapshot, compare with one period before, jump."""
        runs, periods = self._runs, self._periods
        if any(run.op or not p.first + p.length <= run.call < p.end for run, p in zip(runs, periods, strict=True)):
            return
        position = runs[0].call
        if position in self._snapshots:
            return
        new = self._snapshot()
        self._snapshots[position] = new
        # The order the drive visits programs in may cycle over several periods: look that far back.
        for k in range(1, MAX_PERIODS + 1):
            old = self._snapshots.get(position - k * periods[0].length)
            if old is not None and (shift := self._shift(old, new, k)) is not None:
                self._jump(old, new, k, *shift)
                return

    def _snapshot(self) -> _Snapshot:
        scheduler = self._scheduler
        waiting = {
            key: [(p.run.index, p.call, p.op, p.ready) for p in queue]
            for key, queue in scheduler._mailbox.items()
            if queue
        }
        return _Snapshot(
            [run.call for run in self._runs],
            [run.index for run in scheduler._runnable],
            [list(run.stream_end) for run in self._runs],
            waiting,
            [len(a) for a in scheduler._applied],
        )

    def _shift(self, old: _Snapshot, new: _Snapshot, k: int) -> tuple[float, list[list[bool]]] | None:
        """How far the state moved in k periods and, per program and stream, whether the stream moved that far;
        None unless the state repeats."""
        periods = self._periods
        if new.queue != old.queue:
            return None
        if any(n - o != k * p.length for n, o, p in zip(new.calls, old.calls, periods, strict=True)):
            return None
        compute = self._scheduler._compute_stream
        shift = new.streams[0][compute] - old.streams[0][compute]
        if not 0.0 < shift < inf:
            return None
        moved = []
        for now, before in zip(new.streams, old.streams, strict=True):
            flags = []
            for a, b in zip(now, before, strict=True):
                if a == b:
                    flags.append(False)
                elif abs(a - b - shift) <= TOLERANCE_S:
                    flags.append(True)
                else:
                    return None
            moved.append(flags)
        if not self._waiting_repeats(old, new, k, shift):
            return None
        for index, run in enumerate(self._runs):
            if not self._history_repeats(index, run, old, new, k * self._periods[index].length, shift):
                return None
        return shift, moved

    def _waiting_repeats(self, old: _Snapshot, new: _Snapshot, k: int, shift: float) -> bool:
        step = k * self._periods[0].tag_step
        if len(new.waiting) != len(old.waiting) or any(p.tag_step != self._periods[0].tag_step for p in self._periods):
            return False
        for (link, tag), parked in old.waiting.items():
            now = new.waiting.get((link, tag + step))
            if now is None or len(now) != len(parked):
                return False
            for (i, c, op, ready), (j, d, op2, ready2) in zip(parked, now, strict=True):
                length = k * self._periods[i].length
                if i != j or op != op2 or d - c != length or abs(ready2 - ready - shift) > TOLERANCE_S:
                    return False
                if not new.calls[i] - length <= d < new.calls[i] or self._runs[i].out_end[c] == inf:
                    return False  # only transfers of the last period may wait, the one before them done (_jump)
        return True

    def _history_repeats(self, index: int, run, old: _Snapshot, new: _Snapshot, length: int, shift: float) -> bool:
        """The last `length` calls' segments and transfers, and the earlier outputs later calls read, repeat the
        `length` calls before, shifted."""
        applied = self._scheduler._applied[index]
        count = new.applied[index] - old.applied[index]
        if count <= 0 or old.applied[index] < count:
            return False
        for j in range(old.applied[index], new.applied[index]):
            t0, outcome, first = applied[j]
            base = applied[j - count]
            if base[1] is not outcome or base[2] != first - length or abs(t0 - base[0] - shift) > TOLERANCE_S:
                return False
        out_end, call_start, call_end = run.out_end, run.call_start, run.call_end
        start, end = new.calls[index] - length, new.calls[index]
        for c in self._transfers_in(index, start, end):
            if out_end[c] == inf:
                continue  # waiting: compared with the mailbox
            b = c - length
            for values in (out_end, call_start, call_end):
                if abs(values[c] - values[b] - shift) > TOLERANCE_S:
                    return False
        calls = run.program.calls
        # Later periods read what this one read, moved by whole periods: those reads that land before this period
        # must repeat too (this period's own times were compared above).
        for c in range(start, end):
            for j in calls[c].inputs:
                while j + length < start:
                    if abs(out_end[j + length] - out_end[j] - shift) > TOLERANCE_S:
                        return False
                    j += length
        return True

    def _transfers_in(self, index: int, start: int, end: int) -> list[int]:
        transfers = self._transfers[index]
        return transfers[bisect_left(transfers, start) : bisect_left(transfers, end)]

    def _jump(self, old: _Snapshot, new: _Snapshot, k: int, shift: float, moved: list[list[bool]]) -> None:
        """Move every program m times k periods ahead, filling the calls it skips."""
        scheduler = self._scheduler
        m = min((p.end - c) // (k * p.length) for p, c in zip(self._periods, new.calls, strict=True))
        if m < 1:
            return
        waiting = {(i, c) for parked in new.waiting.values() for i, c, _, _ in parked}
        for index, run in enumerate(self._runs):
            length = k * self._periods[index].length
            start, end = new.calls[index] - length, new.calls[index]
            applied = scheduler._applied[index]
            segments = scheduler._layouts[index].segments
            out_end = run.out_end
            for t0, outcome, first in applied[len(applied) - (new.applied[index] - old.applied[index]) :]:
                last = segments[first].end
                for n in range(1, m + 1):
                    applied.append((t0 + n * shift, outcome, first + n * length))
                    out_end[first + n * length : last + n * length] = [v + n * shift for v in out_end[first:last]]
            for c in self._transfers_in(index, start, end):
                if (index, c) in waiting:
                    self._fill(run, c - length, c, 1, shift)  # its own time is the one before it, shifted
                    for n in range(1, m):
                        self._fill(run, c - length, c + n * length, n + 1, shift)
                    out_end[c + m * length] = inf
                else:
                    for n in range(1, m + 1):
                        self._fill(run, c, c + n * length, n, shift)
            stream_end = run.stream_end
            for x, flag in enumerate(moved[index]):
                if flag:
                    stream_end[x] += m * shift
            run.call += m * length
        mailbox = {}
        step = k * self._periods[0].tag_step
        for (link, tag), queue in scheduler._mailbox.items():
            if queue:
                for parked in queue:
                    parked.call += m * k * self._periods[parked.run.index].length
                    parked.ready += m * shift
                mailbox[(link, tag + m * step)] = deque(queue)
        scheduler._mailbox = mailbox
        self._snapshots.clear()
        self.jumps += 1

    @staticmethod
    def _fill(run, base: int, target: int, periods: int, shift: float) -> None:
        """A transfer's times from the one `periods` periods before it."""
        offset = periods * shift
        start, end = run.call_start[base] + offset, run.call_end[base] + offset
        run.call_start[target], run.call_end[target] = start, end
        run.out_end[target] = run.out_end[base] + offset
        run.comm_starts.append(start)
        run.comm_ends.append(end)
        category = run.plans[target].ops[0][7]
        run.category_time[category] += end - start
