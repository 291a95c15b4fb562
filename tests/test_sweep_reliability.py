"""A sweep's storage, reliably: where its URL comes from (never the command line), that a results folder belongs to
one storage, that a storage which cannot be opened leaves the sweep folder untouched, that a lock left by a killed
process does not stall the next start, and that workers wait out a database outage and lose nothing (issue 20)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from postgres_server import PostgresServer, _as_postgres, postgres_or_skip
from study.io import read_json
from study.sweep import queue as queue_module
from study.sweep.queue import TrialQueue
from study.sweep.storage import identity, open_storage
from test_sweep import FAKE, REPO, TESTS, completions, queue_for, write_spec


@pytest.fixture(autouse=True)
def _fakes_importable(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("STUDY_FAKE_SLEEP", "0")
    monkeypatch.delenv("STUDY_STORAGE", raising=False)


def study_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
              timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "study.cli", *args], cwd=cwd, env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def sweep_args(spec: Path, results: Path, *more: str) -> list[str]:
    return ["sweep", str(spec), "--results", str(results), "--workers", "1", "--runner", FAKE, *more]


def sweep_files(sweep_dir: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sweep_dir.iterdir() if f.suffix in (".json", ".yaml")}


# -- where the URL comes from -------------------------------------------------------------------
def test_sweep_and_status_take_the_storage_from_STUDY_STORAGE_when_no_flag_is_given(tmp_path):
    journal = tmp_path / "queue.log"
    env = {"STUDY_STORAGE": f"journal:///{journal}"}
    ran = study_cli(*sweep_args(write_spec(tmp_path), tmp_path / "results"), env=env)
    assert ran.returncode == 0, ran.stderr
    assert journal.is_file() and not (tmp_path / "results" / "t" / "study.db").exists()
    assert read_json(tmp_path / "results" / "t" / "storage.json")["identity"] == f"journal:///{journal}"
    status = study_cli("status", "t", "--results", str(tmp_path / "results"), env=env)
    assert "4 done" in status.stdout and "journal:///" in status.stdout, status.stdout


def test_the_storage_flag_wins_over_STUDY_STORAGE(tmp_path):
    spec = write_spec(tmp_path)
    env = {"STUDY_STORAGE": "mongodb://nowhere/db"}
    refused = study_cli(*sweep_args(spec, tmp_path / "results", "--dry-run"), env=env)
    assert refused.returncode == 2 and "mongodb://nowhere/db" in refused.stderr
    flag = study_cli(*sweep_args(spec, tmp_path / "results", "--dry-run", "--storage", f"sqlite:///{tmp_path}/q.db"),
                     env=env)
    assert flag.returncode == 0, flag.stderr


# -- PostgreSQL with password authentication -----------------------------------------------------
class PasswordServer(PostgresServer):
    """The throwaway server with password authentication over TCP (scram-sha-256), as CI's is."""

    password = "pw-R3liable-s3cret"

    def __init__(self) -> None:
        import psycopg

        super().__init__()
        with psycopg.connect(host=str(self.root), port=self.port, user="postgres", dbname="postgres",
                             autocommit=True) as conn:
            conn.execute(f"ALTER USER postgres PASSWORD '{self.password}'")
        (self.data / "pg_hba.conf").write_text("local all all trust\nhost all all 127.0.0.1/32 scram-sha-256\n")
        self._ctl("reload")

    def _ctl(self, *args: str) -> None:
        subprocess.run(_as_postgres([str(self.bin / "pg_ctl"), "-D", str(self.data), *args]), check=True,
                       capture_output=True)

    def database(self) -> str:
        """A fresh database; its URL without the password (`postgresql://postgres@127.0.0.1:PORT/NAME`)."""
        import psycopg

        self._dbs += 1
        name = f"reliable{self._dbs}"
        with psycopg.connect(host=str(self.root), port=self.port, user="postgres", dbname="postgres",
                             autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return f"postgresql://postgres@127.0.0.1:{self.port}/{name}"

    def stop_for_now(self) -> None:
        self._ctl("-m", "fast", "-w", "stop")

    def start_again(self) -> None:  # on the same port, as a restarted server would be
        self._ctl("-w", "-l", str(self.root / "log"), "-o", f"-p {self.port} -k {self.root} -h 127.0.0.1 -F", "start")


@pytest.fixture(scope="module")
def pg():
    postgres_or_skip().stop()  # skips (or fails where STUDY_REQUIRE_POSTGRES=1) without PostgreSQL
    server = PasswordServer()
    yield server
    server.stop()


def test_a_url_without_its_password_logs_in_with_libpqs_pgpass_file(tmp_path, pg):
    url = pg.database()
    spec = write_spec(tmp_path)
    without = study_cli(*sweep_args(spec, tmp_path / "results", "--storage", url),
                        env={"PGPASSFILE": str(tmp_path / "missing")})
    assert without.returncode == 2 and len(without.stderr.strip().splitlines()) == 1, without.stderr
    assert "cannot open storage" in without.stderr and "password" in without.stderr
    pgpass = tmp_path / "pgpass"
    pgpass.write_text(f"127.0.0.1:{pg.port}:*:postgres:{pg.password}\n")
    pgpass.chmod(0o600)
    ran = study_cli(*sweep_args(spec, tmp_path / "results", "--workers", "2"),
                    env={"PGPASSFILE": str(pgpass), "STUDY_STORAGE": url})
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert set(completions(tmp_path / "results").values()) == {1} and len(completions(tmp_path / "results")) == 4


# -- one results folder, one storage -------------------------------------------------------------
def test_the_same_sweep_from_another_directory_with_a_relative_journal_url_is_refused_and_nothing_rewritten(tmp_path):
    first, second, results = tmp_path / "a", tmp_path / "b", tmp_path / "results"
    first.mkdir(), second.mkdir()
    spec = write_spec(tmp_path)
    ran = study_cli(*sweep_args(spec, results, "--storage", "journal:///q.log"), cwd=first)
    assert ran.returncode == 0, ran.stderr
    before = sweep_files(results / "t")
    assert read_json(results / "t" / "storage.json")["identity"] == f"journal:///{first / 'q.log'}"

    again = study_cli(*sweep_args(spec, results, "--storage", "journal:///q.log", "--set", "seeds=[0,1,2]"), cwd=second)
    assert again.returncode == 2 and len(again.stderr.strip().splitlines()) == 1, again.stderr
    assert str(first / "q.log") in again.stderr and str(second / "q.log") in again.stderr
    assert "--results" in again.stderr and "Traceback" not in again.stderr
    assert sweep_files(results / "t") == before and not (second / "q.log").exists()
    assert set(completions(results).values()) == {1} and len(completions(results)) == 4

    worker = subprocess.run([sys.executable, "-m", "study.sweep.worker", "--sweep-dir", str(results / "t")],
                            cwd=second, env={**os.environ, "STUDY_STORAGE": "journal:///q.log"},
                            capture_output=True, text=True, timeout=60)
    assert worker.returncode == 2 and "belongs to storage" in worker.stderr and not (second / "q.log").exists()


def test_a_server_urls_identity_is_its_database_whoever_logs_in_and_never_its_password():
    assert identity("postgresql://alice:pw@DB.example:5432/sweeps") == "postgresql://db.example:5432/sweeps"
    assert identity("postgresql+psycopg://bob@db.example/sweeps?password=pw") == "postgresql://db.example:5432/sweeps"
    assert identity("sqlite:////abs/study.db") == "sqlite:////abs/study.db"
    assert identity("sqlite:///rel/study.db") == f"sqlite:///{Path.cwd() / 'rel' / 'study.db'}"


# -- a storage that cannot be opened writes nothing ----------------------------------------------
@pytest.mark.parametrize("kind", ["journal", "sqlite"])
def test_an_existing_sweep_whose_storage_cannot_be_opened_keeps_its_files_byte_identical(tmp_path, kind):
    results = tmp_path / "results"
    storage = tmp_path / "q.log" if kind == "journal" else results / "t" / "study.db"
    url = f"{kind}:///{storage}"
    ran = study_cli(*sweep_args(write_spec(tmp_path), results, "--storage", url))
    assert ran.returncode == 0, ran.stderr
    before = sweep_files(results / "t")
    for f in storage.parent.glob(storage.name + "*"):  # the file (and SQLite's -wal, -shm) replaced by a folder
        f.unlink()
    storage.mkdir()
    changed = write_spec(tmp_path, seeds=[0, 1, 2])  # a run that got further would rewrite spec.yaml and plan.json
    again = study_cli(*sweep_args(changed, results, "--storage", url))
    assert again.returncode == 2, again.stderr
    assert again.stderr.strip().splitlines() == [again.stderr.strip()] and "cannot open storage" in again.stderr
    assert sweep_files(results / "t") == before


# -- the enqueue lock -------------------------------------------------------------------------------
HOLD_LOCK = """
import os, signal, sys, time
from study.sweep.queue import TrialQueue
from study.sweep.storage import open_storage
queue = TrialQueue(open_storage(sys.argv[1]), "t")
with queue.lock():
    print("held", flush=True)
    if sys.argv[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(float(sys.argv[2]))
"""


def hold_lock(url: str, how: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, url, how], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_lock_left_by_a_killed_process_on_this_host_is_taken_over_at_once(tmp_path, caplog):
    url = f"sqlite:///{tmp_path / 'q.db'}"
    holder = hold_lock(url, "kill")
    assert holder.wait(timeout=30) == -signal.SIGKILL
    queue = TrialQueue(open_storage(url), "t")
    started = time.time()
    with caplog.at_level("INFO", logger="study.sweep"), queue.lock():
        assert time.time() - started < 5
    assert f":{holder.pid}: that process is gone" in caplog.text


def test_waiting_for_a_live_holder_says_who_holds_the_lock(tmp_path, caplog):
    url = f"sqlite:///{tmp_path / 'q.db'}"
    holder = hold_lock(url, "3")
    queue = TrialQueue(open_storage(url), "t")
    started = time.time()
    with caplog.at_level("INFO", logger="study.sweep"), queue.lock():
        assert time.time() - started > 1.5  # it waited for the holder to finish
    holder.wait(timeout=30)
    waits = [r.getMessage() for r in caplog.records if "waiting for the enqueue lock" in r.getMessage()]
    assert len(waits) == 1 and f":{holder.pid} " in waits[0], caplog.text
    assert "taking over" not in caplog.text


def test_a_lock_held_from_another_host_is_taken_over_after_the_stale_limit(tmp_path, caplog, monkeypatch):
    from optuna.study import StudyDirection

    monkeypatch.setattr(queue_module, "LOCK_STALE_S", 1.5)
    storage = open_storage(f"sqlite:///{tmp_path / 'q.db'}")
    lock = storage.create_new_study([StudyDirection.MINIMIZE], study_name="t~enqueue-lock")
    storage.set_study_user_attr(lock, "holder", {"worker": "elsewhere:4242", "since": time.time()})
    started = time.time()
    with caplog.at_level("INFO", logger="study.sweep"), TrialQueue(storage, "t").lock():
        assert 1.5 <= time.time() - started < 10
    assert "held by elsewhere:4242" in caplog.text and "taking over" in caplog.text


# -- a database outage mid-sweep ------------------------------------------------------------------
@pytest.mark.parametrize("seeds, workers, trial_s", [
    ([0, 1, 2], 2, 2.5),  # trials finish during the outage: their results are told once it is back
    ([0], 3, 14.0),  # trials run through the outage while an idle worker polls: nobody reaps them when it is back
], ids=["finishing-during-the-outage", "running-through-the-outage"])
def test_workers_wait_out_a_postgresql_outage_and_every_trial_completes_exactly_once(tmp_path, pg, seeds, workers,
                                                                                      trial_s):
    url = f"{pg.database()}?password={pg.password}"  # the query-parameter form of the password
    spec = write_spec(tmp_path, seeds=seeds, heartbeat_s=1, grace_s=6)
    results = tmp_path / "results"
    cmd = [sys.executable, "-m", "study.cli", *sweep_args(spec, results, "--workers", str(workers))]
    proc = subprocess.Popen(cmd, env={**os.environ, "STUDY_FAKE_SLEEP": str(trial_s), "STUDY_STORAGE": url},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and len(list(results.glob("runs/*/seed-*/executions.log"))) < 2:
        time.sleep(0.2)
    pg.stop_for_now()
    time.sleep(10)  # longer than grace_s: the trials running now must not be reaped when it comes back
    pg.start_again()
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-4000:]
    assert "Traceback" not in out and "unreachable" in out and "reachable again" in out, out[-4000:]
    done = completions(results)
    assert len(done) == 2 * len(seeds) and set(done.values()) == {1}, done
    executions = [len(p.read_text().splitlines()) for p in results.glob("runs/*/seed-*/executions.log")]
    assert executions == [1] * len(done), out[-4000:]  # no trial was reaped and started again
    queue, keys = queue_for(results / "t", url)
    assert sorted(t.user_attrs["key"] for t in queue.trials() if t.state.name == "COMPLETE") == sorted(keys)
    assert pg.password not in out
    for f in results.rglob("*"):
        if f.is_file() and f.suffix in (".json", ".yaml", ".csv", ".log"):
            assert pg.password not in f.read_text(errors="replace"), f


def test_after_an_outage_a_running_trial_gets_its_grace_period_anew_before_it_can_be_reaped(tmp_path):
    """Nobody could beat a heartbeat while the storage was down: a worker that sees the storage come back must
    not reap the trials whose owners are still reconnecting."""
    from study.sweep.layout import trial_specs
    from study.sweep.runner import SweepOptions, prepare
    from study.sweep.storage import retrying

    _, layout, url = prepare(write_spec(tmp_path, seeds=[0]), SweepOptions(results=tmp_path / "results",
                                                                          estimate_rate=1e11), say=lambda s: None)
    owner = TrialQueue(open_storage(url), "t", grace_s=5, heartbeat_s=1)
    owner.sync(trial_specs(read_json(layout.plan_path)))
    claimed = owner.claim()
    owner.storage.set_trial_user_attr(claimed.trial_id, "heartbeat", time.time() - 60)  # beaten before the outage
    other = TrialQueue(retrying(open_storage(url), 30, url), "t", grace_s=5, heartbeat_s=1)
    other.storage.recovered_at = time.time() - 2  # the outage ended 2 s ago, less than grace_s
    assert other.reap_lost() == 0 and owner.still_mine(claimed)
    other.storage.recovered_at = time.time() - 6  # back for longer than grace_s, and still no heartbeat: lost
    assert other.reap_lost() == 1 and not owner.still_mine(claimed)


def test_a_stopping_process_waits_out_an_outage_for_at_most_the_time_it_was_given():
    """A worker giving its trial back after Ctrl-C (and `study sweep` counting the queue) ignores further signals:
    an unreachable storage is waited for the give-back's few seconds, not the worker's whole --storage-retry-s."""
    from sqlalchemy.exc import OperationalError

    from study.sweep.storage import StorageError, retrying, retrying_at_most

    class Unreachable:
        def get_all_studies(self):
            raise OperationalError("SELECT 1", {}, ConnectionRefusedError("connection refused"))

    storage = retrying(Unreachable(), 300.0, "postgresql://db/sweeps")
    started = time.time()
    with pytest.raises(StorageError), retrying_at_most(storage, 1.0):
        storage.get_all_studies()
    assert time.time() - started < 5 and storage.retry_s == 300.0


def _failing_once(error: BaseException):
    class FailsOnce:
        calls = 0

        def get_all_studies(self):
            FailsOnce.calls += 1
            if FailsOnce.calls == 1:
                raise error
            return ["study"]

    return FailsOnce()


def _internal_error(cause: BaseException):
    """Optuna's StorageInternalError as its scoped session raises it, from what the query raised."""
    import optuna

    try:
        raise cause
    except BaseException as err:
        try:
            raise optuna.exceptions.StorageInternalError("An exception is raised during the commit.") from err
        except optuna.exceptions.StorageInternalError as wrapped:
            return wrapped


def _rollback_pending_after_a_dropped_connection():
    """What SQLAlchemy raises when the server drops the connection while a query loads related rows (seen in CI
    with PostgreSQL's `pg_ctl stop -m fast`): PendingRollbackError, raised while handling the driver's error."""
    from sqlalchemy.exc import OperationalError, PendingRollbackError

    try:
        try:
            raise OperationalError("SELECT ...", {}, ConnectionError("terminating connection due to administrator"
                                                                     " command"), connection_invalidated=True)
        except OperationalError:
            raise PendingRollbackError("Can't reconnect until invalid transaction is rolled back.")
    except PendingRollbackError as err:
        return err


def test_a_connection_dropped_mid_query_is_waited_out_like_any_outage():
    """A worker polling the queue at the moment the server stops saw this once and died with a traceback."""
    from study.sweep.storage import retrying

    storage = retrying(_failing_once(_internal_error(_rollback_pending_after_a_dropped_connection())), 30.0,
                       "postgresql://db/sweeps")
    assert storage.get_all_studies() == ["study"] and storage.recovered_at > 0


def test_a_storage_error_that_is_not_an_outage_is_raised_at_once():
    import optuna
    from sqlalchemy.exc import DataError, PendingRollbackError

    from study.sweep.storage import retrying

    value_too_long = DataError("INSERT ...", {}, ValueError("value too long for type character varying(2048)"))
    for error in (value_too_long, PendingRollbackError("rolled back after an earlier refused statement")):
        storage = retrying(_failing_once(_internal_error(error)), 30.0, "postgresql://db/sweeps")
        with pytest.raises(optuna.exceptions.StorageInternalError):
            storage.get_all_studies()


def test_invocations_ending_at_once_each_keep_their_entry(tmp_path):
    """Hosts sharing a results folder append to invocations.json under a lock: a read-modify-write without one
    drops the entry of whichever wrote first."""
    import multiprocessing

    from study.sweep.layout import SweepLayout

    layout = SweepLayout(tmp_path / "s")
    layout.sweep_dir.mkdir(parents=True)
    procs = [multiprocessing.get_context("fork").Process(target=_append_invocations, args=(layout, 25))
             for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 4
    assert len(read_json(layout.sweep_dir / "invocations.json")) == 100


def _append_invocations(layout, n: int) -> None:
    from study.sweep.runner import _record_invocation

    for _ in range(n):
        _record_invocation(layout, 0.0, 1, 1, {"done": 0})


class _ReplyLostOnce:
    """A storage whose first update of a trial to `state` lands but loses its reply (the connection drops after the
    commit), as a database server restarting at that moment does."""

    def __init__(self, inner, state):
        self.inner, self.state, self.lost = inner, state, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def set_trial_state_values(self, trial_id, state, values=None):
        from sqlalchemy.exc import OperationalError

        done = self.inner.set_trial_state_values(trial_id, state=state, values=values)
        if state == self.state and not self.lost:
            self.lost = True
            raise OperationalError("COMMIT", {}, ConnectionError("server closed the connection unexpectedly"))
        return done


def _queue_losing_one_reply(state, **kwargs):
    import optuna

    from study.sweep.queue import TrialQueue, TrialSpec
    from study.sweep.storage import retrying

    storage = retrying(_ReplyLostOnce(optuna.storages.InMemoryStorage(), state), 30.0, "postgresql://db/sweeps")
    queue = TrialQueue(storage, "s", **kwargs)
    queue.sync([TrialSpec(key="p-s0", point="p", seed=0, label="baseline")])
    return queue


def test_a_completion_whose_reply_was_lost_is_not_mistaken_for_another_workers():
    """The storage committed the COMPLETE but the connection dropped before its reply: the retried call finds the
    trial complete. That is this worker's own update (the token its call wrote), not a trial taken back by another."""
    import optuna

    from study.sweep.queue import TrialQueue, TrialSpec

    queue = _queue_losing_one_reply(optuna.trial.TrialState.COMPLETE)
    storage = queue.storage
    claimed = queue.claim({"p-s0"})
    queue.finish(claimed, "completed", 1.5, {})  # raised UpdateFinishedTrialError before
    (t,) = queue.trials()
    assert (t.state.name, t.values) == ("COMPLETE", [1.5])
    other = TrialQueue(storage, "s")
    other.sync([TrialSpec(key="p-s1", point="p", seed=1, label="baseline")])
    mine = other.claim({"p-s0", "p-s1"})
    other.storage.set_trial_state_values(mine.trial_id, state=optuna.trial.TrialState.FAIL)  # reaped meanwhile
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):
        other.finish(mine, "completed", 1.0, {})


def test_a_failure_whose_reply_was_lost_is_retried_by_the_worker_that_failed_it():
    """The FAIL landed, its reply did not: the retried call is told the trial is already finished. Taken for another
    worker's, the retry would wait for the next `study sweep`; it is this worker's own, so it queues the retry."""
    import optuna

    queue = _queue_losing_one_reply(optuna.trial.TrialState.FAIL)
    claimed = queue.claim({"p-s0"})
    assert queue.fail(claimed, "RuntimeError: boom") is True
    assert [(t.state.name, t.user_attrs["attempt"]) for t in queue.trials()] == [("FAIL", 1), ("WAITING", 2)]


def test_a_claim_whose_reply_was_lost_is_queued_again_without_spending_a_retry():
    """The move to RUNNING landed, its reply did not: the retried call finds the trial running and this worker moves
    on. Nothing ran it, so the reaper queues it again as the same attempt."""
    import optuna

    queue = _queue_losing_one_reply(optuna.trial.TrialState.RUNNING, grace_s=0)
    assert queue.claim({"p-s0"}) is None
    (orphan,) = queue.trials()
    assert orphan.state.name == "RUNNING" and "worker" not in orphan.user_attrs
    time.sleep(0.01)
    assert [requeued for _, requeued in queue.reap()] == [True]
    assert [(t.state.name, t.user_attrs["attempt"]) for t in queue.trials()] == [("FAIL", 1), ("WAITING", 1)]
    assert queue.claim({"p-s0"}).attempt == 1


def _shipped_default(tmp_path: Path) -> Path:
    """A copy of the committed default study as a clean clone has it: the results table, no run directories."""
    import shutil

    repo = Path(__file__).resolve().parents[1]
    shutil.copytree(repo / "results" / "default", tmp_path / "results" / "default",
                    ignore=shutil.ignore_patterns("study.db*"))
    return repo


def test_a_plan_that_would_drop_recorded_trials_whose_run_directories_are_absent_is_refused(tmp_path):
    """On a clean clone the results table is the only record of the committed trials: `--set seeds=[0]` (or another
    spec under the same name) rebuilt the table for the new plan alone, and 22 finished trials left it for good."""
    from study.sweep import SweepOptions, SweepSpecError
    from study.sweep.runner import prepare

    repo = _shipped_default(tmp_path)
    spec = repo / "experiments" / "ablation_default.yaml"
    opts = SweepOptions(results=tmp_path / "results", dry_run=True, estimate_rate=1e11)
    with pytest.raises(SweepSpecError, match=r"holds 22 finished trial\(s\) this spec does not plan"):
        prepare(spec, opts, say=lambda s: None, overrides={"seeds": [0]})
    prepare(spec, opts, say=lambda s: None)  # the spec that ran them: accepted


def test_a_plan_that_leaves_out_finished_trials_whose_run_directories_are_here_says_so(tmp_path, monkeypatch):
    """Their run directories stay, so the plan is accepted; but the folder's table and report then hold the new
    plan's trials alone, and a changed `--set` said only '... newly queued'."""
    import pandas as pd

    from study.sweep import SweepOptions
    from study.sweep.runner import prepare

    repo = _shipped_default(tmp_path)
    monkeypatch.chdir(tmp_path)  # (the table's run_dir paths are relative: results/runs/<point>/seed-<n>)
    for run_dir in pd.read_csv(tmp_path / "results" / "default" / "results.csv")["run_dir"]:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    said: list[str] = []
    prepare(repo / "experiments" / "ablation_default.yaml",
            SweepOptions(results=tmp_path / "results", dry_run=True, estimate_rate=1e11), say=said.append,
            overrides={"seeds": [0]})
    note = next(line for line in said if "note:" in line)
    assert "22 finished trial(s) of the plan this folder last ran are not in this one" in note
    assert "results table and report will hold this plan's trials only" in note


def test_a_recorded_finished_trial_is_kept_over_an_unfinished_attempt_of_it_here(tmp_path):
    """A committed completed row, and a run directory here holding only an interrupted attempt (no record): the
    table said `pending` and lost the recorded result."""
    import pandas as pd

    from study.sweep.layout import SweepLayout
    from study.sweep.results import build_table

    _shipped_default(tmp_path)
    layout = SweepLayout(tmp_path / "results" / "default")
    before = pd.read_csv(layout.sweep_dir / "results.csv")
    row = before[before["status"] == "completed"].iloc[0]
    layout.run_dir(row["point"], int(row["seed"])).mkdir(parents=True)  # an attempt began here, wrote nothing
    after = build_table(layout.sweep_dir).set_index("trial_key")
    assert after.loc[row["trial_key"], "status"] == "completed"
    assert after.loc[row["trial_key"], "metric.valid_loss"] == pytest.approx(row["metric.valid_loss"])


def test_a_results_table_that_cannot_be_read_is_said_so_not_taken_for_a_sweep_that_never_ran(tmp_path):
    """A merge-conflicted CSV beside a truncated parquet: the report said "33 pending (never ran)" and replaced the
    good one, and `study results` rebuilt the table as 33 pending rows, the committed results gone."""
    from study.report.collect import UnreadableTable, load_results
    from study.sweep.results import build_table

    _shipped_default(tmp_path)
    folder = tmp_path / "results" / "default"
    (folder / "results.parquet").write_text("junk")
    (folder / "results.csv").write_text("sweep,point\n<<<<<<< HEAD\n")
    with pytest.raises(UnreadableTable, match=r"results.parquet \(ArrowInvalid.*results.csv \(no trial_key column"):
        load_results(folder)
    with pytest.raises(ValueError, match=r"cannot be read as the table written before"):
        build_table(folder)


def test_a_failed_attempt_is_summarised_by_its_exception_and_its_message_not_the_logs_last_line():
    """A missing dataset failed every trial with the error "    tinyshakespeare/input.txt  (or input.txt.gz)": the
    last line of the log, an indented fragment of the DataError's message, in results.csv and the report."""
    from study.sweep.queue import error_summary

    log = ("Traceback (most recent call last):\n  File \"run.py\", line 3, in <module>\n"
           "study.tasks.data.errors.DatasetUnavailable: dataset 'tinyshakespeare' is not available.\n"
           "  - local: missing file(s) /data/tinyshakespeare/input.txt\n    tinyshakespeare/input.txt  (or .gz)\n")
    assert error_summary(log) == ("study.tasks.data.errors.DatasetUnavailable: dataset 'tinyshakespeare' is not "
                                  "available. - local: missing file(s) /data/tinyshakespeare/input.txt "
                                  "tinyshakespeare/input.txt  (or .gz)")
    assert error_summary("RuntimeError: out of memory\nTraceback...") == "RuntimeError: out of memory"
    assert error_summary("exit code 3") == "exit code 3"


def test_status_creates_no_queue_where_none_is(tmp_path):
    """`study status` of a shipped folder (or with a mistyped --storage path) created an empty SQLite database, and
    its folders, then reported that empty queue as the sweep's."""
    from study.sweep import status

    _shipped_default(tmp_path)
    folder = tmp_path / "results" / "default"
    text = status(folder, f"sqlite:///{tmp_path}/nope/x.db").text
    assert "no queue file at" in text and "finished seed-trial run directories: 0/33" in text
    assert not (tmp_path / "nope").exists()
    assert "no queue file at" in status(folder).text and not (folder / "study.db").exists()


def test_a_killed_attempt_resumed_counts_once_in_the_results_table():
    """A worker killed mid-trial leaves an entry that never ended; the next sweep runs the trial again as the same
    attempt (the queue does not count it), and the table said attempts=2."""
    from study.sweep.results import _attempt_count

    killed, done = {"attempt": 1, "started": 1.0}, {"attempt": 1, "started": 2.0, "ended": 3.0, "outcome": "completed"}
    failed = {"attempt": 1, "started": 0.5, "ended": 0.9, "outcome": "failed"}
    assert _attempt_count([killed, done]) == 1
    assert _attempt_count([failed, killed, done]) == 2
    assert _attempt_count([killed]) == 1 and _attempt_count([]) == 0
