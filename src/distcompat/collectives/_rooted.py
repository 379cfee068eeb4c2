"""Data movement to or from one root: gather and scatter, with torch's signatures.

As in ``_movement``: every tensor is staged contiguous (gloo silently corrupts transposed,
strided and channels_last scatter outputs), complex goes as its real view (gloo's gather refuses
complex), and dtypes a backend cannot move go as raw bytes::

    gather(torch.ones(2, dtype=torch.complex64), out, dst=0)   # gloo alone refuses complex
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, overload

import torch
import torch.distributed as dist

from distcompat.collectives._checked import verify
from distcompat.collectives._entry import entry
from distcompat.collectives._group import group_size, is_root, root_kwargs
from distcompat.collectives._issue import issue
from distcompat.collectives._wire import chain, stage_input, stage_output
from distcompat.collectives._work import CompatWork, done_if_async

__all__ = ["gather", "gather_single", "scatter"]


@overload
def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = ...,
    dst: int | None = ...,
    group: Any = ...,
    *,
    async_op: Literal[True],
    group_dst: int | None = ...,
) -> CompatWork: ...


@overload
def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = ...,
    dst: int | None = ...,
    group: Any = ...,
    async_op: bool = ...,
    group_dst: int | None = ...,
) -> CompatWork | None: ...


@entry
def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int | None = None,
    group: Any = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> CompatWork | None:
    """Gather every rank's ``tensor`` into ``gather_list`` on the destination rank (complex too).

    Example:
        >>> out = [torch.empty(2, dtype=torch.complex64)]
        >>> gather(torch.ones(2, dtype=torch.complex64), out, dst=0)
        >>> out[0]
        tensor([1.+0.j, 1.+0.j])
    """
    world_size = group_size(group)
    if world_size == 1:
        if gather_list is not None:
            gather_list[0].copy_(tensor)
        return done_if_async(gather_list, async_op)
    verify("gather", tensor, group, root=dst if group_dst is None else group_dst)
    source = stage_input(tensor)
    root = root_kwargs("dst", dst, group_dst)
    if is_root(group, dst, group_dst):
        if gather_list is None or len(gather_list) != world_size:
            raise ValueError(f"the destination needs a gather_list of {world_size} tensors")
        staged = [stage_output(out) for out in gather_list]
        wires: list[torch.Tensor] | None = [wire for wire, _ in staged]
        finish = chain(*(step for _, step in staged))
    else:
        wires, finish = None, None
    transport = lambda a: dist.gather(source, wires, group=group, async_op=a, **root)  # noqa: E731
    return issue("gather", transport, group, gather_list, finish, async_op)


def gather_single(
    tensor: torch.Tensor,
    gather_tensor: torch.Tensor | None = None,
    dst: int | None = None,
    group: Any = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> CompatWork | None:
    """Gather every rank's ``tensor`` into one ``gather_tensor`` on the destination rank.

    torch 2.14's ``gather_single``, on every release and backend: ``gather_tensor`` holds world
    size copies of ``tensor`` (flat, or stacked), in rank order, and must be contiguous. It is
    :func:`gather` into one view of ``gather_tensor`` per rank, so every backend's gather and
    distcompat's shims do the work (plain gloo raises "does not support gather_single").
    Without ``dst`` and ``group_dst``, global rank 0 receives, as in torch.

    Example:
        >>> out = torch.empty(1, 2)
        >>> gather_single(torch.ones(2), out, dst=0)
        >>> out
        tensor([[1., 1.]])
    """
    if dst is None and group_dst is None:
        dst = 0
    views = None
    world_size = group_size(group)
    if world_size == 1 or is_root(group, dst, group_dst):
        if gather_tensor is None:
            raise ValueError("gather_single: the destination rank needs a gather_tensor")
        if not gather_tensor.is_contiguous():
            raise ValueError("gather_single: gather_tensor must be contiguous")
        if gather_tensor.dtype != tensor.dtype:
            raise ValueError(
                f"gather_single: gather_tensor is {gather_tensor.dtype}, tensor {tensor.dtype}"
            )
        if gather_tensor.numel() != world_size * tensor.numel():
            raise ValueError(
                f"gather_single: gather_tensor has {gather_tensor.numel()} elements; {world_size} "
                f"rank(s) of {tensor.numel()} need {world_size * tensor.numel()}"
            )
        views = list(gather_tensor.view(world_size, *tensor.shape).unbind(0))
    return gather(tensor, views, dst, group, async_op, group_dst)


@overload
def scatter(
    tensor: torch.Tensor,
    scatter_list: Sequence[torch.Tensor] | None = ...,
    src: int | None = ...,
    group: Any = ...,
    *,
    async_op: Literal[True],
    group_src: int | None = ...,
) -> CompatWork: ...


@overload
def scatter(
    tensor: torch.Tensor,
    scatter_list: Sequence[torch.Tensor] | None = ...,
    src: int | None = ...,
    group: Any = ...,
    async_op: bool = ...,
    group_src: int | None = ...,
) -> CompatWork | None: ...


@entry
def scatter(
    tensor: torch.Tensor,
    scatter_list: Sequence[torch.Tensor] | None = None,
    src: int | None = None,
    group: Any = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> CompatWork | None:
    """Send ``scatter_list[r]`` from the source rank into ``tensor`` on rank r.

    Example:
        >>> t = torch.empty(2)
        >>> scatter(t, [torch.tensor([5.0, 6.0])], src=0)
        >>> t
        tensor([5., 6.])
    """
    world_size = group_size(group)
    if world_size == 1:
        if scatter_list is not None:
            tensor.copy_(scatter_list[0])
        return done_if_async([tensor], async_op)
    verify("scatter", tensor, group, root=src if group_src is None else group_src)
    wire, copy_back = stage_output(tensor)
    root = root_kwargs("src", src, group_src)
    sources: list[torch.Tensor] | None = None
    if is_root(group, src, group_src):
        if scatter_list is None or len(scatter_list) != world_size:
            raise ValueError(f"the source needs a scatter_list of {world_size} tensors")
        sources = [stage_input(item) for item in scatter_list]
    transport = lambda a: dist.scatter(wire, sources, group=group, async_op=a, **root)  # noqa: E731
    return issue("scatter", transport, group, [tensor], copy_back, async_op)
