"""Open the Optuna storage that queues a sweep's trials.

    sqlite:///results/<sweep>/study.db      the embedded default (one machine)
    journal:///results/<sweep>/journal.log  Optuna's journal file (several workers on one machine)
    postgresql://user:pass@host/db          several machines (the password may instead come from libpq's
                                            ~/.pgpass or $PGPASSFILE: postgresql://user@host/db)

A file path after `:///` is relative to the working directory and `:////` makes it absolute, as SQLAlchemy reads
sqlite URLs: `journal:///results/j.log` is ./results/j.log, `journal:////srv/j.log` is /srv/j.log. `identity()`
is what a URL points at, spelled one way (the results folder records it, `study.sweep.layout`).

SQLite is opened with every transaction `BEGIN IMMEDIATE` (SQLAlchemy's recipe for
serialisable pysqlite): Optuna claims a queued trial by reading its state and then
updating it, and under pysqlite's default deferred transactions two workers can both
read WAITING and both "win" the same trial. With immediate transactions the second
waits for the first, sees RUNNING and moves on. The busy timeout turns "database is
locked" into a wait.

Storage URLs can carry a password: `redact()` is what gets printed or recorded.

A worker's storage is `retrying()`: a call that finds the storage unreachable (a database server restarting, a
network blip) is retried with exponential backoff for up to `retry_s` seconds, so that a short outage costs a wait,
not the sweep.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from pathlib import Path
from typing import Any

from optuna.storages import BaseStorage

log = logging.getLogger(__name__)
SCHEMES = ("sqlite", "postgresql", "mysql", "journal")
DEFAULT_PORTS = {"postgresql": 5432, "mysql": 3306}
DEFAULT_RETRY_S = 300.0  # how long a worker waits out an unreachable storage before it stops
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 4.0  # backoff between retries (a sweep's grace_s should exceed the longest)


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


def file_path(url: str) -> Path:
    """The file of a sqlite:// or journal:// URL: relative after `:///`, absolute after `:////`."""
    return Path(url.partition(":///")[2].split("?", 1)[0])


def identity(url: str) -> str:
    """What a storage URL points at, spelled one way whatever the working directory or the login: the absolute
    file for sqlite and journal (`sqlite:////abs/study.db`), scheme://host:port/database for a server (no user
    and no password: the same database whoever logs in)."""
    validate_url(url)
    kind = scheme(url)
    if kind in ("sqlite", "journal"):
        return f"{kind}:///{file_path(url).resolve()}"
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as err:
        raise StorageError(f"storage URL {redact(url)!r} cannot be read: {redact(str(err))}") from None
    host = str(parsed.host or parsed.query.get("host") or "localhost").lower()
    return f"{kind}://{host}:{parsed.port or DEFAULT_PORTS.get(kind, '')}/{parsed.database or ''}"


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

            path = file_path(url)
            path.parent.mkdir(parents=True, exist_ok=True)
            return JournalStorage(JournalFileBackend(str(path)))
        engine_kwargs = {}
        if kind == "sqlite":
            file_path(url).parent.mkdir(parents=True, exist_ok=True)
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


class StorageUnreachable(StorageError):
    """The storage stayed unreachable for longer than the worker's storage_retry_s."""


def _transient(err: BaseException) -> bool:
    """An error that says the storage cannot be reached now (connection refused or dropped, a locked or missing
    file), not that the call was wrong; Optuna re-raises some as its StorageInternalError, from the driver's."""
    from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, PendingRollbackError

    while err is not None:
        if isinstance(err, (OperationalError, InterfaceError, OSError)):
            return True
        if isinstance(err, DBAPIError) and err.connection_invalidated:
            return True
        # a connection dropped while a query loaded related rows leaves the transaction unusable: SQLAlchemy then
        # raises PendingRollbackError while handling the driver's error, which is its context, not its cause
        err = err.__context__ if isinstance(err, PendingRollbackError) else err.__cause__
    return False


def _first_line(err: BaseException) -> str:
    while err.__cause__ is not None:  # the driver's words, not Optuna's wrapper's
        err = err.__cause__
    return redact(str(err)).strip().splitlines()[0] if str(err).strip() else type(err).__name__


class _RetryingCalls(BaseStorage):
    """Every storage call of `inner` retried while the storage is unreachable (see `retrying`)."""

    def __init__(self, inner: BaseStorage, retry_s: float, name: str) -> None:
        self.inner, self.retry_s, self.name = inner, retry_s, name
        self.recovered_at = 0.0  # when the last outage ended (0: none seen): the queue's grace period restarts
        self.gave_up = False  # after one outage outlasted retry_s, calls fail at once (the worker is stopping)
        # whether the last call was tried again after a connection error: its first try may have landed with its
        # reply lost, so an answer such as "already finished" may describe this process's own update
        self.last_call_retried = False

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        outage_started, delay = None, RETRY_FIRST_S
        while True:
            try:
                result = getattr(self.inner, method)(*args, **kwargs)
            except Exception as err:
                if not _transient(err):
                    self.last_call_retried = outage_started is not None
                    raise
                now = time.time()
                if outage_started is None:
                    outage_started = now
                    log.warning("storage %s unreachable (%s); retrying for up to %.0f s", self.name,
                                _first_line(err), self.retry_s)
                if self.gave_up or now + delay - outage_started > self.retry_s:
                    self.gave_up = True
                    raise StorageUnreachable(
                        f"storage {self.name} unreachable for {now - outage_started:.0f} s ({_first_line(err)}); "
                        "every finished trial is in its run directory: run the same command again once the "
                        "storage is back") from None
                time.sleep(delay)
                delay = min(2 * delay, RETRY_MAX_S)
                continue
            self.last_call_retried = outage_started is not None
            if outage_started is not None:
                self.recovered_at = time.time()
                log.warning("storage %s reachable again after %.0f s", self.name, self.recovered_at - outage_started)
            return result


def _forward(method: str):
    def call(self: _RetryingCalls, *args: Any, **kwargs: Any) -> Any:
        return self._call(method, *args, **kwargs)

    call.__name__ = call.__qualname__ = method
    return call


# every public method of Optuna's storage interface, each one forwarded through the retry loop (a class built
# from the interface's own list, so that a method Optuna adds is forwarded too)
RetryingStorage = type("RetryingStorage", (_RetryingCalls,),
                       {"__module__": __name__, **{name: _forward(name) for name, value in vars(BaseStorage).items()
                                                   if callable(value) and not name.startswith("_")}})


@contextlib.contextmanager
def retrying_at_most(storage: BaseStorage, seconds: float):
    """Within the block, `storage` (one `retrying` made) waits out an outage for at most `seconds`: a process that
    is stopping (Ctrl-C) gives its trial back, or counts the queue, briefly or not at all, rather than ignoring the
    user for the full retry time. Other storages are left as they are."""
    saved = storage.retry_s if isinstance(storage, _RetryingCalls) else None
    if saved is not None:
        storage.retry_s = min(saved, seconds)
    try:
        yield
    finally:
        if saved is not None:
            storage.retry_s = saved


def retrying(storage: BaseStorage, retry_s: float, url: str) -> BaseStorage:
    """`storage` with each call retried with exponential backoff (0.5 s, doubling, at most 4 s apart) while the
    storage is unreachable, for up to `retry_s` seconds per outage; one log line when an outage starts and one when
    it ends; then StorageUnreachable. A call whose effect landed but whose reply was lost is repeated: the queue
    tolerates that (a duplicate enqueue is dropped at its claim, a repeated state change is refused)."""
    return RetryingStorage(storage, retry_s, repr(redact(url)))
