"""Every wait on peers in one place: bounded by the group's timeout, watched, named by phase.

A rank waits on its peers in several places before and inside a collective: the mismatch
check's post and first all-gather, the shared-memory path's set-up, the backend's own wait. Each
goes through :func:`until`, which waits in slices of :data:`POLL_S` and, between slices, lets
the caller answer peers' questions, raises :class:`PeerLostError` for a peer on this machine
whose process ended, shows the wait to the watchdog (:data:`observer`) and, past the deadline,
raises :class:`CollectiveTimeoutError` naming the ranks that never arrived::

    wait = Wait(op="all_reduce", phase="mismatch check", group=group,
                deadline=time.monotonic() + group_timeout_s(group), awaited=missing_posts)
    until(lambda s: store_has_every_post(s), wait)

What ``until`` waits on comes from an adapter: :func:`work_ready` (a backend ``Work``) or
:func:`polled` (keys in a store). A blocking call that cannot be waited on in slices (gloo's
point-to-point ops) stays on its thread and is watched by ``_blocking.beside`` instead, which
shows it through :func:`current` and :data:`observer` as ``until`` does.

While a wait lasts, :func:`current` tells what this thread is waiting in, so a hang report can
say "in the mismatch check of all_reduce" of this rank. The watchdog (``distcompat.diagnostics``,
a layer above) installs :data:`observer` and :data:`explain` through ``_checked.set_hooks``;
nothing here imports it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

from distcompat.collectives._errors import CollectiveTimeoutError, gone_error
from distcompat.peers import gone_peers

__all__ = [
    "POLL",
    "POLL_S",
    "Observer",
    "Wait",
    "current",
    "explain",
    "observer",
    "polled",
    "thread_of",
    "timeout_error",
    "until",
    "work_ready",
]

#: The slice of every wait on peers (seconds): how often a waiting rank looks up.
POLL_S = 0.5
#: The same as a timedelta, for ``Work.wait``.
POLL = timedelta(seconds=POLL_S)


@dataclass(slots=True, kw_only=True)
class Wait:
    """One wait on peers: what for, since when, until when, and who has not arrived.

    ``phase`` reads after "in the" ("mismatch check", "shared-memory set-up", "backend wait");
    ``started`` is when the call began (``time.monotonic()``); ``deadline`` ends the wait with
    :class:`CollectiveTimeoutError` (None: the backend's own timeout ends it); ``awaited``
    returns the global ranks not yet arrived (None: not known). ``record`` is the watchdog's,
    whatever it keeps for the call while it watches this wait. ``call`` is set for a wait
    outside any collective (a point-to-point call, a save's arrival): the call in words ("recv
    from rank 1"), which the watchdog reports as it is; a collective's wait leaves it empty
    (its record says what the call is).

    Example:
        >>> w = Wait(op="all_reduce", phase="mismatch check", group=None, started=0.0)
        >>> w.describe()
        'in the mismatch check of all_reduce'
        >>> Wait(op="recv", phase="backend wait", group=None, call="recv from rank 1").describe()
        'in the backend wait of recv from rank 1'
    """

    op: str
    phase: str
    group: Any
    started: float = field(default_factory=time.monotonic)
    deadline: float | None = None
    awaited: Callable[[], tuple[int, ...] | None] | None = None
    record: Any = None
    call: str = ""

    def describe(self) -> str:
        """``in the <phase> of <op>`` (or of the ``call``): what a report says of the rank."""
        return f"in the {self.phase} of {self.call or self.op}"


class Observer(Protocol):
    """What the watchdog does with a wait that outlasted its first slice."""

    def watch(self, wait: Wait) -> None:
        """Look at a wait every slice: report it as a hang, or raise ``HangError``."""

    def release(self, wait: Wait) -> None:
        """Forget a watched wait once it ends, however it ends."""


#: The active watchdog's look at waits (None: no watchdog); set by ``_checked.set_hooks``.
observer: Observer | None = None
#: Words on the absent ranks from the watchdog's last report (what they were doing, where the
#: dump is), added to a timeout error's message; set by ``_checked.set_hooks``.
explain: Callable[[tuple[int, ...]], str] | None = None

#: thread ident -> the wait that thread is in (only while it outlasts its first slice).
_waits: dict[int, Wait] = {}


def thread_of(wait: Wait) -> int | None:
    """Return the ident of the thread that is in ``wait`` (None if no thread shows it now).

    Example:
        >>> thread_of(Wait(op="recv", phase="backend wait", group=None)) is None
        True
    """
    return next((thread for thread, shown in list(_waits.items()) if shown is wait), None)


def current(thread: int | None = None) -> Wait | None:
    """Return the wait ``thread`` (default: the main thread) is in, if it outlasted one slice.

    Example:
        >>> current() is None
        True
    """
    if thread is None:
        thread = threading.main_thread().ident or 0
    return _waits.get(thread)


def work_ready(work: Any) -> Callable[[float], bool]:
    """Return a ``ready(slice_s)`` for :func:`until` that waits on a backend ``Work``.

    A wait that ends before its slice is over with an error is the op failing (a peer died):
    that error is raised; a slice that runs out is not done yet. A Work with no timed wait
    (torch's Work over a future, which the protected group hands Join for DDP's reducer) is
    looked at instead, and waited on once it is complete.
    """
    untimed = False

    def ready(slice_s: float) -> bool:
        nonlocal untimed
        begun = time.monotonic()
        try:
            if untimed:
                if not polled(work.is_completed)(slice_s):
                    return False
                work.wait()  # complete: returns, or raises the op's error
            else:
                work.wait(timedelta(seconds=slice_s))
        except RuntimeError as exc:
            if not untimed and "with finite timeout not implemented" in str(exc):
                untimed = True
                return ready(max(slice_s - (time.monotonic() - begun), 0.0))
            if time.monotonic() - begun < slice_s * 0.99:
                raise
            return False
        return True

    return ready


#: Longest pause between two looks of :func:`polled` (seconds).
_MAX_PAUSE_S = 0.02


def polled(look: Callable[[], bool]) -> Callable[[float], bool]:
    """Return a ``ready(slice_s)`` for :func:`until` that calls ``look()`` until it is True.

    For waits on keys in a store: ``look`` is one round trip, repeated with pauses that double
    from 0.5 ms to 20 ms (a ``store.wait`` that times out would log a C++ warning each slice).

    Example:
        >>> polled(lambda: True)(0.5)
        True
    """

    def ready(slice_s: float) -> bool:
        end, pause = time.monotonic() + slice_s, 0.0005
        while not look():
            left = end - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, _MAX_PAUSE_S)
        return True

    return ready


def timeout_error(wait: Wait, timeout_s: float) -> CollectiveTimeoutError:
    """Return the error of ``wait`` past its deadline, naming the ranks that never arrived.

    An ``awaited`` that returns None could not ask (the rendezvous store did not answer: a
    network partition, or the store's host is gone); the message says so instead of blaming a
    rank.

    Example:
        >>> w = Wait(op="all_reduce", phase="mismatch check", group=None, awaited=lambda: (1,))
        >>> timeout_error(w, 20.0).peers
        (1,)
        >>> w.awaited = lambda: None
        >>> "the rendezvous store did not answer" in str(timeout_error(w, 20.0))
        True
    """
    absent = wait.awaited() if wait.awaited is not None else None
    ranks = ", ".join(map(str, absent or ()))
    named = f" (rank{'s' if len(absent or ()) > 1 else ''} {ranks})" if absent else ""
    if absent is None and wait.awaited is not None:
        named = " (which ones could not be read: the rendezvous store did not answer)"
    message = (
        f"{wait.op}: timed out after {timeout_s:g}s (the group's timeout elapsed) "
        f"{wait.describe()}: not every rank arrived{named}; a rank stuck elsewhere, or a "
        "collective only some ranks call"
    )
    if absent and explain is not None:
        seen = explain(absent)
        if seen:
            message += f"\n{seen}"
    return CollectiveTimeoutError(
        message, op=wait.op, peer=absent[0] if absent and len(absent) == 1 else None,
        peers=absent or (),
    )  # fmt: skip


def until(
    ready: Callable[[float], bool],
    wait: Wait,
    *,
    between: Callable[[], None] | None = None,
) -> None:
    """Call ``ready(slice_s)`` until it returns True; bounded, watched, and named while it lasts.

    ``ready`` waits at most ``slice_s`` seconds itself. Between slices: ``between()`` (the
    mismatch check answers peers' questions there), a look for peers on this machine whose
    process ended (:class:`PeerLostError`), the watchdog's :meth:`Observer.watch`, and the
    deadline (:func:`timeout_error`). The first slice is plain: a wait that ends within it costs
    no bookkeeping.

    Example:
        >>> until(lambda s: True, Wait(op="barrier", phase="backend wait", group=None))
    """
    if ready(_slice(wait)):
        return
    limit = None if wait.deadline is None else wait.deadline - wait.started  # before watch()
    thread = threading.get_ident()
    outer = _waits.get(thread)
    _waits[thread] = wait
    watched = None
    try:
        while True:
            if between is not None:
                between()
            gone = gone_peers(wait.group)
            if gone:
                raise gone_error(wait.op, gone, f"while this rank waited {wait.describe()}")
            watched = observer
            if watched is not None:
                watched.watch(wait)
            if wait.deadline is not None and time.monotonic() >= wait.deadline:
                raise timeout_error(wait, limit or 0.0)
            if ready(_slice(wait)):
                return
    finally:
        if outer is None:
            _waits.pop(thread, None)
        else:
            _waits[thread] = outer
        if watched is not None:
            watched.release(wait)


def _slice(wait: Wait) -> float:
    """Return the next slice: :data:`POLL_S`, or what is left before the deadline if less."""
    if wait.deadline is None:
        return POLL_S
    return max(0.001, min(POLL_S, wait.deadline - time.monotonic()))
