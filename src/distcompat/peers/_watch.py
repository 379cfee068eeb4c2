"""A peer that ends is known at once: pidfds on this machine, idle TCP links across machines.

``init_distributed`` starts one daemon thread per process (:func:`start`). It reads the other
ranks' identities (``_registry.publish``) and, for each peer on this machine, opens a pidfd
(``os.pidfd_open``, Linux 5.3+), which becomes readable the moment that process ends, however it
ends (an exception, ``os._exit``, SIGKILL, the OOM killer). For a peer on another machine it
holds an idle TCP link instead (``_links``), which that process's kernel closes when it
ends. The thread sleeps in ``poll`` on them all: no cost to any collective. When one fires it

* logs one line naming the rank, its pid and host, why it ended when the rank said so (its
  farewell, ``_registry.leave_farewell``: the exception that ended it) and the time of day it was
  seen (``... ended (seen at 21:14:05.798 UTC)``, :func:`clock`), milliseconds after the exit
  and so before a launcher acts on it (torchrun's agent looks every 0.1 s, then stops the
  others). A rank that destroyed its group or whose script ended leaves on purpose: no line;
* records the loss, which ``_lost.gone_peers`` reads: a rank waiting on the lost peer raises
  :class:`PeerLostError` at its next look (``_wait.until``), naming the farewell too.

An error about to end this process settles first (:meth:`_Watch.settle`): the line is written
before it, on the erring thread if the watch's own has not come to it yet. So does a launcher's
SIGTERM where the program left SIGTERM to its default action (``_term``): the thread writes the
lines it can, then ends the process as that action would.

Across machines the line comes a round trip after the process ends (15.5 ms median, 41 ms
worst of 10 from a SIGKILL, two network namespaces here, ``benchmarks/bench_peer_links.py``).
A linked peer that stops its watch (destroy, or at exit) says its farewell on the link first
(:func:`stop`): no line for a rank that left, and the exception for one that raised, even when
the store ended with it. In a world of more than 65 ranks a rank links to its 64 nearest ranks
around the ring only; the watch that sees a loss posts it to the store and every watch reads
the store every 0.5 s (``_relay``), so each rank knows within a second.
A host that vanishes without closing its connections (power off, a cut cable) sends nothing:
gloo's timeout and the watchdog cover it. Without pidfds (not Linux, an old kernel) nothing
starts and ``gone_peers`` reads ``/proc`` as before.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import select
import threading
import time

import torch.distributed as dist

from distcompat._scarcity import ran_out
from distcompat.launch._settings import choose_peer_links
from distcompat.peers import _lost, _registry, _relay, _term
from distcompat.peers._identity import Identity, address_of, is_alive, same_machine
from distcompat.peers._links import Links, all_linked, linked
from distcompat.peers._lost import Lost
from distcompat.peers._registry import LEFT
from distcompat.peers._talk import job_secret

__all__ = ["clock", "read_clock", "start", "stop", "supported"]

_log = logging.getLogger("distcompat.peers")

#: How soon the thread asks the store again for identities not yet published (seconds); the
#: pause doubles, up to :data:`_IDENTITY_POLL_MAX_S`, while no new one comes (a rank that never
#: publishes, a store that does not answer).
_EVERY = "0.0.0.0"
_ADDRESS = re.compile(r"\d{1,3}(\.\d{1,3}){3}")  # an IPv4 address, not an interface name
_IDENTITY_POLL_S = 0.05
_IDENTITY_POLL_MAX_S = 5.0


class _Watch:
    """The watch of one group's peers: its thread, and what it saw."""

    def __init__(self, me: int, world: int, links: Links | None) -> None:
        self.me, self.world, self.links = me, world, links
        self.relay = not all_linked(world)  # some pairs hold no link: losses go through the store
        self.peers: dict[int, Identity] = {}  # rank -> identity of each peer watched by pidfd
        self.remote: dict[int, Identity] = {}  # rank -> identity of each peer on another machine
        self.seen: dict[int, Lost] = {}
        self.claimed: set[int] = set()  # ranks whose end was recorded (or is being recorded)
        self.telling: set[int] = set()  # of those, the ones whose line is not written yet
        self.told = threading.Condition()  # guards claimed and telling
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_write, False)  # written from a signal handler: never waits
        self.stopped = False
        self.ending = False  # our SIGTERM handler asked: settle, then end the process (``_term``)
        self.leaving = LEFT  # the farewell the links are told when the watch stops (``stop``)
        self.thread = threading.Thread(target=self._run, name="distcompat-peer-watch", daemon=True)

    def _run(self) -> None:
        watched: dict[int, int] = {}  # pidfd -> rank
        poller = select.poll()
        poller.register(self.wake_read, select.POLLIN)
        term_fd = _term.read_fd()
        if term_fd is not None:
            poller.register(term_fd, select.POLLIN)
        links = self.links
        if links is not None:
            links.attach(poller)  # the listener, and each link as it comes and goes
        pending = set(range(self.world)) - {self.me}
        pause_s = _IDENTITY_POLL_S
        relayed, relay_at = 0, 0.0  # losses read from the store so far; when to read again
        try:
            while not self.stopped:
                if pending:
                    found = _registry.identities_of(pending)
                    pause_s = _IDENTITY_POLL_S if found else min(2 * pause_s, _IDENTITY_POLL_MAX_S)
                    for rank, peer in found.items():
                        pending.discard(rank)
                        self._watch(rank, peer, poller, watched)
                timeout_s = pause_s if pending else None
                if links is not None:  # handshake deadlines, the listener's rest
                    due_s = links.tick()
                    if due_s is not None:
                        timeout_s = due_s if timeout_s is None else min(timeout_s, due_s)
                if self.relay:
                    now = time.monotonic()
                    if now >= relay_at:
                        relayed, told = _relay.read_since(relayed, time.time())
                        for lost in told:
                            self._record(lost.rank, told=lost)
                        relay_at = now + _relay.POLL_S
                    timeout_s = min(timeout_s or _relay.POLL_S, relay_at - now)
                timeout_ms = None if timeout_s is None else max(0, int(timeout_s * 1000))
                for fd, _ in poller.poll(timeout_ms):
                    if fd == self.wake_read:
                        with contextlib.suppress(BlockingIOError):
                            os.read(fd, 512)
                    elif fd == term_fd:
                        if _term.woken_by_term():  # a byte from Python's C signal handler
                            self._settle_ready(poller, watched)  # the lines, whoever handles it
                            if _term.installed():  # ours: then the default action's end
                                _term.end()
                    else:
                        self._dispatch(fd, poller, watched)
                    if self.ending:  # our handler asked from the main thread (``ask_end``)
                        self._settle_ready(poller, watched)
                        _term.end()
        finally:
            for fd in watched:
                os.close(fd)
            if links is not None:
                links.close(self.leaving)
            os.close(self.wake_read)

    def _dispatch(self, fd: int, poller: select.poll, watched: dict[int, int]) -> None:
        """Act on ``fd`` being ready: a peer's pidfd, the links' listener, or a link."""
        links = self.links
        if fd in watched:
            poller.unregister(fd)
            os.close(fd)
            self._record(watched.pop(fd))
        elif links is not None and fd == links.listener.fileno():
            links.accept()
        elif links is not None and fd in links.links:
            ended = links.read(fd)  # closes the link when it ended
            if ended is not None and ended.rank is not None:  # a proven peer's
                self._record(ended.rank, ended.said)

    def _settle_ready(self, poller: select.poll, watched: dict[int, int]) -> None:
        """Record every end ready now (a pidfd or a link), without waiting for more."""
        for fd, _ in poller.poll(0):
            if fd in watched or (self.links is not None and fd in self.links.links):
                self._dispatch(fd, poller, watched)

    def ask_end(self) -> bool:
        """Have the thread settle, then end the process as SIGTERM would; False: no thread.

        Runs in the SIGTERM handler (``_term``): never blocks.
        """
        if not self.thread.is_alive():
            return False
        self.ending = True
        with contextlib.suppress(OSError):
            os.write(self.wake_write, b"x")
        return True

    def _watch(
        self, rank: int, peer: Identity, poller: select.poll, watched: dict[int, int]
    ) -> None:
        """Start watching ``rank``: a pidfd (put in ``watched``), a link, or neither.

        A peer on this machine gets a pidfd; one on another machine a link, dialled by the
        lower rank of the pair (the higher accepts it) when :func:`linked` pairs them.
        """
        if not same_machine(peer):
            self.remote[rank] = peer
            if self.links is None or rank < self.me or not linked(self.me, rank, self.world):
                return
            if self.links.dial(rank, peer) is None:
                _log.warning(
                    "distcompat: no link to rank %d (port %d on %s): its end is known from the "
                    "backend's error or the watchdog only",
                    rank, peer.port, ", ".join(peer.addrs),
                )  # fmt: skip
            return
        self.peers[rank] = peer
        try:
            fd = _open(peer)
        except OSError as exc:  # no fd left: /proc is read instead (``_lost.gone_peers``)
            _log.warning(
                "distcompat: rank %d (pid %d) is not watched: %s", rank, peer.pid,
                ran_out(exc.errno) or exc,
            )  # fmt: skip
            return
        if fd is None:  # already gone, or its pid names another process now
            self._record(rank)
            return
        watched[fd] = rank
        poller.register(fd, select.POLLIN)

    def _record(self, rank: int, said: str = "", told: Lost | None = None) -> None:
        """Record and log that ``rank`` ended, once, on whichever thread sees it first.

        ``said``: its farewell as its link carried it ("": ask the store); ``told``: the loss
        as another rank's watch posted it (``_relay``).
        """
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
            if told is not None:
                said = told.farewell
            elif not said:
                said = _registry.farewell(rank)
            if said == LEFT:  # it destroyed its group, or its script ended: not a loss
                _log.debug("distcompat: rank %d left", rank)
                return
            peer = self.peers.get(rank) or self.remote.get(rank) or told
            pid, host = (peer.pid, peer.host) if peer is not None else (0, "?")
            found = Lost(rank, pid, host, seen, said)
            self.seen[rank] = found
            _log.error("distcompat: %s (seen at %s)", found.describe(), clock(seen))
            if self.relay and told is None:
                _relay.post(found)
        finally:
            with self.told:
                self.telling.discard(rank)
                self.told.notify_all()
        for listener in list(_lost.listeners):  # once told: a listener may ask for the loss
            try:
                listener(found)
            except Exception:  # a listener's fault must not end the watch
                _log.exception("distcompat: a peer-loss listener failed")

    def lost(self) -> dict[int, Lost]:
        """Return the peers seen to end (global rank -> :class:`Lost`)."""
        return dict(self.seen)

    def settle(self, ranks: tuple[int, ...]) -> dict[int, Lost]:
        """Record the end of each of ``ranks`` watched here and gone now; return every loss.

        The line is written before the caller's error (which may end this process).
        """
        for rank in ranks:
            peer = self.peers.get(rank)
            if peer is not None and not is_alive(peer):
                self._record(rank)
        return dict(self.seen)


