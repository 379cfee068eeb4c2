"""Which peer went away: naming the rank behind "Connection reset by peer" in any group size.

gloo says *that* a peer is gone, not *which*: its message carries only the socket's address
(``Read error [127.0.0.1]:35036``, reliability.md 2.2). In a group of two the answer is the other
rank; in a larger group distcompat finds it from identities every rank published when its group
was set up (:func:`publish`, called by ``init_distributed``)::

    {"host": "node3", "machine": "<boot id>/<pid namespace>", "pid": 4121, "start": 88213,
     "addrs": ["10.0.0.3", ...], "port": 41823}

(``port``: where its peer watch listens for links from other machines, ``_peer_links``; 0 or
absent in an identity written without one.)

When a peer is lost, :func:`lost_peers` reads the group's identities back from the store and

* on this machine (same boot id and pid namespace): a peer whose process is gone, a zombie, or
  a different process under a recycled pid is dead, found within half a second of the error;
* on another machine: the address in gloo's message picks the host, named when it runs one rank
  of the group.

A stuck peer (:func:`stopped_peers`) can only be told apart when it is on this machine and
stopped (SIGSTOP, a debugger). Everything here is best effort: no identity, an unreachable store
or a non-Linux host gives no name, never a wrong one and never a new error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import re
import socket
import struct
import time
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist

from distcompat.collectives._group import global_rank
from distcompat.collectives._store import QuickStore, StoreUnreachable

__all__ = [
    "LEFT",
    "Identity",
    "Lost",
    "Watcher",
    "address_of",
    "farewell",
    "farewells",
    "gone_peers",
    "identities_of",
    "is_alive",
    "leave_farewell",
    "lost_peers",
    "own_farewell",
    "publish",
    "quick_store",
    "rendezvous_store",
    "same_machine",
    "stopped_peers",
    "watcher",
]

_KEY = "distcompat/peer/rank{}"
_FAREWELL = "distcompat/peer/farewell/rank{}"
#: The longest farewell kept (characters): a message can be a whole tensor's repr.
_FAREWELL_CHARS = 300
_ADDRESS = re.compile(r"\[([0-9a-fA-F:.]+)\]:\d+")
_SETTLE_S = 0.5  # a killed process is a zombie within milliseconds of its sockets closing
_SIOCGIFADDR = 0x8915


@dataclass(frozen=True, slots=True)
class Identity:
    """What tells one rank's process apart: where it runs and which process it is."""

    host: str
    machine: str  # boot id + pid namespace: equal means a pid here names the same process
    pid: int
    start: int  # process start time in clock ticks since boot (guards against pid reuse)
    addrs: tuple[str, ...]
    port: int = 0  # where its peer watch takes links from other machines (0: it takes none)

    @classmethod
    def here(cls) -> Identity:
        """Return this process's identity (no link listener: ``publish`` adds its port)."""
        pid = os.getpid()
        return cls(socket.gethostname(), _machine(), pid, _stat(pid)[1], _addresses())

    def to_json(self) -> str:
        """Serialize for the store."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Identity:
        """Read an identity written by :meth:`to_json`."""
        data = json.loads(text)
        known = {field.name for field in dataclasses.fields(cls)} - {"addrs"}  # a newer writer's
        return cls(**{k: v for k, v in data.items() if k in known}, addrs=tuple(data["addrs"]))


@dataclass(frozen=True, slots=True)
class Lost:
    """A peer whose process ended: when it was seen (``time.time()``), and its last words."""

    rank: int
    pid: int
    host: str
    seen: float
    farewell: str = ""  # "ValueError: bad batch at train.py:88", when the rank left one

    def describe(self) -> str:
        """One line: which rank ended, and why when it said so.

        Example:
            >>> Lost(1, 4121, "node3", 0.0, "ValueError: bad at train.py:88").describe()
            'rank 1 (pid 4121 on node3) exited after ValueError: bad at train.py:88'
            >>> Lost(1, 4121, "node3", 0.0).describe()
            'rank 1 (pid 4121 on node3) ended'
        """
        why = f"exited after {self.farewell}" if self.farewell else "ended"
        return f"rank {self.rank} (pid {self.pid} on {self.host}) {why}"


class Watcher(Protocol):
    """What watches this machine's peers as they run (``_peer_watch``, a layer above)."""

    def lost(self) -> dict[int, Lost]:
        """Return the peers seen to end (global rank -> :class:`Lost`)."""
        ...

    def settle(self, ranks: tuple[int, ...]) -> dict[int, Lost]:
        """Record the end of each of ``ranks`` seen gone now (its line written); all losses."""
        ...


