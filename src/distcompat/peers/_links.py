"""Links to peers on other machines: an idle TCP connection whose end says that a peer ended.

A pidfd names a process of this machine only. For a peer on another machine the peer watch
(``_watch``) holds an idle TCP connection instead: when a process ends, however it ends (an
exception, ``os._exit``, SIGKILL, the OOM killer), its kernel closes its sockets, and the other
end reads end-of-file or a reset a network round trip later::

    links = Links(0, 2, job_secret(store))  # listens on every IPv4 interface, at links.port
    links.attach(poller)                    # its sockets come and go in the watch's poll
    fd = links.dial(1, identity)            # the lower rank of a pair dials, the higher accepts
    ended = links.read(fd)                  # when poll says fd is readable: Ended, or None
    links.close(LEFT)                       # "bye left" on every link, then close them all

Nothing is sent while the ranks run: a link costs one socket on each side and no traffic. A
rank that ends on purpose says so first (``bye <farewell>``: "left", or the exception that ended
it, ``_registry.own_farewell``), so its peers need not ask a store that may have ended with it.

The port is open to anyone who reaches the host, so a connection counts for nothing until it
proves that it belongs to this job, and only a proven link's end is ever read as a peer's loss:

* **who**: the dialler greets with itself, the rank and pid it means and a random challenge; the
  listener answers with its own challenge and an HMAC-SHA256 of both under the job's secret
  (:func:`job_secret`, set by the first rank in the rendezvous store), the dialler answers in
  kind, and the listener says the link is taken: each proves it holds the secret without
  sending it, a replay proves nothing, and neither side counts a link the other has not;
* **when**: a connection not proven within :data:`HANDSHAKE_S` is closed, and one whose first
  bytes are not a greeting at once;
* **how many**: past :func:`unproven_cap` connections waiting to prove themselves, a new one
  closes the oldest (one that has not greeted first): a stranger holds at most that many of this
  process's file descriptors however many it opens, and a peer still gets in;
* **no descriptor left**: when ``accept`` fails with ``EMFILE``/``ENFILE`` the listener rests
  :data:`REST_S` (it would be readable again at once) and a line says what ran out.

The secret is as safe as the store, which torch documents as trusting its network (docs/
network.md). Linked pairs (:func:`linked`): ranks on different machines within :data:`REACH` of
each other around the ring, so at most ``2 * REACH`` links a process; every pair up to ``2 *
REACH + 1`` ranks (:func:`all_linked`), beyond which losses are relayed (``_relay``). Out
of scope: a host that vanishes without closing its sockets (power off, a cut cable) sends
nothing (gloo's timeout and the watchdog cover it). IPv4 only.

A process forked from a rank (a DataLoader worker, forked after the group exists) inherits its
sockets: its copies would hold the rank's links open after the rank ends, until the child ends
too (DataLoader workers look for their parent every 5 s). So a child closes its copies at once
(:func:`_forsake_in_child`, run by ``os.register_at_fork``): file descriptors only, no
``shutdown`` and no bye, so the rank's own links are untouched.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import logging
import os
import select
import socket
import time
import weakref
from dataclasses import dataclass, field

from distcompat._scarcity import ran_out
from distcompat.peers._identity import Identity
from distcompat.peers._registry import LEFT
from distcompat.peers._talk import (
    BYE,
    HELLO,
    LINE_BYTES,
    could_greet,
    greeting,
    line,
    nonce,
    proof,
    read_line,
)

__all__ = ["DIAL_TIMEOUT_S", "HANDSHAKE_S", "REACH", "REST_S", "Ended", "Links", "all_linked",
           "linked", "unproven_cap"]  # fmt: skip

_log = logging.getLogger("distcompat.peers")

#: How far around the ring of ranks a rank links to peers on other machines, each way.
REACH = 32
#: How long a dial waits for a connection and for the peer's answer, per address (seconds).
DIAL_TIMEOUT_S = 2.0
#: How long an accepted connection has to prove it is this job's peer (seconds; a proof: 1 RTT).
HANDSHAKE_S = 2.0
#: How long the listener rests after ``accept`` found no file descriptor left (seconds).
REST_S = 1.0
_TAKEN = b"taken\n"  # the listener's last word of the handshake: the proof was taken
#: How often a dial is made when the peer's listener closes it unanswered, and the pause between.
_TRIES, _RETRY_S = 3, 0.05
#: How often a listener that keeps finding no file descriptor says so (seconds).
_WARN_EVERY_S = 60.0
#: Connections waiting to prove themselves beyond the peers that may dial this rank.
_SPARE = 16


def linked(a: int, b: int, world: int) -> bool:
    """Return whether ranks ``a`` and ``b`` hold a link (when on different machines).

    Example:
        >>> linked(0, 1, 2), linked(0, 99, 100), linked(0, 50, 100)
        (True, True, False)
    """
    distance = abs(a - b) % world
    return a != b and min(distance, world - distance) <= REACH


def all_linked(world: int) -> bool:
    """Return whether every pair of ranks of a ``world`` is linked (else losses are relayed).

    Example:
        >>> all_linked(65), all_linked(66)
        (True, False)
    """
    return world <= 2 * REACH + 1


def unproven_cap(world: int) -> int:
    """Return how many connections may wait to prove themselves: every peer that may dial, +16.

    Example:
        >>> unproven_cap(2), unproven_cap(1000)
        (17, 80)
    """
    return min(world - 1, 2 * REACH) + _SPARE


@dataclass(frozen=True, slots=True)
class Ended:
    """A link that ended: whose (None: not a proven peer's), and what it said ("": nothing)."""

    rank: int | None
    said: str


@dataclass(slots=True)
class _Link:
    sock: socket.socket
    rank: int | None  # the proven peer; None: accepted, not proven yet
    since: float = 0.0  # when it was accepted (time.monotonic()): its handshake deadline runs
    said: str = ""
    pending: bytearray = field(default_factory=bytearray)
    claim: tuple[int, int, str, str] | None = None  # greeted: (rank, pid, its nonce, ours)


#: Every open :class:`Links` of this process, whose sockets a forked child closes.
_open: weakref.WeakSet[Links] = weakref.WeakSet()
_fork_hooked = False


def _forsake_in_child() -> None:
    """In a child just forked: close its copies of every link's socket (module docstring)."""
    for links in list(_open):
        links.forsake()


class Links:
    """The link listener of this process and its links, by file descriptor, for one ``poll``.

    Not thread-safe: the watch's thread uses it alone. ``secret``: :func:`job_secret`;
    ``bind``: the IPv4 address to listen on (``0.0.0.0``: every interface).
    """

    def __init__(self, me: int, world: int, secret: bytes, bind: str = "0.0.0.0") -> None:
        self.me, self.world, self.secret, self.address = me, world, secret, bind
        here = Identity.here()
        self.pid = here.pid
        self.own = frozenset(here.addrs)
        self.cap = unproven_cap(world)
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self.listener.bind((bind, 0))  # every interface by default: peers dial what they reach
            self.listener.listen(4 * REACH)
            self.listener.setblocking(False)
        except OSError:
            self.listener.close()
            raise
        self.port: int = self.listener.getsockname()[1]
        self.links: dict[int, _Link] = {}  # fd -> link
        self.poller: select.poll | None = None
        self.resting_until: float | None = None  # out of the poll until then (no fd left)
        self.warned = -_WARN_EVERY_S  # when the rest was last logged (time.monotonic())
        self.refused = 0  # connections closed unproven (a deadline, the cap, a wrong greeting)
        global _fork_hooked
        _open.add(self)
        if not _fork_hooked:
            os.register_at_fork(after_in_child=_forsake_in_child)
            _fork_hooked = True

    def attach(self, poller: select.poll) -> None:
        """Put the listener, and every link from now on, in ``poller`` (the watch's)."""
        self.poller = poller
        for fd in (self.listener.fileno(), *self.links):
            poller.register(fd, select.POLLIN)

    def _add(self, sock: socket.socket, rank: int | None) -> int:
        sock.setblocking(False)
        fd = sock.fileno()
        self.links[fd] = _Link(sock, rank, since=time.monotonic())
        if self.poller is not None:
            self.poller.register(fd, select.POLLIN)
        return fd

    def dial(self, rank: int, peer: Identity) -> int | None:
        """Link to ``peer`` (rank ``rank``); return the link's fd, or None if none answered.

        Tries the peer's addresses that this machine does not hold first (loopback never).
        Blocks up to :data:`DIAL_TIMEOUT_S` per address tried. A connection closed before any
        answer (a stranger's flood past the listener's cap closed it first) is tried again, up
        to :data:`_TRIES` times; a wrong answer (another process or job) is not.
        """
        addresses = [a for a in peer.addrs if not a.startswith("127.")]
        addresses.sort(key=lambda address: address in self.own)  # stable: theirs first
        for address in addresses if peer.port else ():
            for _ in range(_TRIES):
                try:
                    sock = socket.create_connection((address, peer.port), timeout=DIAL_TIMEOUT_S)
                except OSError:
                    break
                proven = self._prove(sock, rank, peer.pid)
                if proven:
                    return self._add(sock, rank)
                sock.close()
                if proven is False:  # another process holds that address and port, or job
                    break
                time.sleep(_RETRY_S)
        return None

    def _prove(self, sock: socket.socket, rank: int, pid: int) -> bool | None:
        """Run the dialler's half of the handshake; return whether the peer proved itself.

        None when it closed without an answer; False when it answered wrong, or not in time.
        """
        ours = nonce()
        words: tuple[object, ...] = (self.me, self.pid, rank, pid, ours)
        try:
            sock.sendall(greeting(words))
            said = read_line(sock)
            if not said:
                return None
            answer = said.decode(errors="replace").split()
            if len(answer) != 2:
                return False
            theirs, shown = answer
            if not hmac.compare_digest(shown, proof(self.secret, "answer", (*words, theirs))):
                return False
            sock.sendall(line(proof(self.secret, "dial", (*words, theirs))))
            taken = read_line(sock)  # a link closed before this was no link: no loss when it ends
            if taken != _TAKEN:
                return None if not taken else False
        except TimeoutError:
            return False
        except OSError:  # reset before an answer
            return None
        return True

    def accept(self) -> int | None:
        """Take a waiting connection on the listener; return its fd, or None.

        Past :func:`unproven_cap` connections waiting to prove themselves, the oldest is closed.
        With no file descriptor left the listener rests :data:`REST_S` (see the module doc).
        """
        try:
            sock, _ = self.listener.accept()
        except OSError as exc:  # BlockingIOError: another wake-up took it; ECONNABORTED
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                self._rest(exc)
            return None
        unproven = [fd for fd, link in self.links.items() if link.rank is None]
        if len(unproven) >= self.cap:  # the oldest that has not even greeted goes first
            oldest = min(unproven, key=lambda fd: (self.links[fd].claim is not None,
                                                    self.links[fd].since))  # fmt: skip
            self._drop(oldest, Ended(None, ""))
        return self._add(sock, None)

    def _rest(self, exc: OSError) -> None:
        now = time.monotonic()
        self.resting_until = now + REST_S
        if self.poller is not None:
            with contextlib.suppress(KeyError):
                self.poller.unregister(self.listener.fileno())
        if now - self.warned >= _WARN_EVERY_S:
            self.warned = now
            held = sum(1 for link in self.links.values() if link.rank is None)
            _log.warning(
                "distcompat: peer links take no new connection for %gs: %s (of them, %d are "
                "connections waiting to prove themselves, at most %d)",
                REST_S, ran_out(exc.errno), held, self.cap,
            )  # fmt: skip

    def tick(self) -> float | None:
        """Close what missed its handshake deadline, end the listener's rest; say when to return.

        Returns the seconds until the next deadline (None: none pending).
        """
        now = time.monotonic()
        if self.resting_until is not None and now >= self.resting_until:
            self.resting_until = None
            if self.poller is not None:
                self.poller.register(self.listener.fileno(), select.POLLIN)
        due = {fd: k.since + HANDSHAKE_S - now for fd, k in self.links.items() if k.rank is None}
        for fd in [fd for fd, left in due.items() if left <= 0]:  # past the handshake deadline
            self._drop(fd, Ended(None, ""))
        waits = [left for left in due.values() if left > 0]
        if self.resting_until is not None:
            waits.append(self.resting_until - now)
        return max(0.0, min(waits)) if waits else None

    def read(self, fd: int) -> Ended | None:
        """Read what link ``fd`` has; return :class:`Ended` (it is closed then) or None."""
        link = self.links[fd]
        try:
            data = link.sock.recv(LINE_BYTES)
        except BlockingIOError:
            return None
        except OSError:  # ECONNRESET: the peer's kernel reset it (unread data, or SIGKILL)
            data = b""
        if data:
            link.pending += data
            if link.rank is None and link.claim is None and not could_greet(link.pending):
                return self._drop(fd, Ended(None, ""))  # not a link's first bytes
            while b"\n" in link.pending:
                if not self._heard(link):  # a stranger: drop it
                    return self._drop(fd, Ended(None, ""))
            if len(link.pending) <= LINE_BYTES:
                return None
            return self._drop(fd, Ended(None, ""))  # a line too long: not one of ours
        return self._drop(fd, Ended(link.rank, link.said))

    def _drop(self, fd: int, ended: Ended) -> Ended:
        link = self.links.pop(fd)
        if link.rank is None:
            self.refused += 1
        if self.poller is not None:
            with contextlib.suppress(KeyError):
                self.poller.unregister(fd)
        link.sock.close()
        return ended

    def _heard(self, link: _Link) -> bool:
        """Take one line of ``link``; return False when the link is of no use (a stranger)."""
        heard, _, rest = link.pending.partition(b"\n")
        link.pending = bytearray(rest)
        text = heard.decode(errors="replace")
        if link.rank is not None:
            if text.startswith(BYE) and not link.said:
                link.said = text[len(BYE) :] or LEFT
            return True
        if link.claim is None:  # its greeting: who dials, whom it means, and its challenge
            words = text.split()
            if len(words) != 6 or words[0] != HELLO or not all(w.isdigit() for w in words[1:5]):
                return False
            rank, pid, meant, meant_pid = map(int, words[1:5])
            if not (rank < self.me and linked(rank, self.me, self.world)):
                return False
            if (meant, meant_pid) != (self.me, self.pid):
                return False
            ours = nonce()
            link.claim = (rank, pid, words[5], ours)
            answer = proof(self.secret, "answer", (rank, pid, self.me, self.pid, words[5], ours))
            with contextlib.suppress(OSError):
                link.sock.send(line(f"{ours} {answer}"))  # a few bytes into an empty buffer
            return True
        rank, pid, theirs, ours = link.claim  # its proof of the job's secret
        expected = proof(self.secret, "dial", (rank, pid, self.me, self.pid, theirs, ours))
        if not hmac.compare_digest(text.strip(), expected):
            return False
        link.rank = rank  # proven: no cap or deadline closes it from now on
        with contextlib.suppress(OSError):
            link.sock.send(_TAKEN)  # the dialler counts the link only once it reads this
        return True

    def close(self, said: str) -> None:
        """Tell every linked peer ``said`` (this rank's farewell), then close every socket."""
        bye = line(BYE + said)
        for link in self.links.values():
            if link.rank is not None:
                with contextlib.suppress(OSError):
                    link.sock.send(bye)
        self.forsake()

    def forsake(self) -> None:
        """Close this process's copies of the sockets, saying nothing: a forked child's part.

        A socket's connection ends when its last copy closes: the rank's copies hold it.
        """
        for link in self.links.values():
            link.sock.close()
        self.links.clear()
        self.listener.close()
        _open.discard(self)
