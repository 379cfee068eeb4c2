"""Whether a CPU collective goes through shared memory or the backend, decided per group.

A group takes the shared-memory path when every one of its ranks runs on this machine (the same
boot id and pid namespace in the identities they post, whatever ``LOCAL_WORLD_SIZE`` says: a
group may be a subset of the host's ranks or span hosts), its CPU backend is gloo, and
``DISTCOMPAT_SHM`` is not ``off``. The ranks decide together, at the group's first call that
would use the path, through the group's store::

    engine = engine_for(group, "all_reduce", wire)   # None: use the backend
    if engine is not None:
        engine.run("all_reduce", engine.all_reduce(wire.view(-1), op), async_op)

Setup: every rank posts its identity and any local problem; rank 0 creates the segment and posts
its name, or why it could not; every rank maps it and posts the outcome; rank 0 unlinks the name
once all have posted. Any problem on any rank sends the whole group to the backend with the same
reason on every rank (rank 0 prints it as a :class:`SharedMemoryFallbackWarning` when it is a
failure rather than a choice). :func:`status` says which path a group takes and why.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import warnings
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from distcompat.collectives._agree_store import QuickStore, StoreUnreachable
from distcompat.collectives._errors import CollectiveError
from distcompat.collectives._group import backend_for, global_rank, group_timeout_s
from distcompat.collectives._peers import Identity
from distcompat.collectives._shm_barrier import Barrier
from distcompat.collectives._shm_engine import REDUCERS, Engine
from distcompat.collectives._shm_segment import (
    MAX_WORLD,
    SHM_DIR,
    Segment,
    SegmentError,
    free_bytes,
    platform_problem,
    sweep_leftovers,
)
from distcompat.collectives._wait import Wait, polled, timeout_error, until
from distcompat.launch._settings import ShmChoice, choose_shm

__all__ = [
    "MIN_BYTES",
    "SLOT_BYTES",
    "WIRED",
    "SharedMemoryFallbackWarning",
    "ShmStatus",
    "engaged",
    "engine_for",
    "floor_bytes",
    "forced",
    "host_reason",
    "reduces",
    "reset",
    "status",
]

#: Bytes of one rank's slot: chunks of a larger tensor are pipelined through it (halved where
#: /dev/shm is small: ``Segment.fit``). For all_reduce of 16-64 MiB at 2 ranks, 1 MiB measured
#: faster than 4 MiB and about as fast as 2 MiB (a chunk's traffic stays in the caches); at 4
#: ranks the size made no difference (benchmarks/README.md).
SLOT_BYTES = 1 << 20
#: Under ``DISTCOMPAT_SHM=auto``, the smallest tensor (bytes) each op sends through shared memory,
#: at 2 ranks and at more: below it gloo measured as fast or faster, or the runs disagreed
#: (benchmarks/README.md, 2 and 4 ranks on 2 cores). Since synchronous calls run in place
#: (2026-11-26), every op and size measured faster through shared memory at 2 ranks in three
#: runs (4 B: 1.61-2.59x); at 4 ranks a broadcast below 1 MiB measured 0.99-1.22x, and at 1 MiB
#: 1.60x in one run but 0.81x in another (issue 28), so it stays on gloo there below 16 MiB
#: (16 and 64 MiB: 1.56-1.76x).
MIN_BYTES: dict[str, tuple[int, int]] = {
    "all_reduce": (0, 0),
    "broadcast": (0, 16 << 20),
    "all_gather_into_tensor": (0, 0),
    "reduce_scatter_tensor": (0, 0),
    "reduce_scatter": (0, 0),  # the list form: reduce_scatter_tensor of the concatenation
}
#: The collectives that take the path where it applies (the others always use the backend).
WIRED = frozenset(
    {"all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter"}
)
_KEY = "distcompat/shm"
_ARITHMETIC = (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX)


class SharedMemoryFallbackWarning(RuntimeWarning):
    """The shared-memory path could not be set up for a group; its collectives use gloo."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ShmStatus:
    """A group's path: ``engaged`` (shared memory) or not, and why."""

    engaged: bool
    reason: str


_groups: weakref.WeakKeyDictionary[Any, Engine | ShmStatus] = weakref.WeakKeyDictionary()
_choice: ShmChoice | None = None


def choice() -> ShmChoice:
    """Return ``DISTCOMPAT_SHM``'s setting, read once (:func:`reset` reads it again)."""
    global _choice
    if _choice is None:
        _choice = choose_shm()
    return _choice


@contextlib.contextmanager
def forced(mode: Literal["on", "off"]) -> Iterator[None]:
    """Inside the block, send this process's CPU collectives through shared memory or not.

    For measuring the two paths side by side (``distcompat bench --compare-shm``): every rank
    must enter and leave the block at the same point of its calls. ``on`` where the group has
    no path (another machine, no room) still goes to the backend.

    Example:
        >>> with forced("off"):
        ...     choice().mode
        'off'
    """
    global _choice
    saved = _choice
    _choice = ShmChoice(mode=mode, reason=f"{mode}: set for a measurement of both paths")
    floors.clear()
    try:
        yield
    finally:
        _choice = saved
        floors.clear()


def reset() -> None:
    """Forget the setting and every group's decision (tests; a group set up keeps its engine)."""
    global _choice
    _choice = None
    floors.clear()
    for found in list(_groups.values()):
        if isinstance(found, Engine):
            found.close()
    _groups.clear()


