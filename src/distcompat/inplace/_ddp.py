"""DDP after a regroup: its reducer forgets the broken step and divides by the new size.

    regroup_ddp(model, regrouped)     # every survivor, after the state is in place

Example:
    >>> callable(regroup_ddp)
    True
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from distcompat import _torch
from distcompat.collectives import all_reduce
from distcompat.inplace._regroup import Regrouped

__all__ = ["regroup_ddp"]


def regroup_ddp(model: DistributedDataParallel, done: Regrouped) -> None:
    """Bring DDP to the new members: its reducer forgets the broken step (torch's own call).

    Where the group's backend was replaced rather than reconfigured, torch's C++ (DDP's
    reducer) still reads the old world size, by which it divides the gradients: a model with
    no comm hook of its own gets :func:`_divide_then_sum`, DDP's own arithmetic at the new size.
    """
    group = _torch.default_group()
    _torch.update_ddp_group(model, group)
    if not done.reconfigured and not _torch.ddp_comm_hooks(model):
        model.register_comm_hook(None, _divide_then_sum)


def _divide_then_sum(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default gradient sync, dividing by the world size Python sees (a comm hook)."""
    del state
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    handle = all_reduce(buffer, dist.ReduceOp.SUM, None, True)
    assert handle is not None
    return handle.get_future().then(lambda done: done.value()[0])


# DDP checks a hook's annotations against the classes themselves; this module's are strings.
_divide_then_sum.__annotations__.update(
    {"bucket": dist.GradBucket, "state": object, "return": torch.futures.Future[torch.Tensor]}
)
