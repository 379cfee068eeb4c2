"""Where this process stands in the job: the record init keeps, and the rank/world queries.

:func:`distcompat.init_distributed` records what it set up here (:class:`DistInfo`, and for a group
it created, the rendezvous store); everything else in distcompat asks these functions for a rank
number instead of importing the process-group lifecycle::

    from distcompat import get_rank, get_world_size
    shard = dataset[get_rank() :: get_world_size()]

Without a record, the answers come from the group if one exists (made by someone else), else
from the launcher environment (rank 0 of 1 when there is none).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from distcompat.launch import LaunchEnv

__all__ = [
    "DistInfo",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "group_active",
    "is_main_process",
    "keep_rendezvous",
    "record",
    "recorded",
    "rendezvous",
    "side_store",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class DistInfo:
    """What :func:`init_distributed` set up, and why.

    ``has_group`` is False for a plain single process (no launcher env): no group exists and the
    rank helpers are the identity. ``timeout`` is None only for an adopted group whose timeout
    nobody told us (torch has no public getter for it). ``exported`` names the variables init
    set in this process's environment (torchrun's ``RANK``, ... where the launcher left them
    unset; ``GLOO_SOCKET_IFNAME`` where it picked gloo's interface), ``environ_reason`` says what
    and why ("" when it set none).

    Example:
        >>> from distcompat import destroy_distributed, init_distributed
        >>> info = init_distributed(device="cpu")
        >>> info.rank, info.world_size, info.backend
        (0, 1, None)
        >>> destroy_distributed()
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    device: torch.device
    backend: str | None
    timeout: timedelta | None
    launcher: str
    has_group: bool
    adopted: bool
    device_reason: str
    backend_reason: str
    timeout_reason: str
    exported: tuple[str, ...] = ()
    environ_reason: str = ""
    watchdog_reason: str = ""
    mismatch_reason: str = ""
    group_reason: str = ""

    @property
    def is_main_process(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0

    @property
    def reason(self) -> str:
        """One line per choice (device, backend, timeout, environ, watchdog, mismatch check)."""
        lines = [
            f"device: {self.device_reason}",
            f"backend: {self.backend_reason}",
            f"timeout: {self.timeout_reason}",
        ]
        if self.environ_reason:
            lines.append(f"environ: {self.environ_reason}")
        if self.watchdog_reason:
            lines.append(f"watchdog: {self.watchdog_reason}")
        if self.mismatch_reason:
            lines.append(f"mismatch check: {self.mismatch_reason}")
        if self.group_reason:
            lines.append(f"group: {self.group_reason}")
        return "\n".join(lines)

    @property
    def summary(self) -> str:
        """What was set up, in one phrase: the group (backend, size, launcher) or one process.

        Example:
            >>> from distcompat import destroy_distributed, init_distributed
            >>> init_distributed(device="cpu").summary
            'one process on cpu, no process group (no launcher)'
            >>> destroy_distributed()
        """
        if not self.has_group:
            how = "no launcher" if self.launcher == "none" else f"launcher {self.launcher}"
            return f"one process on {self.device.type}, no process group ({how})"
        ranks = "rank" if self.world_size == 1 else "ranks"
        how = "adopted" if self.adopted else f"launcher {self.launcher}"
        return f"{self.backend} group of {self.world_size} {ranks} on {self.device.type} ({how})"


# The one piece of module state: what init_distributed set up, and for a group it created, the
# rendezvous store and that init's generation (the diagnostics side channel runs through it).
_info: DistInfo | None = None
_rendezvous: tuple[dist.Store, int | str] | None = None


def record(info: DistInfo | None) -> None:
    """Keep what init set up; ``None`` forgets it and the rendezvous store, as destroy does."""
    global _info, _rendezvous
    _info = info
    if info is None:
        _rendezvous = None


def keep_rendezvous(store: dist.Store, generation: int | str) -> None:
    """Keep the store of the group being created, and its init generation (see side_store).

    A group whose members changed in place (``distcompat.inplace``) is a generation of its own:
    ``"3.1"``, the first regroup of generation 3.
    """
    global _rendezvous
    _rendezvous = (store, generation)


def rendezvous() -> tuple[dist.Store, int | str] | None:
    """Return the rendezvous store of the group init_distributed created, and its generation.

    None for an adopted group or when no group exists (as :func:`side_store`).
    """
    if _rendezvous is None or not group_active():
        return None
    return _rendezvous


def recorded() -> DistInfo | None:
    """Return what init set up, or None before init and after destroy."""
    return _info


def group_active() -> bool:
    """Return True when a default process group exists, whoever made it."""
    return dist.is_available() and dist.is_initialized()


def side_store() -> tuple[dist.Store, str] | None:
    """Return the store of the group init_distributed created, and a key prefix unique to it.

    distcompat.diagnostics exchanges hang reports through it while the group itself is stuck.
    None for an adopted group (its store is not ours to know) or when no group exists.
    """
    if _rendezvous is None or not group_active():
        return None
    store, generation = _rendezvous
    return store, f"distcompat/diagnostics/generation{generation}"


def get_rank() -> int:
    """Return the global rank: from the group if one exists, else the launcher env (0 if none).

    Example:
        >>> get_rank()
        0
    """
    if _info is not None:
        return _info.rank
    if group_active():
        return dist.get_rank()
    return LaunchEnv.from_environ().rank


def get_world_size() -> int:
    """Return the number of ranks: from the group if one exists, else the launcher env (1 if none).

    Example:
        >>> get_world_size()
        1
    """
    if _info is not None:
        return _info.world_size
    if group_active():
        return dist.get_world_size()
    return LaunchEnv.from_environ().world_size


def get_local_rank() -> int:
    """Return the rank within this node, from the launcher env (0 if none).

    Example:
        >>> get_local_rank()
        0
    """
    if _info is not None:
        return _info.local_rank
    return LaunchEnv.from_environ().local_rank


def is_main_process() -> bool:
    """Return True on global rank 0 (and in a plain single process).

    Example:
        >>> is_main_process()
        True
    """
    return get_rank() == 0
