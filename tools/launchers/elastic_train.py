"""A training run that survives a lost rank: the same script on the first start and every restart.

    torchrun --standalone --nproc-per-node=2 --max-restarts=1 elastic_train.py --out DIR --kill 1@7

It starts with ``distcompat.checkpoint.resume`` and saves ``training_state`` every ``--every``
steps into ``DIR/ckpt``. Each step every rank takes ``--batch`` sample indices from a shuffled
``ShardedSampler`` (mode ``"drop"``: the same count on every rank), computes a least-squares loss on
inputs made from the indices, and steps SGD with momentum on the all-reduced gradient. A buffer in
the model counts how often each sample was trained on (all-reduced each step), so the final state
says whether every sample was seen exactly once across kills and restarts.

Rank 0 appends ``{"run", "step", "loss"}`` to ``DIR/losses.jsonl`` after every step and writes
``DIR/result.json`` at the end (run, resumed step, counts, SHA-256 of the parameters); ``run``
is ``--tag``, plus ``-<attempt>`` under torchrun. ``--kill R@S``: rank R SIGKILLs itself before
step S on the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0 or unset), so torchrun's agent must
restart the group, or under another launcher the job ends and is run again without ``--kill``.
``--kill-node``: the rank kills its torchrun agent too, as when its node is lost; an elastic
torchrun (``--nnodes=1:2``) then continues on the nodes left, with a smaller world.

``--preempt``: a ``distcompat.preemption.Preemption`` is asked each step whether to stop (the
cases of ``preempted.py`` signal the job mid-run). Each rank writes its pid to
``DIR/pid-<run>-<rank>`` at the start and, when it stops, its ``StopReport`` to
``DIR/stop-<run>-<rank>.json`` before it exits as the report says. ``--step-s S`` sleeps S s
after each step (the numbers stay the same), so that a signal lands mid-run. ``--hold-at S``:
a run that has not passed step S waits there, asking ``should_stop`` every 0.2 s, until a stop
signal comes (a job whose time-limit warning falls mid-run, at a moment Slurm picks).

``--exact N``: a global batch of N samples a step at every world size (``TrainPlan``, one
sample per micro-batch), each sample's gradient summed as integers (``ExactGradients``): the
final parameters have the same bits at any world size, also after a shrink.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import NoReturn

import torch

import distcompat
from distcompat.anysize import ExactGradients, TrainPlan
from distcompat.checkpoint import atomic_write_json, resume, save_checkpoint, training_state
from distcompat.data import ShardedSampler
from distcompat.preemption import Preemption

FEATURES = 8


class Model(torch.nn.Module):
    """A linear model, and a buffer counting how often each sample was trained on."""

    def __init__(self, samples: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(
            torch.randn(FEATURES, generator=generator, dtype=torch.float64)
        )
        self.seen: torch.Tensor
        self.register_buffer("seen", torch.zeros(samples, dtype=torch.int64))


def batch(indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs [B, FEATURES] made from each sample's index, and targets [B]."""
    rows = [
        torch.randn(
            FEATURES, generator=torch.Generator().manual_seed(1000 + i), dtype=torch.float64
        )
        for i in indices
    ]
    inputs = torch.stack(rows)  # [B, FEATURES]
    return inputs, inputs.sum(dim=1) * 0.5


