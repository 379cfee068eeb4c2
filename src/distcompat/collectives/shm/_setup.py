"""Setting the shared-memory path up for a group, with every rank: decide together, map, meet.

Every rank posts its identity and any local problem; rank 0 creates the segment and posts its
name, or why it could not; every rank maps it and posts the outcome; rank 0 unlinks the name
once all have posted. Any problem on any rank sends the whole group to the backend with the same
reason on every rank. Each store request and wait is bounded by the group's timeout::

    found = set_up(group, "all_reduce")     # an Engine, or the ShmStatus saying why not
"""

from __future__ import annotations

import json
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from distcompat import _torch
from distcompat._store import QuickStore, StoreUnreachable, asked_until
from distcompat.collectives._errors import CollectiveError
from distcompat.collectives._group import backend_for, global_rank, group_timeout_s
from distcompat.collectives._wait import Wait, polled, timeout_error, until
from distcompat.collectives.shm._barrier import Barrier
from distcompat.collectives.shm._engine import Engine
from distcompat.collectives.shm._segment import (
    MAX_WORLD,
    Segment,
    SegmentError,
    platform_problem,
    sweep_leftovers,
)
from distcompat.peers import Identity

__all__ = ["SLOT_BYTES", "SharedMemoryFallbackWarning", "ShmStatus", "set_up"]

#: Bytes of one rank's slot: chunks of a larger tensor are pipelined through it (halved where
#: /dev/shm is small: ``Segment.fit``). For all_reduce of 16-64 MiB at 2 ranks, 1 MiB measured
#: faster than 4 MiB and about as fast as 2 MiB (a chunk's traffic stays in the caches); at 4
#: ranks the size made no difference (benchmarks/README.md).
SLOT_BYTES = 1 << 20
_KEY = "distcompat/shm"


class SharedMemoryFallbackWarning(RuntimeWarning):
    """The shared-memory path could not be set up for a group; its collectives use gloo."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ShmStatus:
    """A group's path: ``engaged`` (shared memory) or not, and why."""

    engaged: bool
    reason: str


def set_up(key: Any, op: str) -> Engine | ShmStatus:
    """Decide with the group's other ranks, and set the path up if every rank can take it.

    The set-up waits for every rank through ``_wait.until`` ("in the shared-memory set-up"),
    bounded by the group's timeout: a rank that never comes ends the call with
    :class:`CollectiveTimeoutError` naming it, as the collective itself would.
    """
    if backend_for(key, torch.device("cpu")) != "gloo":
        return ShmStatus(
            engaged=False, reason="the group's CPU backend is not gloo"
        )  # the same on every rank
    if dist.get_world_size(key) > MAX_WORLD:
        return ShmStatus(engaged=False, reason=f"more than {MAX_WORLD} ranks")
    try:
        # the default store, under a prefix per group: one connection serves every group
        store = QuickStore(_torch.default_store(), f"{_KEY}/{key.group_name}")
    except (AttributeError, RuntimeError, ValueError) as exc:
        return ShmStatus(engaged=False, reason=f"no store to set the path up through ({exc})")
    try:
        outcome = _agree_and_map(key, store, op)
    except CollectiveError:
        raise  # a rank never came, or went away: the collective's own error
    except (RuntimeError, ValueError) as exc:  # the store failed
        outcome = ShmStatus(
            engaged=False, reason=f"failed: setup did not complete on every rank: {exc}"
        )
    if isinstance(outcome, Engine):
        weakref.finalize(key, outcome.close)
    elif outcome.reason.startswith("failed") and dist.get_rank(key) == 0:
        warnings.warn(
            f"distcompat: CPU collectives of this group use gloo, not shared memory: "
            f"{outcome.reason}",
            SharedMemoryFallbackWarning,
            stacklevel=5,
        )
    return outcome


