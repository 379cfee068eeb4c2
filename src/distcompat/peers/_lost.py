"""Which peer went away: naming the rank behind "Connection reset by peer" in any group size.

gloo says *that* a peer is gone, not *which*: its message carries only the socket's address
(``Read error [127.0.0.1]:35036``, reliability.md 2.2). In a group of two the answer is the other
rank; in a larger group it is found from the identities every rank published when its group was
set up (``_registry.publish``, called by ``init_distributed``). When a peer is lost,
:func:`lost_peers` reads them back and

* on this machine (same boot id and pid namespace): a peer whose process is gone, a zombie, or
  a different process under a recycled pid is dead, found within half a second of the error;
* on another machine: the address in gloo's message picks the host, named when it runs one rank
  of the group.

A stuck peer (:func:`stopped_peers`) can only be told apart when it is on this machine and
stopped (SIGSTOP, a debugger). The running watch (``_watch``) records losses as it sees them
(:data:`watcher`). Everything here is best effort: no identity, an unreachable store or a
non-Linux host gives no name, never a wrong one and never a new error.
"""

from __future__ import annotations

import re
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist

from distcompat.peers._identity import Identity, _dead, _machine, is_stopped
from distcompat.peers._registry import LEFT, farewell, identities_of

__all__ = [
    "Lost",
    "Watcher",
    "farewells",
    "forget",
    "gone_peers",
    "listeners",
    "lost_peers",
    "stopped_peers",
    "watcher",
]

_ADDRESS = re.compile(r"\[([0-9a-fA-F:.]+)\]:\d+")

_SETTLE_S = 0.5  # a killed process is a zombie within milliseconds of its sockets closing


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
    """What watches this machine's peers as they run (``_watch``, a layer above)."""

    def lost(self) -> dict[int, Lost]:
        """Return the peers seen to end (global rank -> :class:`Lost`)."""
        ...

    def settle(self, ranks: tuple[int, ...]) -> dict[int, Lost]:
        """Record the end of each of ``ranks`` seen gone now (its line written); all losses."""
        ...


#: The running watch, installed by ``_watch.start``; None: ``/proc`` is read instead.
watcher: Watcher | None = None
#: Called with each loss the watch records, on its thread, after its line: what waits where no
#: slice looks for lost peers (a C++ caller's future, ``collectives._handover``) ends there.
listeners: list[Callable[[Lost], None]] = []


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


#: Each group's identities once every other member's was read: they never change, and a wait
#: that looks for gone peers every slice must not ask a store that may not answer (a partition).
_known: weakref.WeakKeyDictionary[Any, dict[int, Identity]] = weakref.WeakKeyDictionary()


def _global_rank(group: Any, group_rank: int) -> int:
    """Return the global rank of ``group_rank`` in ``group`` (torch refuses ``group.WORLD``)."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def _identities(group: Any) -> dict[int, Identity]:
    """Return the published identities of ``group``'s other members (global rank -> identity).

    Read once per group when every member has published; until then each request is bounded
    (``QuickStore``), and what could be read is returned.
    """
    key = group if group is not None else dist.group.WORLD
    known = _known.get(key)
    if known is not None:
        return known
    others = {_global_rank(group, r) for r in range(dist.get_world_size(group))}
    others.discard(dist.get_rank())
    found = identities_of(others)
    if len(found) == len(others):
        _known[key] = found
    return found


def forget(group: Any) -> None:
    """Drop the identities read for ``group``: its members changed (``distcompat.inplace``).

    Example:
        >>> forget(None)
    """
    key = group if group is not None else dist.group.WORLD
    if key is not None:  # no group: nothing was read
        _known.pop(key, None)


def _on_this_machine(peers: dict[int, Identity]) -> dict[int, Identity]:
    """Return the peers whose pid names a process here (same boot and pid namespace)."""
    here = _machine()  # read once for all of them: every wait's slice comes here
    return {rank: peer for rank, peer in peers.items() if here and peer.machine == here}


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
        members = {_global_rank(group, r) for r in range(dist.get_world_size(group))}
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
    return tuple(sorted(rank for rank, peer in local.items() if is_stopped(peer)))
