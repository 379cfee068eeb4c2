"""An unchanged Lightning Fabric program: DDP on 2 CPU ranks (Fabric re-launches this script).

python frameworks/lightning_fabric.py
distcompat run python frameworks/lightning_fabric.py
"""

from __future__ import annotations

import lightning as L
import torch
from _common import digest, fault, shapes_for


def main() -> None:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    fabric.seed_everything(0, verbose=False)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
    generator = torch.Generator().manual_seed(fabric.global_rank)
    for step in range(6):
        fault(fabric.global_rank, step)
        x, y = torch.randn(8, 8, generator=generator), torch.randn(8, 1, generator=generator)
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        metric = fabric.all_reduce(
            torch.full((shapes_for(fabric.global_rank, step),), loss.item()), reduce_op="sum"
        )
    rank = fabric.global_rank
    print(f"rank {rank}: loss {metric[0].item()!r}", flush=True)
    print(f"rank {rank}: digest {digest(list(model.parameters()))}", flush=True)


if __name__ == "__main__":
    main()
