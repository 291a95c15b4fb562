"""Ctrl-C and SIGTERM reach the code they interrupt, even when they land in a finalizer.

Python runs a signal's handler in the main thread between two bytecodes, wherever they are: inside a `__del__` or a
weakref callback too, which garbage collection may run at any allocation (SQLAlchemy, under Optuna's RDB storage,
keeps weakref callbacks). An exception raised there cannot propagate: Python prints "Exception ignored in ..." with a
traceback and carries on. So the KeyboardInterrupt of a Ctrl-C, or the SystemExit of a SIGTERM, is lost: the process
keeps running and the terminal shows a traceback. The sweep's Ctrl-C test (tests/test_sweep.py) met it once in many
runs, in SQLAlchemy's `_collection_gced`.

`deliver_interrupts` installs the two handlers and an unraisable hook that, for an interrupt lost in a finalizer,
prints nothing and sends the same signal again a moment later, from a timer thread: sent from the hook itself, it
would be raised inside the hook, where it would be lost again. No library does this; Python's own documentation
(signal, "Note on Signal Handlers and Exceptions") leaves it to the program.
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import sys
import threading

REDELIVER_AFTER_S = 0.01  # the hook returns in microseconds; the signal comes back once it has


class Terminated(SystemExit):
    """SIGTERM (`kill PID`, a batch scheduler's stop): exits 143 as a process killed by it would, after the cleanup
    a `finally` or `except BaseException` does (a sweep's worker gives its trial back)."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


_STOPPING = (signal.SIGINT, signal.SIGTERM)
_lost: list[BaseException] = []  # an interrupt lost in a finalizer while the handlers ignore signals: raised again


def _raise_for(signum: int) -> None:
    raise KeyboardInterrupt() if signum == signal.SIGINT else Terminated()


def _terminate(signum, frame) -> None:
    _raise_for(signum)


def _stop_once(signum, frame) -> None:
    """The first Ctrl-C or SIGTERM stops the process; those after it are ignored, so that the cleanup it starts (a
    worker giving its trial back) runs to its end. Lightning's own handlers do the same. `_ignored`, not SIG_IGN: a
    signal already pending when the handler changed would otherwise be reported as 'ignored due to race condition'."""
    for other in _STOPPING:
        if signal.getsignal(other) is _stop_once:
            signal.signal(other, _ignored)
    _raise_for(signum)


def _ignored(signum, frame) -> None:
    if _lost:  # the one interrupt that stops the process, lost in a finalizer and sent again by `_redelivering_hook`
        raise _lost.pop()


def _lost_signal(exc: BaseException | None) -> int | None:
    if isinstance(exc, KeyboardInterrupt):
        return signal.SIGINT
    if isinstance(exc, Terminated):
        return signal.SIGTERM
    return None


def _redelivering_hook(previous):
    def hook(unraisable) -> None:
        signum = _lost_signal(unraisable.exc_value)
        if signum is None:
            previous(unraisable)
            return
        if signal.getsignal(signum) is _ignored:  # `_stop_once` disarmed it before raising: the handler re-raises
            _lost[:] = [unraisable.exc_value]
        timer = threading.Timer(REDELIVER_AFTER_S, _thread.interrupt_main, (signum,))
        timer.daemon = True
        timer.start()

    hook.redelivers = True
    return hook


@contextlib.contextmanager
def shielded():
    """Ctrl-C and SIGTERM are ignored while the block runs (main thread only): the cleanup after an interrupt (a sweep
    worker giving its trial back to the queue, `study sweep` waiting for its workers to) is not cut short by a second
    Ctrl-C or a SIGTERM, which would leave a trial running in the queue until its heartbeat went stale."""
    previous = {signum: signal.signal(signum, _ignored) for signum in _STOPPING}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def deliver_interrupts(sigterm: bool = True, once: bool = False) -> None:
    """In the main thread: SIGTERM (where `sigterm`) raises Terminated, and it or Ctrl-C's KeyboardInterrupt, when
    lost in a finalizer, is delivered again rather than printed and dropped. `once`: the first of them stops the
    process and later ones are ignored (`_stop_once`). Ctrl-C keeps the handler Python gave it (none where the process
    was started with SIGINT ignored, as a shell's background job is), made `once` where asked. Idempotent."""
    if sigterm:
        signal.signal(signal.SIGTERM, _stop_once if once else _terminate)
    if once and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _stop_once)
    if not getattr(sys.unraisablehook, "redelivers", False):
        sys.unraisablehook = _redelivering_hook(sys.unraisablehook)
