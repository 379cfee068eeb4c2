"""Links to peers on other machines: an idle TCP connection whose end says that a peer ended.

A pidfd names a process of this machine only. For a peer on another machine the peer watch
(``_peer_watch``) holds an idle TCP connection instead: when a process ends, however it ends (an
exception, ``os._exit``, SIGKILL, the OOM killer), its kernel closes its sockets, and the other
end reads end-of-file or a reset a network round trip later::

    links = Links(me=0, world=2)              # listens on every IPv4 interface, at links.port
    fd = links.dial(1, identity)              # the lower rank of a pair dials, the higher accepts
    ended = links.read(fd)                    # when poll says fd is readable: Ended, or None
    links.close(LEFT)                         # "bye left" on every link, then close them all

Nothing is sent while the ranks run: a link costs one socket on each side and no traffic.
A rank that ends on purpose says so before its sockets close (``bye <farewell>``: "left", or
the exception that ended it, ``_peers.own_farewell``), so its peers need not ask a store that
may have ended with it. Both sides check whom they talk to: the dialler's first line names
itself and the rank and pid it means to reach, and the process that answers names itself, so
neither an address that another machine also holds (a ``docker0`` bridge) nor a connection
meant for another job's rank (or a port scan) is ever taken for a peer, whose end would read as
a loss.

Which pairs are linked is :func:`linked`: ranks on different machines within :data:`REACH` of
each other around the ring of ranks, so a process holds at most ``2 * REACH`` links; every pair
is linked in a world of up to ``2 * REACH + 1`` ranks (:func:`all_linked`), and in a larger one
the watch relays losses through the store (``_peer_relay``).

Out of scope: a host that vanishes without closing its connections (power off, a cut cable)
sends nothing; gloo's timeout and the watchdog cover that case. IPv4 only.
"""

from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass, field

from distcompat.collectives._peers import LEFT, Identity

__all__ = ["DIAL_TIMEOUT_S", "REACH", "Ended", "Links", "all_linked", "linked"]

#: How far around the ring of ranks a rank links to peers on other machines, each way.
REACH = 32
#: How long a dial waits for a connection and for the peer's answer, per address (seconds).
DIAL_TIMEOUT_S = 2.0
_HELLO = "distcompat-link"
_BYE = "bye "
_LINE_BYTES = 512  # a hello is ~40 bytes; a farewell is cut at 300 characters (``_peers``)


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


@dataclass(frozen=True, slots=True)
class Ended:
    """A link that ended: whose (None: it never said), and what it said first ("": nothing)."""

    rank: int | None
    said: str


@dataclass(slots=True)
class _Link:
    sock: socket.socket
    rank: int | None  # None: accepted, its hello not read yet
    said: str = ""
    pending: bytearray = field(default_factory=bytearray)


def _line(text: str) -> bytes:
    """One line of the link's talk: ``text`` on one line, cut to fit :data:`_LINE_BYTES`."""
    return " ".join(text.split()).encode()[: _LINE_BYTES - 1] + b"\n"


class Links:
    """The link listener of this process and its links, by file descriptor, for one ``poll``.

    Not thread-safe: the watch's thread uses it alone.
    """

    def __init__(self, me: int, world: int) -> None:
        self.me, self.world = me, world
        here = Identity.here()
        self.pid = here.pid
        self.hello = _line(f"{_HELLO} {me} {here.pid}")
        self.own = frozenset(here.addrs)
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self.listener.bind(("0.0.0.0", 0))  # every interface: peers dial what they reach
            self.listener.listen(4 * REACH)
            self.listener.setblocking(False)
        except OSError:
            self.listener.close()
            raise
        self.port: int = self.listener.getsockname()[1]
        self.links: dict[int, _Link] = {}  # fd -> link

    def dial(self, rank: int, peer: Identity) -> int | None:
        """Link to ``peer`` (rank ``rank``); return the link's fd, or None if none answered.

        Tries the peer's addresses that this machine does not hold first (loopback never).
        Blocks up to :data:`DIAL_TIMEOUT_S` per address tried.
        """
        addresses = [a for a in peer.addrs if not a.startswith("127.")]
        addresses.sort(key=lambda address: address in self.own)  # stable: theirs first
        expected = _line(f"{_HELLO} {rank} {peer.pid}")
        for address in addresses if peer.port else ():
            try:
                sock = socket.create_connection((address, peer.port), timeout=DIAL_TIMEOUT_S)
            except OSError:
                continue
            try:
                sock.sendall(_line(f"{_HELLO} {self.me} {self.pid} {rank} {peer.pid}"))
                answer = _read_line(sock)
            except OSError:
                answer = b""
            if answer != expected:  # another process holds that address and port
                sock.close()
                continue
            sock.setblocking(False)
            self.links[sock.fileno()] = _Link(sock, rank)
            return sock.fileno()
        return None

    def accept(self) -> int | None:
        """Take a waiting connection on the listener; return its fd, or None."""
        try:
            sock, _ = self.listener.accept()
        except OSError:  # BlockingIOError: another wake-up took it; ECONNABORTED
            return None
        sock.setblocking(False)
        self.links[sock.fileno()] = _Link(sock, None)
        return sock.fileno()

    def read(self, fd: int) -> Ended | None:
        """Read what link ``fd`` has; return :class:`Ended` (it is closed then) or None."""
        link = self.links[fd]
        try:
            data = link.sock.recv(_LINE_BYTES)
        except BlockingIOError:
            return None
        except OSError:  # ECONNRESET: the peer's kernel reset it (unread data, or SIGKILL)
            data = b""
        if data:
            link.pending += data
            while b"\n" in link.pending:
                if not self._heard(link):  # a stranger: drop it
                    return self._drop(fd, Ended(None, ""))
            if len(link.pending) <= _LINE_BYTES:
                return None
            return self._drop(fd, Ended(None, ""))  # a line too long: not one of ours
        return self._drop(fd, Ended(link.rank, link.said))

    def _drop(self, fd: int, ended: Ended) -> Ended:
        self.links.pop(fd).sock.close()
        return ended

    def _heard(self, link: _Link) -> bool:
        """Take one line of ``link``; return False when the link is of no use (a stranger)."""
        line, _, rest = link.pending.partition(b"\n")
        link.pending = bytearray(rest)
        text = line.decode(errors="replace")
        if link.rank is None:  # an accepted link's first line: who dialled, and whom it means
            words = text.split()
            if len(words) == 5 and words[0] == _HELLO and all(w.isdigit() for w in words[1:]):
                rank, meant, meant_pid = int(words[1]), int(words[3]), int(words[4])
                if rank < self.me and (meant, meant_pid) == (self.me, self.pid):
                    link.rank = rank
                    with contextlib.suppress(OSError):
                        link.sock.send(self.hello)  # a few bytes into an empty buffer
                    return True
            return False
        if text.startswith(_BYE) and not link.said:
            link.said = text[len(_BYE) :] or LEFT
        return True

    def close(self, said: str) -> None:
        """Tell every linked peer ``said`` (this rank's farewell), then close every socket."""
        bye = _line(_BYE + said)
        for link in self.links.values():
            if link.rank is not None:
                with contextlib.suppress(OSError):
                    link.sock.send(bye)
            link.sock.close()
        self.links.clear()
        self.listener.close()


def _read_line(sock: socket.socket) -> bytes:
    """Read up to a newline (the socket's timeout bounds each receive)."""
    got = b""
    while not got.endswith(b"\n") and len(got) < _LINE_BYTES:
        chunk = sock.recv(_LINE_BYTES - len(got))
        if not chunk:
            break
        got += chunk
    return got
