"""argparse types for the commands' numeric options: a value outside its range is argparse's own usage error
(exit 2) that says the range, instead of a traceback or a silent nonsense later (a port of 70,000, a trial -1)."""

import argparse
from collections.abc import Callable


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
