"""Reductions: all_reduce, reduce, reduce_scatter, reduce_scatter_tensor, with torch's signatures.

Each stages its tensors (``_wire``), plans the ReduceOp (``_reduce_ops``), issues ONE backend
collective, and finishes (divide, parity, copy back) when that op completes, synchronously or in
the returned :class:`CompatWork`'s future::

    work = reduce_scatter_tensor(shard, flat_grads, op=dist.ReduceOp.AVG, async_op=True)
    work.get_future().then(step_optimizer_shard)       # works on gloo too

reduce-scatter on backends other than NCCL is done as ``all_to_all_single`` plus a local
reduction: the same bytes on the wire as a true reduce-scatter, measured faster than gloo's own
on 1 MB and 64 MB, a native future on gloo (whose reduce_scatter has none), and no SIGSEGV on a
0-dim output. Floats then agree with other backends to rounding, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, overload

import torch
import torch.distributed as dist

from distcompat.collectives import _checked
from distcompat.collectives._checked import verify
from distcompat.collectives._errors import raise_typed
from distcompat.collectives._group import backend_for, group_size, is_root, root_kwargs
from distcompat.collectives._native import all_gather_flat, reduce_scatter_flat
from distcompat.collectives._probed import probed_for
from distcompat.collectives._reduce_ops import (
    PROBED_COLLECTIVES,
    ReducePlan,
    local_reduce,
    plan_fast,
    plan_reduction,
)
from distcompat.collectives._wire import Finish, chain, stage_input, stage_output
from distcompat.collectives._work import CompatWork, done_if_async

__all__ = [
    "all_reduce",
    "check_sizes",
    "issue",
    "plan_call",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
]

R = dist.ReduceOp


def issue(
    op: str,
    call: Callable[[bool], Any],
    group: Any,
    result: Any,
    finish: Finish | None,
    async_op: bool,
) -> CompatWork | None:
    """Run ``call(async_op)``; finish now (sync) or when the op completes (async).

    Backend failures come out typed (:class:`PeerLostError`, :class:`CollectiveTimeoutError`).
    """
    watcher = _checked.watch  # distcompat.diagnostics' watchdog, None unless one is active
    try:
        if not async_op:
            if watcher is None:
                call(False)
            else:  # a bounded wait: a hang becomes a report and HangError, not a group timeout
                watcher.wait_sync(call(True), op, group)
            if finish is not None:
                finish()
            return None
        work = call(True)
    except RuntimeError as exc:  # inline, not typed_errors(): this is every call's hot path
        raise_typed(exc, op, group)
    handle = CompatWork.from_work(work, group, result, finish, op=op)
    if watcher is not None:
        watcher.track_async(handle)
    return handle


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


def _after(plan: ReducePlan, wire: torch.Tensor) -> Finish | None:
    if not plan.has_finish:
        return None
    return lambda: plan.finish(wire)


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
    world_size = group_size(group)
    plan = plan_call(op, tensor, group, world_size, "all_reduce")
    if world_size == 1:
        plan.scale_in_place(tensor)  # what a reduction over one rank does (PREMUL_SUM scales)
        return done_if_async([tensor], async_op)
    verify("all_reduce", tensor, group, reduce_op=op)
    wire, copy_back = stage_output(tensor, reduce=True, fill=True)
    plan.prepare_in_place(wire)
    if plan.gather:
        return _reduce_by_gathering(
            "all_reduce", wire, wire, copy_back, plan, group, async_op, [tensor]
        )
    finish = chain(_after(plan, wire), copy_back)
    return issue(
        "all_reduce",
        lambda a: dist.all_reduce(wire, op=plan.op, group=group, async_op=a),
        group,
        [tensor],
        finish,
        async_op,
    )


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
    if plan.gather:
        source = plan.prepared(stage_input(tensor, reduce=True))
        out_wire, out_done = (
            stage_output(tensor, reduce=True, fill=True) if is_dst else (None, None)
        )
        return _reduce_by_gathering(
            "reduce", source, out_wire, out_done, plan, group, async_op, [tensor]
        )
    if is_dst:
        wire, copy_back = stage_output(tensor, reduce=True, fill=True)
        plan.prepare_in_place(wire)
        finish = chain(_after(plan, wire), copy_back)
    else:
        wire = plan.prepared(stage_input(tensor, reduce=True))
        if wire.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
            wire = wire.clone()  # the backend scribbles on non-destination buffers
        finish = None
    return issue(
        "reduce",
        lambda a: dist.reduce(wire, op=plan.op, group=group, async_op=a, **target),
        group,
        [tensor],
        finish,
        async_op,
    )


def _reduce_by_gathering(
    op: str,
    source: torch.Tensor,
    target: torch.Tensor | None,
    copy_back: Finish | None,
    plan: ReducePlan,
    group: Any,
    async_op: bool,
    result: Any,
) -> CompatWork | None:
    """Reduce with an op the backend lacks: all-gather every rank's ``source``, reduce locally.

    ``target`` (None on ranks that keep no result) receives the reduction; world_size times the
    memory and bytes of the native op, which is why it is only used where there is none.
    """
    world_size = group_size(group)
    flat = source.reshape(-1)
    gathered = torch.empty(world_size * flat.numel(), dtype=flat.dtype, device=flat.device)

    def combine() -> None:
        if target is None:
            return
        target.view(-1).copy_(local_reduce(gathered.view(world_size, -1), plan.op))
        plan.finish(target)
        if copy_back is not None:
            copy_back()

    return issue(
        op,
        lambda a: all_gather_flat(gathered, flat, group=group, async_op=a),
        group,
        result,
        combine,
        async_op,
    )


def check_sizes(output: torch.Tensor, numel: int, world_size: int, what: str) -> None:
    """Raise ``ValueError`` unless ``numel`` is ``world_size`` times ``output``'s elements."""
    if numel != world_size * output.numel():
        raise ValueError(
            f"{what} has {numel} elements; a reduce-scatter over {world_size} ranks into an "
            f"output of {output.numel()} elements needs {world_size * output.numel()}"
        )