#: The running watch, installed by ``_peer_watch.start``; None: ``/proc`` is read instead.
watcher: Watcher | None = None


def _read(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return ""


def _machine() -> str:
    """Return this process's boot id + pid namespace ("" where they cannot be read).

    Kept once read: they never change for a process, and reading them takes two file
    descriptors, which a process out of them (``EMFILE``) does not have.
    """
    global _this_machine
    if _this_machine:
        return _this_machine
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    boot = _read("/proc/sys/kernel/random/boot_id")
    found = f"{boot}/{namespace}" if boot and namespace else ""
    if found:
        _this_machine = found
    return found


_this_machine = ""
#: The state letter of a process whose ``/proc`` entry exists but could not be read (no file
#: descriptor left, ``EMFILE``): not known to be dead, so never reported as ended.
UNKNOWN = "?"


def _stat(pid: int) -> tuple[str, int]:
    """Return (state letter, start time) of ``pid`` from /proc, or ("", 0) if there is none.

    ("?", 0) when it exists but cannot be read (this process is out of file descriptors): only
    a missing entry is evidence that a process ended.
    """
    try:
        with open(f"/proc/{pid}/stat") as handle:
            text = handle.read().strip()
    except (FileNotFoundError, ProcessLookupError):
        return "", 0
    except OSError:
        return UNKNOWN, 0
    fields = text.rpartition(")")[2].split()  # the command name may hold spaces and parens
    if len(fields) < 20:
        return "", 0
    return fields[0], int(fields[19])


def address_of(interface: str) -> str | None:
    """Return the IPv4 address of ``interface`` (Linux), or None when it has none.

    Example:
        >>> address_of("no-such-interface") is None
        True
    """
    request = struct.pack("256s", interface.encode()[:15])
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
    except OSError:
        return None
    return socket.inet_ntoa(answer[20:24])


def _addresses() -> tuple[str, ...]:
    """Return this host's IPv4 addresses, one per interface (Linux; empty elsewhere)."""
    found: list[str] = []
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            with contextlib.suppress(OSError):
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
                found.append(socket.inet_ntoa(answer[20:24]))
    return tuple(found)


def _store() -> Any:
    """Return the default group's store (torch keeps it privately), or None."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:
        return None
    try:
        return getter()
    except (RuntimeError, ValueError):
        return None


def rendezvous_store() -> Any:
    """Return the default group's store, or None (no group).

    Example:
        >>> rendezvous_store() is None
        True
    """
    return _store()


def publish(rank: int | None = None, *, port: int = 0, listen: str = "") -> None:
    """Write this process's :class:`Identity` to the default group's store (no collective).

    ``init_distributed`` calls it, so a lost peer can be named in groups of any size; ``port``
    is where its peer watch takes links from other machines (``_peer_watch.start``), on the
    address ``listen`` only when one is given (it comes first in the identity's addresses).

    Example:
        >>> publish()   # no process group: nothing to write to
    """
    store = _store()
    if store is None or not _machine():
        return
    rank = dist.get_rank() if rank is None else rank
    with contextlib.suppress(RuntimeError, ValueError):
        identity = dataclasses.replace(Identity.here(), port=port)
        if listen:
            rest = tuple(a for a in identity.addrs if a != listen)
            identity = dataclasses.replace(identity, addrs=(listen, *rest))
        store.set(_KEY.format(rank), identity.to_json())


#: Each group's identities once every other member's was read: they never change, and a wait
#: that looks for gone peers every slice must not ask a store that may not answer (a partition).
_known: weakref.WeakKeyDictionary[Any, dict[int, Identity]] = weakref.WeakKeyDictionary()
#: The default store, asked through a QuickStore (no request waits past its short timeout).
_quick: tuple[Any, QuickStore] | None = None


def _asked(store: Any) -> QuickStore:
    global _quick
    if _quick is None or _quick[0] is not store:
        _quick = (store, QuickStore(store))
    return _quick[1]


def quick_store() -> QuickStore | None:
    """Return the default group's store asked through a :class:`QuickStore`, or None.

    Example:
        >>> quick_store() is None   # no process group
        True
    """
    store = _store()
    return None if store is None else _asked(store)


def identities_of(ranks: set[int]) -> dict[int, Identity]:
    """Return the identities among ``ranks`` (global) published so far; never blocks long.

    Example:
        >>> identities_of({1})   # no process group: none
        {}
    """
    store = _store()
    if store is None:
        return {}
    quick = _asked(store)
    wanted = sorted(ranks)
    names = [_KEY.format(rank) for rank in wanted]
    try:
        if names and quick.check(names):  # all published: two requests, not two per rank
            values = quick.multi_get(names)
            return {rank: Identity.from_json(v) for rank, v in zip(wanted, values, strict=True)}
    except (StoreUnreachable, ValueError, KeyError, TypeError):
        return {}  # the store does not answer: later, again
    found: dict[int, Identity] = {}
    for rank in wanted:
        name = _KEY.format(rank)
        try:
            if quick.check([name]):  # never blocks: a rank that did not publish is skipped
                found[rank] = Identity.from_json(quick.get(name))
        except (StoreUnreachable, ValueError, KeyError, TypeError):
            break  # the store does not answer (its host died, or a partition): later, again
    return found


#: The farewell of a rank that ended on purpose: its group destroyed, or its script done.
LEFT = "left"


def leave_farewell(exc: BaseException | None) -> None:
    """Write why this rank is ending, for its peers: ``exc`` and where, or (None) on purpose.

    An exception's farewell is never overwritten by a later "left".

    Called by ``diagnostics._exit`` (the exception hook, then at exit) and by destroy, before
    the process ends; a peer that sees this rank end names the exception (:func:`farewell`), or
    says nothing when it left on purpose.

    Example:
        >>> leave_farewell(ValueError("bad batch"))   # no process group: nothing to write to
    """
    global _farewell_left, _said
    store = _store()
    if store is None or (exc is None and _farewell_left):
        return
    if exc is None:
        text = LEFT
    else:
        where = ""
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is not None:
            where = f" at {os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno}"
        said = str(exc).splitlines()[0] if str(exc) else ""
        text = f"{type(exc).__name__}: {said}" if said else type(exc).__name__
        if len(text) > _FAREWELL_CHARS:
            text = text[: _FAREWELL_CHARS - 3] + "..."
        text += where
        _farewell_left = True
    _said = text
    with contextlib.suppress(StoreUnreachable, RuntimeError, ValueError):
        _asked(store).set(_FAREWELL.format(dist.get_rank()), text)


_farewell_left = False  # an exception's farewell was written: a later "left" must not replace it
_said = ""  # the farewell this process wrote last


def own_farewell() -> str:
    """Return the farewell this process wrote (:func:`leave_farewell`), or "" before any.

    Example:
        >>> own_farewell()
        ''
    """
    return _said


def farewell(rank: int) -> str:
    """Return what ``rank`` (global) left when it ended (:func:`leave_farewell`), or "".

    Example:
        >>> farewell(1)
        ''
    """
    store = _store()
    if store is None:
        return ""
    quick = _asked(store)
    name = _FAREWELL.format(rank)
    try:
        return quick.get(name).decode() if quick.check([name]) else ""
    except (StoreUnreachable, RuntimeError, ValueError, UnicodeDecodeError):
        return ""


def farewells(ranks: tuple[int, ...]) -> str:
    """Return "; rank R exited after ..." for each of ``ranks`` that left a farewell, else "".

    Example:
        >>> farewells((1,))
        ''
    """
    watched = watcher.settle(ranks) if watcher is not None else {}  # its line before this error
    said = []
    for rank in ranks:
        seen = watched.get(rank)
        text = seen.farewell if seen is not None and seen.farewell else farewell(rank)
        if text and text != LEFT:
            said.append(f"rank {rank} exited after {text}")
    return "".join(f"; {one}" for one in said)


def _identities(group: Any) -> dict[int, Identity]:
    """Return the published identities of ``group``'s other members (global rank -> identity).

    Read once per group when every member has published; until then each request is bounded
    (``QuickStore``), and what could be read is returned.
    """
    key = group if group is not None else dist.group.WORLD
    known = _known.get(key)
    if known is not None:
        return known
    others = {global_rank(group, r) for r in range(dist.get_world_size(group))}
    others.discard(dist.get_rank())
    found = identities_of(others)
    if len(found) == len(others):
        _known[key] = found
    return found


def _on_this_machine(peers: dict[int, Identity]) -> dict[int, Identity]:
    """Return the peers whose pid names a process here (same boot and pid namespace)."""
    here = _machine()  # read once for all of them: every wait's slice comes here
    return {rank: peer for rank, peer in peers.items() if here and peer.machine == here}


def same_machine(peer: Identity) -> bool:
    """Return True when ``peer``'s pid names a process here (same boot and pid namespace)."""
    here = _machine()
    return bool(here) and peer.machine == here


def is_alive(peer: Identity) -> bool:
    """Return True while ``peer``'s process (on this machine) runs and has not exited."""
    return not _dead(peer)


def _dead(peer: Identity) -> bool:
    """Return True on evidence that ``peer``'s process ended: gone, a zombie, or another's pid."""
    state, start = _stat(peer.pid)
    if state == UNKNOWN:  # /proc could not be read here: no evidence either way
        return False
    return state in ("", "Z", "X") or start != peer.start


def lost_peers(group: Any, message: str) -> tuple[int, ...]:
    """Return the global ranks of ``group`` that went away, as far as they can be told.

    Example:
        >>> lost_peers(None, "Read error [127.0.0.1]:4242: Connection reset by peer")
        ()
    """
    if not (dist.is_available() and dist.is_initialized()):
        return ()
    peers = _identities(group)
    local = _on_this_machine(peers)
    deadline = time.monotonic() + _SETTLE_S
    while local:
        dead = tuple(sorted(rank for rank, peer in local.items() if _dead(peer)))
        if dead:
            return dead
        if time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    match = _ADDRESS.search(message)
    if match is None or match.group(1).startswith("127."):
        return ()
    remote = [rank for rank, peer in peers.items() if match.group(1) in peer.addrs]
    return tuple(remote) if len(remote) == 1 else ()


def gone_peers(group: Any) -> tuple[int, ...]:
    """Return the global ranks of ``group`` on this machine whose process has ended (no wait).

    Example:
        >>> gone_peers(None)
        ()
    """
    if not (dist.is_available() and dist.is_initialized()):
        return ()
    seen = watcher.lost() if watcher is not None else None
    if seen:  # the watch saw them end; a member of another group is not this group's loss
        members = {global_rank(group, r) for r in range(dist.get_world_size(group))}
        ended = members.intersection(seen)
        if ended:
            return tuple(sorted(ended))
    local = _on_this_machine(_identities(group))
    return tuple(sorted(rank for rank, peer in local.items() if _dead(peer)))


def stopped_peers(group: Any) -> tuple[int, ...]:
    """Return the global ranks of ``group`` on this machine whose process is stopped (SIGSTOP).

    Example:
        >>> stopped_peers(None)
        ()
    """
    if not (dist.is_available() and dist.is_initialized()):
        return ()
    local = _on_this_machine(_identities(group))
    return tuple(
        sorted(
            rank
            for rank, peer in local.items()
            if _stat(peer.pid) in (("T", peer.start), ("t", peer.start))
        )
    )
