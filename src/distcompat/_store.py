"""Requests to a rendezvous store, each bounded by a short timeout.

The default mismatch check (``agree``) talks to the group's rendezvous store while a rank waits
in a collective; the shared-memory set-up (``shm._setup``) and the lost-peer naming (``_peers``)
ask it too. When the store's host cannot be reached (a network partition), a store request
does not come back: measured on torch 2.13 against a stopped store server, ``check``, ``add``,
``get`` and ``multi_get`` block with no end, and ``set_timeout`` bounds only a wait for a key,
not the socket; even ``clone()`` blocks in its handshake. A rank whose main thread sat in such a
request never reached its collective's timeout and typed error.

So every request runs on one daemon thread of this process, and the caller waits at most
:data:`TIMEOUT_S` for the answer::

    quick = QuickStore(store, "agree/0")   # keys go under the prefix
    quick.check(["s/3/0", "s/3/1"])        # raises StoreUnreachable within TIMEOUT_S

The requests go over the store's own connection (torch's client serializes requests from
every thread), never a new one. A new connection is not free: torch's TCP client and server
each format the other's address with ``getnameinfo``, which for ``::ffff:127.0.0.1`` asks the
DNS. On a host whose nameserver does not answer (this one), about one connection in 25 waits
the resolver's 5 s, and when the server waits, every rank's store request waits with it.
Clones made by the check, each shared-memory set-up and the peer lookup put those 5 s on a
group's first collective several times as often as torch's own start-up meets them.

A request that does not come back in time leaves the thread blocked in it. Until it returns,
every further request waits for it only what is left of that request's own :data:`TIMEOUT_S`
(at least :data:`STUCK_GRACE_S`), then fails without being sent: one stuck thread at most,
never one per request. While the store is silent each request so fails within a quarter
second, and a caller that asks between the slices of its wait does not push that wait past its
deadline (a store-only partition ended rank 1's collective 3 s past the group timeout when each
request waited 2 s more). When the stuck request returns, the connection is in step again and
is used on. A request given up on holds the client's lock until it returns, so torch's own
requests on that store wait too; they would not be answered either.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = [
    "STUCK_GRACE_S",
    "TIMEOUT_S",
    "QuickStore",
    "StoreUnreachable",
    "asked_until",
    "shut_down",
]

T = TypeVar("T")

#: How long one request of the check may wait for the store (seconds).
TIMEOUT_S = 2.0
#: What a request waits for one stuck past its own bound (seconds): while the store is silent
#: each request fails this fast; once it answers, the stuck one returns within it.
STUCK_GRACE_S = 0.25


class StoreUnreachable(RuntimeError):
    """A request to the rendezvous store did not complete within :data:`TIMEOUT_S`."""


@dataclass(slots=True)
class _Request:
    target: QuickStore
    name: str
    args: tuple[Any, ...]
    done: threading.Event = field(default_factory=threading.Event)
    value: Any = None
    error: BaseException | None = None
    timeout: float = TIMEOUT_S  # how long its caller waits for it
    begun: float = 0.0  # when the worker thread started it (time.monotonic())


class _Worker:
    """The thread that makes every store request of the check in this process, one at a time."""

    def __init__(self) -> None:
        self.requests: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()  # None: stop
        self.current: _Request | None = None  # the request on the thread now, if any
        self.thread = threading.Thread(target=self._run, name="distcompat-agree-store", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            request = self.requests.get()
            if request is None:  # shut_down
                return
            request.begun = time.monotonic()
            self.current = request
            try:
                request.value = request.target._serve(request.name, request.args)
            except Exception as exc:  # handed to the caller, which raises it as StoreUnreachable
                request.error = exc
            finally:
                self.current = None
                request.done.set()


_worker: _Worker | None = None
_lock = threading.Lock()


def shut_down(timeout: float = TIMEOUT_S) -> None:
    """End the worker thread (after the request it is making, if any); the next request starts anew.

    Called when distcompat destroys its process group, so that no thread is left to ask the
    store of a destroyed group.

    Example:
        >>> shut_down()
    """
    global _worker
    with _lock:
        worker, _worker = _worker, None
    if worker is None or not worker.thread.is_alive():
        return
    worker.requests.put(None)
    worker.thread.join(timeout)


def _the_worker() -> _Worker:
    global _worker
    if sys.is_finalizing():  # a thread started now waits forever (Python 3.11's Thread.start)
        raise RuntimeError("the interpreter is shutting down: no store request starts now")
    with _lock:
        if _worker is None or not _worker.thread.is_alive():  # none yet, or lost in a fork
            _worker = _Worker()
        return _worker


class QuickStore:
    """The group's store, asked through the check's thread; no request waits past TIMEOUT_S.

    ``prefix``: the keys go under it, as a :class:`torch.distributed.PrefixStore` puts them.

    Example:
        >>> import torch.distributed as dist
        >>> server = dist.TCPStore("127.0.0.1", 0, 1, True)
        >>> quick = QuickStore(server, "agree")
        >>> quick.set("k", "v"); quick.multi_get(["k"])
        [b'v']
        >>> server.get("agree/k")
        b'v'
    """

    def __init__(self, store: Any, prefix: str = "") -> None:
        self._source, self._prefix = store, prefix
        self._view: Any = None  # the prefixed store, made on the worker thread

    def _serve(self, name: str, args: tuple[Any, ...]) -> Any:
        """Make one request (on the worker thread) under the prefix."""
        if self._view is None:
            self._view = _prefixed(self._prefix, self._source)
        return getattr(self._view, name)(*args)

    def _request(self, name: str, *args: Any, timeout: float = TIMEOUT_S) -> Any:
        worker = _the_worker()
        stuck = worker.current  # a request given up on earlier, or another thread's
        if stuck is not None:
            left = stuck.begun + stuck.timeout - time.monotonic()  # its own bound, not a new one
            if not stuck.done.wait(min(timeout, max(STUCK_GRACE_S, left))):
                raise StoreUnreachable(
                    "the rendezvous store did not answer: an earlier "
                    f"{stuck.name} is still unanswered"
                )
        request = _Request(self, name, args, timeout=timeout)
        worker.requests.put(request)
        if not request.done.wait(timeout):
            raise StoreUnreachable(
                f"the rendezvous store did not answer {name} within {timeout:g}s"
            )
        if request.error is not None:
            raise StoreUnreachable(
                f"the rendezvous store did not answer {name}: {request.error}"
            ) from request.error
        return request.value

    def set(self, key: str, value: str) -> None:
        """Set ``key``; raise :class:`StoreUnreachable` if the store does not answer in time."""
        self._request("set", key, value)

    def check(self, keys: list[str]) -> bool:
        """Return whether every key exists (never waits for them to appear)."""
        return bool(self._request("check", keys))

    def add(self, key: str, amount: int, *, timeout: float = TIMEOUT_S) -> int:
        """Add ``amount`` to the counter ``key`` and return its new value, waiting ``timeout``.

        Not safe to ask again: a request given up on stays queued and may still be made, so a
        retried ``add`` could count twice. Give it the whole time it may take instead.
        """
        return int(self._request("add", key, amount, timeout=timeout))

    def get(self, key: str) -> bytes:
        """Return the value of ``key``, which must exist (a missing one waits for the store)."""
        value: bytes = self._request("get", key)
        return value

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected``; return what it holds then.

        ``expected`` ``""``: only if the key does not exist. The value returned is ``desired``,
        or the one another rank set first.
        """
        value: bytes = self._request("compare_set", key, expected, desired)
        return value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Return the values of ``keys``, which must exist (a missing one waits for the store)."""
        values: list[bytes] = self._request("multi_get", keys)
        return values


def _prefixed(prefix: str, store: Any) -> Any:
    import torch.distributed as dist  # here: importing torch.distributed is not free

    return dist.PrefixStore(prefix, store) if prefix else store


def asked_until(
    request: Callable[[], T], deadline: float, pause_s: float, late: Callable[[], Exception]
) -> T:
    """Return ``request()``, asked again every ``pause_s`` while the store does not answer.

    Past ``deadline`` (``time.monotonic()``) the last :class:`StoreUnreachable` becomes
    ``late()``, the caller's own error.

    Example:
        >>> asked_until(lambda: 3, time.monotonic() + 1, 0.1, lambda: TimeoutError("late"))
        3
    """
    while True:
        try:
            return request()
        except StoreUnreachable as exc:
            if time.monotonic() > deadline:
                raise late() from exc
            time.sleep(pause_s)
