"""Blocking backend calls that cannot be waited on in slices: run aside, or watched beside.

gloo's point-to-point ``Work.wait(timeout)`` that runs out closes every pair of the group
("Application timeout caused pair closure", torch 2.13), so such a call cannot go through
``_wait.until``'s slices where it blocks. Two ways round, by what the call may cost:

* :class:`Aside` runs the call on a helper thread while the caller waits for it in ``until``
  (bounded by the caller's own deadline, watched, a lost peer raised): for rare waits with a
  deadline shorter than the backend's (a checkpoint save's arrival);
* :func:`beside` leaves the call on the calling thread and has one watcher thread show it to the
  watchdog once it outlasts a slice: for calls on the hot path (blocking ``send``/``recv``),
  where the hand-over to a helper cost more than the call.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from distcompat.collectives import _wait
from distcompat.collectives._wait import POLL_S, Observer, Wait

__all__ = ["EXIT_WAIT_S", "Aside", "beside"]

T = TypeVar("T")


class Aside(Generic[T]):
    """A blocking backend call run on a helper thread; :meth:`ready` waits for it in slices.

    For a wait that cannot be sliced where it blocks: a gloo point-to-point ``Work.wait(timeout)``
    that runs out closes every pair of the group ("Application timeout caused pair closure",
    measured on torch 2.13), so ``_wait.work_ready`` would break the group after half a second.
    The call runs whole on a helper thread (its own timeout, the group's, still ends it) and the
    waiting thread waits for the helper in ``_wait.until``'s slices, which cost nothing::

        call = Aside(lambda: dist.recv(tensor, src=1))
        until(call.ready, Wait(op="recv", phase="backend wait", group=None))
        sender = call.value

    Helpers are daemon threads kept for reuse: one per call in progress, none started while one
    is idle. A call left behind by a wait that gave up (a timeout, a lost peer) keeps its helper
    until the backend ends it; at exit, busy helpers get :data:`EXIT_WAIT_S` to finish first
    (on Python 3.11 a daemon thread that returns from C++ while the interpreter is finalizing
    is ended by ``pthread_exit``, which aborts the process: measured, "terminate called without
    an active exception" when the group's timeout ended a recv just after the wait gave up).

    Example:
        >>> call = Aside(lambda: 6 * 7)
        >>> call.ready(0.5), call.value
        (True, 42)
    """

    __slots__ = ("_call", "_done", "_error", "_value")

    def __init__(self, call: Callable[[], T]) -> None:
        self._call: Callable[[], T] | None = call
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._value: T | None = None
        _Helper.take(self)

    def ready(self, slice_s: float) -> bool:
        """Wait at most ``slice_s`` seconds for the call; raise its error if it failed."""
        if not self._done.wait(slice_s):
            return False
        if self._error is not None:
            raise self._error
        return True

    @property
    def value(self) -> T:
        """What the call returned (only once :meth:`ready` said True)."""
        assert self._done.is_set(), "the call has not returned yet"
        assert self._error is None, "the call failed: ready() raised its error"
        return self._value  # type: ignore[return-value]

    def run(self) -> None:
        """Run the call (on a helper thread) and keep its outcome."""
        call, self._call = self._call, None
        try:
            if call is not None:
                self._value = call()
        except BaseException as exc:  # handed to the waiting thread by ready()
            self._error = exc
        finally:
            del call  # hold no backend object once done
            self._done.set()


class _Helper:
    """One daemon thread that runs :class:`Aside` calls, one at a time, idle in between."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Aside[Any]] = queue.SimpleQueue()
        self._job: Aside[Any] | None = None  # the call in progress
        self._thread = threading.Thread(target=self._serve, name="distcompat-aside", daemon=True)
        with _helpers_lock:
            if not _all_helpers:
                atexit.register(_finish_at_exit)
            _all_helpers.append(self)
        self._thread.start()

    @classmethod
    def take(cls, job: Aside[Any]) -> None:
        """Hand ``job`` to an idle helper, or to a new one if none is idle."""
        with _helpers_lock:
            helper = _idle_helpers.pop() if _idle_helpers else None
        if helper is None or not helper._thread.is_alive():  # not alive: forked from its process
            helper = cls()
        helper._job = job
        helper._jobs.put(job)

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            job.run()
            self._job = None
            del job  # an idle helper holds nothing (a backend Work destroyed at teardown aborts)
            with _helpers_lock:
                _idle_helpers.append(self)


#: Seconds the exit waits for calls still in progress on helpers (see :class:`Aside`).
EXIT_WAIT_S = 2.0
#: Helpers waiting for a call (the newest last: reused first), and every helper started.
_idle_helpers: list[_Helper] = []
_all_helpers: list[_Helper] = []
_helpers_lock = threading.Lock()


def _finish_at_exit() -> None:
    """Give calls in progress on helpers :data:`EXIT_WAIT_S` to end before finalization."""
    end = time.monotonic() + EXIT_WAIT_S
    for helper in list(_all_helpers):
        job = helper._job
        if job is not None and helper._thread.is_alive():
            job._done.wait(max(0.0, end - time.monotonic()))  # its outcome is nobody's now


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

    For a blocking backend call that cannot be sliced (a timed gloo point-to-point wait that
    runs out closes the group's pairs). Handing it to a helper thread (:class:`Aside`) cost a
    4-float send/recv round trip on gloo 1.5-2x its time (2-core VM, ``bench_p2p.py``); here the
    call costs a registration, about 1 us. One watcher thread looks every :data:`POLL_S` at the
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
