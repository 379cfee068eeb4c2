"""An unchanged torchrun DDP program: torch's init, DDP, a metric all_reduce, DataLoader workers.

    torchrun --standalone --nproc-per-node=2 frameworks/ddp_torchrun.py
    distcompat run torchrun --standalone --nproc-per-node=2 frameworks/ddp_torchrun.py

The DataLoader forks 2 workers per rank after the group exists (the fork case of issue 48).
Prints ``rank R: digest D`` (the final parameters) and ``rank R: loss L``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from _common import digest, fault, shapes_for
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(rank)
    data = TensorDataset(
        torch.randn(48, 8, generator=generator), torch.randn(48, 1, generator=generator)
    )
    loader = DataLoader(data, batch_size=8, num_workers=2, multiprocessing_context="fork")
    for step, (x, y) in enumerate(loader):
        fault(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        metric = torch.full((shapes_for(rank, step),), loss.item())
        dist.all_reduce(metric)  # a user's metric sync
    print(f"rank {rank}: loss {metric[0].item()!r}", flush=True)
    print(f"rank {rank}: digest {digest(list(model.parameters()))}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