def _open(peer: Identity) -> int | None:
    """Return a pidfd for ``peer``'s process, or None if that process is already gone.

    Raises OSError when the pidfd cannot be had for another reason (``EMFILE``): that is no
    evidence that the peer ended.
    """
    try:
        fd = os.pidfd_open(peer.pid)
    except ProcessLookupError:
        return None
    if not is_alive(peer):  # the pid was reused: the pidfd names another process
        os.close(fd)
        return None
    return fd


def clock(when: float) -> str:
    """Return ``when`` (``time.time()``) as a time of day in UTC, to the millisecond.

    Example:
        >>> clock(1796148889.798)
        '18:14:49.798 UTC'
    """
    whole = int(when)
    return time.strftime("%H:%M:%S", time.gmtime(whole)) + f".{int((when - whole) * 1000):03d} UTC"


def read_clock(text: str, near: float) -> float:
    """Return the ``time.time()`` that :func:`clock` wrote as ``text``, the one nearest ``near``.

    Example:
        >>> read_clock("18:14:49.798 UTC", near=1796148880.0)
        1796148889.798
    """
    hours, minutes, seconds = text.removesuffix(" UTC").split(":")
    of_day = int(hours) * 3600 + int(minutes) * 60 + float(seconds)
    midnight = near - near % 86400
    candidates = [midnight + day + of_day for day in (-86400.0, 0.0, 86400.0)]
    nearest: float = min(candidates, key=lambda candidate: abs(candidate - near))
    return round(nearest, 3)


