"""The barrier a group's ranks meet at in their segment, without spinning for long.

A rank arrives by storing the number of the barrier and its call's signature in its own word of
the segment, then waits for every peer's word to show the same barrier of the same call::

    barrier = Barrier(segment, rank=0, peers=identities, timeout_s=600.0)
    barrier.start("all_reduce", signature)
    barrier.meet()                                          # every rank has arrived here

A rank that finds a peer not yet arrived looks a few times, then sleeps in the Linux futex wait on
that peer's word (``syscall(SYS_futex)`` through ctypes, which releases the GIL), woken by the
peer's arrival (the sleeper marks the word first, so an arrival nobody sleeps on costs no syscall:
``Segment.arrive``), so 4 ranks on 2 cores do not starve each other. Every ``_SLICE_S`` a sleeping
rank looks at the peers it waits for: a process that is gone raises :class:`PeerLostError` naming
it; past the group's timeout, :class:`CollectiveTimeoutError` names the ranks that did not arrive
(the stopped ones, where some are), or that arrived with another call.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from distcompat.collectives._errors import CollectiveTimeoutError, PeerLostError
from distcompat.collectives.shm._segment import NUMBER_MASK, Segment
from distcompat.peers import Identity, is_alive, is_stopped

__all__ = ["Barrier"]

_HALF = 0x80000000
_SPINS = 64  # looks at a peer's word before sleeping (a few microseconds of Python)
_SLICE_S = 0.05  # longest sleep between two looks at the peers' liveness and the deadline


class Barrier:
    """The ranks' meeting point: numbered barriers on the segment's counters (see module doc).

    ``peers`` maps each other group rank to (its global rank, its identity), for naming and
    liveness. ``timeout_s`` bounds each collective, counted from :meth:`start`.
    """

    def __init__(
        self,
        segment: Segment,
        rank: int,
        peers: Mapping[int, tuple[int, Identity]],
        timeout_s: float,
        op: str = "collective",
    ) -> None:
        self.segment = segment
        self.rank = rank
        self.peers = dict(peers)
        self.timeout_s = timeout_s
        self.number = 0  # barriers met so far: the same on every rank
        self.op = op
        self.signature = 0
        self._deadline = 0.0

    def start(self, op: str, signature: int) -> None:
        """Begin a collective: its deadline is the group timeout from now.

        ``signature`` (32 bits: the op and its sizes) goes with each arrival; a peer that arrives
        with another signature made another call, and is not counted as arrived (as on gloo,
        the ranks wait, here until the timeout, which names the call that differs).
        """
        self.op = op
        self.signature = signature & NUMBER_MASK
        self._deadline = time.monotonic() + self.timeout_s

    def meet(self) -> None:
        """Arrive, then return once every rank has arrived; raise a typed error if one cannot."""
        self.wait_for(self.arrive(), None)

    def arrive(self) -> int:
        """Arrive at the next barrier (after this rank's writes for it); return its number."""
        self.number += 1
        self.segment.arrive(self.rank, self.number, self.signature)
        return self.number

    def _there(self, word: int, target: int) -> bool:
        """Whether a peer's arrival word shows it at barrier ``target`` of this call, or past it."""
        ahead = ((word & NUMBER_MASK) - target) & NUMBER_MASK
        return ahead < _HALF and (ahead > 0 or word >> 32 == self.signature)

    def wait_for(self, target: int, until: float | None) -> bool:
        """Wait until every rank reached barrier ``target``: True; False once ``until`` passed.

        ``until`` (a ``time.monotonic()`` value) ends a slice of a wait that a later call goes
        on with; dead peers and the collective's own timeout raise whatever the slice.
        """
        segment = self.segment
        for peer in self.peers:
            word = segment.counter(peer)
            spins = 0
            while not self._there(word, target):
                if spins < _SPINS:
                    spins += 1
                else:
                    before = time.monotonic()
                    nap = _SLICE_S if until is None else min(_SLICE_S, until - before)
                    if nap <= 0:
                        return False
                    segment.sleep_on(peer, word, nap)
                    if time.monotonic() - before >= _SLICE_S * 0.9:
                        self._check(target)
                word = segment.counter(peer)
        return True

    def _behind(self, target: int) -> list[int]:
        """Return the group ranks that have not reached barrier ``target`` of this call."""
        segment = self.segment
        return [p for p in self.peers if not self._there(segment.counter(p), target)]

    def _check(self, target: int) -> None:
        """Raise if a rank we wait for is gone, or the collective ran past its timeout."""
        behind = self._behind(target)
        gone = sorted(self.peers[p][0] for p in behind if not is_alive(self.peers[p][1]))
        if gone:
            raise PeerLostError(
                f"{self.op}: a peer process went away (rank{'s' if len(gone) > 1 else ''} "
                f"{', '.join(map(str, gone))}) during a shared-memory collective",
                op=self.op,
                peer=gone[0],
                peers=tuple(gone),
            )
        if time.monotonic() > self._deadline:
            other = [p for p in behind if self.segment.counter(p) & NUMBER_MASK == target]
            if other:
                ranks = ", ".join(str(self.peers[p][0]) for p in other)
                raise CollectiveTimeoutError(
                    f"{self.op}: timed out after {self.timeout_s:g}s: rank(s) {ranks} made a "
                    "different call (another op, size or root) at the same point; the "
                    "shared-memory path of this group is unusable now",
                    op=self.op,
                    peer=self.peers[other[0]][0],
                    peers=tuple(sorted(self.peers[p][0] for p in other)),
                )
            stopped = [p for p in behind if is_stopped(self.peers[p][1])]
            late = sorted(self.peers[p][0] for p in (stopped or behind))
            raise CollectiveTimeoutError(
                f"{self.op}: timed out after {self.timeout_s:g}s: a peer is alive but not taking "
                f"part (rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))}); the "
                "shared-memory path of this group is unusable now",
                op=self.op,
                peer=late[0] if late else None,
                peers=tuple(late),
            )
