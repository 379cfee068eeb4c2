"""Data movement to every rank: broadcast, all_gather, all_gather_into_tensor.

Every tensor is staged contiguous (gloo silently corrupts transposed, strided and channels_last
scatter outputs), complex goes as its real view (gloo's gather refuses complex), and dtypes a
backend cannot move go as raw bytes::

    broadcast(torch.ones(2, dtype=torch.complex64), src=0)   # gloo alone refuses complex

gather and scatter (to or from one root) are in ``_rooted``.
"""

from __future__ import annotations

from typing import Any, Literal, overload

import torch
import torch.distributed as dist

from distcompat.collectives import direct as _direct
from distcompat.collectives._checked import verify
from distcompat.collectives._entry import entry
from distcompat.collectives._group import group_rank_of, group_size, root_kwargs
from distcompat.collectives._issue import issue
from distcompat.collectives._native import all_gather_flat
from distcompat.collectives._uneven import all_gather_rows
from distcompat.collectives._wire import Transport, chain, stage_input, stage_output
from distcompat.collectives._work import CompatWork, done_if_async
from distcompat.collectives.shm import _path as shm

__all__ = ["all_gather", "all_gather_into_tensor", "broadcast"]


@overload
def broadcast(
    tensor: torch.Tensor,
    src: int | None = ...,
    group: Any = ...,
    *,
    async_op: Literal[True],
    group_src: int | None = ...,
) -> CompatWork: ...


@overload
def broadcast(
    tensor: torch.Tensor,
    src: int | None = ...,
    group: Any = ...,
    async_op: bool = ...,
    group_src: int | None = ...,
) -> CompatWork | None: ...


@entry
def broadcast(
    tensor: torch.Tensor,
    src: int | None = None,
    group: Any = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> CompatWork | None:
    """Send ``src``'s ``tensor`` to every rank, in place.

    Example:
        >>> t = torch.arange(4.0)
        >>> broadcast(t, src=0)
        >>> t
        tensor([0., 1., 2., 3.])
    """
    done = _direct.broadcast(tensor, src, group, async_op, group_src)  # the common case?
    if done is not _direct.SKIP:
        return done
    if group_size(group) == 1:
        return done_if_async([tensor], async_op)
    verify("broadcast", tensor, group, root=src if group_src is None else group_src)
    wire, copy_back = stage_output(tensor, fill=True)
    engine = shm.engine_for(group, "broadcast", wire)
    transport: Transport
    if engine is not None:  # every rank on this machine: through shared memory
        flat, at = wire.view(-1), group_rank_of(group, src, group_src)
        call = engine.broadcast(flat, at)
        transport = lambda a: engine.run("broadcast", call, a, (tensor,))  # noqa: E731
    else:
        root = root_kwargs("src", src, group_src)
        transport = lambda a: dist.broadcast(wire, group=group, async_op=a, **root)  # noqa: E731
    return issue("broadcast", transport, group, [tensor], copy_back, async_op)


@overload
def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: Any = ...,
    *,
    async_op: Literal[True],
) -> CompatWork: ...


@overload
def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: Any = ...,
    async_op: bool = ...,
) -> CompatWork | None: ...


@entry
def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
) -> CompatWork | None:
    """Gather every rank's ``tensor`` into ``tensor_list`` in rank order (row counts may differ).

    Example:
        >>> out = [torch.empty(2)]
        >>> all_gather(out, torch.ones(2))
        >>> out
        [tensor([1., 1.])]
    """
    world_size = group_size(group)
    if len(tensor_list) != world_size:
        raise ValueError(f"tensor_list has {len(tensor_list)} tensors; the group has {world_size}")
    if world_size == 1:
        tensor_list[0].copy_(tensor)
        return done_if_async(tensor_list, async_op)
    if any(out.shape != tensor.shape for out in tensor_list):  # rows differ: pad, gather, trim
        return all_gather_rows(tensor_list, tensor, group, async_op)
    verify("all_gather", tensor, group)
    staged = [stage_output(out) for out in tensor_list]
    wires = [wire for wire, _ in staged]
    source = stage_input(tensor)
    transport = lambda a: dist.all_gather(wires, source, group=group, async_op=a)  # noqa: E731
    return issue(
        "all_gather", transport, group, tensor_list, chain(*(f for _, f in staged)), async_op
    )


@overload
def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: Any = ...,
    *,
    async_op: Literal[True],
) -> CompatWork: ...


@overload
def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: Any = ...,
    async_op: bool = ...,
) -> CompatWork | None: ...


@entry
def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
) -> CompatWork | None:
    """Gather every rank's input into ``output_tensor``, concatenated in flattened rank order.

    Both the concatenated shape ``(W * n, ...)`` and the stacked shape ``(W, n, ...)`` work (gloo
    refuses the stacked one), and so do 0-dim inputs.

    Example:
        >>> out = torch.empty(1, 3)
        >>> all_gather_into_tensor(out, torch.ones(3))
        >>> out
        tensor([[1., 1., 1.]])
    """
    done = _direct.allgather(output_tensor, input_tensor, group, async_op)  # the common case?
    if done is not _direct.SKIP:
        return done
    world_size = group_size(group)
    if output_tensor.numel() != world_size * input_tensor.numel():
        raise ValueError(
            f"output_tensor has {output_tensor.numel()} elements; gathering {world_size} inputs "
            f"of {input_tensor.numel()} needs {world_size * input_tensor.numel()}"
        )
    if world_size == 1:
        output_tensor.copy_(input_tensor.reshape(output_tensor.shape))
        return done_if_async([output_tensor], async_op)
    verify("all_gather_into_tensor", input_tensor, group)
    wire, copy_back = stage_output(output_tensor)
    source = stage_input(input_tensor)
    # Flat views only where needed: each view costs 1-3 us, the op's whole Python budget.
    source = source if source.dim() == 1 else source.reshape(-1)
    out_flat = wire if wire.dim() == 1 else wire.view(-1)
    op = "all_gather_into_tensor"
    engine = shm.engine_for(group, op, out_flat)
    transport: Transport
    if engine is not None:  # every rank on this machine: through shared memory
        call = engine.all_gather(out_flat, source)
        transport = lambda a: engine.run(op, call, a, (input_tensor,))  # noqa: E731
    else:
        transport = lambda a: all_gather_flat(out_flat, source, group=group, async_op=a)  # noqa: E731
    return issue(op, transport, group, [output_tensor], copy_back, async_op)
