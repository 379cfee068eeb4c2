"""What ``Preemption.should_stop`` costs a training step when no signal came.

Usage::

    .venv/bin/python benchmarks/bench_preemption.py [--steps 30] [--calls 300]

Two local gloo ranks (``torchrun``'s contract, ``init_distributed``, every default on) build the
demo's model at its default size (``DemoConfig``: 4 blocks, width 128, 8 x 128 tokens per rank)
and, in one run: time ``--steps`` demo training steps alone, then ``--calls`` calls of
``should_stop`` alone, then ``--steps`` steps each followed by ``should_stop``. Prints the median
step, the median call, and the call as a share of a step; issue 42 asks for at most 1 %.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from _self_on_ranks import run_self

ROOT = Path(__file__).resolve().parents[1]


def _rank(steps: int, calls: int) -> None:
    import torch

    import distcompat
    from distcompat.demo._config import DemoConfig
    from distcompat.demo._train import _prepare_corpus
    from distcompat.demo._trainer import Trainer
    from distcompat.preemption import Preemption

    torch.set_num_threads(1)
    info = distcompat.init_distributed(device="cpu")
    out = Path(tempfile.gettempdir()) / "distcompat-bench-preemption"
    config = DemoConfig(out=out)
    corpus = _prepare_corpus(config, first_attempt=True)
    trainer = Trainer.build(config, corpus, info.device, init_seed=config.seed)
    preemption = Preemption()

    def step_ms(ask: bool) -> list[float]:
        took = []
        for step in range(steps):
            distcompat.barrier()
            started = time.perf_counter()
            trainer.train_step()
            if ask:
                assert not preemption.should_stop(step)
            took.append((time.perf_counter() - started) * 1e3)
        return took

    step_ms(False)[:3]  # warm-up
    alone = step_ms(False)
    distcompat.barrier()
    started = time.perf_counter()
    for call in range(calls):
        preemption.should_stop(call)
    call_us = (time.perf_counter() - started) / calls * 1e6
    asked = step_ms(True)
    if info.rank == 0:
        step = statistics.median(alone)
        print(f"demo step alone          median {step:.2f} ms ({steps} steps)")
        print(f"demo step + should_stop  median {statistics.median(asked):.2f} ms")
        print(f"should_stop alone        mean {call_us:.1f} us ({calls} calls)")
        print(f"should_stop / step       {call_us / 1e3 / step * 100:.3f} %")
    preemption.close()
    trainer.close()
    distcompat.destroy_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        _rank(args.steps, args.calls)
        return
    run_self(__file__, 2, ("--rank", f"--steps={args.steps}", f"--calls={args.calls}"))


if __name__ == "__main__":
    main()
