"""Open the Optuna storage that queues a sweep's trials.

    sqlite:///results/<sweep>/study.db      the embedded default (one machine); //// for an absolute path
    journal:///results/<sweep>/journal.log  Optuna's journal file (several workers on one machine)
    postgresql://user:pass@host/db          several machines

SQLite is opened with every transaction `BEGIN IMMEDIATE` (SQLAlchemy's recipe for
serialisable pysqlite): Optuna claims a queued trial by reading its state and then
updating it, and under pysqlite's default deferred transactions two workers can both
read WAITING and both "win" the same trial. With immediate transactions the second
waits for the first, sees RUNNING and moves on. The busy timeout turns "database is
locked" into a wait.

Storage URLs can carry a password: `redact()` is what gets printed or recorded.
"""

from __future__ import annotations

import re
from pathlib import Path

SCHEMES = ("sqlite", "postgresql", "mysql", "journal")


class StorageError(ValueError):
    pass


def redact(url: str) -> str:
    """The text with every password in it replaced by ***: `USER:PASS@` (an empty user too) and the query
    parameter `password=` (libpq's and SQLAlchemy's other spelling), wherever the URL appears in the text."""
    text = re.sub(r"(://[^:/@\s]*:)[^@\s]*(@)", r"\1***\2", str(url))
    return re.sub(r"([?&;]password=)[^&\s'\"]*", r"\1***", text, flags=re.IGNORECASE)


def scheme(url: str) -> str:
    head = url.split(":", 1)[0]
    return head.split("+", 1)[0]


def validate_url(url: str) -> None:
    if "://" not in url or scheme(url) not in SCHEMES:
        raise StorageError(
            f"storage URL {redact(url)!r} is not one of: sqlite:///PATH, journal:///PATH, "
            "postgresql://USER:PASSWORD@HOST[:PORT]/DB (or mysql://...)")
    if scheme(url) in ("sqlite", "journal") and not url.partition(":///")[2]:
        raise StorageError(f"storage URL {redact(url)!r} names no file: sqlite:///relative/path.db, "
                           "sqlite:////absolute/path.db (and likewise journal:///...)")


def _sqlite_serialisable(engine) -> None:
    from sqlalchemy import event

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection, connection_record):  # noqa: ARG001
        dbapi_connection.isolation_level = None  # let the begin hook below issue BEGIN itself
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA busy_timeout=120000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn):
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()  # connections opened before the hooks existed are dropped


def _rdb_storage(url: str, engine_kwargs: dict, tries: int = 5):
    """RDBStorage, retried: workers starting together race to create the schema, and the losers'
    CREATE TABLE fails with 'already exists' (or a unique violation on PostgreSQL's catalog)."""
    import time

    import optuna
    from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

    for attempt in range(tries):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)
        except (OperationalError, IntegrityError, ProgrammingError) as err:
            text = str(err).lower()
            racing = isinstance(err, IntegrityError) or any(
                s in text for s in ("already exists", "duplicate key", "unique", "locked"))
            if not racing or attempt == tries - 1:
                raise
            time.sleep(0.5 * (attempt + 1))


def open_storage(url: str):
    """An Optuna storage for `url`, or a StorageError naming the (redacted) URL and why."""

    validate_url(url)
    kind = scheme(url)
    try:
        if kind == "journal":
            from optuna.storages.journal import JournalFileBackend, JournalStorage

            path = Path(url.split(":///", 1)[1])
            path.parent.mkdir(parents=True, exist_ok=True)
            return JournalStorage(JournalFileBackend(str(path)))
        engine_kwargs = {}
        if kind == "sqlite":
            Path(url.split("///", 1)[1]).parent.mkdir(parents=True, exist_ok=True)
            engine_kwargs = {"connect_args": {"timeout": 120}}
        else:
            engine_kwargs = {"pool_pre_ping": True}
        storage = _rdb_storage(url, engine_kwargs)
        if kind == "sqlite":
            _sqlite_serialisable(storage.engine)
        return storage
    except StorageError:
        raise
    except Exception as err:  # the driver's message can quote the URL: redact it
        message = redact(str(err)).splitlines()[0] if str(err) else type(err).__name__
        raise StorageError(f"cannot open storage {redact(url)!r}: {message}") from None


def default_url(sweep_dir: str | Path) -> str:
    return f"sqlite:///{Path(sweep_dir) / 'study.db'}"
