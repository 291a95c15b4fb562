"""A throwaway PostgreSQL server on 127.0.0.1 for the sweep tests (Debian's postgresql package).

The server must not run as root, so initdb and postgres run as the `postgres` user when the
tests run as root. Without PostgreSQL installed the tests that need it skip, unless
STUDY_REQUIRE_POSTGRES=1 (CI sets it), where they fail instead.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest


def _bin_dir() -> Path | None:
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if candidates:
        return Path(candidates[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_postgres(cmd: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return cmd
    return ["runuser", "-u", "postgres", "--", *cmd]


class PostgresServer:
    def __init__(self) -> None:
        bin_dir = _bin_dir()
        if bin_dir is None:
            raise RuntimeError("PostgreSQL is not installed (apt-get install postgresql)")
        self.bin = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="study-pg-"))
        self.data = self.root / "data"
        self.port = _free_port()
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
        subprocess.run(_as_postgres([str(bin_dir / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
                                     "--no-sync"]), check=True, capture_output=True)
        subprocess.run(_as_postgres([str(bin_dir / "pg_ctl"), "-D", str(self.data), "-w", "-l", str(self.root / "log"),
                                     "-o", f"-p {self.port} -k {self.root} -h 127.0.0.1 -F", "start"]),
                       check=True, capture_output=True)
        self._dbs = 0

    def new_database(self, password: str = "s3cret-pw") -> str:
        """A fresh database; the URL carries a password (trust auth ignores it) so tests can
        check that it never leaks into logs or results."""
        import psycopg

        self._dbs += 1
        name = f"sweep{self._dbs}_{int(time.time() * 1000) % 100000}"
        with psycopg.connect(host="127.0.0.1", port=self.port, user="postgres", dbname="postgres",
                             autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return f"postgresql://postgres:{password}@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        subprocess.run(_as_postgres([str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop"]),
                       capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)


def postgres_or_skip() -> PostgresServer:
    try:
        import psycopg  # noqa: F401  (SQLAlchemy's default PostgreSQL driver)

        return PostgresServer()
    except (RuntimeError, ImportError, subprocess.CalledProcessError) as err:
        detail = err.stderr.decode(errors="replace") if isinstance(err, subprocess.CalledProcessError) and err.stderr else ""
        if os.environ.get("STUDY_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"PostgreSQL is required here (STUDY_REQUIRE_POSTGRES=1) but could not start: {err} {detail}")
        pytest.skip(f"no PostgreSQL server available: {err}")
