"""The collectives of one distributed save: a bounded arrival check, then small object gathers.

Every save runs, on every rank and in this order: ``arrive`` (point-to-point tokens to and from
rank 0, waited on as every wait on peers is, by ``collectives._wait.until``, but bounded by the
save's own timeout: a save called from one rank only fails in seconds and rank 0 names the ranks
that never came, instead of hanging until the process-group timeout; the watchdog sees the wait
as "the checkpoint arrival of save_checkpoint(step=N)"), then three small object gathers
carrying the plan, each rank's write result, and rank 0's commit result. Because every rank
reports success *or* its error in those gathers, a rank that fails to write never leaves the
others waiting. Without a process group (or at world size 1) each function here is the identity.

The tokens and gathers use CPU tensors, so they run on gloo: the default group when it is gloo,
else a gloo side group made on the first save (every rank must make that first save together, as
with any collective; this path is not exercised by the CPU-only test suite).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distcompat._ranks import get_world_size
from distcompat.checkpoint._errors import CheckpointSyncError
from distcompat.collectives import all_gather_object
from distcompat.collectives._blocking import Aside
from distcompat.collectives._errors import CollectiveError, CollectiveTimeoutError, translate
from distcompat.collectives._wait import Wait, until

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

        Each rank > 0 sends a token to rank 0 and waits for rank 0's reply; rank 0 takes the
        tokens as they come, so it can name the ranks that never came, then replies. The exchange
        blocks on a helper thread (gloo's point-to-point wait cannot be sliced: ``_blocking.Aside``)
        while this thread waits in ``_wait.until`` ("in the checkpoint arrival of <what>"):
        watched, :class:`PeerLostError` at once for a peer process that ended, and at
        ``timeout_s`` :class:`CheckpointSyncError` naming who never came. (``monitored_barrier``
        is no substitute: a rank > 0 whose rank 0 never arrives hangs in it on torch 2.13 gloo.)
        """
        if not self.active:
            return
        started = time.monotonic()
        gave_up = threading.Event()  # a helper left behind by a failed arrival does no more
        done: set[int] = set()  # rank 0: ranks whose token came; then those that had the reply
        peers = range(1, self.world_size)  # the save's groups hold every rank: group = global

        def exchange() -> None:
            token = torch.zeros(1)
            if self.rank > 0:
                dist.send(token, dst=0, group=self.group, tag=_ARRIVE_TAG)
                if not gave_up.is_set():
                    dist.recv(token, src=0, group=self.group, tag=_ARRIVE_TAG)
                return
            while len(done) < len(peers) and not gave_up.is_set():
                done.add(dist.recv(torch.zeros(1), group=self.group, tag=_ARRIVE_TAG))
            done.clear()
            for peer in peers:
                dist.send(token, dst=peer, group=self.group, tag=_ARRIVE_TAG)
                done.add(peer)

        def missing() -> tuple[int, ...]:
            return (0,) if self.rank > 0 else tuple(p for p in peers if p not in done)

        late = self._late(what, timeout_s, missing)
        wait = Wait(
            op=what,
            phase="checkpoint arrival",
            group=self.group,
            started=started,
            deadline=started + timeout_s,
            awaited=missing,
            late=late,
        )
        try:
            until(Aside(exchange).ready, wait)
        except (CollectiveError, CheckpointSyncError):
            raise
        except RuntimeError as exc:  # the helper's gloo call: a peer went away, or timed out
            error = translate(exc, what, self.group)
            if isinstance(error, CollectiveTimeoutError):  # the group's timeout came first
                raise late(error) from exc
            if error is exc:
                raise
            raise error from exc
        finally:
            gave_up.set()

    def _late(
        self, what: str, timeout_s: float, missing: Callable[[], tuple[int, ...]]
    ) -> Callable[[CollectiveTimeoutError], CheckpointSyncError]:
        """Return the error of an arrival that ran out of time, naming the ranks not seen."""

        def late(error: CollectiveTimeoutError) -> CheckpointSyncError:
            if self.rank > 0:
                return CheckpointSyncError(
                    f"{what} on rank {self.rank}: rank 0 did not call it within {timeout_s:g}s "
                    f"(or another rank did not, and rank 0 gave up). {_EVERY_RANK}"
                )
            return CheckpointSyncError(
                f"{what} on rank 0: rank(s) {', '.join(map(str, missing()))} of "
                f"{self.world_size} did not call it within {timeout_s:g}s. {_EVERY_RANK}"
            )

        return late

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
            side = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
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
    return backend == "gloo" or "cpu:gloo" in backend.split(",")


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
        side = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise CheckpointSyncError(
            f"{what} on rank {rank}: not every rank made the save group within "
            f"{timeout_s:g}s ({exc}). Every rank must create it, in the same order"
        ) from exc
    return SaveGroup(rank=rank, world_size=world_size, group=side, active=True)
