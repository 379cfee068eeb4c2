"""A live job dumped on demand: a signal to any rank, and every rank writes where it is.

``init_distributed`` installs a handler for :data:`SIGNAL` (SIGUSR2) where the program has none.
Sent to any rank (``kill -USR2 PID``, or ``distcompat dump PID``), it has that rank's watchdog
raise an on-demand incident in the rendezvous store; every rank's watchdog thread answers it as
it answers a hang, without stopping anything: its Python stacks and collective history go into
``<dump_dir>/<job>/incident-<N>/`` (distcompat's JSON and torch's Flight Recorder format, which
``distcompat diagnose`` and ``fr_trace`` read), and the rank that was asked logs the report,
which names a rank that did not answer (stopped, or holding the GIL in native code).

The Python handler runs on the main thread between bytecodes: within a wait's slice (0.5 s)
when the main thread waits in a distcompat collective, later when it is inside a long native
call. The handler only wakes the watchdog's thread; the dump itself is made there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from types import FrameType

from distcompat.diagnostics import _hooks

__all__ = ["SIGNAL", "install", "request"]

#: The signal that asks for a dump (SIGUSR1 is Slurm's and Lightning's requeue signal).
SIGNAL = signal.SIGUSR2

_installed = False


def request(who: str) -> bool:
    """Ask every rank for a dump through this rank's watchdog; False when none is running.

    Example:
        >>> request("a test")   # no watchdog running here
        False
    """
    with _hooks.state.lock:
        watching = _hooks.state.watchdogs[-1] if _hooks.state.watchdogs else None
    if watching is None:
        return False
    watching.dump_now(who)
    return True


def _handler(signum: int, frame: FrameType | None) -> None:
    from distcompat._ranks import get_rank  # the handler runs after init: nothing new to load

    request(f"{signal.Signals(signum).name} to rank {get_rank()} (pid {os.getpid()})")


def install() -> str:
    """Install the handler once, where :data:`SIGNAL` has none; return what was done.

    Example:
        >>> install().split(":")[0] in ("installed", "not installed")
        True
    """
    global _installed
    if _installed:
        return f"installed: {SIGNAL.name} asks every rank for a dump"
    if threading.current_thread() is not threading.main_thread():
        return "not installed: init ran outside the main thread, where signals are set"
    with contextlib.suppress(ValueError, OSError):
        current = signal.getsignal(SIGNAL)
        if current not in (signal.SIG_DFL, None):
            return f"not installed: the program handles {SIGNAL.name} itself"
        signal.signal(SIGNAL, _handler)
        _installed = True
        return f"installed: {SIGNAL.name} asks every rank for a dump"
    return f"not installed: {SIGNAL.name} cannot be handled here"
