"""Reductions to one or every rank: all_reduce and reduce, with torch's signatures.

Each stages its tensors (``_wire``), plans the ReduceOp (``_reduce_ops``, or the capability
probe's cells once it ran: :func:`plan_call`), issues ONE backend collective (``_issue``), and
finishes (divide, parity, copy back) when that op completes, synchronously or in the returned
:class:`CompatWork`'s future::

    work = all_reduce(grads, op=dist.ReduceOp.AVG, async_op=True)
    work.get_future().then(step_optimizer)              # works on gloo too

The reduce-scatters are in ``_reduce_scatter``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, overload

import torch
import torch.distributed as dist

from distcompat.collectives import direct as _direct
from distcompat.collectives._checked import verify
from distcompat.collectives._entry import entry
from distcompat.collectives._group import backend_for, group_size, is_root, root_kwargs
from distcompat.collectives._issue import issue
from distcompat.collectives._native import all_gather_flat
from distcompat.collectives._probed import probed_for
from distcompat.collectives._reduce_ops import (
    PROBED_COLLECTIVES,
    ReducePlan,
    local_reduce,
    plan_fast,
    plan_reduction,
)
from distcompat.collectives._wire import Finish, stage_input
from distcompat.collectives._work import CompatWork, done_if_async
from distcompat.collectives.shm import _path as shm

__all__ = ["all_reduce", "plan_call", "reduce"]

R = dist.ReduceOp

#: What a route hands ``issue``: starts the transport (``async_op`` in), returns its Work or None.
Transport = Callable[[bool], Any]


def plan_call(
    op: Any, tensor: torch.Tensor, group: Any, world_size: int, collective: str
) -> ReducePlan:
    """Plan the reduction of ``collective``; the capability probe's cells apply where it ran it."""
    probed = probed_for(group) if collective in PROBED_COLLECTIVES and world_size > 1 else None
    if probed is not None and probed.device_type == tensor.device.type:
        # A PREMUL_SUM factor may be a tensor, so those plans are made afresh every call.
        kind = getattr(op, "op", op)
        key = None if kind == R.PREMUL_SUM else (kind, tensor.dtype, world_size, collective)
        plan = probed.plans.get(key) if key is not None else None
        if plan is None:
            plan = plan_reduction(
                op,
                tensor.dtype,
                world_size=world_size,
                backend=backend_for(group, tensor.device),
                probed=probed.cells,
                collective=collective,
            )
            if key is not None:
                probed.plans[key] = plan
        return plan
    fast = plan_fast(op, tensor.dtype)
    if fast is not None:
        return fast
    backend = backend_for(group, tensor.device) if world_size > 1 else "none"
    return plan_reduction(op, tensor.dtype, world_size=world_size, backend=backend)


@overload
def all_reduce(
    tensor: torch.Tensor,
    op: Any = ...,
    group: Any = ...,
    async_op: Literal[False] = ...,
) -> None: ...


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
    if world_size == 1:
        plan.scale_in_place(tensor)  # what a reduction over one rank does (PREMUL_SUM scales)
        return done_if_async([tensor], async_op)
    verify("all_reduce", tensor, group, reduce_op=op)
    # Route, then transport and settle (on completion: finish the shim, copy back).
    wire, settle = plan.staged_output(tensor, in_place=True)
    transport, settle = _all_reduce_route(wire, settle, plan, group)
    return issue("all_reduce", transport, group, [tensor], settle, async_op)


def _all_reduce_route(
    wire: torch.Tensor, settle: Finish | None, plan: ReducePlan, group: Any
) -> tuple[Transport, Finish | None]:
    """Pick an all_reduce's transport, and what settles its result.

    By gathering (the backend lacks the op), through shared memory (every rank on this
    machine), or the backend's own all_reduce.
    """
    if plan.gather:
        return _by_gathering(wire, wire, settle, plan, group)
    engine = shm.engine_for(group, "all_reduce", wire) if shm.reduces(plan.op, wire.dtype) else None
    if engine is not None:
        flat = wire.view(-1)
        return lambda a: engine.run("all_reduce", engine.all_reduce(flat, plan.op), a), settle
    return lambda a: dist.all_reduce(wire, op=plan.op, group=group, async_op=a), settle


@overload
def reduce(
    tensor: torch.Tensor,
    dst: int | None = ...,
    op: Any = ...,
    group: Any = ...,
    async_op: Literal[False] = ...,
    group_dst: int | None = ...,
) -> None: ...


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
        plan.scale_in_place(tensor)  # what a reduction over one rank does (PREMUL_SUM scales)
        return done_if_async([tensor], async_op)
    verify("reduce", tensor, group, reduce_op=op, root=dst if group_dst is None else group_dst)
    is_dst = is_root(group, dst, group_dst)
    target = root_kwargs("dst", dst, group_dst)
    if plan.gather:  # every rank gathers; only the destination keeps the reduction
        source = plan.prepared(stage_input(tensor, reduce=True))
        out, settle = plan.staged_output(tensor, in_place=False) if is_dst else (None, None)
        transport, settle = _by_gathering(source, out, settle, plan, group)
        return issue("reduce", transport, group, [tensor], settle, async_op)
    if is_dst:
        wire, settle = plan.staged_output(tensor, in_place=True)
    else:
        wire, settle = plan.prepared(stage_input(tensor, reduce=True)), None
        if wire.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
            wire = wire.clone()  # the backend scribbles on non-destination buffers
    return issue(
        "reduce",
        lambda a: dist.reduce(wire, op=plan.op, group=group, async_op=a, **target),
        group,
        [tensor],
        settle,
        async_op,
    )


def _by_gathering(
    source: torch.Tensor,
    target: torch.Tensor | None,
    settle: Finish | None,
    plan: ReducePlan,
    group: Any,
) -> tuple[Transport, Finish]:
    """Transport for an op the backend lacks: all-gather every rank's ``source``, reduce here.

    ``target`` (None on ranks that keep no result) receives the reduction, then ``settle`` runs;
    world_size times the memory and bytes of the native op, which is why it is only used where
    there is none.
    """
    world_size = group_size(group)
    flat = source.reshape(-1)
    gathered = torch.empty(world_size * flat.numel(), dtype=flat.dtype, device=flat.device)

    def combine() -> None:
        if target is None:
            return
        target.view(-1).copy_(local_reduce(gathered.view(world_size, -1), plan.op))
        if settle is not None:
            settle()

    return lambda a: all_gather_flat(gathered, flat, group=group, async_op=a), combine