_watch: _Watch | None = None


def supported() -> bool:
    """Return True where pidfds exist (Linux 5.3+ with Python 3.9+).

    Example:
        >>> isinstance(supported(), bool)
        True
    """
    return hasattr(os, "pidfd_open") and hasattr(select, "poll")


def start(me: int, world: int, *, links: bool = True) -> None:
    """Publish this rank's identity and watch its peers (``world`` ranks, this one ``me``).

    The identity carries the port where peers on other machines link to this one; ``links``
    False (the launcher says every rank runs on this machine) opens no port. Replaces the
    watch of an earlier group. Example:
        >>> start(0, 1)   # no peers: nothing to watch
    """
    global _watch, _exit_hooked
    stop()
    if not supported() or world < 2:
        _registry.publish(me)
        return
    listening = _listener(me, world) if links else None
    port, address = (listening.port, listening.address) if listening is not None else (0, "")
    _registry.publish(me, port=port, listen="" if address == _EVERY else address)
    _watch = _Watch(me, world, listening)
    _log.debug("distcompat: %s", _term.install(_watch.ask_end))  # its pipe before the thread
    _watch.thread.start()
    _lost.watcher = _watch
    if not _exit_hooked:
        atexit.register(_at_exit)
        _exit_hooked = True


def _listener(me: int, world: int) -> Links | None:
    """Open the links' listener where ``DISTCOMPAT_PEER_LINKS`` says; None: off, or it cannot."""
    choice = choose_peer_links()
    if not choice.on:
        return None
    address: str | None = choice.bind
    if address != _EVERY and not _ADDRESS.fullmatch(choice.bind):
        address = address_of(choice.bind)  # an interface: its IPv4 address
    secret = job_secret(_registry.rendezvous_store())
    why = ""
    if address is None:
        why = f"{choice.bind} has no IPv4 address ({choice.reason})"
    elif secret is None:
        why = "the rendezvous store gave no secret for their links"
    else:
        try:
            return Links(me, world, secret, bind=address)
        except OSError as exc:
            why = f"no listener on {choice.bind} ({ran_out(exc.errno) or exc})"
    _log.warning("distcompat: peers on other machines are not watched: %s", why)
    return None


def stop() -> None:
    """End the watch (the group is destroyed); its losses are forgotten.

    Peers linked from other machines are told this rank's farewell (``_registry.own_farewell``:
    the exception that is ending this process, else "left"), so that they do not take its
    sockets closing for a loss, or name what ended it. Example:
        >>> stop()
    """
    global _watch
    watch, _watch = _watch, None
    if watch is None:
        return
    _term.uninstall()
    _lost.watcher = None
    watch.leaving = _registry.own_farewell() or LEFT
    watch.stopped = True
    with contextlib.suppress(OSError):
        os.write(watch.wake_write, b"x")
    watch.thread.join(1.0)
    with contextlib.suppress(OSError):
        os.close(watch.wake_write)


_exit_hooked = False


def _at_exit() -> None:
    """At interpreter exit (the group not destroyed), tell the linked peers why, and close."""
    stop()
