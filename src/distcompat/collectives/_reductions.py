"""Reductions to one or every rank: all_reduce and reduce, with torch's signatures.

Each plans the ReduceOp (``_reduce_ops.plan_call``, with the capability probe's cells once it
ran), stages its tensors by that plan (``_wire``), issues ONE backend collective (``_issue``),
and finishes (divide, parity, copy back) when that op completes, synchronously or in the
returned :class:`CompatWork`'s future::

    work = all_reduce(grads, op=dist.ReduceOp.AVG, async_op=True)
    work.get_future().then(step_optimizer)              # works on gloo too

The reduce-scatters are in ``_reduce_scatter``.
"""

from __future__ import annotations

from typing import Any, Literal, overload

import torch
import torch.distributed as dist

from distcompat.collectives import direct as _direct
from distcompat.collectives._checked import verify
from distcompat.collectives._entry import entry
from distcompat.collectives._group import group_size, is_root, root_kwargs
from distcompat.collectives._issue import issue
from distcompat.collectives._reduce_ops import by_gathering, plan_call
from distcompat.collectives._wire import Transport, stage_input, stage_reduction
from distcompat.collectives._work import CompatWork
from distcompat.collectives.shm import _path as shm

__all__ = ["all_reduce", "reduce"]

R = dist.ReduceOp


@overload
def all_reduce(
    tensor: torch.Tensor,
    op: Any = ...,
    group: Any = ...,
    *,
    async_op: Literal[True],
) -> CompatWork: ...


@overload
def all_reduce(
    tensor: torch.Tensor,
    op: Any = ...,
    group: Any = ...,
    async_op: bool = ...,
) -> CompatWork | None: ...


@entry
def all_reduce(
    tensor: torch.Tensor, op: Any = R.SUM, group: Any = None, async_op: bool = False
) -> CompatWork | None:
    """Reduce ``tensor`` across ranks in place; correct for every layout, dtype and ReduceOp.

    Example:
        >>> t = torch.tensor([True])
        >>> all_reduce(t)   # no group: the identity
        >>> t
        tensor([True])
    """
    done = _direct.allreduce(tensor, op, group, async_op)  # the common case, written out
    if done is not _direct.SKIP:
        return done
    # Check: what the op means here, and that every rank calls the same.
    world_size = group_size(group)
    plan = plan_call(op, tensor, group, world_size, "all_reduce")
    if world_size > 1:
        verify("all_reduce", tensor, group, reduce_op=op)
    # Stage, route, then transport and settle (on completion: finish the shim, copy back).
    wire, settle = stage_reduction(tensor, plan, in_place=True)
    engine = None
    if world_size > 1 and not plan.gather and shm.reduces(plan.op, wire.dtype):
        engine = shm.engine_for(group, "all_reduce", wire)  # every rank on this machine
    transport: Transport | None
    if world_size == 1:
        transport = None  # staging and settling are all a reduction over one rank does
    elif plan.gather:  # the backend lacks the op
        transport, settle = by_gathering(wire, wire, settle, plan, group)
    elif engine is not None:
        flat = wire.view(-1)
        call = engine.all_reduce(flat, plan.op)
        transport = lambda a: engine.run("all_reduce", call, a, (tensor,))  # noqa: E731
    else:
        transport = lambda a: dist.all_reduce(wire, op=plan.op, group=group, async_op=a)  # noqa: E731
    return issue("all_reduce", transport, group, [tensor], settle, async_op)


@overload
def reduce(
    tensor: torch.Tensor,
    dst: int | None = ...,
    op: Any = ...,
    group: Any = ...,
    *,
    async_op: Literal[True],
    group_dst: int | None = ...,
) -> CompatWork: ...


@overload
def reduce(
    tensor: torch.Tensor,
    dst: int | None = ...,
    op: Any = ...,
    group: Any = ...,
    async_op: bool = ...,
    group_dst: int | None = ...,
) -> CompatWork | None: ...


@entry
def reduce(
    tensor: torch.Tensor,
    dst: int | None = None,
    op: Any = R.SUM,
    group: Any = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> CompatWork | None:
    """Reduce onto ``dst`` (a global rank; or ``group_dst`` in the group); other ranks keep theirs.

    torch leaves partial sums in the non-destination tensors on gloo; distcompat leaves the
    caller's tensor untouched there.

    Example:
        >>> t = torch.ones(3)
        >>> reduce(t, dst=0)
        >>> t
        tensor([1., 1., 1.])
    """
    world_size = group_size(group)
    plan = plan_call(op, tensor, group, world_size, "reduce")
    if world_size == 1:
        _, settle = stage_reduction(tensor, plan, in_place=True)
        return issue("reduce", None, group, [tensor], settle, async_op)
    verify("reduce", tensor, group, reduce_op=op, root=dst if group_dst is None else group_dst)
    is_dst = is_root(group, dst, group_dst)
    target = root_kwargs("dst", dst, group_dst)
    if plan.gather:  # every rank gathers; only the destination keeps the reduction
        source = stage_input(tensor, plan)
        out, settle = stage_reduction(tensor, plan, in_place=False) if is_dst else (None, None)
        transport, settle = by_gathering(source, out, settle, plan, group)
        return issue("reduce", transport, group, [tensor], settle, async_op)
    if is_dst:
        wire, settle = stage_reduction(tensor, plan, in_place=True)
    else:
        wire, settle = stage_input(tensor, plan), None
        if wire.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
            wire = wire.clone()  # the backend scribbles on non-destination buffers
    transport = lambda a: dist.reduce(wire, op=plan.op, group=group, async_op=a, **target)  # noqa: E731
    return issue("reduce", transport, group, [tensor], settle, async_op)
