"""The Optuna storage of a study, from a URL: where trials live while and after a study runs.

A journal file in the output folder by default (Optuna's format, kept in memory and appended to by
dse.search.journal.JournalMirror): the driver makes it durable and resumable, and `optuna-dashboard` reads it live. One
driver writes a journal file at a time. For a team or a cluster whose drivers run on different hosts: an RDB
(`postgresql://`, `mysql://`, `sqlite:///`) or the Redis journal (`redis://`). A plain path is a journal file.
"""

import warnings
from pathlib import Path
from urllib.parse import urlsplit

from optuna.exceptions import ExperimentalWarning
from optuna.storages import BaseStorage, RDBStorage
from optuna.storages.journal import JournalRedisBackend, JournalStorage

from dse.errors import DseError
from dse.search.journal import JournalMirror

JOURNAL = "optuna-journal.log"
RDB_SCHEMES = ("postgresql", "mysql", "sqlite")
DRIVERS = {"postgresql": "psycopg[binary]", "mysql": "pymysql", "redis": "redis"}
"""The pip package each scheme's client needs, for the error message when it is missing."""


def describe(url: str | None, out_dir: Path) -> str:
    """The storage as a user would pass it again (passwords hidden), for messages and the run record."""
    if url is None:
        return str(out_dir / JOURNAL)
    parts = urlsplit(url)
    if parts.password:
        return url.replace(f":{parts.password}@", ":***@")
    return url


def scheme_of(url: str | None, out_dir: Path) -> str:
    """The storage URL's scheme ('' for a journal file path); an unknown one raises DseError, before anything is
    opened or made."""
    scheme = urlsplit(url).scheme.split("+")[0] if url else ""
    if scheme not in (*RDB_SCHEMES, "redis", "", "file"):
        raise DseError(
            f"field 'storage': unknown storage URL scheme '{scheme}' in {describe(url, out_dir)}; use "
            f"postgresql://, mysql://, sqlite:///, redis:// or a journal file path"
        )
    return scheme


def open_storage(url: str | None, out_dir: Path) -> BaseStorage:
    """The storage at `url` (None: OUT_DIR's journal file); a bad URL or an unreachable server raises DseError."""
    scheme = scheme_of(url, out_dir)
    try:
        if not url:
            return _journal_file(out_dir / JOURNAL, "")
        if scheme in RDB_SCHEMES:
            return RDBStorage(url)
        if scheme == "redis":
            with warnings.catch_warnings():  # "experimental" since Optuna 3.1; it is the shared journal we want
                warnings.simplefilter("ignore", ExperimentalWarning)
                return JournalStorage(JournalRedisBackend(url))
        return _journal_file(Path(urlsplit(url).path if scheme == "file" else url), "field 'storage': ")
    except DseError:  # a journal file's own errors name the file and the line
        raise
    except ImportError as exc:  # Optuna turns a missing database driver into a bare ImportError
        package = DRIVERS.get(scheme, getattr(exc, "name", None) or "the database driver")
        raise DseError(
            f"field 'storage': {describe(url, out_dir)} needs the Python package {package}; `pip install '{package}'`"
        ) from None
    except Exception as exc:  # sqlalchemy and redis raise their own hierarchies; the message is what matters
        first = f"{type(exc).__name__}: {exc}".splitlines()[0]
        raise DseError(
            f"field 'storage': cannot open Optuna storage {describe(url, out_dir)} ({first}); check that the "
            f"server is up and the URL is right"
        ) from None


def _journal_file(path: Path, field: str) -> JournalMirror:
    """A journal file's storage; a path that cannot hold one is named with the reason (not a server's)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return JournalMirror(str(path))
    except OSError as exc:
        raise DseError(
            f"{field}{path}: cannot open the study journal ({exc.strerror or exc}); give a journal file path "
            "that can be written"
        ) from None


def holds_study(url: str | None, out_dir: Path, name: str) -> bool:
    """Whether the storage at `url` (None: OUT_DIR's journal file) holds a study of that name, read without
    creating anything (a missing journal file holds none)."""
    if not url and not (out_dir / JOURNAL).is_file():
        return False
    return name in {study.study_name for study in open_storage(url, out_dir).get_all_studies()}
