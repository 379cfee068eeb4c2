"""SIGTERM after a peer ended: the watch's line naming that peer is written before this rank dies.

A launcher that sees one rank fail stops the others: torchrun's agent looks every 0.1 s, then
sends every other worker SIGTERM (the one launcher measured here; any SIGTERM is met the same
way). Under the default action the kernel ends a rank at that signal at once, so when the
signal came inside the few milliseconds between the peer's end and the watch's line, the line
was never written (measured with torchrun on torch 2.9.1, two busy cores beside it: the line
0.5-6 ms after the peer's end, the agent's SIGTERM 4-90 ms after it, the line lost in 1 run of
20; CI lost it once).

So where SIGTERM has the default action when the watch starts on the main thread, a handler
goes in that keeps that action's outcome: the process still ends by SIGTERM (its parent sees
``-15``, no ``atexit`` hook or ``finally`` runs), after the watch has recorded and logged every
peer whose end it can see by then. :func:`install` also points Python's wakeup fd
(``signal.set_wakeup_fd``) at a pipe the watch thread polls: the C half of Python's handling
writes the signal's number there at once, so the watch thread settles and ends the process
even while the main thread sits in a long native call (a matmul, a C++ collective), where the
Python handler would run only when the call returns. The Python handler on the main thread
asks the watch as well (a wakeup fd set by someone else is not ours) and waits for it, at
most :data:`WAIT_S`, then ends the process itself.

What stays as it was: a program that handles SIGTERM itself, before or after ``init`` (one
installed later replaces this handler; if it calls the handler it replaced, this one returns at
once and the process lives on as that program decides, the lines written); ``init`` outside the
main thread (nothing installed: the line races the launcher as before); a child made by
``fork`` (DataLoader workers): SIGTERM's default action and no wakeup fd, as before. With no fd
left for the pipe, the handler goes in without a wakeup fd and asks the watch from the main thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

from distcompat._scarcity import ran_out

__all__ = ["WAIT_S", "end", "install", "installed", "read_fd", "uninstall", "woken_by_term"]

#: How long the main thread's handler waits for the watch thread to end the process (seconds):
#: past the store's bound on reading a farewell (``_store.TIMEOUT_S``).
WAIT_S = 3.0

_SIGNAL = signal.SIGTERM

# The pipe Python's wakeup fd writes to: made once, kept for the process (an fd number closed
# while Python still writes to it would take bytes meant for whatever file gets that number).
_pipe: tuple[int, int] | None = None
_owner = 0  # the pid that installed the handler; a forked child is not it
_ask: Callable[[], bool] | None = None  # tells the watch to settle and end it; False: no watch
_forks_hooked = False


def installed() -> bool:
    """Return True while this module's handler is the one SIGTERM runs in this process.

    Example:
        >>> installed()
        False
    """
    return os.getpid() == _owner and signal.getsignal(_SIGNAL) is _handler


def install(ask: Callable[[], bool]) -> str:
    """Put the handler in where SIGTERM has its default action; return what was done.

    ``ask`` tells the watch thread to settle and end the process (it must not block; False:
    no thread will). Example:
        >>> install(lambda: False).split(":")[0] in ("installed", "not installed")
        True
        >>> uninstall()
    """
    global _ask, _owner, _forks_hooked
    if threading.current_thread() is not threading.main_thread():
        return "not installed: init ran outside the main thread, where signals are set"
    if signal.getsignal(_SIGNAL) is _handler and os.getpid() == _owner:
        _ask = ask
        return "installed: SIGTERM waits for the watch's lines"
    if signal.getsignal(_SIGNAL) != signal.SIG_DFL:
        return "not installed: the program handles SIGTERM itself"
    _ask, _owner = ask, os.getpid()
    signal.signal(_SIGNAL, _handler)
    if not _forks_hooked:
        os.register_at_fork(after_in_child=_in_child)
        _forks_hooked = True
    try:
        _, write = _wakeup_pipe()
    except OSError as exc:  # no fd left: the handler asks the watch from the main thread
        why = ran_out(exc.errno) or str(exc)
        return f"installed: SIGTERM waits for the watch's lines (no wakeup fd: {why})"
    before = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    if before not in (-1, write):  # someone's (asyncio's): theirs stays; the handler asks
        signal.set_wakeup_fd(before)
        return "installed: SIGTERM waits for the watch's lines (another wakeup fd was set)"
    return "installed: SIGTERM waits for the watch's lines"


def uninstall() -> None:
    """Put SIGTERM's default action and the wakeup fd back, where ours are still there.

    Off the main thread nothing can be put back: the handler then acts as the default action
    would (no watch to wait for). Example:
        >>> uninstall()
    """
    global _ask
    _ask = None
    if threading.current_thread() is not threading.main_thread() or os.getpid() != _owner:
        return
    if signal.getsignal(_SIGNAL) is _handler:
        signal.signal(_SIGNAL, signal.SIG_DFL)
    if _pipe is not None:
        now = signal.set_wakeup_fd(-1)
        if now != _pipe[1]:
            signal.set_wakeup_fd(now)


def read_fd() -> int | None:
    """Return the pipe end the watch thread polls for the wakeup fd's bytes (None: no pipe).

    Example:
        >>> read_fd() is None or read_fd() >= 0
        True
    """
    return None if _pipe is None else _pipe[0]


def woken_by_term() -> bool:
    """Read what the wakeup fd wrote so far; return True when SIGTERM was among it.

    Example:
        >>> woken_by_term()
        False
    """
    if _pipe is None:
        return False
    got = b""
    with contextlib.suppress(BlockingIOError, InterruptedError):
        while chunk := os.read(_pipe[0], 512):
            got += chunk
    return int(_SIGNAL) in got


def end() -> None:
    """End this process as SIGTERM's default action would (its parent sees ``-15``).

    Callable from any thread: off the main thread the action is put back through libc, since
    Python lets only the main thread set handlers. Example (it does not return)::

        end()   # the parent sees returncode -15, as after the default action
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(_SIGNAL, signal.SIG_DFL)
    else:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal(ctypes.c_int(int(_SIGNAL)), ctypes.c_void_p(0))  # SIG_DFL
    os.kill(os.getpid(), _SIGNAL)
    time.sleep(1.0)  # the kernel ends the process on delivery; this is never passed
    os._exit(128 + int(_SIGNAL))


def _handler(signum: int, frame: FrameType | None) -> None:
    """SIGTERM on the main thread: let the watch write its lines and end the process."""
    if signal.getsignal(_SIGNAL) is not _handler:
        return  # called by a program's own handler, which replaced this one: its decision
    ask = _ask
    if os.getpid() == _owner and ask is not None and ask():
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:  # the watch thread ends the process meanwhile
            time.sleep(0.01)
    end()


def _wakeup_pipe() -> tuple[int, int]:
    global _pipe
    if _pipe is None:
        read, write = os.pipe()  # close-on-exec: a program run by exec does not get it
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        _pipe = (read, write)
    return _pipe


def _in_child() -> None:
    """In a child made by fork: SIGTERM's default action and no wakeup fd, as before init."""
    global _ask
    _ask = None
    with contextlib.suppress(ValueError, OSError):
        if signal.getsignal(_SIGNAL) is _handler:
            signal.signal(_SIGNAL, signal.SIG_DFL)
        if _pipe is not None:
            now = signal.set_wakeup_fd(-1)
            if now != _pipe[1]:  # someone else's: theirs to keep
                signal.set_wakeup_fd(now)
