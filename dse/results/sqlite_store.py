"""A local sqlite MLflow store, made cheap to write: write-ahead logging with normal synchronisation.

MLflow opens sqlite in its default rollback-journal mode with full synchronisation, so each of the three
transactions of a child run (create, log_batch, terminate) waits for several fsyncs: 80-100 ms per run on this
machine's disk against 13-20 ms with WAL and `synchronous=NORMAL` (measured with 30 runs of 25 params and 12
metrics each, interleaved). In WAL mode a power loss can take the last transactions but never corrupts the file,
and whatever MLflow loses is rewritten from the Optuna storage by `dse sync`. WAL also lets `mlflow ui` read the
store while a study writes it. The setting is made on each new connection of an MLflow engine whose database is
one of the files registered here, and stays in the file (WAL is persistent).
"""

import sqlite3
import threading
from pathlib import Path
from typing import Any

from dse.errors import DseError

_FILES: set[str] = set()
_LOCK = threading.Lock()


def speed_up(database: Path) -> None:
    """Make every sqlite connection SQLAlchemy opens to `database` from now on use WAL with normal sync."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    with _LOCK:
        if not _FILES:
            event.listen(Engine, "connect", _on_connect)
        _FILES.add(str(database.resolve()))


SQLITE_HEADER = b"SQLite format 3\x00"
"""How every SQLite database file begins (an empty file is one MLflow has yet to write)."""


def check(database: Path, source: str = "") -> None:
    """Refuse a file that is not an SQLite database (a missing one is fine: MLflow creates it). MLflow would retry
    such a file for about 100 s (ten attempts, doubling waits) before failing. source: the option that named the
    store (`--tracking-uri`), if one did; the fix then offers another."""
    if not database.exists():
        return
    try:
        with database.open("rb") as file:  # SQLite reads a file shorter than its header as an empty database
            header = file.read(len(SQLITE_HEADER))
        if header and header != SQLITE_HEADER:
            raise sqlite3.DatabaseError("file is not a database")  # as SQLite says it of a longer file
        with sqlite3.connect(f"{database.resolve().as_uri()}?mode=ro", uri=True) as db:
            db.execute("SELECT name FROM sqlite_master LIMIT 1").fetchall()
    except sqlite3.Error as exc:
        given = f"{source} sqlite:///{database}: " if source else ""
        other = f", or give another {source}" if source else ""
        raise DseError(
            f"{given}{database}: not a readable MLflow store ({exc}); move it aside (`dse sync` writes a study's "
            f"runs to a new one){other}"
        ) from None


def _on_connect(connection: Any, record: Any) -> None:
    if not isinstance(connection, sqlite3.Connection):
        return
    cursor = connection.cursor()
    try:
        files = {row[2] for row in cursor.execute("PRAGMA database_list") if row[1] == "main"}
        if files & _FILES:
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
    finally:
        cursor.close()
