"""Point-to-point ops, barrier, and the object collectives.

gloo gives ``isend``/``irecv`` Works no future and a second ``wait()`` on an any-source ``irecv``
hangs; here they return :class:`CompatWork` (completed by the group's worker thread) like every
other async op. Tensors are staged contiguous (gloo refuses non-contiguous ones).

The object collectives delegate to torch and are the identity at world size 1.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from distcompat.collectives._errors import typed_errors
from distcompat.collectives._group import group_size
from distcompat.collectives._reductions import issue
from distcompat.collectives._wire import stage_input, stage_output
from distcompat.collectives._work import CompatWork

__all__ = [
    "all_gather_object",
    "barrier",
    "broadcast_object_list",
    "gather_object",
    "irecv",
    "isend",
    "recv",
    "scatter_object_list",
    "send",
]


class NoPeerError(ValueError):
    """A point-to-point op was called where there is no other rank to talk to."""


def _need_peer(group: Any, op: str) -> None:
    if group_size(group) == 1:
        raise NoPeerError(f"{op} needs another rank, but the world size is 1 (or no group exists)")


def _peer(name: str, rank: int | None, group_rank: int | None) -> dict[str, int | None]:
    return {f"group_{name}": group_rank} if group_rank is not None else {name: rank}


def send(
    tensor: torch.Tensor,
    dst: int | None = None,
    group: Any = None,
    tag: int = 0,
    group_dst: int | None = None,
) -> None:
    """Send ``tensor`` to ``dst`` (any layout: staged contiguous first)."""
    _need_peer(group, "send")
    wire = stage_input(tensor, reduce=False)
    with typed_errors("send", group):
        dist.send(wire, group=group, tag=tag, **_peer("dst", dst, group_dst))


def recv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: Any = None,
    tag: int = 0,
    group_src: int | None = None,
) -> int:
    """Receive into ``tensor`` from ``src`` (any rank if None); return the sender's rank."""
    _need_peer(group, "recv")
    wire, copy_back = stage_output(tensor, reduce=False)
    with typed_errors("recv", group):
        sender = dist.recv(wire, group=group, tag=tag, **_peer("src", src, group_src))
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
    _need_peer(group, "isend")
    wire = stage_input(tensor, reduce=False)
    with typed_errors("isend", group):
        work = dist.isend(wire, group=group, tag=tag, **_peer("dst", dst, group_dst))
    return CompatWork.from_work(work, group, [tensor], None, op="isend")


def irecv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: Any = None,
    tag: int = 0,
    group_src: int | None = None,
) -> CompatWork:
    """Start receiving into ``tensor``; ``wait()`` on the handle is safe to repeat."""
    _need_peer(group, "irecv")
    wire, copy_back = stage_output(tensor, reduce=False)
    with typed_errors("irecv", group):
        work = dist.irecv(wire, group=group, tag=tag, **_peer("src", src, group_src))
    return CompatWork.from_work(work, group, [tensor], copy_back, op="irecv")


def barrier(
    group: Any = None, async_op: bool = False, device_ids: list[int] | None = None
) -> CompatWork | None:
    """Wait for every rank of ``group``; the identity at world size 1.

    Example:
        >>> barrier()
    """
    if group_size(group) == 1:
        return CompatWork.completed(None) if async_op else None
    return issue(
        "barrier",
        lambda a: dist.barrier(group=group, async_op=a, device_ids=device_ids),
        group,
        None,
        None,
        async_op,
    )


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    """Gather picklable ``obj`` from every rank into ``object_list``.

    Example:
        >>> out = [None]
        >>> all_gather_object(out, {"loss": 1.5})
        >>> out
        [{'loss': 1.5}]
    """
    if group_size(group) == 1:
        object_list[0] = obj
        return
    dist.all_gather_object(object_list, obj, group=group)


def broadcast_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: Any = None,
    device: torch.device | None = None,
    group_src: int | None = None,
) -> None:
    """Broadcast the picklable objects in ``object_list`` from ``src``, in place.

    Example:
        >>> objs = ["config"]
        >>> broadcast_object_list(objs, src=0)
        >>> objs
        ['config']
    """
    if group_size(group) == 1:
        return
    root = {"group_src": group_src} if group_src is not None else {"src": src}
    dist.broadcast_object_list(object_list, group=group, device=device, **root)


def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: Any = None,
    group_dst: int | None = None,
) -> None:
    """Gather picklable objects onto ``dst``.

    Example:
        >>> out = [None]
        >>> gather_object(3, out, dst=0)
        >>> out
        [3]
    """
    if group_size(group) == 1:
        if object_gather_list is not None:
            object_gather_list[0] = obj
        return
    root = {"group_dst": group_dst} if group_dst is not None else {"dst": dst}
    dist.gather_object(obj, object_gather_list, group=group, **root)


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int | None = None,
    group: Any = None,
    group_src: int | None = None,
) -> None:
    """Scatter picklable objects from ``src``; rank r gets element r in its output list.

    Example:
        >>> out = [None]
        >>> scatter_object_list(out, ["mine"], src=0)
        >>> out
        ['mine']
    """
    if group_size(group) == 1:
        if scatter_object_input_list is not None:
            scatter_object_output_list[0] = scatter_object_input_list[0]
        return
    root = {"group_src": group_src} if group_src is not None else {"src": src}
    dist.scatter_object_list(
        scatter_object_output_list, scatter_object_input_list, group=group, **root
    )
