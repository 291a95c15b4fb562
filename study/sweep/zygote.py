"""Start trial processes without paying the imports each time: a zygote that imports torch, Lightning and the run layer
once, then forks one process per trial.

A fresh `python -m study.sweep.trial` per trial costs its interpreter start and about 5-8 s of imports (torch,
Lightning, the tasks) before training starts: more than the training of a short sweep trial. A forked child of a
process that has already imported them starts in milliseconds, and keeps what a fresh process per trial guarantees:

* its memory is its own and goes back to the OS when it exits;
* it can be killed alone (its pid), and it dies with its worker (the zygote dies with the worker, the child with the
  zygote: PR_SET_PDEATHSIG at each link);
* its RNG state does not depend on earlier trials: torch, NumPy and Python's `random` are seeded from the OS in each
  child, as a new interpreter seeds them (and the run layer then seeds everything from the trial's seed);
* it never holds the storage URL: the zygote is started from the worker with the same environment a trial gets, which
  has no $STUDY_STORAGE, and before the worker reads anything else.

The zygote never runs a torch operation, so no OpenMP thread pool or CUDA context exists when it forks (neither
survives a fork). Its only other threads are the pools NumPy's and torch's OpenBLAS start at import, and OpenBLAS
stops them before every fork (its pthread_atfork handler) and restarts them on its next call: a child is forked
from a single-threaded process, as a fork needs (a lock another thread held would stay locked in the child; Python
3.12's warning about forking a multi-threaded process counts the threads before that handler runs). Each child sets
its own thread count. Python's multiprocessing 'forkserver' does the same for functions; here a child runs the
trial's command line (`study.sweep.trial.main`), so the worker keeps supervising an exit code and a log file, as with
a subprocess.

Protocol (one JSON object per line): the zygote says {"ready": true} once it has imported what it preloads; the
worker writes {"argv", "log", "threads", "env"}; the zygote answers {"pid"} at once and {"pid", "exit"} when that
child ends. The worker writes {"kill": pid} to stop a child: the zygote, its parent, kills it only while it has not
reaped it, so a pid the system has since given to another process is never killed (the worker cannot know that: the
child is not its own). End of input (the worker closed the pipe or died): the zygote kills its children and exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from typing import Any

from study.sweep.trial import DEFAULT_RUNNER

# What the default runner imports before training; a custom runner (the sweep tests' fakes) preloads its own module
# and what every trial's command imports before calling it (TRIAL: study.sweep.trial.main's config and lock).
# torch.utils.cpp_extension loads the axis values' CPU kernels (study/axes/cpu_kernels.py): 0.1 s a trial otherwise.
HEAVY = ("torch", "lightning", "study.run", "study.tasks.lm", "study.tasks.translation", "study.tasks.glue",
         "study.tasks.pretrain", "torch.utils.cpp_extension")
TRIAL = ("study.sweep.trial", "study.config", "study.run.pipeline")


def preload(runner: str) -> None:
    """Import what the trials will use, without creating a CUDA context: a child forked after one cannot use CUDA.
    torch.utils.cpp_extension asks torch.cuda.is_available() when it is imported on a CUDA build where a toolkit is
    found (CUDA_HOME, nvcc on PATH, /usr/local/cuda), which initialises CUDA unless the answer comes from NVML."""
    modules = (*TRIAL, *(HEAVY if runner == DEFAULT_RUNNER else (runner.partition(":")[0],)))
    before = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        for name in modules:
            importlib.import_module(name)
    finally:
        if before is None:  # the trials' own environment, as a fresh process would have it
            del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised while the trial zygote imported its modules, so the trials it would "
                           "fork could not use the GPU: run the sweep with --launcher spawn")


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (PR_SET_PDEATHSIG), so that a killed worker never
    leaves an orphan training into a run directory a retry will use. Linux only; elsewhere a no-op."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


class LineReader:
    """Lines from a pipe with a timeout. (A buffered file object cannot be combined with select: a second line already
    in its buffer would never wake select up.)"""

    def __init__(self, fd: int):
        self.fd, self.buffer = fd, b""

    def readline(self, timeout: float | None) -> str | None:
        """The next line (without its newline); None at end of input; raises TimeoutError after `timeout` s."""
        while b"\n" not in self.buffer:
            ready, _, _ = select.select([self.fd], [], [], timeout)
            if not ready:
                raise TimeoutError
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode()


def _child(request: dict[str, Any], zygote: int) -> None:
    """In the forked child of process `zygote`: output to the trial's log, the trial's environment and threads, run
    it, exit. Never returns (os._exit: the zygote's atexit handlers and buffers are not the child's to run)."""
    code = 1
    try:
        # A process group of its own: killing the trial kills the ranks Lightning's DDP launcher started for it too
        # (they are not its forked children, and nothing would kill them), and ranks it leaves behind are killed
        # when it ends (_reap). Ctrl-C reaches the worker, which kills its trial.
        os.setsid()
        die_with_parent()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if os.getppid() != zygote:  # it died before the line above took effect (the orphan went to init or a subreaper)
            os._exit(1)
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # the zygote's command pipe is not the trial's
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
        threads = str(request["threads"])
        os.environ.update({**(request.get("env") or {}), "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads})
        if "torch" in sys.modules:  # imported before the fork: the variables above come too late for it
            sys.modules["torch"].set_num_threads(int(request["threads"]))
            sys.modules["torch"].seed()  # a new interpreter's generator is seeded from the OS: so is a child's
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()  # (Python's `random` reseeds itself after a fork)
        _become_the_trial_command(request["argv"])
        from study.sweep.trial import main

        code = main(request["argv"]) or 0
    except SystemExit as stop:  # as the interpreter exits: sys.exit() is 0, sys.exit("why") prints why and is 1
        code = 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the trial's error goes to its log, as a subprocess's would
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def _become_the_trial_command(argv: list[str]) -> None:
    """Make this process look like `python -m study.sweep.trial ARGV` to code that re-executes its own command line:
    Lightning's DDP launcher starts ranks 1..n-1 as `[python, -m, __main__.__spec__.name, *sys.argv[1:]]`, which in a
    forked child would otherwise start more zygotes instead of the trial's other ranks."""
    import __main__

    spec = importlib.util.find_spec("study.sweep.trial")
    __main__.__spec__ = spec
    sys.argv = [spec.origin, *argv]