#: :func:`floor_bytes`' answers by (collective, world size), kept until :func:`reset`: the fast
#: paths (``_direct``) read this dict before they call it (one call less per tiny collective).
floors: dict[tuple[str, int], float] = {}


def floor_bytes(collective: str, world: int) -> float:
    """Return the smallest tensor (bytes) of ``collective`` the path takes now (inf: none)."""
    mode = choice().mode
    if mode == "off":
        floor = math.inf
    else:
        floor = 0 if mode == "on" else MIN_BYTES[collective][0 if world <= 2 else 1]
    floors[collective, world] = floor
    return floor


def engine_for(group: Any, collective: str, tensor: torch.Tensor) -> Engine | None:
    """Return the group's engine when ``collective`` on ``tensor`` takes the path, else None.

    The first call that could take it sets the path up, on every rank together.
    """
    key = group if group is not None else dist.group.WORLD
    if tensor.device.type != "cpu" or tensor.nbytes < floor_bytes(
        collective, dist.get_world_size(key)
    ):
        return None
    return engaged(key, collective)


def engaged(pg: Any, op: str = "collective") -> Engine | None:
    """Return ``pg``'s engine if the path is usable there (the first call, ``op``, sets it up).

    For the fast paths (``_direct``), which checked the floor and the tensor themselves: one
    dict lookup once the group has decided.
    """
    found = _groups.get(pg)
    if found is None:
        found = _groups[pg] = _set_up(pg, op)
    if isinstance(found, Engine) and not found.broken:
        return found
    return None


def reduces(op: Any, dtype: torch.dtype) -> bool:
    """Return whether the path reduces ``dtype`` with ``op`` (a plan's RedOpType)."""
    if op in _ARITHMETIC:
        return dtype != torch.bool
    if op == dist.ReduceOp.AVG:
        return dtype.is_floating_point
    return op in REDUCERS and not dtype.is_floating_point and dtype != torch.bool


def status(group: Any) -> ShmStatus:
    """Return the path ``group``'s CPU collectives take (nothing is sent or set up).

    Exported as ``distcompat.collectives.shm_status``.

    Example:
        >>> status(None).engaged
        False
    """
    mode = choice()
    if mode.mode == "off":
        return ShmStatus(engaged=False, reason=mode.reason)
    if not (dist.is_available() and dist.is_initialized()):
        return ShmStatus(engaged=False, reason="no process group")
    key = group if group is not None else dist.group.WORLD
    found = _groups.get(key)
    if isinstance(found, Engine):
        if found.broken:
            return ShmStatus(engaged=False, reason=f"the path failed on this group: {found.broken}")
        size = found.segment.size / 2**20
        return ShmStatus(
            engaged=True, reason=f"all {found.world} ranks on this machine ({size:.1f} MiB segment)"
        )
    if isinstance(found, ShmStatus):
        return found
    problem = _local_problem(key)
    if problem:
        return ShmStatus(engaged=False, reason=problem)
    return ShmStatus(
        engaged=True, reason="not set up yet: decided with the other ranks at the first call"
    )


def host_reason(environ: Mapping[str, str] | None = None) -> str:
    """Say whether CPU collectives on this machine may use shared memory (no group needed).

    ``distcompat doctor`` prints it. A malformed ``DISTCOMPAT_SHM`` raises ``LaunchEnvError``.

    Example:
        >>> host_reason({"DISTCOMPAT_SHM": "off"})
        'off: DISTCOMPAT_SHM=off'
    """
    setting = choose_shm(environ)
    if setting.mode == "off":
        return setting.reason
    problem = platform_problem()
    if problem:
        return f"gloo: {problem} ({setting.reason})"
    room = free_bytes() / 2**20
    return (
        f"{setting.reason}; decided per group at its first call: shared memory when every rank "
        f"is on one machine ({SHM_DIR} has {room:.0f} MiB free)"
    )


def _local_problem(key: Any) -> str:
    """Return a reason this rank alone can see for the backend ('' if none)."""
    if backend_for(key, torch.device("cpu")) != "gloo":
        return "the group's CPU backend is not gloo"
    world = dist.get_world_size(key)
    if world > MAX_WORLD:
        return f"more than {MAX_WORLD} ranks"
    return platform_problem()


def _set_up(key: Any, op: str) -> Engine | ShmStatus:
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
        store = dist.distributed_c10d._get_process_group_store(key)
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

    def __init__(self, key: Any, store: Any, op: str) -> None:
        self.key, self.op, self.store = key, op, QuickStore(store)
        self.started, self.limit = time.monotonic(), group_timeout_s(key)

    def ask(self, name: str, *args: Any) -> Any:
        """Make one store request, asked again while the store does not answer."""
        while True:
            try:
                return getattr(self.store, name)(*args)
            except StoreUnreachable as exc:
                if time.monotonic() > self.started + self.limit:
                    wait = Wait(op=self.op, phase="shared-memory set-up", group=self.key)
                    raise timeout_error(wait, self.limit) from exc
                time.sleep(0.1)

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


def _agree_and_map(key: Any, store: Any, op: str) -> Engine | ShmStatus:
    rank, world = dist.get_rank(key), dist.get_world_size(key)
    talk = _SetUp(key, store, op)
    generation = (talk.ask("add", f"{_KEY}/setups", 1) - 1) // world  # this setup's number
    base = f"{_KEY}/{generation}"
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
