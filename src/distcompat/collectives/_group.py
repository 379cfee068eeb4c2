"""The group a collective runs on: is there one, how big, is this rank in it, which backend.

At world size 1, or with no group at all, every distcompat collective is the identity and needs
no process group, so single-process code runs unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["NotInGroupError", "backend_for", "group_size", "rank_in"]


class NotInGroupError(ValueError):
    """A rank called a collective on a group it is not a member of."""


def group_size(group: Any) -> int:
    """Return the world size of ``group``; 1 when no process group exists.

    Raises :class:`NotInGroupError` where torch would warn and silently return None.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return 1
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
    return dist.get_rank(group)


def backend_for(group: Any, device: torch.device) -> str:
    """Return the backend that moves ``device`` tensors on ``group`` (cpu:gloo,... -> gloo)."""
    config = getattr(dist, "get_backend_config", None)
    text = str(config(group)) if config is not None else str(dist.get_backend(group))
    if ":" not in text:
        return text
    pairs = dict(part.split(":", 1) for part in text.split(","))
    return pairs.get(device.type, str(dist.get_backend(group)))
