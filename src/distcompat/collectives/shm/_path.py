"""Whether a CPU collective goes through shared memory or the backend, decided per group.

A group takes the shared-memory path when every one of its ranks runs on this machine (the same
boot id and pid namespace in the identities they post, whatever ``LOCAL_WORLD_SIZE`` says: a
group may be a subset of the host's ranks or span hosts), its CPU backend is gloo, and
``DISTCOMPAT_SHM`` is not ``off``. The ranks decide together, at the group's first call that
would use the path, through the group's store::

    engine = engine_for(group, "all_reduce", wire)   # None: use the backend
    if engine is not None:
        engine.run("all_reduce", engine.all_reduce(wire.view(-1), op), async_op)

The set-up itself is ``_setup``'s: any problem on any rank sends the whole group to the backend
with the same reason on every rank (rank 0 prints it as a :class:`SharedMemoryFallbackWarning`
when it is a failure rather than a choice). :func:`status` says which path a group takes and
why.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist

from distcompat.collectives._group import backend_for
from distcompat.collectives.shm._engine import Engine
from distcompat.collectives.shm._folds import REDUCERS
from distcompat.collectives.shm._segment import (
    MAX_WORLD,
    SHM_DIR,
    free_bytes,
    platform_problem,
)
from distcompat.collectives.shm._setup import (
    SLOT_BYTES,
    SharedMemoryFallbackWarning,
    ShmStatus,
    set_up,
)
from distcompat.launch._settings import ShmChoice, choose_shm

__all__ = [
    "MIN_BYTES",
    "SLOT_BYTES",
    "WIRED",
    "SharedMemoryFallbackWarning",
    "ShmStatus",
    "close_all",
    "engaged",
    "engine_for",
    "floor_bytes",
    "forced",
    "host_reason",
    "reduces",
    "reset",
    "status",
]

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
_ARITHMETIC = (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX)


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
    """Forget the setting and every group's decision, and end every engine (tests)."""
    global _choice
    _choice = None
    floors.clear()
    close_all()


def close_all() -> None:
    """End every group's engine (its thread, its segment): the groups were destroyed.

    A destroyed group that something still holds (see ``_lifecycle._destroy_group``) would
    otherwise keep its engine's thread and shared memory until the process exits.

    Example:
        >>> close_all()
    """
    for found in list(_groups.values()):
        if isinstance(found, Engine):
            found.close()
    _groups.clear()


#: :func:`floor_bytes`' answers by (collective, world size), kept until :func:`reset`: the fast
#: paths (``direct``) read this dict before they call it (one call less per tiny collective).
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

    The first call that could take it sets the path up, on every rank together. Called by the
    general paths only, after the call's mismatch check: every rank sets up at the same point
    of its collectives, whichever way its call came in (see :func:`engaged`).
    """
    key = group if group is not None else dist.group.WORLD
    if tensor.device.type != "cpu" or tensor.nbytes < floor_bytes(
        collective, dist.get_world_size(key)
    ):
        return None
    found = _groups.get(key)
    if found is None:
        found = _groups[key] = set_up(key, collective)
    return engaged(key)


def engaged(pg: Any) -> Engine | None:
    """Return ``pg``'s engine if the path is set up and usable there; never sets it up.

    For the fast paths (``direct``), which checked the floor and the tensor themselves: one
    dict lookup. Before the group's first set-up they take the general path, which checks the
    call and then sets up: a fast path that set up before its check deadlocked against a rank
    whose same call took the general path (check first), each waiting in the other's step.
    """
    found = _groups.get(pg)
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
