"""An unchanged FSDP2 program that never calls init: ``init_device_mesh`` makes the default group.

    torchrun --standalone --nproc-per-node=2 frameworks/mesh_fsdp2.py

torch's ``device_mesh`` imported ``init_process_group`` by name; ``distcompat run`` must reach
that name too. Prints the losses and a digest of the full (gathered) parameters.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from _common import digest, fault, shapes_for
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def main() -> None:
    mesh = init_device_mesh("cpu", (2,))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    losses = []
    for step in range(6):
        fault(rank, step)
        loss = model(torch.randn(4, 8, generator=generator)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        metric = torch.full((shapes_for(rank, step),), loss.item())
        dist.all_reduce(metric)
        losses.append(metric[0].item())
    full = [p.full_tensor() for p in model.parameters()]  # type: ignore[attr-defined]
    print(f"rank {rank}: loss {','.join(map(repr, losses))}", flush=True)
    print(f"rank {rank}: digest {digest(full)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
