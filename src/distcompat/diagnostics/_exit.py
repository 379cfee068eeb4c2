"""A declared failure ends the process in seconds, even with a collective stuck in the backend.

After a hang is declared (``HangError``), a group timeout (``CollectiveTimeoutError``) or a lost
peer (``PeerLostError``), the op that failed is still pending inside gloo: one of its worker
threads waits for a peer that will not come. Destroying the group joins that thread, and so does
interpreter teardown (``~ProcessGroupGloo``), so a script whose error went unhandled used to print
its traceback and then stay alive until the group timeout (measured: 38 s of a 60 s timeout in
``destroy_process_group``; 10 minutes by default), and the launcher saw no failure.

:func:`distcompat.init_distributed` calls :func:`install` for every group it makes or adopts::

    install()            # sys.excepthook (chained) and an atexit check; idempotent

* Every unhandled exception is first written to the store as this rank's farewell
  (``_peers.leave_farewell``, one bounded request): a peer that sees this rank end says which
  exception ended it and where (``rank 1 exited after ValueError: ... at train.py:88``).
* An unhandled exception whose chain (``__cause__``/``__context__``) holds a
  :class:`~distcompat.CollectiveTimeoutError` or :class:`~distcompat.PeerLostError` is printed
  by the previous hook as usual; then a deadline of :data:`EXIT_GRACE_S` seconds is armed and
  teardown goes on (atexit handlers, flushing). If it has not finished by then, the process ends
  with exit code 1 (``faulthandler.dump_traceback_later(exit=True)``: a C thread that still runs
  while the interpreter tears down, where no Python thread can).
* At exit, the same deadline is armed when a failure was :func:`noted <note_failure>` (the
  watchdog notes every failed wait), so ``except HangError: sys.exit(1)`` ends promptly too.
* :func:`failure_seen` tells ``destroy_distributed`` not to destroy a group with a stuck op: it
  would wait for it. A new group (made after the failed one was destroyed) forgets the failure.

The deadline replaces a ``faulthandler.dump_traceback_later`` the application armed itself; a
``sys.excepthook`` installed after init and not chained to ours bypasses the first rule.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import sys
from types import TracebackType

from distcompat.collectives._errors import CollectiveTimeoutError, PeerLostError
from distcompat.peers import leave_farewell

__all__ = [
    "EXIT_GRACE_S",
    "declared_failure",
    "failure_seen",
    "forget_failures",
    "install",
    "note_failure",
]

#: Seconds teardown gets after a declared failure before the process is ended (exit code 1).
EXIT_GRACE_S = 5.0
_DECLARED = (CollectiveTimeoutError, PeerLostError)


class _State:
    def __init__(self) -> None:
        self.previous: object = None  # the excepthook we chained to
        self.installed = False
        self.noted: str | None = None  # the first failure noted in this process
        self.armed = False


_state = _State()


def declared_failure(exc: BaseException | None) -> BaseException | None:
    """Return the timeout or lost-peer error in ``exc``'s chain (itself, cause, context), if any.

    Example:
        >>> from distcompat.collectives import PeerLostError
        >>> lost = PeerLostError("gone", op="all_reduce", peer=1)
        >>> wrapped = RuntimeError("training failed")
        >>> wrapped.__cause__ = lost
        >>> declared_failure(wrapped) is lost, declared_failure(ValueError("x"))
        (True, None)
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, _DECLARED):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def note_failure(what: str) -> None:
    """Record that a collective of this process failed (the group holds a stuck op).

    Example:
        >>> note_failure("all_reduce: HangError")   # doctest: +SKIP
    """
    if _state.noted is None:
        _state.noted = what


def forget_failures() -> None:
    """Forget noted failures: the group that held the failed op is gone (a new one is made).

    Example:
        >>> forget_failures()
    """
    _state.noted = None


def failure_seen() -> str | None:
    """Say what failed, if a collective failed here or the exception being handled is one.

    Example:
        >>> forget_failures()
        >>> failure_seen() is None
        True
    """
    if _state.noted is not None:
        return _state.noted
    current = declared_failure(sys.exc_info()[1])  # inside `finally:` / `__exit__` too
    return None if current is None else type(current).__name__


def install() -> None:
    """Chain the excepthook and register the atexit check, once per process.

    Never undone: torch's ``init_process_group`` chains its own hook over whatever is installed,
    so ours stays in the chain, and installing it a second time would call itself.

    Example:
        >>> install()   # doctest: +SKIP
    """
    if _state.installed:
        return
    _state.installed = True
    _state.previous = sys.excepthook
    sys.excepthook = _excepthook
    atexit.register(_at_exit)


def _excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    leave_farewell(value)  # first: the peers that see this rank end name the exception
    previous = _state.previous if callable(_state.previous) else sys.__excepthook__
    previous(kind, value, tb)
    failure = declared_failure(value)
    if failure is not None:
        _arm(type(failure).__name__)


def _at_exit() -> None:
    leave_farewell(None)  # the script ended (unless an exception's farewell was written)
    if _state.noted is not None:
        _arm(_state.noted)


def _arm(what: str) -> None:
    """Flush, say so in one line, and end the process if teardown outlives the grace."""
    if _state.armed:
        return
    _state.armed = True
    with contextlib.suppress(OSError, ValueError, AttributeError):  # a closed or odd stream
        sys.stdout.flush()
        sys.stderr.write(
            f"distcompat: a collective failed ({what}); this process ends within "
            f"{EXIT_GRACE_S:g}s even if the backend still waits in it\n"
        )
        sys.stderr.flush()
    # faulthandler writes every thread's stack before it exits; nobody needs them here (the
    # error was printed), so they go to /dev/null. The descriptor stays open for the process.
    sink = os.open(os.devnull, os.O_WRONLY)
    faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True, file=sink)
