"""An unchanged ``mp.spawn`` program with a ``tcp://`` rendezvous (no launcher environment).

    python frameworks/spawn_tcp.py PORT
    distcompat run python frameworks/spawn_tcp.py PORT

The parent never touches torch.distributed; each spawned child (a fresh interpreter: it runs the
bootstrap from the inherited PYTHONPATH) calls torch's init with ``init_method="tcp://..."``.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import digest, fault, shapes_for
from torch.nn.parallel import DistributedDataParallel

WORLD = 2


def worker(rank: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    for step in range(6):
        fault(rank, step)
        x = torch.randn(16, 8, generator=generator)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        metric = torch.full((shapes_for(rank, step),), loss.item())
        dist.all_reduce(metric)
    print(f"rank {rank}: loss {metric[0].item()!r}", flush=True)
    print(f"rank {rank}: digest {digest(list(model.parameters()))}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(int(sys.argv[1]),), nprocs=WORLD, join=True)
