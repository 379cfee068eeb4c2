"""A peer that ends is known at once: this machine's peers watched through pidfds.

``init_distributed`` starts one daemon thread per process (:func:`start`). It reads the other
ranks' identities (``_peers.publish``) and, for each peer on this machine, opens a pidfd
(``os.pidfd_open``, Linux 5.3+), which becomes readable the moment that process ends, however it
ends (an exception, ``os._exit``, SIGKILL, the OOM killer). The thread sleeps in ``poll`` on them:
no cost to any collective. When one fires it

* logs one line naming the rank, its pid and host, and why it ended when the rank said so (its
  farewell, ``_peers.leave_farewell``: the exception that ended it), milliseconds after the exit
  and so before a launcher acts on it (torchrun's agent looks every 0.1 s, then stops the
  others). A rank that destroyed its group or whose script ended leaves on purpose: no line;
* records the loss, which ``_peers.gone_peers`` reads: a rank waiting on the lost peer raises
  :class:`PeerLostError` at its next look (``_wait.until``), naming the farewell too.

An error about to end this process settles first (:meth:`_Watch.settle`): the line is written
before it, on the erring thread if the watch's own has not come to it yet.

Peers on other machines are not watched here (a pidfd names a process of this machine); gloo's
connection reset and the watchdog cover them. Without pidfds (not Linux, an old kernel) nothing
starts and ``gone_peers`` reads ``/proc`` as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time

import torch.distributed as dist

from distcompat.collectives import _peers
from distcompat.collectives._peers import LEFT, Identity, Lost

__all__ = ["start", "stop", "supported"]

_log = logging.getLogger("distcompat.peers")

#: How soon the thread asks the store again for identities not yet published (seconds); the
#: pause doubles, up to :data:`_IDENTITY_POLL_MAX_S`, while no new one comes (a rank that never
#: publishes, a store that does not answer).
_IDENTITY_POLL_S = 0.05
_IDENTITY_POLL_MAX_S = 5.0


class _Watch:
    """The watch of one group's peers: its thread, and what it saw."""

    def __init__(self, me: int, world: int) -> None:
        self.me, self.world = me, world
        self.peers: dict[int, Identity] = {}  # rank -> identity of each peer watched here
        self.seen: dict[int, Lost] = {}
        self.claimed: set[int] = set()  # ranks whose end was recorded (or is being recorded)
        self.telling: set[int] = set()  # of those, the ones whose line is not written yet
        self.told = threading.Condition()  # guards claimed and telling
        self.wake_read, self.wake_write = os.pipe()
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="distcompat-peer-watch", daemon=True)

    def _run(self) -> None:
        watched: dict[int, int] = {}  # pidfd -> rank
        poller = select.poll()
        poller.register(self.wake_read, select.POLLIN)
        pending = set(range(self.world)) - {self.me}
        pause_s = _IDENTITY_POLL_S
        try:
            while not self.stopped:
                if pending:
                    found = _peers.identities_of(pending)
                    pause_s = _IDENTITY_POLL_S if found else min(2 * pause_s, _IDENTITY_POLL_MAX_S)
                    for rank, peer in found.items():
                        pending.discard(rank)
                        if not _peers.same_machine(peer):
                            continue
                        self.peers[rank] = peer
                        fd = _open(peer)
                        if fd is None:  # already gone, or its pid names another process now
                            self._record(rank)
                            continue
                        watched[fd] = rank
                        poller.register(fd, select.POLLIN)
                timeout_ms = int(pause_s * 1000) if pending else None
                for fd, _ in poller.poll(timeout_ms):
                    if fd == self.wake_read:
                        continue
                    poller.unregister(fd)
                    os.close(fd)
                    self._record(watched.pop(fd))
        finally:
            for fd in watched:
                os.close(fd)
            os.close(self.wake_read)

    def _record(self, rank: int) -> None:
        """Record and log that ``rank`` ended, once, on whichever thread sees it first."""
        with self.told:
            if rank in self.claimed:
                self.told.wait_for(lambda: rank not in self.telling, 1.0)
                return
            self.claimed.add(rank)
            self.telling.add(rank)
        seen = time.time()
        try:
            if not dist.is_initialized():  # the group was destroyed (torch's own call): no loss
                return
            said = _peers.farewell(rank)
            if said == LEFT:  # it destroyed its group, or its script ended: not a loss
                _log.debug("distcompat: rank %d left", rank)
                return
            peer = self.peers[rank]
            found = Lost(rank, peer.pid, peer.host, seen, said)
            self.seen[rank] = found
            _log.error("distcompat: %s (seen at %.3f)", found.describe(), seen)
        finally:
            with self.told:
                self.telling.discard(rank)
                self.told.notify_all()

    def lost(self) -> dict[int, Lost]:
        """Return the peers seen to end (global rank -> :class:`Lost`)."""
        return dict(self.seen)

    def settle(self, ranks: tuple[int, ...]) -> dict[int, Lost]:
        """Record the end of each of ``ranks`` watched here and gone now; return every loss.

        The line is written before the caller's error (which may end this process).
        """
        for rank in ranks:
            peer = self.peers.get(rank)
            if peer is not None and not _peers.is_alive(peer):
                self._record(rank)
        return dict(self.seen)


def _open(peer: Identity) -> int | None:
    """Return a pidfd for ``peer``'s process, or None if that process is already gone."""
    try:
        fd = os.pidfd_open(peer.pid)
    except OSError:
        return None
    if not _peers.is_alive(peer):  # the pid was reused: the pidfd names another process
        os.close(fd)
        return None
    return fd


_watch: _Watch | None = None


def supported() -> bool:
    """Return True where pidfds exist (Linux 5.3+ with Python 3.9+).

    Example:
        >>> isinstance(supported(), bool)
        True
    """
    return hasattr(os, "pidfd_open") and hasattr(select, "poll")


def start(me: int, world: int) -> None:
    """Watch this machine's peers of the default group (``world`` ranks, this one ``me``).

    Replaces the watch of an earlier group. Example:
        >>> start(0, 1)   # no peers: nothing to watch
    """
    global _watch
    stop()
    if not supported() or world < 2:
        return
    _watch = _Watch(me, world)
    _watch.thread.start()
    _peers.watcher = _watch


def stop() -> None:
    """End the watch (the group is destroyed); its losses are forgotten.

    Example:
        >>> stop()
    """
    global _watch
    watch, _watch = _watch, None
    if watch is None:
        return
    _peers.watcher = None
    watch.stopped = True
    with contextlib.suppress(OSError):
        os.write(watch.wake_write, b"x")
    watch.thread.join(1.0)
    with contextlib.suppress(OSError):
        os.close(watch.wake_write)
