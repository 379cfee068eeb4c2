r"""An unchanged Hugging Face Accelerate program: ``Accelerator(cpu=True)`` on 2 CPU ranks.

    accelerate launch --multi_gpu --num_processes 2 frameworks/accelerate_cpu.py
    accelerate launch --cpu --mpirun_hostfile frameworks/accelerate_hostfile \
        --num_processes 2 --num_machines 1 frameworks/accelerate_cpu.py
    distcompat run accelerate launch ...   # either of them, unchanged

Accelerate 1.15 has no multi-CPU flag for one machine: ``--cpu --num_processes 2`` starts one
process; ``--multi_gpu`` starts torchrun's agent with 2 processes, which ``cpu=True`` makes a
gloo group (``MULTI_CPU``); its documented multi-CPU route is ``mpirun`` with a hostfile.
``prepare`` wraps the model in DDP and shards the loaders; ``accelerator.reduce`` sums a metric
each step; ``gather_for_metrics`` collects the evaluation's predictions (the last batch uneven).
Prints ``rank R: digest D`` (the final parameters) and ``rank R: loss L`` (the evaluation's).
"""

from __future__ import annotations

import torch
from _common import digest, fault, shapes_for
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    accelerator = Accelerator(cpu=True)
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1)
    train = TensorDataset(
        torch.randn(96, 8, generator=generator), torch.randn(96, 1, generator=generator)
    )
    held_out = TensorDataset(
        torch.randn(40, 8, generator=generator), torch.randn(40, 1, generator=generator)
    )
    model, opt, train_loader, eval_loader = accelerator.prepare(
        model, opt, DataLoader(train, batch_size=8), DataLoader(held_out, batch_size=16)
    )
    rank = accelerator.process_index
    model.train()
    for step, (x, y) in enumerate(train_loader):
        fault(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        metric = torch.full((shapes_for(rank, step),), loss.item())
        metric = accelerator.reduce(metric, reduction="sum")  # a user's metric sync
        accelerator.print(f"step {step}: loss summed over the ranks {metric[0].item():.4f}")
    model.eval()
    predictions, targets = [], []
    with torch.no_grad():
        for x, y in eval_loader:
            gathered = accelerator.gather_for_metrics((model(x), y))
            predictions.append(gathered[0])
            targets.append(gathered[1])
    assert sum(len(t) for t in targets) == len(held_out)  # gather_for_metrics drops the padding
    eval_loss = torch.nn.functional.mse_loss(torch.cat(predictions), torch.cat(targets))
    print(f"rank {rank}: loss {eval_loss.item()!r}", flush=True)
    params = list(accelerator.unwrap_model(model).parameters())
    print(f"rank {rank}: digest {digest(params)}", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
