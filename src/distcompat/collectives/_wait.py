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

What ``until`` waits on comes from an adapter: :func:`work_ready` (a backend ``Work``),
:func:`polled` (keys in a store), or :class:`Aside` (a blocking backend call that must not be
waited on in slices, run on a helper thread: gloo's point-to-point ops).

While a wait lasts, :func:`current` tells what this thread is waiting in, so a hang report can
say "in the mismatch check of all_reduce" of this rank. The watchdog (``distcompat.diagnostics``,
a layer above) installs :data:`observer` and :data:`explain` through ``_checked.set_hooks``;
nothing here imports it.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Generic, Protocol, TypeVar

from distcompat.collectives._errors import CollectiveTimeoutError, PeerLostError
from distcompat.collectives._peers import gone_peers

__all__ = [
    "POLL",
    "POLL_S",
    "Aside",
    "Observer",
    "Wait",
    "beside",
    "current",
    "explain",
    "observer",
    "polled",
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
    returns the global ranks not yet arrived (None: not known). ``late``, if given, turns that
    error into the one raised instead (a checkpoint's own error type), chained to it.
    ``record`` is the watchdog's, whatever it keeps for the call while it watches this wait.

    Example:
        >>> w = Wait(op="all_reduce", phase="mismatch check", group=None, started=0.0)
        >>> w.describe()
        'in the mismatch check of all_reduce'
    """

    op: str
    phase: str
    group: Any
    started: float = field(default_factory=time.monotonic)
    deadline: float | None = None
    awaited: Callable[[], tuple[int, ...] | None] | None = None
    late: Callable[[CollectiveTimeoutError], BaseException] | None = None
    record: Any = None

    def describe(self) -> str:
        """``in the <phase> of <op>``: what a report says of the rank that waits here."""
        return f"in the {self.phase} of {self.op}"


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
    that error is raised; a slice that runs out is not done yet.
    """

    def ready(slice_s: float) -> bool:
        begun = time.monotonic()
        try:
            work.wait(timedelta(seconds=slice_s))
        except RuntimeError:
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


T = TypeVar("T")


class Aside(Generic[T]):
    """A blocking backend call run on a helper thread; :meth:`ready` waits for it in slices.

    For a wait that cannot be sliced where it blocks: a gloo point-to-point ``Work.wait(timeout)``
    that runs out closes every pair of the group ("Application timeout caused pair closure",
    measured on torch 2.13), so :func:`work_ready` would break the group after half a second.
    The call runs whole on a helper thread (its own timeout, the group's, still ends it) and the
    waiting thread waits for the helper in :func:`until`'s slices, which cost nothing::

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
    calling thread's wait (:func:`current`) and to the watchdog (:data:`observer`). What it
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
                if _waits.get(entry.thread) is entry.wait:
                    del _waits[entry.thread]
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
                    _waits.setdefault(entry.thread, entry.wait)
                    entry.watched = entry.watched or observer
                    if entry.watched is not None:
                        entry.watched.watch(entry.wait)
                except Exception:  # a raising watchdog's HangError (reported, not raisable
                    continue  # here), or anything else: the watcher goes on for other calls


def timeout_error(wait: Wait, timeout_s: float) -> CollectiveTimeoutError:
    """Return the error of ``wait`` past its deadline, naming the ranks that never arrived.

    Example:
        >>> w = Wait(op="all_reduce", phase="mismatch check", group=None, awaited=lambda: (1,))
        >>> timeout_error(w, 20.0).peers
        (1,)
    """
    absent = wait.awaited() if wait.awaited is not None else None
    ranks = ", ".join(map(str, absent or ()))
    named = f" (rank{'s' if len(absent or ()) > 1 else ''} {ranks})" if absent else ""
    message = (
        f"{wait.op}: timed out after {timeout_s:g}s (the group's timeout) {wait.describe()}: "
        f"not every rank arrived{named}; a rank stuck elsewhere, or a collective only some ranks "
        "call"
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
                raise PeerLostError(
                    f"{wait.op}: a peer process went away (rank{'s' if len(gone) > 1 else ''} "
                    f"{', '.join(map(str, gone))}) while this rank waited {wait.describe()}",
                    op=wait.op,
                    peer=gone[0],
                    peers=gone,
                )
            watched = observer
            if watched is not None:
                watched.watch(wait)
            if wait.deadline is not None and time.monotonic() >= wait.deadline:
                error = timeout_error(wait, limit or 0.0)
                if wait.late is None:
                    raise error
                raise wait.late(error) from error
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
