"""Reduce-scatters: reduce_scatter_tensor and reduce_scatter, with torch's signatures.

On backends other than NCCL a reduce-scatter is done as ``all_to_all_single`` plus a local
reduction: the same bytes on the wire as a true reduce-scatter, measured faster than gloo's own
on 1 MB and 64 MB, a native future on gloo (whose reduce_scatter has none), and no SIGSEGV on a
0-dim output. Floats then agree with other backends to rounding, not bit for bit::

    work = reduce_scatter_tensor(shard, flat_grads, op=dist.ReduceOp.AVG, async_op=True)
    work.get_future().then(step_optimizer_shard)       # works on gloo too
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, overload

import torch
import torch.distributed as dist

from distcompat.collectives import direct as _direct
from distcompat.collectives._checked import verify
from distcompat.collectives._entry import entry
from distcompat.collectives._group import backend_for, group_size
from distcompat.collectives._issue import issue
from distcompat.collectives._native import reduce_scatter_flat
from distcompat.collectives._reduce_ops import ReducePlan, local_reduce, plan_call
from distcompat.collectives._wire import Transport, scale, stage_input, stage_reduction
from distcompat.collectives._work import CompatWork, done_if_async
from distcompat.collectives.shm import _path as shm

__all__ = ["check_sizes", "reduce_scatter", "reduce_scatter_tensor"]

R = dist.ReduceOp


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
    wire, settle = stage_reduction(output, plan, in_place=False)
    out_flat, op = wire.view(-1), "reduce_scatter_tensor"
    engine = None
    if shm.reduces(plan.op, flat_input.dtype) and not plan.gather:
        engine = shm.engine_for(group, op, flat_input)
    transport: Transport
    if engine is not None:  # every rank on this machine: through shared memory
        call = engine.reduce_scatter(out_flat, flat_input, plan.op)
        transport = lambda a: engine.run(op, call, a, (flat_input,))  # noqa: E731
    elif backend_for(group, output.device) == "nccl" and not plan.gather:

        def transport(a: bool) -> Any:
            return reduce_scatter_flat(out_flat, flat_input, op=plan.op, group=group, async_op=a)

    else:  # an all-to-all of the chunks, then the same reduction here
        op, received = "all_to_all_single", torch.empty_like(flat_input)  # row r: rank r's chunk
        transport = lambda a: dist.all_to_all_single(received, flat_input, group=group, async_op=a)  # noqa: E731

        def combine() -> None:
            out_flat.copy_(local_reduce(received.view(world_size, -1), plan.op))
            if settle is not None:
                settle()

        return issue(op, transport, group, [output], combine, async_op)
    return issue(op, transport, group, [output], settle, async_op)


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


@entry
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
    done = _direct.reducescatter(output, input, op, group, async_op)  # the common case?
    if done is not _direct.SKIP:
        return done
    world_size = group_size(group)
    check_sizes(output, input.numel(), world_size, "input")
    plan = plan_call(op, input, group, world_size, "reduce_scatter_tensor")
    if world_size == 1:
        output.copy_(input.reshape(output.shape))
        scale(plan, output)
        return done_if_async([output], async_op)
    verify("reduce_scatter_tensor", input, group, reduce_op=op)
    flat = stage_input(input, plan).reshape(-1)
    return _reduce_scatter_flat(output, flat, plan, group, world_size, async_op)


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


@entry
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
        scale(plan, output)
        return done_if_async([output], async_op)
    verify("reduce_scatter", output, group, reduce_op=op)
    flat = torch.cat([stage_input(item, plan).reshape(-1) for item in input_list])
    return _reduce_scatter_flat(output, flat, plan, group, world_size, async_op)