def _reduce_scatter_flat(
    output: torch.Tensor,
    flat_input: torch.Tensor,
    plan: ReducePlan,
    group: Any,
    world_size: int,
    async_op: bool,
) -> CompatWork | None:
    """Reduce-scatter a flat wire input (already premultiplied) into ``output``."""
    wire, copy_back = stage_output(output, reduce=True)
    out_flat = wire.view(-1)
    if backend_for(group, output.device) == "nccl" and not plan.gather:
        finish = chain(_after(plan, wire), copy_back)
        return issue(
            "reduce_scatter_tensor",
            lambda a: reduce_scatter_flat(
                out_flat, flat_input, op=plan.op, group=group, async_op=a
            ),
            group,
            [output],
            finish,
            async_op,
        )
    received = torch.empty_like(flat_input)  # row r: rank r's chunk for this rank

    def combine() -> None:
        out_flat.copy_(local_reduce(received.view(world_size, -1), plan.op))
        plan.finish(wire)
        copy_back()

    return issue(
        "all_to_all_single",
        lambda a: dist.all_to_all_single(received, flat_input, group=group, async_op=a),
        group,
        [output],
        combine,
        async_op,
    )


@overload
def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any = ...,
    group: Any = ...,
    async_op: Literal[False] = ...,
) -> None: ...


@overload
def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any = ...,
    group: Any = ...,
    *,
    async_op: Literal[True],
) -> CompatWork: ...


@overload
def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any = ...,
    group: Any = ...,
    async_op: bool = ...,
) -> CompatWork | None: ...


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,  # torch's name for it
    op: Any = R.SUM,
    group: Any = None,
    async_op: bool = False,
) -> CompatWork | None:
    """Reduce ``input`` (world_size chunks along its flattened order) and keep this rank's chunk.

    Works on every backend with a real future, for every layout, 0-dim outputs included.

    Example:
        >>> out = torch.empty(2)
        >>> reduce_scatter_tensor(out, torch.tensor([1.0, 2.0]), op=dist.ReduceOp.AVG)
        >>> out
        tensor([1., 2.])
    """
    world_size = group_size(group)
    check_sizes(output, input.numel(), world_size, "input")
    plan = plan_call(op, input, group, world_size, "reduce_scatter_tensor")
    if world_size == 1:
        output.copy_(input.reshape(output.shape))
        plan.scale_in_place(output)
        return done_if_async([output], async_op)
    verify("reduce_scatter_tensor", input, group, reduce_op=op)
    flat = plan.prepared(stage_input(input, reduce=True)).reshape(-1)
    return _reduce_scatter_flat(output, flat, plan, group, world_size, async_op)


@overload
def reduce_scatter(
    output: torch.Tensor,
    input_list: Sequence[torch.Tensor],
    op: Any = ...,
    group: Any = ...,
    async_op: Literal[False] = ...,
) -> None: ...


@overload
def reduce_scatter(
    output: torch.Tensor,
    input_list: Sequence[torch.Tensor],
    op: Any = ...,
    group: Any = ...,
    *,
    async_op: Literal[True],
) -> CompatWork: ...


@overload
def reduce_scatter(
    output: torch.Tensor,
    input_list: Sequence[torch.Tensor],
    op: Any = ...,
    group: Any = ...,
    async_op: bool = ...,
) -> CompatWork | None: ...


def reduce_scatter(
    output: torch.Tensor,
    input_list: Sequence[torch.Tensor],
    op: Any = R.SUM,
    group: Any = None,
    async_op: bool = False,
) -> CompatWork | None:
    """Reduce ``input_list[r]`` across ranks into ``output`` on rank r.

    Example:
        >>> out = torch.empty(2)
        >>> reduce_scatter(out, [torch.tensor([3.0, 4.0])])
        >>> out
        tensor([3., 4.])
    """
    world_size = group_size(group)
    if len(input_list) != world_size:
        raise ValueError(f"input_list has {len(input_list)} tensors; the group has {world_size}")
    for index, item in enumerate(input_list):
        check_sizes(output, item.numel() * world_size, world_size, f"input_list[{index}]")
    plan = plan_call(op, output, group, world_size, "reduce_scatter")
    if world_size == 1:
        output.copy_(input_list[0].reshape(output.shape))
        plan.scale_in_place(output)
        return done_if_async([output], async_op)
    verify("reduce_scatter", output, group, reduce_op=op)
    flat = torch.cat([stage_input(item, reduce=True).reshape(-1) for item in input_list])
    plan.prepare_in_place(flat)  # a fresh concatenation: scaling it leaves the inputs alone
    return _reduce_scatter_flat(output, flat, plan, group, world_size, async_op)
