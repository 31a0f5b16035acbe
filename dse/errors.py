"""Errors a user can cause.

Every one carries a message that names the field or file at fault and how to fix it; the CLI prints the message
on one line and exits with code 2, never a traceback.
"""


class DseError(Exception):
    """Base class of every user-facing error."""


class SpecError(DseError):
    """A design point, study or catalog entry is malformed or names something unknown."""


class InfeasibleError(DseError):
    """A well-formed design point that cannot run (degrees that do not divide, a world that does not fit)."""


class PluginError(DseError):
    """A generator, cost model or objective name that no installed plugin provides."""
