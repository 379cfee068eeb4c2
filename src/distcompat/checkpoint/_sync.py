"""The collectives of one distributed save: a bounded arrival check, then small object gathers.

Every save runs, on every rank and in this order: ``arrive`` (point-to-point tokens to and from
rank 0, each wait bounded by the save's own timeout, so a save called from one rank only fails in
seconds and rank 0 names the ranks that never came, instead of hanging until the process-group
timeout; the watchdog sees the wait as "the checkpoint arrival of save_checkpoint(step=N)"),
then three small object gathers carrying the plan, each rank's write result, and rank 0's commit
result. Because every rank reports success *or* its error in those gathers, a rank that fails to
write never leaves the others waiting. Without a process group (or at world size 1) each
function here is the identity.

The tokens and gathers use CPU tensors, so they run on gloo: the default group when it is gloo,
else a gloo side group made on the first save (every rank must make that first save together, as
with any collective; this path is not exercised by the CPU-only test suite).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distcompat._ranks import get_world_size
from distcompat.checkpoint._errors import CheckpointSyncError
from distcompat.collectives import all_gather_object
from distcompat.collectives._blocking import beside
from distcompat.collectives._entry import entry
from distcompat.collectives._errors import (
    CollectiveError,
    CollectiveTimeoutError,
    PeerLostError,
    translate,
    typed_errors,
)
from distcompat.collectives._wait import Wait, work_ready

__all__ = ["DEFAULT_SYNC_TIMEOUT_S", "SaveGroup", "dedicated_save_group", "save_group"]

_ARRIVE_TAG = 0x5AFE  # keeps the arrival tokens apart from the application's own send/recv
_EVERY_RANK = (
    "Every rank must call it, with its own state, at the same step; never inside `if rank == 0:`"
)

#: Seconds the ranks may arrive apart at a save. Ranks reach a save right after a training step's
#: collectives, so they arrive seconds apart; 5 minutes leaves room for a slow rank while failing
#: long before the 30-minute gloo default when a save runs inside ``if rank == 0:``.
DEFAULT_SYNC_TIMEOUT_S = 300.0

# The gloo group made for a non-gloo default group (which it belongs to, the side group).
_side_group: tuple[object, dist.ProcessGroup] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveGroup:
    """The ranks taking part in one save: ``group=None`` means the default (gloo) group."""

    rank: int
    world_size: int
    group: dist.ProcessGroup | None
    active: bool

    def arrive(self, what: str, timeout_s: float) -> None:
        """Wait, at most ``timeout_s``, until every rank has called the same save.

        Each rank > 0 sends a token to rank 0 and waits for rank 0's reply; rank 0 waits for every
        token against one deadline, so it can name the ranks that never came. Point-to-point
        ``Work.wait(timeout)`` is bounded on both sides (``monitored_barrier`` is not: a rank > 0
        whose rank 0 never arrives hangs in it on torch 2.13 gloo). The waits run on this thread,
        watched from beside it (``collectives._blocking.beside``: a report says "in the checkpoint
        arrival of <what>"). A peer whose process ended fails its wait at once: rank 0 raises
        :class:`PeerLostError` naming it and tells the ranks that came, which raise it too.
        """
        if not self.active:
            return
        deadline = time.monotonic() + timeout_s
        arrived: set[int] = set()  # rank 0: the ranks whose token came
        peers = range(1, self.world_size)  # the save's groups hold every rank: group = global

        def missing() -> tuple[int, ...]:
            return (0,) if self.rank > 0 else tuple(p for p in peers if p not in arrived)

        def make(begun: float) -> Wait:
            return Wait(
                op=what,
                phase="checkpoint arrival",
                group=self.group,
                started=begun,
                deadline=deadline,
                awaited=missing,
                call=what,  # not a collective: reported in its own words, not as a record
            )

        if self.rank == 0:
            beside(lambda: self._take_tokens(what, timeout_s, deadline, arrived), make)
        else:
            beside(lambda: self._give_token(what, timeout_s, deadline), make)

    @entry  # its own arrival protocol, watched beside: straight to the backend
    def _take_tokens(self, what: str, timeout_s: float, deadline: float, arrived: set[int]) -> None:
        """Take every rank's token (rank 0), then tell the ranks that came how it went."""
        with typed_errors(what, self.group):  # a peer already gone fails the post itself
            pending = {
                peer: dist.irecv(torch.zeros(1), src=peer, group=self.group, tag=_ARRIVE_TAG)
                for peer in range(1, self.world_size)
            }
        missing: list[int] = []
        lost: PeerLostError | None = None
        timed_out = False
        for peer, work in pending.items():
            outcome = _wait(work, deadline, what, self.group)
            if outcome is None:
                arrived.add(peer)
                continue
            missing.append(peer)
            if isinstance(outcome, PeerLostError):
                lost = lost or outcome
            else:
                timed_out = True
        if not timed_out:  # a timed-out wait closed the group's pairs: no reply can go out then
            verdict = 0.0  # go on; else 1 + the rank lost, or -1 (lost, not named): give up
            if lost is not None:
                verdict = -1.0 if lost.peer is None else 1.0 + lost.peer
            with typed_errors(what, self.group):
                for peer in sorted(arrived):  # the ranks that came learn now of a lost rank
                    dist.send(
                        torch.full((1,), verdict), dst=peer, group=self.group, tag=_ARRIVE_TAG
                    )
        if lost is not None:
            raise lost
        if missing:
            raise CheckpointSyncError(
                f"{what} on rank 0: rank(s) {', '.join(map(str, missing))} of "
                f"{self.world_size} did not call it within {timeout_s:g}s. {_EVERY_RANK}"
            )

    @entry  # its own arrival protocol, watched beside: straight to the backend
    def _give_token(self, what: str, timeout_s: float, deadline: float) -> None:
        """Send this rank's token to rank 0 (a rank > 0), then wait for its reply."""
        reply = torch.zeros(1)
        with typed_errors(what, self.group):  # a peer already gone fails the post itself
            sent = dist.isend(torch.zeros(1), dst=0, group=self.group, tag=_ARRIVE_TAG)
        outcome = _wait(sent, deadline, what, self.group)
        if outcome is None:
            with typed_errors(what, self.group):
                got = dist.irecv(reply, src=0, group=self.group, tag=_ARRIVE_TAG)
            outcome = _wait(got, deadline, what, self.group)
        if isinstance(outcome, PeerLostError):
            raise outcome
        verdict = int(reply.item())
        if outcome is None and verdict > 0:  # rank 0 lost a rank: say which
            raise PeerLostError(
                f"{what}: rank 0 gave the save up: rank {verdict - 1} went away before it",
                op=what,
                peer=verdict - 1,
            )
        if outcome is not None or verdict != 0:
            raise CheckpointSyncError(
                f"{what} on rank {self.rank}: rank 0 did not call it within {timeout_s:g}s "
                f"(or another rank did not, and rank 0 gave up). {_EVERY_RANK}"
            )

    def gather(self, value: Any) -> list[Any]:
        """Return every rank's ``value``, in rank order (``[value]`` without a group).

        distcompat's ``all_gather_object``, not torch's: torch's decodes with NumPy and raises
        "Numpy is not available" on builds without it. The values are small (a plan, a file
        entry, an error string).
        """
        if not self.active:
            return [value]
        everyone: list[Any] = [None] * self.world_size
        all_gather_object(everyone, value, group=self.group)
        return everyone


def _wait(work: dist.Work | None, deadline: float, what: str, group: Any) -> CollectiveError | None:
    """Wait for ``work`` until ``deadline`` (monotonic seconds): None once it completed, else why.

    A wait that fails before its time is the peer failing (its process ended): the translated
    error when it is a :class:`PeerLostError`; a wait that runs out (or fails otherwise) is a
    :class:`CollectiveTimeoutError` (the caller names the ranks itself).
    """
    if work is None:  # torch returns None for a rank outside the group: nothing to wait for
        return None
    try:  # work_ready raises only for a wait that failed before its time: the peer failed
        if work_ready(work)(max(deadline - time.monotonic(), 0.001)):
            return None
        reason = "the save's timeout ran out"
    except RuntimeError as exc:
        error = translate(exc, what, group)
        if isinstance(error, PeerLostError):
            return error
        reason = str(exc)
    return CollectiveTimeoutError(reason, op=what, peer=None)


def _alone(what: str) -> SaveGroup | None:
    """Return an inactive group for one process (no group, or world size 1), else None."""
    if not (dist.is_available() and dist.is_initialized()):
        world_size = get_world_size()
        if world_size > 1:
            raise CheckpointSyncError(
                f"{what}: the launcher says WORLD_SIZE={world_size} but no process group exists; "
                "call distcompat.init_distributed() first"
            )
        return SaveGroup(rank=0, world_size=1, group=None, active=False)
    if dist.get_world_size() == 1:
        return SaveGroup(rank=dist.get_rank(), world_size=1, group=None, active=False)
    return None


def save_group(what: str, timeout_s: float) -> SaveGroup:
    """Describe the ranks of the current launch; refuse a multi-rank launch with no group."""
    alone = _alone(what)
    if alone is not None:
        return alone
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if carries_cpu_tensors(str(dist.get_backend())):
        return SaveGroup(rank=rank, world_size=world_size, group=None, active=True)
    global _side_group
    if _side_group is None or _side_group[0] is not dist.group.WORLD:  # none yet, or a new world
        try:
            side: Any = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        except RuntimeError as exc:  # gloo's connect timed out: not every rank made the group
            raise CheckpointSyncError(
                f"{what} on rank {rank}: could not make the gloo group a save needs beside the "
                f"{dist.get_backend()} group within {timeout_s:g}s ({exc}). {_EVERY_RANK}"
            ) from exc
        _side_group = (dist.group.WORLD, side)
    return SaveGroup(rank=rank, world_size=world_size, group=_side_group[1], active=True)


def carries_cpu_tensors(backend: str) -> bool:
    """Say whether a default group with this backend runs CPU collectives (gloo, or a map to it).

    Example:
        >>> carries_cpu_tensors("gloo"), carries_cpu_tensors("cpu:gloo,cuda:nccl")
        (True, True)
        >>> carries_cpu_tensors("nccl")
        False
    """
    return backend in ("gloo", "distcompat") or "cpu:gloo" in backend.split(",")


def dedicated_save_group(what: str, timeout_s: float) -> SaveGroup:
    """Make a gloo group used by saves only, for saves that run beside training in a thread.

    Collectives of one group must run in the same order on every rank; a background save sharing
    the default group with the training loop would interleave differently on each rank. Every
    rank must call this together (it is a collective), like ``dist.new_group``.
    """
    alone = _alone(what)
    if alone is not None:
        return alone
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        side: Any = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise CheckpointSyncError(
            f"{what} on rank {rank}: not every rank made the save group within "
            f"{timeout_s:g}s ({exc}). Every rank must create it, in the same order"
        ) from exc
    return SaveGroup(rank=rank, world_size=world_size, group=side, active=True)
