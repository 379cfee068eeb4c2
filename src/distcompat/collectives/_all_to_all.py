"""All-to-all: all_to_all_single (even or uneven splits) and all_to_all (any tensor sizes).

Both stage every tensor contiguous: gloo silently corrupts a non-contiguous all_to_all_single
output and a channels_last input. ``all_to_all`` of uneven tensors, which gloo refuses, is done as
one ``all_to_all_single`` over the concatenation::

    all_to_all(outputs, inputs)          # any sizes, any backend
"""

from __future__ import annotations

from typing import Any, Literal, overload

import torch
import torch.distributed as dist

from distcompat.collectives import direct as _direct
from distcompat.collectives._checked import verify
from distcompat.collectives._entry import entry
from distcompat.collectives._group import group_size
from distcompat.collectives._issue import issue
from distcompat.collectives._wire import stage_input, stage_output
from distcompat.collectives._work import CompatWork, done_if_async

__all__ = ["all_to_all", "all_to_all_single"]


@overload
def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = ...,
    input_split_sizes: list[int] | None = ...,
    group: Any = ...,
    *,
    async_op: Literal[True],
) -> CompatWork: ...


@overload
def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = ...,
    input_split_sizes: list[int] | None = ...,
    group: Any = ...,
    async_op: bool = ...,
) -> CompatWork | None: ...


@entry
def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,  # torch's name for it
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Any = None,
    async_op: bool = False,
) -> CompatWork | None:
    """Split ``input`` along dim 0 (evenly, or by ``input_split_sizes``) and exchange the pieces.

    Example:
        >>> out = torch.empty(3)
        >>> all_to_all_single(out, torch.tensor([1.0, 2.0, 3.0]))
        >>> out
        tensor([1., 2., 3.])
    """
    even = output_split_sizes is None and input_split_sizes is None
    done = _direct.alltoall(output, input, group, async_op, even)  # the common case, if it is
    if done is not _direct.SKIP:
        return done
    world_size = group_size(group)
    if world_size == 1:
        output.copy_(input)
        return done_if_async([output], async_op)
    rows_in, rows_out = (t.shape[0] if t.dim() else 1 for t in (input, output))
    even_in, even_out = rows_in // world_size, rows_out // world_size
    verify(
        "all_to_all_single",
        input,
        group,
        in_splits=input_split_sizes or [even_in] * world_size,
        out_splits=output_split_sizes or [even_out] * world_size,
    )
    wire, copy_back = stage_output(output)
    source = stage_input(input)
    splits = output_split_sizes, input_split_sizes
    transport = lambda a: dist.all_to_all_single(wire, source, *splits, group=group, async_op=a)  # noqa: E731
    return issue("all_to_all_single", transport, group, [output], copy_back, async_op)


@overload
def all_to_all(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor],
    group: Any = ...,
    *,
    async_op: Literal[True],
) -> CompatWork: ...


@overload
def all_to_all(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor],
    group: Any = ...,
    async_op: bool = ...,
) -> CompatWork | None: ...


@entry
def all_to_all(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor],
    group: Any = None,
    async_op: bool = False,
) -> CompatWork | None:
    """Send ``input_tensor_list[r]`` to rank r and receive rank r's into ``output_tensor_list[r]``.

    Sizes may differ per rank (gloo refuses that natively).

    Example:
        >>> out = [torch.empty(2)]
        >>> all_to_all(out, [torch.tensor([7.0, 8.0])])
        >>> out
        [tensor([7., 8.])]
    """
    world_size = group_size(group)
    for name, items in (("output", output_tensor_list), ("input", input_tensor_list)):
        if len(items) != world_size:
            raise ValueError(f"{name}_tensor_list has {len(items)} tensors; group has {world_size}")
    if world_size == 1:
        output_tensor_list[0].copy_(input_tensor_list[0])
        return done_if_async(output_tensor_list, async_op)
    verify(
        "all_to_all",
        input_tensor_list[0],
        group,
        in_splits=[item.numel() for item in input_tensor_list],
        out_splits=[item.numel() for item in output_tensor_list],
    )
    sources = [stage_input(item).reshape(-1) for item in input_tensor_list]
    flat_in = torch.cat(sources)
    staged = [stage_output(out) for out in output_tensor_list]
    out_flats = [wire.view(-1) for wire, _ in staged]
    flat_out = torch.empty(
        sum(w.numel() for w in out_flats), dtype=flat_in.dtype, device=flat_in.device
    )
    in_splits = [piece.numel() for piece in sources]
    out_splits = [piece.numel() for piece in out_flats]

    def unpack() -> None:
        for piece, target in zip(torch.split(flat_out, out_splits), out_flats, strict=True):
            target.copy_(piece)
        for _, finish in staged:
            finish()

    def transport(a: bool) -> Any:
        return dist.all_to_all_single(
            flat_out, flat_in, out_splits, in_splits, group=group, async_op=a
        )

    return issue("all_to_all_single", transport, group, output_tensor_list, unpack, async_op)
