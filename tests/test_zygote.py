"""The trial zygote: a process that imports once and forks one child per trial. A child runs the trial's command line
with the trial's environment and thread count, writes its output to the trial's log, reports its exit code, can be
killed alone, starts from the same RNG state as every other child, and dies with its worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from study.sweep.zygote import TrialProcess, Zygote

RUNNER = "tests.zygote_runners:run"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def zygote(tmp_path):
    (tmp_path / "point.yaml").write_text(yaml.safe_dump({
        "name": "z", "model": {"preset": "gpt2", "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 16},
        "task": {"name": "lm", "dataset": "tinyshakespeare", "seq_len": 16}}))
    env = {k: v for k, v in os.environ.items() if k != "STUDY_STORAGE"}
    env["PYTHONPATH"] = str(ROOT)
    z = Zygote(RUNNER, env)
    yield z, tmp_path
    z.close()


def _argv(tmp_path: Path, run: str, seed: int = 0) -> list[str]:
    return ["--config", str(tmp_path / "point.yaml"), "--seed", str(seed), "--run-dir", str(tmp_path / run),
            "--runner", RUNNER]


def test_a_child_runs_the_trial_with_its_environment_and_threads_and_logs_its_output(zygote):
    z, tmp = zygote
    child = z.start(_argv(tmp, "a", seed=3), str(tmp / "a.log"), threads=1, env={"STUDY_ZYGOTE_MODE": "ok"})
    assert child.wait(timeout=60) == 0
    out = (tmp / "a" / "out.txt").read_text().split()
    assert out[0] == "seed=3" and out[1] == "mode=ok" and out[2] == "threads=1"
    assert "hello from the trial" in (tmp / "a.log").read_text()


def test_a_forked_trial_relaunches_as_the_trial_command_for_its_other_ddp_ranks(zygote):
    """Lightning starts DDP ranks 1..n-1 by re-running this process's command line: in a forked child that must be
    `python -m study.sweep.trial ARGV`, as a spawned trial's is, not the zygote's."""
    z, tmp = zygote
    argv = _argv(tmp, "ddp")
    assert z.start(argv, str(tmp / "ddp.log"), 1, {"STUDY_ZYGOTE_MODE": "ddp-command"}).wait(60) == 0
    assert (tmp / "ddp" / "command.txt").read_text().split("\n") == [sys.executable, "-m", "study.sweep.trial", *argv]


def test_a_failing_trial_reports_its_exit_code_and_its_traceback_goes_to_the_log(zygote):
    z, tmp = zygote
    child = z.start(_argv(tmp, "b"), str(tmp / "b.log"), threads=1, env={"STUDY_ZYGOTE_MODE": "fail"})
    assert child.wait(timeout=60) == 1
    assert "RuntimeError: scripted failure" in (tmp / "b.log").read_text()


@pytest.mark.parametrize("runner", [RUNNER, "study.run:run_experiment"])
def test_every_child_draws_fresh_random_numbers_as_a_new_interpreter_would(tmp_path, runner):
    """torch and Python's `random` are seeded from the OS in each child (a new interpreter's are): nothing carries
    over from one trial to the next, whether torch was imported before the fork (the default runner preloads it) or
    after. The zygote is a single-threaded process when it forks (the OpenBLAS pools its imports start are stopped
    for the fork), so no lock another thread held is copied locked into the child."""
    env = {k: v for k, v in os.environ.items() if k != "STUDY_STORAGE"}
    z = Zygote(runner, {**env, "PYTHONPATH": str(ROOT)})
    (tmp_path / "point.yaml").write_text(yaml.safe_dump({"name": "z", "task": {"name": "lm"}}))
    draws = []
    try:
        for run in ("c1", "c2"):
            argv = _argv(tmp_path, run)
            argv[-1] = RUNNER  # the trial itself is the scripted one
            assert z.start(argv, str(tmp_path / f"{run}.log"), 1, {"STUDY_ZYGOTE_MODE": "ok"}).wait(120) == 0
            draws.append(dict(kv.split("=") for kv in (tmp_path / run / "out.txt").read_text().split()[3:]))
    finally:
        z.close()
    assert draws[0]["torch"] != draws[1]["torch"] and draws[0]["python"] != draws[1]["python"]
    assert draws[0]["zygote_threads"] == "1"


def test_a_child_can_be_killed_and_a_wait_times_out_meanwhile(zygote):
    z, tmp = zygote
    child = z.start(_argv(tmp, "d"), str(tmp / "d.log"), 1, {"STUDY_ZYGOTE_MODE": "sleep"})
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.5)
    child.kill()
    assert child.wait(timeout=30) == -signal.SIGKILL


def test_an_end_reported_after_the_worker_stopped_waiting_reaches_its_own_trial(zygote):
    """A killed trial the worker stopped waiting for (study.sweep.worker gives it GIVE_BACK_S) reports its end
    later, between the next trial's replies: the next start gets its own pid, each wait its own exit code."""
    z, tmp = zygote
    first = z.start(_argv(tmp, "h"), str(tmp / "h.log"), 1, {"STUDY_ZYGOTE_MODE": "sleep"})
    first.kill()
    time.sleep(1.0)  # its end is in the pipe before the next start's reply
    second = z.start(_argv(tmp, "i"), str(tmp / "i.log"), 1, {"STUDY_ZYGOTE_MODE": "ok"})
    assert second.pid != first.pid
    assert second.wait(timeout=60) == 0
    assert first.wait(timeout=5) == -signal.SIGKILL
    third = z.start(_argv(tmp, "j"), str(tmp / "j.log"), 1, {"STUDY_ZYGOTE_MODE": "sleep"})
    third.kill()
    fourth = z.start(_argv(tmp, "k"), str(tmp / "k.log"), 1, {"STUDY_ZYGOTE_MODE": "ok"})
    assert (fourth.wait(timeout=60), third.wait(timeout=5)) == (0, -signal.SIGKILL)  # ends awaited out of order


