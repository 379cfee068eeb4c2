"""The backend's own call for plain CPU tensors, without torch's Python wrapper around it.

``torch.distributed.all_reduce`` is Python around ``ProcessGroup.allreduce``: torch-function
dispatch, argument checks, an options object. On 2 gloo ranks sharing 2 cores, a tiny call made
right after a barrier spends about 10 us there (benchmarks/README.md), twice distcompat's budget
for its own per-call cost. Where distcompat has already checked the call, the fast paths of
``all_reduce``, ``broadcast`` and ``all_to_all_single`` call the ProcessGroup method that the
wrapper would call, with the same options::

    if ready(tensor):
        work = allreduce(pg, tensor, dist.ReduceOp.SUM, async_op)

:func:`ready` says when that holds: a plain ``torch.Tensor`` (no subclass, no torch-function
mode: those go through torch's dispatch), on the CPU, dense; no diagnostics hook, checked mode or
capability probe results that would change the call. Everything else takes the general path.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import has_torch_function

from distcompat.collectives import _checked, _probed

__all__ = ["allreduce", "alltoall", "broadcast", "ready"]


def ready(tensor: torch.Tensor) -> bool:
    """Return whether a call on ``tensor`` may go straight to the ProcessGroup method."""
    return (
        type(tensor) is torch.Tensor
        and tensor.is_cpu
        and tensor.is_contiguous()
        and not _checked._active
        and _checked.watch is None
        and not _probed._any
        and not has_torch_function((tensor,))
    )


@functools.cache
def _has_async_op(options: type) -> bool:
    """Whether this torch's options carry ``asyncOp`` (newer releases; a feature test)."""
    return hasattr(options(), "asyncOp")


def _finish(work: Any, async_op: bool) -> Any:
    if not async_op and work is not None:
        work.wait()
    return work


def allreduce(pg: Any, tensor: torch.Tensor, op: Any, async_op: bool) -> Any:
    """``pg.allreduce`` as ``dist.all_reduce`` calls it; waits unless ``async_op``."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    if _has_async_op(dist.AllreduceOptions):
        opts.asyncOp = async_op
    return _finish(pg.allreduce([tensor], opts), async_op)


def broadcast(pg: Any, tensor: torch.Tensor, group_root: int, async_op: bool) -> Any:
    """``pg.broadcast`` from group rank ``group_root``, as ``dist.broadcast`` calls it."""
    opts = dist.BroadcastOptions()
    opts.rootRank = group_root
    opts.rootTensor = 0
    if _has_async_op(dist.BroadcastOptions):
        opts.asyncOp = async_op
    return _finish(pg.broadcast([tensor], opts), async_op)


def alltoall(pg: Any, output: torch.Tensor, input: torch.Tensor, async_op: bool) -> Any:
    """``pg.alltoall_base`` with even splits, as ``dist.all_to_all_single`` calls it."""
    opts = dist.AllToAllOptions()
    if _has_async_op(dist.AllToAllOptions):
        opts.asyncOp = async_op
    return _finish(pg.alltoall_base(output, input, [], [], opts), async_op)
