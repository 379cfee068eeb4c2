"""Coalesced collectives: many small tensors as one flat bucket per (dtype, device).

What custom optimizers need: 200 gradient tensors cost one collective, not 200 round trips::

    all_reduce_coalesced(grads, op=dist.ReduceOp.AVG)
    reduce_scatter_coalesced(shards, flat_grads, op=dist.ReduceOp.AVG, async_op=True)

Results equal the per-tensor ops element for element: the bucket is reduced by the same
distcompat collective (so every shim applies), then copied back into the caller's tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, overload

import torch
import torch.distributed as dist

from distcompat.collectives._entry import entry
from distcompat.collectives._group import group_size
from distcompat.collectives._profiled import showing
from distcompat.collectives._reduce_scatter import check_sizes, reduce_scatter_tensor
from distcompat.collectives._reductions import all_reduce
from distcompat.collectives._work import CompatWork, done_if_async, finish_now, joined

__all__ = ["all_reduce_coalesced", "reduce_scatter_coalesced"]

R = dist.ReduceOp


def _buckets(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Return the indices of ``tensors`` grouped by (dtype, device), in first-seen order."""
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault((tensor.dtype, tensor.device), []).append(index)
    return list(groups.values())


def _unflatten_into(
    targets: Sequence[torch.Tensor], buckets: list[list[int]], flats: list[torch.Tensor]
) -> None:
    """Copy each bucket's flat result back into the caller's tensors, in bucket order."""
    for bucket, flat in zip(buckets, flats, strict=True):
        pieces = torch.split(flat, [targets[i].numel() for i in bucket])
        for i, piece in zip(bucket, pieces, strict=True):
            targets[i].copy_(piece.view(targets[i].shape))


@overload
def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor],
    op: Any = ...,
    group: Any = ...,
    *,
    async_op: Literal[True],
) -> CompatWork: ...


@overload
def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor],
    op: Any = ...,
    group: Any = ...,
    async_op: bool = ...,
) -> CompatWork | None: ...


@entry
def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor], op: Any = R.SUM, group: Any = None, async_op: bool = False
) -> CompatWork | None:
    """All-reduce every tensor in ``tensors`` in place, one collective per dtype and device.

    Example:
        >>> a, b = torch.ones(2), torch.tensor([3])
        >>> all_reduce_coalesced([a, b])   # no group: the identity
        >>> a, b
        (tensor([1., 1.]), tensor([3]))
    """
    if not tensors:
        return done_if_async([], async_op)
    buckets = _buckets(tensors)
    flats = [torch.cat([tensors[i].reshape(-1) for i in bucket]) for bucket in buckets]

    def copy_back() -> None:
        _unflatten_into(tensors, buckets, flats)

    handles: list[CompatWork | None] = []
    for bucket, flat in zip(buckets, flats, strict=True):
        with showing([tensors[i] for i in bucket]):  # a profiler's event shows the caller's
            handles.append(all_reduce(flat, op=op, group=group, async_op=async_op))
    if not async_op:
        finish_now(copy_back, tensors)
        return None
    return joined([h for h in handles if h is not None], copy_back, list(tensors))


@overload
def reduce_scatter_coalesced(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    op: Any = ...,
    group: Any = ...,
    *,
    async_op: Literal[True],
) -> CompatWork: ...


@overload
def reduce_scatter_coalesced(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    op: Any = ...,
    group: Any = ...,
    async_op: bool = ...,
) -> CompatWork | None: ...


@entry
def reduce_scatter_coalesced(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    op: Any = R.SUM,
    group: Any = None,
    async_op: bool = False,
) -> CompatWork | None:
    """Reduce-scatter ``inputs[i]`` into ``outputs[i]`` for every i, one collective per dtype.

    Each input has world_size times its output's elements (this rank gets chunk ``rank``).

    Example:
        >>> out = [torch.empty(2)]
        >>> reduce_scatter_coalesced(out, [torch.tensor([1.0, 2.0])])
        >>> out
        [tensor([1., 2.])]
    """
    if len(outputs) != len(inputs):
        raise ValueError(f"{len(outputs)} outputs but {len(inputs)} inputs")
    world_size = group_size(group)
    for index, (out, inp) in enumerate(zip(outputs, inputs, strict=True)):
        check_sizes(out, inp.numel(), world_size, f"inputs[{index}]")
        if inp.dtype != out.dtype:
            raise ValueError(f"inputs[{index}] is {inp.dtype} but outputs[{index}] is {out.dtype}")
    if not outputs:
        return done_if_async([], async_op)
    buckets = _buckets(outputs)
    # Lay each bucket's input out rank-major: chunk r of every tensor, then chunk r+1, ...
    flat_ins = [
        torch.cat(
            [inputs[i].reshape(world_size, -1)[rank] for rank in range(world_size) for i in bucket]
        )
        for bucket in buckets
    ]
    flat_outs = [
        torch.empty(sum(outputs[i].numel() for i in bucket), dtype=outputs[bucket[0]].dtype,
                    device=outputs[bucket[0]].device)
        for bucket in buckets
    ]  # fmt: skip

    def copy_back() -> None:
        _unflatten_into(outputs, buckets, flat_outs)

    handles = [
        reduce_scatter_tensor(flat_out, flat_in, op=op, group=group, async_op=async_op)
        for flat_out, flat_in in zip(flat_outs, flat_ins, strict=True)
    ]
    if not async_op:
        finish_now(copy_back, outputs)
        return None
    return joined([h for h in handles if h is not None], copy_back, list(outputs))
