"""What a shared-memory op is while it runs: its steps, its signature, and a Work to wait on.

An op is a generator that yields at each barrier, so it can run in slices; :class:`ShmWork`
hands it a backend Work's ``wait(timeout)`` and ``get_future()``::

    work = ShmWork(engine, "all_reduce", engine.all_reduce(flat, dist.ReduceOp.SUM))
    work.wait(timedelta(seconds=0.5))   # runs it here, for at most half a second
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch

from distcompat.collectives._profiled import end

__all__ = ["Call", "ShmWork", "Steps", "signature"]

Steps = Iterator[None]  # an op's body: runs up to each barrier and yields there


@dataclass(frozen=True, slots=True)
class Call:
    """An op to run: its body, and its signature (the op and its sizes: peers must match it)."""

    signature: int
    steps: Steps


def signature(*parts: object) -> int:
    """Return a 32-bit code of ``parts``, the same in every process."""
    return zlib.crc32(repr(parts).encode())


class _Driver(Protocol):
    """The engine, as a work sees it."""

    def drive_here(self, work: ShmWork, until: float | None) -> None: ...

    def submit(self, work: ShmWork) -> None: ...


class ShmWork:
    """An op on the path with a backend Work's ``wait(timeout)`` and ``get_future()``.

    Until :meth:`get_future` asks for it to complete on its own (an async op), the op runs in the
    thread that waits for it, slice by slice, so a synchronous call costs no thread hand-off
    and the watchdog's bounded waits still see it.
    """

    __slots__ = (
        "_done", "_engine", "_error", "_future", "_queued", "op", "record", "signature", "steps",
        "target",
    )  # fmt: skip

    def __init__(self, engine: _Driver, op: str, call: Call) -> None:
        self._engine = engine
        self.op = op
        self.signature, self.steps = call.signature, call.steps
        self.target: int | None = None  # the barrier this op waits at between slices
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._future: torch.futures.Future[Any] = torch.futures.Future()
        self._queued = False
        self.record: Any = None  # the profiler's event, ended when the op ends (_profiled)

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Block until done and raise the op's error; ``RuntimeError`` if ``timeout`` passes first.

        A zero timeout means none, as for torch's ``Work.wait``.
        """
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        until = time.monotonic() + seconds if seconds else None
        if not self._queued and not self._done.is_set():
            self._engine.drive_here(self, until)
        else:
            self._done.wait(None if until is None else max(0.0, until - time.monotonic()))
        if not self._done.is_set():
            raise RuntimeError(f"{self.op} on shared memory still running after {seconds:g}s")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """Return whether the op ended (successfully or not)."""
        return self._done.is_set()

    def get_future(self) -> torch.futures.Future[Any]:
        """Return the op's future (value None), and let the group's thread complete the op."""
        if not self._queued and not self._done.is_set():
            self._queued = True
            self._engine.submit(self)
        return self._future

    def settle(self, error: BaseException | None) -> None:
        """Record the op's outcome, end its profiler event, wake waiters, complete the future."""
        record, self.record = self.record, None
        if record is not None:
            end(record)  # before waking the waiter, who may stop the profiler next
        self._error = error
        self._done.set()
        if error is None:
            self._future.set_result(None)
        else:
            self._future.set_exception(error)
