"""DDP training steps through the protected group against raw gloo DDP and DDP with the hook.

Usage::

    .venv/bin/python benchmarks/bench_ddp.py [--ranks 2] [--widths 256 512 1024 2048 0] [--steps 30]

Starts itself on ``--ranks`` ranks under torchrun with every distcompat default on
(``init_distributed``: the default group is the protected group, the watchdog and the mismatch
check on, shared memory ``auto``). For each width it builds the same 4-layer MLP three times
(width 0: the demo's GPT, ``distcompat.demo``'s model at its default size):

* ``raw``: ``DistributedDataParallel(model, process_group=gloo)`` on a plain gloo group
  (``new_group(backend="gloo")``: torch's own, no distcompat);
* ``hook``: the same, with ``register_comm_hook(gloo, distcompat.collectives.allreduce_hook)``;
* ``protected``: ``DistributedDataParallel(model)`` on the default group, nothing registered.

A step is forward, backward and ``optimizer.step()`` on a batch of 16. After 5 warm-up steps
each, the three take turns step by step (the order rotating), and rank 0 prints the median step
of each and the ratios (above 1: the protected group is faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch


def _mlp(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _gpt() -> torch.nn.Module:
    from distcompat.demo._model import GPT, GPTConfig

    return GPT(GPTConfig(), seed=0)  # the demo's model: 4 layers, 128 wide, 128 tokens


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    """Time one training step (forward, backward, optimizer step) in seconds."""
    start = time.perf_counter()
    if batch.dtype == torch.long:  # tokens: the GPT's own loss
        model(batch, batch).backward()
    else:
        model(batch).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - start


def worker(widths: list[int], steps: int) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import distcompat
    from distcompat.collectives import allreduce_hook

    info = distcompat.init_distributed(device="cpu")
    gloo = dist.new_group(backend="gloo")  # torch's own group
    rows = []
    for width in widths:
        make = _gpt if width == 0 else lambda: _mlp(width)  # noqa: B023  # called at once
        models = {
            "raw": DistributedDataParallel(make(), process_group=gloo),
            "hook": DistributedDataParallel(make(), process_group=gloo),
            "protected": DistributedDataParallel(make()),
        }
        models["hook"].register_comm_hook(gloo, allreduce_hook)
        opts = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
        seeded = torch.Generator().manual_seed(info.rank)
        if width == 0:  # the GPT: 8 sequences of 128 tokens
            batch = torch.randint(0, 256, (8, 128), generator=seeded)
        else:
            batch = torch.randn(16, width, generator=seeded)
        times: dict[str, list[float]] = {name: [] for name in models}

        for name in models:
            for _ in range(5):
                _step(models[name], opts[name], batch)
        names = list(models)
        for i in range(steps):
            order = names[i % 3 :] + names[: i % 3]
            for name in order:
                times[name].append(_step(models[name], opts[name], batch))
        median = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        rows.append((width, median))
    if info.rank == 0:
        print(f"{info.world_size} ranks, median of {steps} steps (ms); width 0: the demo's GPT")
        print("(4-layer MLP, batch 16; GPT: 4 layers, 128 wide, batch 8 x 128 tokens)")
        print(
            "| width | raw gloo | with allreduce_hook | protected group | raw / protected "
            "| hook / protected |"
        )
        print("|---|---|---|---|---|---|")
        for width, m in rows:
            print(
                f"| {width} | {m['raw']:.2f} | {m['hook']:.2f} | {m['protected']:.2f} | "
                f"{m['raw'] / m['protected']:.2f}x | {m['hook'] / m['protected']:.2f}x |"
            )
    distcompat.destroy_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument(
        "--widths", type=int, nargs="+", default=[256, 512, 1024, 2048, 0], help="0: the GPT"
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.widths, args.steps)
        return
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks)]
    command += [__file__, "--worker", f"--steps={args.steps}", "--widths"]
    command += [str(w) for w in args.widths]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sys.exit(subprocess.run(command, env=env, check=False).returncode)


if __name__ == "__main__":
    main()
