"""One rank of a tiny resumable training run, started by tests/test_checkpoint_resume.py.

    python _resume_script.py --ckpt DIR --result FILE [--kill RANK@STEP] [--kill-in step|save]

Each step every rank takes one sample index from a ``ShardedSampler`` (shuffled, ``mode="drop"``),
makes its input from the index, and takes an SGD-with-momentum step on the all-reduced gradient.
The model also counts, in a buffer, how often each sample was trained on (the counts of every
rank are all-reduced), so the buffer in the final state proves exactly-once across kills and
restarts: a step that was not committed is rolled back with the counts it added. The run starts
with ``resume`` and saves ``training_state`` every ``--every`` steps. At the end rank 0 writes
``FILE``: the counts, the SHA-256 of the parameters, the step it resumed from and what it skipped.

``--kill R@S``: rank R SIGKILLs itself at step S, before the step (``--kill-in step``) or while
pickling its state in the save of step S (``--kill-in save``: a real kill in the middle of a save).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import distcompat
from distcompat.checkpoint import resume, save_checkpoint, training_state
from distcompat.data import ShardedSampler


class Counted(torch.nn.Module):
    """A linear model and a buffer counting how often each sample was trained on."""

    def __init__(self, samples: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(4, generator=generator, dtype=torch.float64))
        self.seen: torch.Tensor
        self.register_buffer("seen", torch.zeros(samples, dtype=torch.int64))


class Pickled:
    """Pickling it (inside a save's ``torch.save``) runs ``action``: a signal in the middle of a
    save (shared with ``_preempt_script.py``)."""

    def __init__(self, action: Callable[[], object]) -> None:
        self.action = action

    def __reduce__(self) -> Any:
        self.action()
        return (dict, ())


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def write_result(path: Path, model: Counted, resumed: Any, step: int, world: int) -> None:
    """Write a finished run's counts, parameters' SHA-256 and steps to ``path`` (rank 0)."""
    digest = hashlib.sha256(bytes(model.weight.detach().view(torch.uint8).tolist()))
    result = {
        "seen": model.seen.tolist(),
        "sha256": digest.hexdigest(),
        "resumed_step": resumed.step,
        "skipped": list(resumed.skipped),
        "last_step": step,
        "world_size": world,
    }
    path.write_text(json.dumps(result), encoding="utf-8")


def start_run(ckpt: Path, samples: int) -> tuple[Any, Counted, Any, ShardedSampler, Any]:
    """Init, the model, its optimizer and sampler, resumed from ``ckpt`` (shared, as train_on)."""
    info = distcompat.init_distributed(device="cpu", timeout=30)
    model = Counted(samples)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler = ShardedSampler(range(samples), shuffle=True, seed=7, mode="drop")
    resumed = resume(ckpt, model=model, optimizer=optimizer, loader=sampler)
    return info, model, optimizer, sampler, resumed


def train_on(model: Counted, optimizer: torch.optim.Optimizer, index: int, world: int) -> None:
    """One step on sample ``index``: the all-reduced gradient, and the count of what was seen.

    Shared with ``_preempt_script.py``.
    """
    generator = torch.Generator().manual_seed(1000 + index)
    x = torch.randn(4, generator=generator, dtype=torch.float64)
    loss = (model.weight @ x - x.sum() * 0.5) ** 2
    loss.backward()  # type: ignore[no-untyped-call]
    assert model.weight.grad is not None
    distcompat.all_reduce(model.weight.grad)
    model.weight.grad /= world
    counts = torch.zeros_like(model.seen)
    counts[index] = 1
    distcompat.all_reduce(counts)
    model.seen += counts
    optimizer.step()
    optimizer.zero_grad()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--kill", default="")
    parser.add_argument("--kill-in", choices=("step", "save"), default="step")
    args = parser.parse_args()
    kill_rank, kill_step = (int(v) for v in args.kill.split("@")) if args.kill else (-1, -1)

    info, model, optimizer, sampler, resumed = start_run(args.ckpt, args.samples)
    indices = iter(sampler)
    step = resumed.step
    for index in indices:  # the rest of epoch 0, re-sharded over this world size
        step += 1
        if info.rank == kill_rank and step == kill_step and args.kill_in == "step":
            os.kill(os.getpid(), signal.SIGKILL)
        train_on(model, optimizer, index, info.world_size)
        if step % args.every == 0:
            bomb = info.rank == kill_rank and step == kill_step and args.kill_in == "save"
            extra = {"bomb": Pickled(_kill)} if bomb else {}
            state = training_state(model=model, optimizer=optimizer, loader=sampler, extra=extra)
            save_checkpoint(args.ckpt, step, state, keep_last=2)
    if info.rank == 0:
        write_result(args.result, model, resumed, step, info.world_size)
    distcompat.destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
