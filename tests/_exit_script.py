"""A script that succeeds and returns without ``destroy_distributed()``: run by test_process_group.

It waits on a few async all_reduce and reduce_scatter_tensor futures, as a ZeRO-style optimizer
does, then simply ends. Its process must exit 0 (issue 28: it ended in SIGABRT 3-5 times in 10),
and distcompat's at-exit teardown must have destroyed the group: a hook registered before init
runs after it and prints ``AT_EXIT <rank> group gone``.

With ``--freed`` it makes an optimizer after init (``torch.optim`` imports
``torch.distributed.nn.functional``, whose defaults once kept the group), destroys the group and
prints ``FREED <rank> <whether the group object is gone>``.
"""

from __future__ import annotations

import atexit
import os
import sys
import weakref

import torch
import torch.distributed as dist

import distcompat


def _after_teardown(rank: int) -> None:
    """Registered before init: runs after distcompat's at-exit teardown (last in, first out)."""
    print("AT_EXIT", rank, "group up" if dist.is_initialized() else "group gone", flush=True)


def main() -> None:
    """Wait on async futures, print, and return with the group still up."""
    atexit.register(_after_teardown, int(os.environ["RANK"]))
    info = distcompat.init_distributed(device="cpu")
    if "--freed" in sys.argv:
        freed(info.rank)
        return
    buckets = [torch.ones(8) for _ in range(3)]
    futures = []
    for grads in buckets:
        futures.append(distcompat.all_reduce(grads, async_op=True).get_future())
        shard = torch.empty(8 // info.world_size)
        work = distcompat.reduce_scatter_tensor(shard, torch.ones(8), async_op=True)
        futures.append(work.get_future())
    for future in futures:
        future.wait()
    print("DONE", info.rank, sum(b[0].item() for b in buckets), flush=True)


def freed(rank: int) -> None:
    """Make an optimizer after init, destroy the group, and say whether it was freed."""
    weight = torch.nn.Parameter(torch.ones(4))
    torch.optim.SGD([weight], lr=0.1).step()
    distcompat.all_reduce(torch.ones(4))
    world = weakref.ref(dist.group.WORLD)
    distcompat.destroy_distributed()
    print("FREED", rank, world() is None, flush=True)


if __name__ == "__main__":
    main()
