"""What one regroup did, and the rules a survivor's recovery reads its error and time by.

    Recovery(...)                  # InPlace.recoveries: who was lost, who joined, the times
    report(recovery, regrouped)    # rank 0's one line on the ``distcompat.inplace`` logger
    is_collective(error)           # a collective's failure: a lost peer may be behind it
    deadline()                     # when a regroup gives up: the group timeout from now

Example:
    >>> Recovery(epoch=1, lost=(2,), members=(0, 1), step=5, source=0, how="a new backend",
    ...          agree_s=0.5, regroup_s=0.25, sync_s=0.25).seconds
    1.0
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from distcompat._ranks import recorded
from distcompat.collectives import CollectiveError
from distcompat.inplace._regroup import Regrouped

__all__ = ["Recovery", "deadline", "is_collective", "report"]

_log = logging.getLogger("distcompat.inplace")


@dataclass(frozen=True, slots=True)
class Recovery:
    """One regroup: who was lost, who went on, from which step, and the time of each part."""

    epoch: int
    lost: tuple[int, ...]  # member ids (launch ranks; newcomers count on from the first size)
    members: tuple[int, ...]  # member ids, in their new rank order
    step: int  # the step the group goes on from (steps applied)
    source: int  # the rank whose state every survivor took
    how: str
    agree_s: float
    regroup_s: float
    sync_s: float
    joined: tuple[int, ...] = ()  # newcomers admitted (a grow)

    @property
    def seconds(self) -> float:
        """From this rank's error to the state in place."""
        return self.agree_s + self.regroup_s + self.sync_s


def report(recovery: Recovery, done: Regrouped) -> None:
    """Say ``recovery`` in one line (rank 0 of the regrouped group ``done``; others say nothing)."""
    if done.rank != 0:
        return
    change = f"launch rank(s) {list(recovery.lost)} lost" if recovery.lost else ""
    if recovery.joined:
        change += f"{'; ' if change else ''}newcomer(s) {list(recovery.joined)} joined"
    _log.warning(
        "distcompat: %s; %d rank(s) go on in place from step %d "
        "(epoch %d, %s; %.0f ms: agree %.0f, regroup %.0f, state %.0f)",
        change, done.world_size, recovery.step, recovery.epoch, done.how,
        recovery.seconds * 1e3, recovery.agree_s * 1e3, recovery.regroup_s * 1e3,
        recovery.sync_s * 1e3,
    )  # fmt: skip


def deadline() -> float:
    """Return the ``time.monotonic()`` past which a regroup gives up: the group timeout on."""
    info = recorded()
    timeout_s = info.timeout.total_seconds() if info and info.timeout else 600.0
    return time.monotonic() + timeout_s


def is_collective(error: BaseException) -> bool:
    """Whether ``error`` (or what it wraps) is a collective's failure, or torch's text of one."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, CollectiveError) or "PeerLostError" in str(current):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return isinstance(error, RuntimeError)
