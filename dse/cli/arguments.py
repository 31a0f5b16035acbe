"""argparse types for the commands' options, and the defaults that the parser (dse.cli.main) and the commands
share: a value outside its range is argparse's own usage error (exit 2) that says the range, instead of a
traceback or a silent nonsense later (a port of 70,000, a trial -1). Light on purpose: the parser imports it for
every command, `dse --help` included."""

import argparse
import re
from collections.abc import Callable
from pathlib import Path

DEMO_OUT = Path("runs/quickstart")
"""The output folder `make ui` serves (the Makefile's DEMO_OUT), `dse ui`'s default."""
PORT = 5000
"""`dse ui --port`'s default."""
MAX_TRIAL_NUMBER = 10**7
"""Trial numbers `dse timeline --trial` takes: a study has at most 10^7 trials (README: Limits)."""
DEFAULT_MAX_BYTES = 20 * 10**9
"""`dse generate --max-bytes`'s default, 20 GB: Llama-3-70B on 1,024 H100s (README's example point) is about 10 GB;
a world of 2^20 ranks about 51 GB."""
MAX_BYTES_LIMIT = 10**18
UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
UNITS |= {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50}
SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]i?)?b?\s*$", re.IGNORECASE)


def bounded_int(low: int, high: int, what: str) -> Callable[[str], int]:
    """An int option's type: a whole number from low to high."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}: give a whole number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not {what}: give {low} to {high:,}")
        return value

    parse.__name__ = what  # argparse names the type in its own messages
    return parse


def byte_size(text: str) -> int:
    """A size as `--max-bytes` takes it: bytes, or with a suffix (500M, 20G, 1.5T, 64GiB)."""
    match = SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give bytes, or e.g. 500M, 20G, 1.5T, 64GiB")
    size = float(match.group(1)) * UNITS[(match.group(2) or "").lower()]
    if not 1 <= size <= MAX_BYTES_LIMIT:
        raise argparse.ArgumentTypeError(f"{text!r}: give a size from 1 byte to 1000P")
    return int(size)


def human(size: float) -> str:
    """A byte count as a person reads it (20.0 GB)."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if size >= scale:
            return f"{size / scale:,.1f} {unit}"
    return f"{size:,.0f} bytes"


def night_name(text: str) -> str:
    """`dse nightly --night`'s type: dse.results.nightly's, whose module (pandas, the study's storage) is imported
    only when the option is given, not for every command's parse."""
    from dse.results import nightly

    return nightly.night_name(text)