def kill_group(pid: int, leader: bool = True) -> None:
    """SIGKILL the process group a trial leads (the trial and the DDP ranks it started), as far as it still exists,
    and with `leader` the trial itself (a kill that comes before the child made its group). Once the trial has been
    waited for, only the group: its number stays taken while a member lives, a lone pid may be reused."""
    for kill in (os.killpg, os.kill) if leader else (os.killpg,):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _reap(children: set[int], out) -> None:
    """Report every child that has ended, after killing what it left of its group (a DDP rank whose rank zero died
    would otherwise wait in a collective call, holding its memory, until its process-group timeout)."""
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            kill_group(pid, leader=False)
            children.discard(pid)
            out.write(json.dumps({"pid": pid, "exit": os.waitstatus_to_exitcode(status)}) + "\n")
            out.flush()


def serve(runner: str) -> None:
    """The zygote's loop: preload, then fork a child per request until the worker goes away."""
    # Ctrl-C reaches every process of the terminal's group: the worker decides what stops (it kills its trial and
    # closes this zygote), so the zygote must not die first and take the trial's exit code with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")  # the protocol's own descriptor: whatever a preloaded module
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # prints goes to stderr, never into the worker's replies
    preload(runner)
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    commands = LineReader(sys.stdin.fileno())
    children: set[int] = set()
    try:
        while True:
            try:
                line = commands.readline(0.1)
            except TimeoutError:
                _reap(children, out)
                continue
            if line is None:
                break
            request = json.loads(line)
            if "kill" in request:  # only a child not yet reaped: its pid cannot have been given to another process
                if request["kill"] in children:
                    kill_group(request["kill"])
                continue
            out.flush()
            zygote = os.getpid()
            pid = os.fork()
            if pid == 0:
                os.close(out.fileno())  # the replies are the zygote's: the worker must see their end when it dies
                _child(request, zygote)
            children.add(pid)
            out.write(json.dumps({"pid": pid}) + "\n")
            out.flush()
    finally:
        for pid in children:
            kill_group(pid)


class TrialProcess:
    """A forked trial, supervised like a `subprocess.Popen`: `wait(timeout)` (raises subprocess.TimeoutExpired) and
    `kill()`."""

    def __init__(self, zygote: "Zygote", pid: int):
        self.zygote, self.pid, self.returncode = zygote, pid, None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                self.returncode = self.zygote.exit_of(self.pid, timeout)
            except RuntimeError:  # the zygote is gone, and its children with it (PR_SET_PDEATHSIG)
                self.returncode = -signal.SIGKILL
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            self.zygote.kill(self.pid)


class Zygote:
    """The worker's side: start the zygote once, then `start(argv, log, threads, env)` for each trial. Returns once
    the zygote has imported what it preloads (raises RuntimeError where it could not)."""

    def __init__(self, runner: str, env: dict[str, str]):
        self.process = subprocess.Popen([sys.executable, "-m", "study.sweep.zygote", "--runner", runner],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
                                        preexec_fn=die_with_parent)
        self.replies = LineReader(self.process.stdout.fileno())
        # exit codes that arrived while the worker waited for another reply: a child killed but not reaped within
        # the worker's wait (study.sweep.worker) reports its end later, between other replies
        self.exits: dict[int, int] = {}
        if self._receive(None) != {"ready": True}:
            raise RuntimeError("trial zygote: expected its ready line first")

    def start(self, argv: list[str], log: str, threads: int, env: dict[str, str]) -> TrialProcess:
        self._send({"argv": argv, "log": log, "threads": threads, "env": env})
        while "exit" in (message := self._receive(None)):
            self.exits[int(message["pid"])] = int(message["exit"])
        return TrialProcess(self, int(message["pid"]))

    def exit_of(self, pid: int, timeout: float | None) -> int:
        """The exit code of child `pid`, waiting up to `timeout` seconds for it (others' ends kept for them)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while pid not in self.exits:
            message = self._receive(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if "exit" not in message:
                raise RuntimeError(f"trial zygote: expected the end of {pid}, got {message}")
            self.exits[int(message["pid"])] = int(message["exit"])
        return self.exits.pop(pid)

    def kill(self, pid: int) -> None:
        """Kill child `pid` (and its process group) if it still runs; the zygote decides, as its parent (see the
        module's docstring). A zygote already gone took its children with it."""
        with contextlib.suppress(OSError):  # (BrokenPipeError: it is gone)
            self._send({"kill": pid})

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait()

    def _send(self, message: dict[str, Any]) -> None:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def _receive(self, timeout: float | None) -> dict[str, Any]:
        try:
            line = self.replies.readline(timeout)
        except TimeoutError:
            raise subprocess.TimeoutExpired(self.process.args, timeout) from None
        if line is None:
            raise RuntimeError(f"trial zygote exited (code {self.process.wait()})")
        return json.loads(line)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m study.sweep.zygote")
    parser.add_argument("--runner", default=DEFAULT_RUNNER)
    serve(parser.parse_args(argv).runner)
    return 0


if __name__ == "__main__":
    sys.exit(main())
