"""The flat all-gather and reduce-scatter of torch, called by their newest names.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``all_gather_single`` /
``reduce_scatter_single`` and the old names now raise a ``FutureWarning`` (an error under
``-W error``); older releases have only the old names. Internal code calls these two helpers::

    all_gather_flat(out, inp, group=group, async_op=True)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather_flat", "reduce_scatter_flat"]


@functools.cache
def _native(new: str, old: str) -> Callable[..., Any]:
    """Return torch's function named ``new`` where it exists (feature test), else ``old``."""
    found: Callable[..., Any] | None = getattr(dist, new, None)
    return found if found is not None else getattr(dist, old)


def all_gather_flat(
    output: torch.Tensor, input: torch.Tensor, *, group: Any = None, async_op: bool = False
) -> Any:
    """Call the flat all-gather: ``all_gather_single``, else ``all_gather_into_tensor``."""
    gather = _native("all_gather_single", "all_gather_into_tensor")
    return gather(output, input, group=group, async_op=async_op)


def reduce_scatter_flat(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    op: Any = dist.ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """Call the flat reduce-scatter: ``reduce_scatter_single``, else ``reduce_scatter_tensor``."""
    scatter = _native("reduce_scatter_single", "reduce_scatter_tensor")
    return scatter(output, input, op=op, group=group, async_op=async_op)
