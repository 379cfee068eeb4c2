"""``distcompat.barrier()``: every rank meets here, as a distcompat collective.

The barrier a training script writes (after rank 0 prepares data, before a save) is a
collective like any other, and it is where jobs hang: a rank that took another branch meets an
``all_reduce`` with its barrier. So it goes through distcompat's collectives: the mismatch check
compares it with what the other ranks call (a barrier against an ``all_reduce`` raises
:class:`~distcompat.CollectiveMismatchError` on both ranks), the watchdog sees it, and the
group's timeout ends its wait with a typed error naming the rank that never came::

    if distcompat.is_main_process():
        prepare_dataset()
    distcompat.barrier()
"""

from __future__ import annotations

import torch.distributed as dist

from distcompat._ranks import group_active, recorded

__all__ = ["barrier"]


def barrier() -> None:
    """Block until every rank arrives; the identity without a group or at world size 1.

    Every rank must call it (never inside ``if rank == 0:``). With NCCL it synchronizes on the
    device ``init_distributed`` bound. The wait is watched and bounded like every distcompat
    collective's (``distcompat.collectives.barrier``, which also has an async form).

    Example:
        >>> barrier()   # single process: returns at once
    """
    if not group_active() or dist.get_world_size() == 1:
        return
    # the collectives are imported by init_distributed, not with the lifecycle (import time)
    from distcompat.collectives import barrier as group_barrier

    info = recorded()
    device_ids = None
    if info is not None and info.device.type == "cuda" and "nccl" in str(dist.get_backend()):
        device_ids = [info.device.index or 0]
    group_barrier(device_ids=device_ids)
