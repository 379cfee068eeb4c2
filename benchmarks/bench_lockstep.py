"""What a 2-rank demo step costs on this machine besides communication: the lockstep ceiling.

    python benchmarks/bench_lockstep.py [--rounds 2] [--steps 12]

The demo's 1 -> 2 rank ratio (``bench_demo.py``) stays under 2x for reasons that are not all the
collectives'. This runs the demo's model and batch (``bench_demo.py``'s configuration: batch 32,
sequence 256, 4 layers of 128, one thread per rank) seven ways, each in a fresh process tree,
interleaved round by round (the order reversed every other round), and times every step phase:

- ``one``: one rank alone (the 1-rank demo's step);
- ``pair``: two independent 1-rank processes at once (no group: what two cores give two copies);
- ``lockstep``: 2 ranks, each with a local ``torch.optim.AdamW`` and a ``barrier()`` before every
  step: in step with each other, but with no gradient sync at all;
- ``free``: the same 2 ranks without the barrier (they drift out of phase);
- ``demo``: 2 ranks as the demo trains (``ZeroAdamW``: reduce-scatter during backward, AdamW on
  the shard, all-gather), with distcompat's defaults;
- ``lockstep_bound``, ``demo_bound``: ``lockstep`` and ``demo`` with each rank bound to a CPU
  of its own (``os.sched_setaffinity``, Linux), to see whether binding lifts the ratio. ``one``
  is not bound, as a 1-rank demo is not.

Per variant and round it prints each rank's median step phases and per-thread CPU times:
``fwd_cpu`` is the main thread's CPU time in the forward pass, where no collective runs, so a
rise there over ``pair`` is contention between the ranks, not waiting. The summary gives
``2 * one / step`` per variant: the ratio the demo would read if it ran at that variant's speed.
Writes ``benchmarks/results/lockstep.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "lockstep.json"
#: Variant name -> (ranks per process tree, process trees at once, PROF_MODE for the ranks).
VARIANTS: dict[str, tuple[int, int, str]] = {
    "one": (1, 1, "demo"),
    "pair": (1, 2, "demo"),
    "lockstep": (2, 1, "barrier"),
    "free": (2, 1, "free"),
    "demo": (2, 1, "demo"),
    "lockstep_bound": (2, 1, "barrier-bound"),
    "demo_bound": (2, 1, "demo-bound"),
}
_SKIP = 3  # warm-up steps not counted


def _ranks(out: str, steps: int, mode: str) -> dict[str, float]:
    """Run on each rank: build the demo's trainer, time ``steps`` steps, return median phases."""
    import torch.distributed as tdist

    import distcompat
    import distcompat.distributed as dist
    from distcompat.demo import _train, _trainer
    from distcompat.demo._config import DemoConfig
    from distcompat.demo._optim import ZeroAdamW

    torch.set_num_threads(1)  # as the demo: one thread per rank
    if mode.endswith("-bound"):  # one CPU per rank: every thread now, and those started later
        mode = mode.removesuffix("-bound")
        cpus = sorted(os.sched_getaffinity(0))
        for thread in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(thread), {cpus[int(os.environ["RANK"]) % len(cpus)]})
    config = DemoConfig(out=Path(out), steps=steps, batch_size=32, seq_len=256)
    info = distcompat.init_distributed(device="cpu")
    corpus = _train._prepare_corpus(config, first_attempt=True)
    trainer = _trainer.Trainer.build(config, corpus, info.device, init_seed=config.seed)
    batches = _trainer._endless(trainer.loader)
    assert isinstance(trainer.optimizer, ZeroAdamW)  # the demo's default mode
    local = None
    if mode != "demo":
        trainer.optimizer.close()  # its hooks would launch the gradient sync
        local = torch.optim.AdamW(trainer.model.parameters(), lr=1e-3)
    rows = []
    for index in range(steps):
        cpu0, wall0, main0 = time.process_time(), time.perf_counter(), time.thread_time()
        if mode == "barrier":
            tdist.barrier()
        inputs, targets = next(batches)
        wall1 = time.perf_counter()
        with trainer.autocast():
            loss = trainer.model(inputs, targets)
        wall2, main2 = time.perf_counter(), time.thread_time()
        if local is None:
            mean = loss.detach().float().reshape(1)
            loss_sync = dist.all_reduce(mean, op=dist.ReduceOp.AVG, async_op=True)
            loss.backward()
            wall3, main3 = time.perf_counter(), time.thread_time()
            trainer.optimizer.step()
            trainer.optimizer.zero_grad()
            loss_sync.wait()
            sync = trainer.optimizer.sync_wait_s
        else:
            loss.backward()
            wall3, main3 = time.perf_counter(), time.thread_time()
            local.step()
            local.zero_grad()
            sync = 0.0
        wall4, cpu4, main4 = time.perf_counter(), time.process_time(), time.thread_time()
        if index >= _SKIP:
            rows.append(
                {
                    "step_ms": (wall4 - wall0) * 1e3,
                    "data_ms": (wall1 - wall0) * 1e3,
                    "fwd_ms": (wall2 - wall1) * 1e3,
                    "bwd_ms": (wall3 - wall2) * 1e3,
                    "opt_ms": (wall4 - wall3) * 1e3,
                    "sync_wait_ms": sync * 1e3,
                    "fwd_cpu_ms": (main2 - main0) * 1e3,
                    "bwd_cpu_ms": (main3 - main2) * 1e3,
                    "main_cpu_ms": (main4 - main0) * 1e3,
                    "other_threads_cpu_ms": ((cpu4 - cpu0) - (main4 - main0)) * 1e3,
                }
            )
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def _tree(ranks: int, steps: int, mode: str) -> list[dict[str, float]]:
    """In a fresh process: start ``ranks`` ranks with ``run_on_ranks`` and return their medians."""
    from distcompat.testing import run_on_ranks

    with tempfile.TemporaryDirectory(prefix="bench-lockstep-") as out:
        return run_on_ranks(_ranks, ranks, args=(out, steps, mode), timeout=1800)


