"""Blocking backend calls that cannot be waited on in slices, watched from beside them.

gloo's point-to-point ``Work.wait(timeout)`` that runs out closes every pair of the group
("Application timeout caused pair closure", torch 2.13), so such a call cannot go through
``_wait.until``'s slices where it blocks. :func:`beside` leaves the call on the calling thread
and has one watcher thread show it to the watchdog once it outlasts a slice (blocking
``send``/``recv``, a checkpoint save's arrival). Running the call on a helper thread while the
caller waits in ``until`` was tried and dropped: it cost a small send/recv round trip 1.5-2x,
and such helpers (daemon threads that make gloo calls) were one of two suspects when CI saw two
SIGABRTs at exit ("terminate called without an active exception").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from distcompat.collectives import _wait
from distcompat.collectives._wait import POLL_S, Observer, Wait

__all__ = ["beside"]

T = TypeVar("T")


class _Beside:
    """A call in progress on ``thread`` that the watcher may look at (see :func:`beside`)."""

    __slots__ = ("lock", "make", "started", "thread", "wait", "watched")

    def __init__(self, make: Callable[[float], Wait], started: float, thread: int) -> None:
        self.make, self.started, self.thread = make, started, thread
        self.lock = threading.Lock()  # held by the watcher while it looks at this call
        self.wait: Wait | None = None  # made by the watcher once the call outlasts a slice
        self.watched: Observer | None = None


#: Calls made through :func:`beside` now, by ``id``; the watcher thread, once started.
_beside: dict[int, _Beside] = {}
_watcher: threading.Thread | None = None


def beside(call: Callable[[], T], make: Callable[[float], Wait]) -> T:
    """Return ``call()``, made on this thread, while a thread beside it watches the call.

    For a blocking backend call that cannot be sliced (module docstring): the call costs a
    registration, about 1 us. One watcher thread looks every :data:`POLL_S` at the
    calls older than a slice: it makes their :class:`Wait` (``make(started)``), shows it as the
    calling thread's wait (``_wait.current``) and to the watchdog (``_wait.observer``). What it
    cannot do is end the call: the backend's own timeout (the group's) and its error for a lost
    peer do, and a raising watchdog's ``HangError`` is not raised (its report is made).

    Example:
        >>> beside(lambda: 6 * 7, lambda t: Wait(op="recv", phase="backend wait", group=None))
        42
    """
    global _watcher
    if _watcher is None or not _watcher.is_alive():  # none yet, or lost in a fork
        _watcher = threading.Thread(target=_watch_beside, name="distcompat-beside", daemon=True)
        _watcher.start()
    entry = _Beside(make, time.monotonic(), threading.get_ident())
    key = id(entry)
    _beside[key] = entry
    try:
        return call()
    finally:
        del _beside[key]
        # The watcher looks at a call only while it is registered, holding its lock: once it is
        # gone from _beside and the lock is free, the watcher is done with it.
        if entry.wait is not None or entry.lock.locked():
            with entry.lock:
                if _wait._waits.get(entry.thread) is entry.wait:
                    del _wait._waits[entry.thread]
                if entry.watched is not None and entry.wait is not None:
                    entry.watched.release(entry.wait)


def _watch_beside() -> None:
    while True:
        time.sleep(POLL_S)
        now = time.monotonic()
        for key, entry in list(_beside.items()):
            if now - entry.started < POLL_S:
                continue
            with entry.lock:
                if key not in _beside:  # the call returned meanwhile
                    continue
                try:
                    if entry.wait is None:
                        entry.wait = entry.make(entry.started)
                    _wait._waits.setdefault(entry.thread, entry.wait)
                    entry.watched = entry.watched or _wait.observer
                    if entry.watched is not None:
                        entry.watched.watch(entry.wait)
                except Exception:  # a raising watchdog's HangError (reported, not raisable
                    continue  # here), or anything else: the watcher goes on for other calls
