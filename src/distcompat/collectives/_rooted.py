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

__all__ = ["gather", "scatter"]


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