def _start(ranks: int, steps: int, mode: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-W", "ignore", __file__, "--tree", str(ranks), str(steps), mode]
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)


def _run_variant(name: str, steps: int) -> list[dict[str, float]]:
    """Run one variant (its process trees at once); return every rank's medians."""
    ranks, trees, mode = VARIANTS[name]
    started = [_start(ranks, steps, mode) for _ in range(trees)]
    found: list[dict[str, float]] = []
    for process in started:
        out, _ = process.communicate()
        if process.returncode != 0:
            raise SystemExit(f"{name}: a process tree failed ({process.returncode})")
        found.extend(json.loads(out.strip().splitlines()[-1]))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--tree", nargs=3, help=argparse.SUPPRESS)  # internal: one process tree
    options = parser.parse_args()
    if options.tree:
        ranks, steps, mode = options.tree
        print(json.dumps(_tree(int(ranks), int(steps), mode)))
        return
    names = list(VARIANTS)
    rounds: list[dict[str, Any]] = []
    for round_index in range(options.rounds):
        order = names if round_index % 2 == 0 else names[::-1]
        found = {name: _run_variant(name, options.steps) for name in order}
        one = found["one"][0]["step_ms"]
        ratios = {name: 2 * one / max(r["step_ms"] for r in found[name]) for name in names}
        rounds.append({"ranks": found, "ratio_2_one_over_step": ratios})
        for name in names:
            for rank, medians in enumerate(found[name]):
                fields = " ".join(f"{k.removesuffix('_ms')} {v:.0f}" for k, v in medians.items())
                print(f"round {round_index} {name:8} rank {rank}: {fields}", flush=True)
        print(
            f"round {round_index} ratios 2*one/step: "
            + ", ".join(f"{n} {r:.2f}x" for n, r in ratios.items()),
            flush=True,
        )
    summary = {
        "what": "demo step phases: one rank, two independent ranks, 2 ranks in lockstep "
        "(barrier, local AdamW), 2 free ranks, the demo's 2 ranks; interleaved",
        "config": {"rounds": options.rounds, "steps": options.steps, "counted_from": _SKIP + 1},
        "ratio_median": {
            name: statistics.median(r["ratio_2_one_over_step"][name] for r in rounds)
            for name in names
        },
        "rounds": rounds,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }
    options.output.parent.mkdir(parents=True, exist_ok=True)
    options.output.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary["ratio_median"]))
    print(f"wrote {options.output}")


if __name__ == "__main__":
    main()
