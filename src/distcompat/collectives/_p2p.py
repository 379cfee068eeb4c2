"""Point-to-point ops and barrier.

gloo gives ``isend``/``irecv`` Works no future and a second ``wait()`` on an any-source ``irecv``
hangs; here they return :class:`CompatWork` (completed by the group's worker thread) like every
other async op. Tensors are staged contiguous (gloo refuses non-contiguous ones).
"""

from __future__ import annotations

from typing import Any, Literal, overload

import torch
import torch.distributed as dist

from distcompat.collectives._checked import verify
from distcompat.collectives._errors import typed_errors
from distcompat.collectives._group import group_size, root_kwargs
from distcompat.collectives._reductions import issue
from distcompat.collectives._wire import stage_input, stage_output
from distcompat.collectives._work import CompatWork, done_if_async

__all__ = ["NoPeerError", "barrier", "irecv", "isend", "recv", "send"]


class NoPeerError(ValueError):
    """A point-to-point op was called where there is no other rank to talk to."""


def _needroot_kwargs(group: Any, op: str) -> None:
    if group_size(group) == 1:
        raise NoPeerError(f"{op} needs another rank, but the world size is 1 (or no group exists)")


def send(
    tensor: torch.Tensor,
    dst: int | None = None,
    group: Any = None,
    tag: int = 0,
    group_dst: int | None = None,
) -> None:
    """Send ``tensor`` to ``dst`` (any layout: staged contiguous first)."""
    _needroot_kwargs(group, "send")
    wire = stage_input(tensor, reduce=False)
    with typed_errors("send", group):
        dist.send(wire, group=group, tag=tag, **root_kwargs("dst", dst, group_dst))


def recv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: Any = None,
    tag: int = 0,
    group_src: int | None = None,
) -> int:
    """Receive into ``tensor`` from ``src`` (any rank if None); return the sender's rank."""
    _needroot_kwargs(group, "recv")
    wire, copy_back = stage_output(tensor, reduce=False)
    with typed_errors("recv", group):
        sender = dist.recv(wire, group=group, tag=tag, **root_kwargs("src", src, group_src))
    copy_back()
    return int(sender)


def isend(
    tensor: torch.Tensor,
    dst: int | None = None,
    group: Any = None,
    tag: int = 0,
    group_dst: int | None = None,
) -> CompatWork:
    """Start sending ``tensor`` to ``dst``; the handle's future works on every backend."""
    _needroot_kwargs(group, "isend")
    wire = stage_input(tensor, reduce=False)
    with typed_errors("isend", group):
        work = dist.isend(wire, group=group, tag=tag, **root_kwargs("dst", dst, group_dst))
    return CompatWork.from_work(work, group, [tensor], None, op="isend")


def irecv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: Any = None,
    tag: int = 0,
    group_src: int | None = None,
) -> CompatWork:
    """Start receiving into ``tensor``; ``wait()`` on the handle is safe to repeat."""
    _needroot_kwargs(group, "irecv")
    wire, copy_back = stage_output(tensor, reduce=False)
    with typed_errors("irecv", group):
        work = dist.irecv(wire, group=group, tag=tag, **root_kwargs("src", src, group_src))
    return CompatWork.from_work(work, group, [tensor], copy_back, op="irecv")


@overload
def barrier(
    group: Any = ...,
    async_op: Literal[False] = ...,
    device_ids: list[int] | None = ...,
) -> None: ...


@overload
def barrier(
    group: Any = ...,
    *,
    async_op: Literal[True],
    device_ids: list[int] | None = ...,
) -> CompatWork: ...


@overload
def barrier(
    group: Any = ...,
    async_op: bool = ...,
    device_ids: list[int] | None = ...,
) -> CompatWork | None: ...


def barrier(
    group: Any = None, async_op: bool = False, device_ids: list[int] | None = None
) -> CompatWork | None:
    """Wait for every rank of ``group``; the identity at world size 1.

    Example:
        >>> barrier()
    """
    if group_size(group) == 1:
        return done_if_async(None, async_op)
    verify("barrier", None, group)
    return issue(
        "barrier",
        lambda a: dist.barrier(group=group, async_op=a, device_ids=device_ids),
        group,
        None,
        None,
        async_op,
    )
