"""The group a collective runs on: is there one, how big, is this rank in it, which backend.

At world size 1, or with no group at all, every distcompat collective is the identity and needs
no process group, so single-process code runs unchanged.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

from distcompat import _torch
from distcompat._ranks import recorded

__all__ = [
    "FALLBACK_TIMEOUT_S",
    "NotInGroupError",
    "StaleGroupError",
    "backend_for",
    "global_rank",
    "group_rank_of",
    "group_size",
    "group_timeout_s",
    "is_root",
    "rank_in",
    "refuse_stale",
    "root_kwargs",
]


class NotInGroupError(ValueError):
    """A rank called a collective on a group it is not a member of."""


class StaleGroupError(RuntimeError):
    """A collective on a group made before the default group changed members in place.

    ``distcompat.inplace`` fences every other group when the default one regroups: their
    members, ranks and connections are the old epoch's. Make the group again (``new_group``,
    a new device mesh) after the regroup.
    """


def refuse_stale(group: Any) -> None:
    """Raise :class:`StaleGroupError` for a group fenced by an in-place regroup.

    Example:
        >>> refuse_stale(None)   # the default group: never fenced
    """
    fenced = getattr(group, "fenced", "") if group is not None else ""
    if fenced:
        raise StaleGroupError(fenced)


def group_size(group: Any) -> int:
    """Return the world size of ``group``; 1 when no process group exists.

    Raises :class:`NotInGroupError` where torch would warn and silently return None, and
    :class:`StaleGroupError` for a group an in-place regroup fenced.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    refuse_stale(group)
    if group is not None and dist.get_rank(group) < 0:
        raise NotInGroupError(
            f"rank {dist.get_rank()} called a collective on a group it does not belong to "
            "(torch would only warn and leave the tensors untouched)"
        )
    return dist.get_world_size(group)


def rank_in(group: Any) -> int:
    """Return this process's rank within ``group`` (0 when no process group exists)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    refuse_stale(group)
    return dist.get_rank(group)


_backends: weakref.WeakKeyDictionary[Any, dict[str, str]] = weakref.WeakKeyDictionary()


def global_rank(group: Any, group_rank: int) -> int:
    """Return the global rank of ``group_rank`` in ``group`` (the same rank for the default group).

    torch's ``get_global_rank`` refuses ``group.WORLD`` itself, so the default group, named as
    None or as ``dist.group.WORLD``, is answered here.
    """
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def is_root(group: Any, rank: int | None, group_rank: int | None) -> bool:
    """Return whether this process is the root named by a global ``rank`` or a ``group_rank``."""
    if group_rank is not None:
        return rank_in(group) == group_rank
    return dist.get_rank() == rank


def group_rank_of(group: Any, rank: int | None, group_rank: int | None) -> int:
    """Return the rank within ``group`` of a root named by global ``rank`` or by ``group_rank``."""
    if group_rank is not None:
        return group_rank
    if rank is None:
        raise ValueError("a root rank is needed: pass src/dst or group_src/group_dst")
    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_group_rank(group, rank)


def root_kwargs(name: str, rank: int | None, group_rank: int | None) -> dict[str, int | None]:
    """Return torch's keyword for a root/peer: ``{name: rank}`` or ``{"group_" + name: ...}``.

    Only the form the caller used is passed on, so torch releases without ``group_src`` /
    ``group_dst`` keep working when those are not used.
    """
    return {f"group_{name}": group_rank} if group_rank is not None else {name: rank}


def backend_for(group: Any, device: torch.device) -> str:
    """Return the backend that moves ``device`` tensors on ``group`` (cpu:gloo,... -> gloo).

    Cached per group object: a group's backends never change.
    """
    key = group if group is not None else dist.group.WORLD
    known = _backends.get(key)
    protects = getattr(key, "protects", None)  # a ProtectedGroup: the backend it holds
    if known is None and protects is not None:
        known = _backends[key] = {"*": protects}
    if known is None:
        config = getattr(dist, "get_backend_config", None)
        text = str(config(group)) if config is not None else str(dist.get_backend(group))
        fallback = str(dist.get_backend(group))
        known = dict(part.split(":", 1) for part in text.split(",")) if ":" in text else {}
        known["*"] = text if ":" not in text else fallback
        _backends[key] = known
    return known.get(device.type, known["*"])


#: A group's timeout where neither it nor the default group says (an adopted group, seconds).
FALLBACK_TIMEOUT_S = 1800.0


def group_timeout_s(group: Any) -> float:
    """Return ``group``'s timeout in seconds: its own, else the default group's, else 30 min.

    torch keeps a group's own timeout in the CPU backend's options, privately (``_timeout``); a
    subgroup made with ``new_group(timeout=...)`` has its own, which the default group's does not
    tell. Where this torch does not say, the timeout init_distributed recorded applies, and
    :data:`FALLBACK_TIMEOUT_S` where there is none.

    Example:
        >>> group_timeout_s(None)   # no group here
        1800.0
    """
    own = _torch.backend_timeout_s(group)
    if own is not None:
        return own
    info = recorded()
    if info is not None and info.timeout is not None:
        return info.timeout.total_seconds()
    return FALLBACK_TIMEOUT_S
