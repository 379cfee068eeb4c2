"""A DDP communication hook that averages gradients through distcompat's ``all_reduce``.

DDP all-reduces its gradient buckets through the process group itself, past distcompat; with
this hook the buckets go through :func:`distcompat.collectives.all_reduce` instead, and so take
the shared-memory path where every rank of the group is on this machine (and gloo elsewhere)::

    model = torch.nn.parallel.DistributedDataParallel(model)
    model.register_comm_hook(None, allreduce_hook)      # state: the group, None for the default

The result is DDP's own: the bucket averaged over the group's ranks (summed, then divided by the
world size, as DDP's default hook does).
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects.
from typing import Any

import torch
import torch.distributed as dist

from distcompat.collectives._reductions import all_reduce

__all__ = ["allreduce_hook"]


def allreduce_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a DDP gradient bucket over ``state`` (a process group, or None for the default).

    Register it with ``DistributedDataParallel.register_comm_hook(group, allreduce_hook)``.

    Example:
        >>> from types import SimpleNamespace
        >>> bucket = SimpleNamespace(buffer=lambda: torch.ones(3))   # no group: the identity
        >>> allreduce_hook(None, bucket).wait()
        tensor([1., 1., 1.])
    """
    buffer = bucket.buffer()
    work = all_reduce(buffer, op=dist.ReduceOp.AVG, group=state, async_op=True)
    return work.get_future().then(lambda done: done.value()[0])