def _stop(preemption: Preemption, report_file: Path, save: Callable[[], None] | None) -> NoReturn:
    """Save the agreed step (unless the loop just did), write the report, exit as it says."""
    report = preemption.stop(save=save, exit=False)
    atomic_write_json(report_file, asdict(report))
    preemption.exit(report)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--every", type=int, default=3, help="steps between checkpoints")
    parser.add_argument("--kill", default="", help="RANK@STEP, first attempt only")
    parser.add_argument(
        "--kill-node", action="store_true", help="the killed rank SIGKILLs its torchrun agent too"
    )
    parser.add_argument(
        "--tag", default="run", help="tag of this run's lines (under torchrun: + -<attempt>)"
    )
    parser.add_argument("--preempt", action="store_true", help="stop together when signalled")
    parser.add_argument("--step-s", type=float, default=0.0, help="sleep after each step")
    parser.add_argument("--hold-at", type=int, default=0, help="wait at this step for a signal")
    parser.add_argument("--exact", type=int, default=0, help="a global batch, summed exactly")
    args = parser.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        args.tag = f"{args.tag}-{attempt}"
    kill = tuple(int(v) for v in args.kill.split("@")) if args.kill and attempt == 0 else None

    info = distcompat.init_distributed(device="cpu", timeout=60)
    model = Model(args.samples)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    sampler = ShardedSampler(range(args.samples), shuffle=True, seed=5, mode="drop")
    exact = None
    if args.exact:  # the same global batch at every size: each rank takes its share
        plan = TrainPlan(global_batch=args.exact, micro_batch=1)
        args.batch = plan.share().samples
        exact = ExactGradients([model.weight], micro_batches=plan.micro_batches)
    resumed = resume(args.out / "ckpt", model=model, optimizer=optimizer, loader=sampler)
    if exact is not None and "exact" in resumed.extra:
        exact.load_state_dict(resumed.extra["exact"])
    preemption = Preemption(grace_s=20) if args.preempt else None
    if preemption is not None:
        (args.out / f"pid-{args.tag}-{info.rank}").write_text(str(os.getpid()), encoding="utf-8")
    indices = iter(sampler)
    step = resumed.step
    while True:
        mine = [i for _, i in zip(range(args.batch), indices, strict=False)]
        if len(mine) < args.batch:
            break  # the epoch is over (mode "drop": the same on every rank)
        step += 1
        if kill == (info.rank, step):
            if args.kill_node:  # the agent first: the whole node is gone, nothing restarts here
                os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        inputs, targets = batch(mine)
        if exact is None:
            loss = ((inputs @ model.weight - targets) ** 2).mean()
            loss.backward()  # type: ignore[no-untyped-call]
            assert model.weight.grad is not None
            distcompat.all_reduce(model.weight.grad)
            model.weight.grad /= info.world_size
        else:
            while True:  # one micro-batch a sample; redone if a gradient outgrew its bound
                for row in range(len(mine)):
                    loss = ((inputs[row] @ model.weight - targets[row]) ** 2).mean()
                    exact.add_loss(loss)
                    loss.backward()  # type: ignore[no-untyped-call]
                reduced = exact.reduce()
                if reduced.ok:
                    assert reduced.loss is not None
                    loss = torch.tensor(reduced.loss * info.world_size)  # logged / world_size
                    break
        counts = torch.zeros(args.samples, dtype=torch.int64)
        counts[mine] = 1
        distcompat.all_reduce(counts)
        model.seen += counts
        mean = loss.detach().reshape(1)
        if exact is None:
            distcompat.all_reduce(mean)
        optimizer.step()
        optimizer.zero_grad()
        if info.rank == 0:
            with (args.out / "losses.jsonl").open("a", encoding="utf-8") as log:
                line = {"run": args.tag, "step": step, "loss": mean.item() / info.world_size}
                log.write(json.dumps(line) + "\n")
        saved = step % args.every == 0
        extra: dict[str, object] = {} if exact is None else {"exact": exact.state_dict()}
        if saved:  # no RNG state: the inputs come from per-sample generators
            state = training_state(
                model=model, optimizer=optimizer, loader=sampler, rng=False, extra=extra
            )
            save_checkpoint(args.out / "ckpt", step, state, keep_last=2)
        if preemption is not None:
            time.sleep(args.step_s)
            stop_now = preemption.should_stop(step)
            while step == args.hold_at and not stop_now:
                time.sleep(0.2)
                stop_now = preemption.should_stop(step)
            if stop_now:

                def save(step: int = step, extra: dict[str, object] = extra) -> None:
                    state = training_state(
                        model=model, optimizer=optimizer, loader=sampler, rng=False, extra=extra
                    )
                    save_checkpoint(args.out / "ckpt", step, state, keep_last=2)

                stop_file = args.out / f"stop-{args.tag}-{info.rank}.json"
                _stop(preemption, stop_file, None if saved else save)
    if preemption is not None:
        preemption.close()
    if info.rank == 0:
        raw = model.weight.detach().view(torch.uint8)
        atomic_write_json(
            args.out / "result.json",
            {
                "run": args.tag,
                "attempt": attempt,
                "world_size": info.world_size,
                "resumed_step": resumed.step,
                "resume_s": resumed.seconds,
                "skipped": list(resumed.skipped),
                "last_step": step,
                "seen": model.seen.tolist(),
                "sha256": hashlib.sha256(bytes(raw.tolist())).hexdigest(),
            },
        )
    distcompat.destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
