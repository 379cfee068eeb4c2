"""What a run free of the world size costs a step: default mode, and exact mode against DDP.

Usage::

    .venv/bin/python benchmarks/bench_anysize.py [--pairs 20]

Two local gloo ranks (torchrun's worker contract, ``init_distributed``, every default on) build
the demo's model at its default size (4 blocks, width 128, 8 x 128 tokens per rank, a global
batch of 16 in micro-batches of 8) and time, interleaved in pairs so that load on the machine
falls on both sides alike:

1. *default*: the demo's step as it is now (``Trainer.train_step``: the micro-batch loop,
   ``ZeroAdamW``) against *before*: the step as written before issue 47 (one forward, the loss
   all-reduce, backward, ``ZeroAdamW.step``), on the same trainer;
2. *exact*: a replicated AdamW fed by ``ExactGradients`` (int64 sums, one all-reduce) against
   *DDP*: ``DistributedDataParallel`` (float all-reduce) with the same AdamW.

Prints each side's median, the median of the paired ratios, and exact mode's extra memory.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from _self_on_ranks import run_self


def _rank(pairs: int) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import distcompat
    import distcompat.distributed as dist
    from distcompat.anysize import ExactGradients
    from distcompat.demo._config import DemoConfig
    from distcompat.demo._model import GPT
    from distcompat.demo._train import _prepare_corpus
    from distcompat.demo._trainer import Trainer

    torch.set_num_threads(1)
    info = distcompat.init_distributed(device="cpu")
    out = Path(tempfile.gettempdir()) / "distcompat-bench-anysize"
    config = DemoConfig(out=out, global_batch=16, micro_batch=8)
    corpus = _prepare_corpus(config, first_attempt=True)
    trainer = Trainer.build(config, corpus, info.device, init_seed=config.seed)
    batches = iter(trainer.loader)

    def before() -> None:  # the demo's step before issue 47, on the same model and optimizer
        inputs, targets = next(batches)
        loss = trainer.model(inputs, targets)
        mean = loss.detach().float().reshape(1)
        sync = dist.all_reduce(mean, op=dist.ReduceOp.AVG, async_op=True)
        loss.backward()
        trainer.optimizer.step()
        trainer.optimizer.zero_grad()
        sync.wait()

    exact_model = GPT(config.model_config(), seed=config.seed)
    exact = ExactGradients(exact_model, micro_batches=2)
    exact_opt = torch.optim.AdamW(exact_model.parameters(), lr=1e-3)
    ddp_model = DistributedDataParallel(GPT(config.model_config(), seed=config.seed))
    ddp_opt = torch.optim.AdamW(ddp_model.parameters(), lr=1e-3)
    inputs, targets = next(iter(trainer.loader))
    redone: list[int] = []

    def exact_step() -> None:
        while True:  # a gradient that outgrew its bound redoes the step (counted, rare)
            loss = exact_model(inputs, targets)
            exact.add_loss(loss)
            loss.backward()
            if exact.reduce().ok:
                break
            redone.append(1)
        exact_opt.step()
        exact_opt.zero_grad()

    def ddp_step() -> None:
        loss = ddp_model(inputs, targets)
        loss.backward()
        ddp_opt.step()
        ddp_opt.zero_grad()

    def timed(step: Callable[[], None]) -> float:
        distcompat.barrier()
        started = time.perf_counter()
        step()
        return (time.perf_counter() - started) * 1e3

    sides: dict[str, list[float]] = {k: [] for k in ("default", "before", "exact", "ddp")}
    for pair in range(pairs + 2):  # the first two pairs warm up
        order = [("default", trainer.train_step), ("before", before)]
        order += [("exact", exact_step), ("ddp", ddp_step)]
        if pair % 2:
            order = [order[1], order[0], order[3], order[2]]
        for name, step in order:
            took = timed(step)  # type: ignore[arg-type]
            if pair >= 2:
                sides[name].append(took)
    if info.rank == 0:
        numel = sum(p.numel() for p in exact_model.parameters())
        for name, base in (("default", "before"), ("exact", "ddp")):
            ratios = [a / b for a, b in zip(sides[name], sides[base], strict=True)]
            print(
                f"{name:8s} median {statistics.median(sides[name]):7.2f} ms  {base:7s} median "
                f"{statistics.median(sides[base]):7.2f} ms  paired ratio median "
                f"{statistics.median(ratios):.3f} ({pairs} pairs)"
            )
        print(f"exact steps redone: {len(redone)} of {pairs + 2}")
        print(
            f"exact mode's extra memory: {numel:,} parameters x 8 bytes (int64 accumulators) = "
            f"{numel * 8 / 2**20:.1f} MiB, plus float32 and int64 temporaries of the largest "
            "tensor while a gradient is converted, and the all-reduce's int64 copy of them all "
            f"({numel * 8 / 2**20:.1f} MiB)"
        )
    exact.close()
    trainer.close()
    distcompat.destroy_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        _rank(args.pairs)
        return
    run_self(__file__, 2, ("--rank", f"--pairs={args.pairs}"))


if __name__ == "__main__":
    main()
