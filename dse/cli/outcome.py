"""How a `dse` command ends: its exit codes, what a run whose trials failed says, and what a bug prints.

README "Exit codes" lists them: 0 done; 1 `dse nightly` found a figure that moved; 2 bad input or an environment
the command cannot work in (one `error:` line); 3 a run or sweep in which no trial completed and some failed
(every evaluation failed: the reasons, counted); 70 a bug in dse (one line naming the file that holds the
traceback); 130 interrupted; 141 stdout closed early. A run in which some trials failed and others completed ends
as usual, exit 0, with the failures counted by reason on stderr: a search space may hold points a cost model
cannot price, and the rest is a result.
"""

import datetime
import errno
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the frames come from the commands that read them: `dse --help` does not import pandas
    import pandas as pd

EXIT_OK = 0
EXIT_CHANGED = 1
"""`dse nightly`: a tracked figure moved beyond its threshold."""
EXIT_USER_ERROR = 2
EXIT_ALL_FAILED = 3
EXIT_INTERNAL_ERROR = 70
"""sysexits.h's EX_SOFTWARE: distinct from every code above, and from Python's own 1 for an uncaught exception."""
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141
"""stdout closed before dse finished writing (piped into `head`): what a shell reports for a SIGPIPE death."""
RESUME_HINT = "interrupted; run the same command again to resume the study (finished trials are kept)"
REASONS_SHOWN = 5
REASON_CHARS = 300

ENVIRONMENT_ERRNOS = {errno.ENOSPC: "free some space", errno.EDQUOT: "free some space (disk quota)"}
ENVIRONMENT_ERRNOS |= {errno.EROFS: "give a writable place", errno.EMFILE: "raise the open-file limit (ulimit -n)"}
"""OSErrors without a file name that are still the machine's state, not a bug: the fix for each."""
FIXES = {
    errno.ENOENT: "check the path",
    errno.EACCES: "check its permissions",
    errno.EPERM: "check its permissions",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.EISDIR: "give a file, not a folder",
    errno.ENAMETOOLONG: "use a shorter name",
    errno.EEXIST: "remove it or give another path",
}


def failures(frame: "pd.DataFrame") -> tuple[int, list[tuple[int, str]]]:
    """The failed trials (rows) of a study or sweep table, and their reasons' first lines by count, most first."""
    if frame.empty:
        return 0, []
    failed = frame.loc[frame["state"] == "FAIL", "reason"]
    reasons = failed.fillna("no reason recorded").astype(str).map(lambda r: (r.strip().splitlines() or [""])[0])
    counts = reasons.map(lambda r: r[:REASON_CHARS]).value_counts()
    return len(failed), [(int(count), str(reason)) for reason, count in counts.items()]


def report_failures(frame: "pd.DataFrame", what: str = "trials") -> int:
    """Print what failed to stderr, by reason; EXIT_ALL_FAILED when none of the table's rows completed (every
    evaluation failed; the others, if any, were pruned before one), else EXIT_OK."""
    failed, reasons = failures(frame)
    if not failed:
        return EXIT_OK
    none_completed = not (frame["state"] == "COMPLETE").any()
    if none_completed:
        pruned = int((frame["state"] == "PRUNED").sum())
        others = f", and the other {pruned:,} were pruned before evaluation" if pruned else ""
        head = f"error: no result: every one of the {failed:,} {what} evaluated failed{others}; by reason:"
    else:
        head = f"warning: {failed:,} of {len(frame):,} {what} failed; by reason:"
    lines = [head, *(f"  {count:6,d}  {reason}" for count, reason in reasons[:REASONS_SHOWN])]
    if len(reasons) > REASONS_SHOWN:
        lines.append(f"  and {len(reasons) - REASONS_SHOWN} other reasons (column 'reason' of the trials table)")
    print("\n".join(lines), file=sys.stderr)
    return EXIT_ALL_FAILED if none_completed else EXIT_OK


def environment_error(exc: OSError) -> str | None:
    """The one line for an OSError that is the user's files or machine, not a bug (None for any other)."""
    reason = exc.strerror or str(exc)
    if exc.filename is not None:
        fix = FIXES.get(exc.errno or 0) or ENVIRONMENT_ERRNOS.get(exc.errno or 0) or "check the path and the disk"
        target = f"{exc.filename} -> {exc.filename2}" if exc.filename2 is not None else str(exc.filename)
        return f"error: {target}: {reason}; {fix}"
    if exc.errno in ENVIRONMENT_ERRNOS:
        return f"error: {reason}; {ENVIRONMENT_ERRNOS[exc.errno]}"
    return None


def internal_error(exc: BaseException, command: str) -> str:
    """Write the traceback of a bug to a file of its own and return the line that names it."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    text = "".join(traceback.format_exception(exc))
    first = f"{type(exc).__name__}: {exc}".splitlines()[0][:REASON_CHARS]
    try:
        handle, name = tempfile.mkstemp(prefix=f"dse-{command}-{stamp}-", suffix=".traceback.txt")
        with os.fdopen(handle, "w") as file:
            file.write(f"dse {command}: {' '.join(sys.argv[1:])}\n{text}")
    except OSError:  # no temporary folder either: the traceback goes where the line goes
        return f"internal error in dse {command} ({first}), a bug in dse, not your input:\n{text}"
    where = Path(name)
    return (
        f"internal error in dse {command} ({first}), a bug in dse, not your input; the traceback is in {where}: "
        "please report it with that file"
    )
