"""`dse generate`: one design point's workload as Chakra traces for ASTRA-sim, or as a per-rank-class summary.

Traces are one file per rank, so a large world writes a lot: the trace set's size is measured before anything is
written (`chakra.estimate_bytes`) and a set over `--max-bytes` (dse.cli.arguments.DEFAULT_MAX_BYTES) is refused
with its size, as is one the folder's file system has no room for. Trace files of the same prefix already in the
folder are refused too, and replaced only with `--force` (a set of fewer ranks would otherwise leave the old set's
last files).
"""

import argparse
import os
import re
import shutil
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dse.cli.arguments import human
from dse.errors import DseError
from dse.fields import GiB
from dse.point.points import load_point
from dse.search import preflight
from dse.serving.deployment import generated_step

NAME_MAX = 255
"""The longest file name Linux file systems take, in bytes."""
GROUPS_SUFFIX = ".comm_groups.json"


def check_prefix(prefix: str) -> None:
    """A prefix that makes one file name in the folder: `--prefix sub/dir` would write into a folder that does not
    exist, `..` and an empty one make hidden or parent names."""
    problem = None
    if not prefix.strip():
        problem = "is empty"
    elif "/" in prefix or "\0" in prefix:
        problem = "holds a '/' or a NUL byte: it names files in OUT_DIR, not folders (give the folder as --chakra)"
    elif prefix in (".", ".."):
        problem = "names a folder"
    elif any(ord(c) < 32 or ord(c) == 127 for c in prefix):
        problem = "holds a control character"
    elif len(os.fsencode(f"{prefix}{GROUPS_SUFFIX}")) > NAME_MAX:
        problem = f"is too long: the file names it makes would be over {NAME_MAX} bytes"
    if problem:
        raise DseError(f"--prefix {prefix!r}: {problem}; give a plain name such as trace")


def prepare_folder(folder: Path, prefix: str, size: int, max_bytes: int, force: bool) -> None:
    """Make the folder ready for a trace set of `size` bytes, or refuse it (before writing any trace): over
    `max_bytes`, a file in the way, a folder that cannot be made, a file system without the room, or trace files
    of this prefix already there (removed with `force`)."""
    if size > max_bytes:
        larger = next(
            f"{size // scale + 1}{unit}" for unit, scale in (("G", 10**9), ("M", 10**6), ("k", 1)) if size >= scale
        )
        raise DseError(
            f"--chakra {folder}: the trace set would be about {human(size)} ({size:,} bytes), over --max-bytes "
            f"{human(max_bytes)}; pass --max-bytes {larger} to write it, or a point with fewer ranks"
        )
    if folder.exists() and not folder.is_dir():
        raise DseError(f"--chakra {folder}: a file is in the way, not a folder; give a folder path")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        reason = f"cannot create the folder ({exc.strerror})"
        raise DseError(f"--chakra {folder}: {reason}; give a writable folder") from None
    pattern = re.compile(rf"^{re.escape(prefix)}\.(\d+\.et|comm_groups\.json)$")
    traces = sorted(p for p in folder.iterdir() if pattern.match(p.name))
    if traces and not force:
        raise DseError(
            f"--chakra {folder}: holds {len(traces)} trace files named {prefix}.* ({traces[0].name}, ...); pass "
            "--force to replace them, or give another folder or --prefix"
        )
    if size > (free := shutil.disk_usage(folder).free + sum(p.stat().st_size for p in traces)):
        raise DseError(
            f"--chakra {folder}: the trace set would be about {human(size)}, but its file system has {human(free)} "
            "free; free some space or give a folder on another disk"
        )
    for stale in traces:
        stale.unlink()


def main(args: argparse.Namespace, console: Console) -> int:
    from dse.modelstats import active_param_count, param_count
    from dse.point import chakra
    from dse.point.described import description
    from dse.point.feasibility import check_feasible
    from dse.point.summary import summarize

    if args.chakra:
        check_prefix(args.prefix)
    point = load_point(args.point, args.generator)
    check_feasible(point)
    if point.workload.mode == "serve":
        point = generated_step(point)
        w = point.workload
        console.print(
            f"a serving point: its decode iteration of {w.micro_batch} sequences at a context of {w.seq_len} tokens "
            f"on one instance ({point.parallel.world} ranks)",
            soft_wrap=True,
        )
    workload = preflight.check_point(point, str(args.point), args.generator).generate(point)
    if args.chakra:
        network = [d.npus for d in point.system.network]
        itemsize, accelerator = point.model.dtype_bytes, point.system.accelerator
        size = chakra.estimate_bytes(workload, network, itemsize, accelerator)
        prepare_folder(args.chakra, args.prefix, size, args.max_bytes, args.force)
        paths = chakra.export(workload, args.chakra, network, args.prefix, itemsize, accelerator)
        written = sum(path.stat().st_size for path in paths)
        console.print(
            f"wrote {len(paths)} traces ({human(written)}) and {args.prefix}{GROUPS_SUFFIX} to {args.chakra}",
            soft_wrap=True,
        )
    if args.summary or not args.chakra:
        m = point.model
        model = description(point, args.generator)  # the module's own count under generator fx
        total, active = (param_count(m), active_param_count(m)) if model is None else (model.parameters, model.active)
        console.print(
            f"{point.model.name}: {total:,} parameters ({active:,} active per token), "
            f"{point.parallel.world} ranks in {len(workload.programs)} rank classes, "
            f"{len(workload.blocks)} blocks",
            soft_wrap=True,
        )
        for s in summarize(workload):
            table = Table(title=f"rank class {s.rank_class} ({s.name}, {s.ranks} ranks)", title_justify="left")
            table.add_column("what")
            table.add_column("value", justify="right")
            for category, count in sorted(s.ops.items()):
                table.add_row(f"ops: {category}", f"{count:,}")
            table.add_row("FLOPs", f"{s.flops:.4g}")
            for (kind, axis), size in sorted(s.comm_bytes.items()):
                table.add_row(f"comm: {kind} on {axis}", f"{size / GiB:,.3f} GiB")
            table.add_row("parameters on a rank", f"{s.parameters / m.dtype_bytes:,.0f}")
            for kind, size in sorted(s.static_bytes.items()):
                table.add_row(f"static: {kind}", f"{size / GiB:,.3f} GiB")
            table.add_row("peak activations", f"{s.peak_activation_bytes / GiB:,.3f} GiB")
            console.print(table)
    return 0