class _SetUp:
    """One set-up's talk with the other ranks: every store request and wait bounded.

    Requests go through a :class:`QuickStore` (none waits on an unreachable store past its
    short timeout) and are asked again until the group's timeout; waits for the other ranks'
    keys are ``_wait.until``'s ("in the shared-memory set-up"), which name who never posted.
    """

    def __init__(self, key: Any, store: QuickStore, op: str) -> None:
        self.key, self.op, self.store = key, op, store
        self.started, self.limit = time.monotonic(), group_timeout_s(key)

    def ask(self, name: str, *args: Any) -> Any:
        """Make one store request, asked again while the store does not answer."""
        wait = Wait(op=self.op, phase="shared-memory set-up", group=self.key)
        return asked_until(
            lambda: getattr(self.store, name)(*args),
            self.started + self.limit,
            0.1,
            lambda: timeout_error(wait, self.limit),
        )

    def count(self, key: str) -> int:
        """Add one to the counter ``key``, sent once (never asked again: it would count twice)."""
        left = self.started + self.limit - time.monotonic()
        try:
            return self.store.add(key, 1, timeout=max(left, 0.001))
        except StoreUnreachable as exc:
            wait = Wait(op=self.op, phase="shared-memory set-up", group=self.key)
            raise timeout_error(wait, self.limit) from exc

    def wait_for(self, keys: list[str]) -> None:
        """Wait until every one of ``keys`` is posted; the group's timeout ends the wait."""

        def posted() -> bool:
            try:
                return self.store.check(keys)
            except StoreUnreachable:
                return False

        def missing() -> tuple[int, ...] | None:
            try:
                absent = [r for r, k in enumerate(keys) if not self.store.check([k])]
            except StoreUnreachable:
                return None  # no one to name: the store did not answer
            return tuple(global_rank(self.key, r) for r in absent)

        wait = Wait(
            op=self.op,
            phase="shared-memory set-up",
            group=self.key,
            started=self.started,
            deadline=self.started + self.limit,
            awaited=missing,
        )
        until(polled(posted), wait)


def _agree_and_map(key: Any, store: QuickStore, op: str) -> Engine | ShmStatus:
    rank, world = dist.get_rank(key), dist.get_world_size(key)
    talk = _SetUp(key, store, op)
    generation = (talk.count("setups") - 1) // world  # this setup's number
    base = str(generation)
    me = Identity.here()
    hello = {"identity": me.to_json(), "problem": platform_problem()}
    talk.ask("set", f"{base}/hello/{rank}", json.dumps(hello))
    keys = [f"{base}/hello/{r}" for r in range(world)]
    talk.wait_for(keys)
    hellos = [json.loads(value) for value in talk.ask("multi_get", keys)]
    for r, other in enumerate(hellos):
        if other["problem"]:
            return ShmStatus(
                engaged=False, reason=f"rank {global_rank(key, r)}: {other['problem']}"
            )
    identities = [Identity.from_json(h["identity"]) for h in hellos]
    machines = {identity.machine for identity in identities}
    if "" in machines or len(machines) > 1:
        hosts = sorted({identity.host for identity in identities})
        where = ", ".join(hosts)
        return ShmStatus(
            engaged=False, reason=f"the group's ranks are not all on one machine ({where})"
        )
    segment: Segment | None = None
    problem = ""
    if rank == 0:
        sweep_leftovers()
        try:
            segment = Segment.create(world, Segment.fit(world, SLOT_BYTES))
            talk.ask("set", f"{base}/name", f"{segment.slot_bytes} {segment.path}")
        except SegmentError as exc:
            problem = f"failed on rank {global_rank(key, 0)}: {exc.strerror or exc}"
            talk.ask("set", f"{base}/name", "!" + problem)
    else:
        talk.wait_for([f"{base}/name"])
        name = talk.ask("get", f"{base}/name").decode()
        if name.startswith("!"):
            problem = name[1:]
        else:
            slot_bytes, path = name.split(" ", 1)
            try:
                segment = Segment.attach(path, world, int(slot_bytes))
            except SegmentError as exc:
                problem = f"failed on rank {global_rank(key, rank)}: {exc.strerror or exc}"
    talk.ask("set", f"{base}/mapped/{rank}", "!" + problem if problem else "ok")
    keys = [f"{base}/mapped/{r}" for r in range(world)]
    try:
        talk.wait_for(keys)
        posts = [value.decode() for value in talk.ask("multi_get", keys)]
    finally:
        if rank == 0 and segment is not None:
            segment.unlink()  # every rank has it mapped (or gave up): nothing left in /dev/shm
    failed = [post[1:] for post in posts if post.startswith("!")]
    if failed or segment is None:
        if segment is not None:
            segment.close()
        return ShmStatus(engaged=False, reason=failed[0] if failed else problem)
    peers = {r: (global_rank(key, r), identities[r]) for r in range(world) if r != rank}
    barrier = Barrier(segment, rank, peers, talk.limit)
    return Engine(segment, barrier, rank=rank, world=world)
