"""Init is a wait like any other: each phase watched, a late or absent rank named.

A rank in init waits on the others in phases the collectives' watchdog never sees: connecting
to the rendezvous store (its host, rank 0 or the launcher's agent, is not up yet), then the
rendezvous and the backend's creation (gloo connects to every rank; every rank must come). A
rank that starts late, or never, used to leave the others silent until the group's timeout.

:func:`watched` runs the init under a thread that reports past the watchdog's threshold (the
same ``DISTCOMPAT_WATCHDOG`` seconds), then every :data:`REPEAT_S` (at least the threshold),
on the ``distcompat.process_group`` logger::

    with watched(threshold_s=120, rank=0, world=4, where="127.0.0.1:29500 (rank 0's)") as watch:
        store = make_store()                       # phase "store connection"
        watch.arrived(store, "distcompat/generation3")
        init_process_group(store=...)              # phase "rendezvous"

    distcompat: rank 0 has waited 12s in init, in the rendezvous: rank 1 has not arrived
    (arrived: rank 0 on node1, rank 2 on node2, rank 3 on node2)

Each rank posts ``<prefix>/arrived/<rank>`` (its host) once it reaches the store; a report reads
them over a connection of its own (made only when a report is due: a new connection can cost
seconds here, see ``distcompat._store``; the init's own holds the store's lock while gloo
waits). Where distcompat does not know the store (torch's ``tcp://`` or ``file://`` init), the
report says the phase and how long, without names.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["REPEAT_S", "InitWatch", "watched"]

#: The longest time between two reports of one init (seconds).
REPEAT_S = 30.0

_log = logging.getLogger("distcompat.process_group")


class InitWatch:
    """What one rank's init is waiting in, told by the main thread, reported by a thread."""

    def __init__(self, threshold_s: float, rank: int, world: int, where: str) -> None:
        self.threshold_s, self.rank, self.world, self.where = threshold_s, rank, world, where
        self.started = time.monotonic()
        self.current = "store connection"
        self.store: Any = None  # the init's store, once connected
        self.prefix = ""
        self.done = threading.Event()
        self.reports: list[str] = []  # every line reported (tests, the closing summary)
        self.thread = threading.Thread(target=self._run, name="distcompat-init-watch", daemon=True)

    def phase(self, name: str) -> None:
        """Say which phase the init is in now ("rendezvous", ...)."""
        self.current = name

    def arrived(self, store: Any, prefix: str) -> None:
        """Post this rank's arrival under ``prefix`` in ``store``; the phase is the rendezvous."""
        with contextlib.suppress(RuntimeError, ValueError):
            store.set(f"{prefix}/arrived/{self.rank}", socket.gethostname())
        self.store, self.prefix = store, prefix
        self.current = "rendezvous"

    def _run(self) -> None:
        wait_s = self.threshold_s
        conn: Any = None
        while not self.done.wait(max(0.0, self.started + wait_s - time.monotonic())):
            if self.store is not None and conn is None:
                with contextlib.suppress(RuntimeError, ValueError, OSError):
                    conn = self.store.clone()  # the init's own connection is busy
            line = self.describe(conn)
            if self.done.is_set():
                return
            self.reports.append(line)
            _log.warning("distcompat: %s", line)
            wait_s += max(self.threshold_s, min(REPEAT_S, 2 * self.threshold_s))

    def describe(self, conn: Any) -> str:
        """Return the report: how long, in which phase, and who is missing when it is known."""
        waited = time.monotonic() - self.started
        who = f"rank {self.rank}" if self.rank >= 0 else "this rank"
        head = f"{who} has waited {waited:.0f}s in init, in the {self.current}"
        if self.current == "store connection":
            return f"{head}: the rendezvous store at {self.where} does not answer yet"
        if conn is None:
            return f"{head}: not every rank has come (which ones: unknown here)"
        absent, hosts = [], []
        for rank in range(self.world):
            key = f"{self.prefix}/arrived/{rank}"
            try:
                if conn.check([key]):
                    hosts.append(f"rank {rank} on {conn.get(key).decode()}")
                else:
                    absent.append(rank)
            except (RuntimeError, ValueError, UnicodeDecodeError):
                return f"{head}: the rendezvous store at {self.where} stopped answering"
        if not absent:
            return f"{head}: every rank has arrived; the backend is connecting them"
        which = ", ".join(map(str, absent))
        return (
            f"{head}: rank{'s' if len(absent) > 1 else ''} {which} "
            f"{'have' if len(absent) > 1 else 'has'} not arrived (arrived: {', '.join(hosts)})"
        )


@contextlib.contextmanager
def watched(threshold_s: float | None, rank: int, world: int, where: str) -> Iterator[InitWatch]:
    """Run the block (an init) watched: past ``threshold_s``, its phase and who is missing.

    ``threshold_s`` None watches nothing (the watchdog is off).

    Example:
        >>> with watched(None, 0, 1, "nowhere") as watch:
        ...     watch.phase("rendezvous")
    """
    watch = InitWatch(threshold_s or 0.0, rank, world, where)
    if threshold_s is not None:
        watch.thread.start()
    try:
        yield watch
    finally:
        watch.done.set()