def test_a_kill_reaches_only_a_child_the_zygote_has_not_reaped(zygote):
    """The worker kills a trial through the zygote, its parent: once the zygote has reaped a child, its pid may be
    another process's, which the kill must never reach (here a process of ours stands in for one given that pid)."""
    z, tmp = zygote
    child = z.start(_argv(tmp, "e"), str(tmp / "e.log"), 1, {"STUDY_ZYGOTE_MODE": "ok"})
    assert child.wait(timeout=60) == 0
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = TrialProcess(z, bystander.pid)  # a handle whose pid the zygote does not hold (any more)
        stale.kill()
        # the zygote reads its requests in order: once the next child has ended, the kill has been handled
        assert z.start(_argv(tmp, "f"), str(tmp / "f.log"), 1, {"STUDY_ZYGOTE_MODE": "ok"}).wait(60) == 0
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


@pytest.mark.parametrize("mode, code, logged", [("exit-quietly", 0, None), ("exit-with-text", 1, "scripted reason")])
def test_a_trial_that_calls_sys_exit_ends_as_an_interpreter_would(zygote, mode, code, logged):
    z, tmp = zygote
    assert z.start(_argv(tmp, "g"), str(tmp / "g.log"), 1, {"STUDY_ZYGOTE_MODE": mode}).wait(60) == code
    assert logged is None or logged in (tmp / "g.log").read_text()


def test_the_children_die_with_the_worker(tmp_path):
    """A worker killed with SIGKILL takes its zygote, the zygote's trial and the DDP rank the trial started with it
    (the rank is the trial's command with LOCAL_RANK=1, as Lightning starts it; nothing else would kill it)."""
    (tmp_path / "point.yaml").write_text(yaml.safe_dump({"name": "z", "task": {"name": "lm"}}))
    script = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from study.sweep.zygote import TrialProcess, Zygote
        env = dict(os.environ, PYTHONPATH={str(ROOT)!r}, STUDY_ZYGOTE_MODE="rank-trial")
        z = Zygote({RUNNER!r}, env)
        child = z.start({_argv(tmp_path, "e")!r}, {str(tmp_path / "e.log")!r}, 1, {{}})
        print(z.process.pid, child.pid, flush=True)
        time.sleep(600)
    """)
    worker = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    zygote_pid, trial_pid = map(int, worker.stdout.readline().split())
    deadline = time.time() + 60
    ready = [tmp_path / "e" / "sleeping", tmp_path / "e" / "rank.pid"]  # (the rank got to its runner; its pid noted)
    while not all(p.exists() for p in ready) and time.time() < deadline:
        time.sleep(0.1)
    rank_pid = int((tmp_path / "e" / "rank.pid").read_text())
    assert _alive(rank_pid)
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    deadline = time.time() + 10
    while time.time() < deadline and (_alive(zygote_pid) or _alive(trial_pid) or _alive(rank_pid)):
        time.sleep(0.1)
    assert not _alive(zygote_pid) and not _alive(trial_pid) and not _alive(rank_pid)


def test_preloading_asks_cuda_through_nvml_and_refuses_a_cuda_context_before_forking(tmp_path, monkeypatch):
    """torch.utils.cpp_extension asks torch.cuda.is_available() when imported (on a CUDA build with a toolkit in
    sight): answered by NVML while the zygote preloads, it creates no CUDA context, which no forked trial could use.
    If one exists anyway, the zygote stops with the way out rather than fork trials that fail on the GPU."""
    import torch

    from study.sweep.zygote import preload

    (tmp_path / "asks_cuda.py").write_text(
        "import os\nSEEN = os.environ.get('PYTORCH_NVML_BASED_CUDA_CHECK')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    preload("asks_cuda:run")
    assert sys.modules["asks_cuda"].SEEN == "1" and "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA was initialised .* --launcher spawn"):
        preload("asks_cuda:run")


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # (it may end between any two looks)
        return False
    return not stat.rsplit(") ", 1)[1].startswith("Z")  # a zombie has ended


def _wait_gone(pid: int, seconds: float = 10) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline and _alive(pid):
        time.sleep(0.05)
    return not _alive(pid)


@pytest.mark.parametrize("mode", ["rank-sleep", "rank-left"])
def test_the_ddp_ranks_a_trial_started_die_with_it(zygote, mode):
    """Lightning starts a DDP run's other ranks with a plain Popen: killing the trial (a worker stopping it) or the
    trial ending without them (its rank zero failed) must not leave them waiting in a collective call, holding
    their memory and GPU, until a timeout."""
    z, tmp = zygote
    child = z.start(_argv(tmp, mode), str(tmp / f"{mode}.log"), 1, {"STUDY_ZYGOTE_MODE": mode})
    pid_file = tmp / mode / "rank.pid"
    deadline = time.time() + 60
    while not pid_file.is_file() and time.time() < deadline:
        time.sleep(0.05)
    rank = int(pid_file.read_text())
    if mode == "rank-sleep":
        assert _alive(rank)
        child.kill()
    child.wait(timeout=30)
    assert _wait_gone(rank)
