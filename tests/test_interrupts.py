"""A Ctrl-C or SIGTERM that lands in a finalizer (a weakref callback that garbage collection runs, as SQLAlchemy's
are) still stops the program, quietly; without study.interrupts Python prints the exception as ignored and runs on."""

import signal
import subprocess
import sys
import textwrap

import pytest

# The signal arrives while a weakref callback runs: its handler raises inside the callback, where the exception
# cannot propagate. The main code then loops for up to 5 s; it must be interrupted, not run to its end.
SCRIPT = textwrap.dedent("""
    import signal, sys, time, weakref
    from study.interrupts import deliver_interrupts

    if sys.argv[2] in ("on", "once"):
        deliver_interrupts(sigterm=True, once=sys.argv[2] == "once")
    else:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signum = getattr(signal, sys.argv[1])

    class Resource:
        pass

    def collected(ref):
        signal.raise_signal(signum)
        print("the callback went on", flush=True)

    resource = Resource()
    ref = weakref.ref(resource, collected)
    try:
        del resource
        deadline = time.time() + 5
        while time.time() < deadline:
            time.sleep(0.001)
        print("ran to the end", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        if sys.argv[2] == "once":  # a second signal during the cleanup is ignored: the cleanup runs to its end
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGINT)
            print("cleaned up", flush=True)
        sys.exit(130)
""")


def _run(signame: str, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, signame, mode], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("mode", ["on", "once"])
@pytest.mark.parametrize(("signame", "code"), [("SIGINT", 130), ("SIGTERM", 128 + signal.SIGTERM)])
def test_an_interrupt_raised_in_a_finalizer_stops_the_program_without_a_traceback(signame, code, mode):
    done = _run(signame, mode)
    assert done.returncode == code, done.stdout + done.stderr
    assert "ran to the end" not in done.stdout and "the callback went on" not in done.stdout
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    if mode == "once" and signame == "SIGINT":
        assert "cleaned up" in done.stdout, done.stdout + done.stderr


def test_after_the_first_interrupt_a_once_process_ignores_the_next_even_when_both_were_pending():
    """`study sweep` stops its workers with SIGTERM right after the terminal's Ctrl-C reached them: a worker that
    gets the CPU late has both pending. The first stops it; the second must not cut its cleanup short."""
    script = textwrap.dedent("""
        import os, signal, sys
        from study.interrupts import deliver_interrupts

        deliver_interrupts(sigterm=True, once=True)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        try:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
            print("not interrupted", flush=True)
        except BaseException as first:
            total = sum(range(100000))  # the cleanup: many bytecodes, where the pending SIGTERM would be raised
            print(f"cleaned up after {type(first).__name__}", flush=True)
            sys.exit(130)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 130 and "cleaned up after KeyboardInterrupt" in done.stdout, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "race condition" not in done.stderr, done.stderr


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_without_it_python_drops_the_interrupt_and_prints_it_as_ignored(signame):
    """Why the module exists: the same script with Python's own handling runs on (the test above can fail)."""
    done = _run(signame, "off")
    assert done.returncode == 0 and "ran to the end" in done.stdout
    assert "Exception ignored" in done.stderr


def test_installing_it_twice_wraps_the_hook_once():
    from study.interrupts import deliver_interrupts

    before, handler = sys.unraisablehook, signal.getsignal(signal.SIGTERM)
    try:
        deliver_interrupts(sigterm=False)
        hook = sys.unraisablehook
        deliver_interrupts(sigterm=False)
        assert sys.unraisablehook is hook and signal.getsignal(signal.SIGTERM) is handler
    finally:
        sys.unraisablehook = before


def test_a_shielded_block_runs_to_its_end_through_ctrl_c_and_sigterm_and_the_handlers_come_back():
    """A worker's give-back after an interrupt: the second Ctrl-C, or `study sweep`'s SIGTERM, does not cut it short."""
    import os

    from study.interrupts import deliver_interrupts, shielded

    before_hook, before = sys.unraisablehook, {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        deliver_interrupts(sigterm=True)
        handlers = {s: signal.getsignal(s) for s in before}
        steps = []
        with shielded():
            for signum in (signal.SIGINT, signal.SIGTERM):
                os.kill(os.getpid(), signum)
                steps.append(signum)
        assert steps == [signal.SIGINT, signal.SIGTERM]
        assert {s: signal.getsignal(s) for s in before} == handlers
        with pytest.raises(SystemExit) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
        assert stopped.value.code == 143
    finally:
        sys.unraisablehook = before_hook
        for signum, handler in before.items():
            signal.signal(signum, handler)
