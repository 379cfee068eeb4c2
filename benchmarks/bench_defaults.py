"""What distcompat's protections cost a training run: ``distcompat demo`` with defaults vs off.

    python benchmarks/bench_defaults.py [--rounds 6] [--steps 30] [--nproc 2]

The protections on by default are the report-only watchdog (``DISTCOMPAT_WATCHDOG``) and the
mismatch check (``DISTCOMPAT_MISMATCH_CHECK``). Each round runs the demo twice on ``--nproc``
local gloo ranks, once with default settings and once with both set to ``off``; the order
alternates between rounds so drift in machine load hits both alike. The figure is the demo's own
tokens/s (steps after warm-up); the budget (issue 15) is the defaults within 1 % of everything
off. Writes ``benchmarks/results/defaults_cost.json``.

Whole runs scatter by up to a quarter on a shared 2-core VM, which hides 1 %. ``--pairs N``
measures it step by step instead: one 2-rank process tree runs the demo's model and batch (as
``bench_lockstep.py``) for N pairs of training steps, one step with the protections on and one
with them off, by turns (the order alternating), so the machine's drift falls on both sides of a
pair alike. "Off" removes the watchdog's hooks for the step (``_checked.set_hooks(None, None)``,
which is what an unset watchdog leaves) and pauses the mismatch check (``unchecked()``). The
watchdog's thread keeps running through both, so its CPU time is measured on its own (its
thread's CPU clock) and reported as a share of the run. Writes ``defaults_steps.json``::

    python benchmarks/bench_defaults.py --pairs 60
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_demo import machine_facts, run_once

RESULTS = Path(__file__).resolve().parent / "results" / "defaults_cost.json"
STEPS_RESULTS = RESULTS.with_name("defaults_steps.json")
OFF = {"DISTCOMPAT_WATCHDOG": "off", "DISTCOMPAT_MISMATCH_CHECK": "off"}
_WARMUP_STEPS = 3


def _protections_off(fn: Callable[[], float]) -> Callable[[], float]:
    """Return ``fn`` made to run with the protections off; every rank must switch alike.

    Off: the watchdog's hooks removed, as an unset watchdog leaves them, and the mismatch check
    paused (``unchecked()``); both put back after each call.
    """
    from distcompat.collectives import _checked, unchecked

    pre_call, watcher, hooked = _checked._pre_call, _checked.watch, _checked._hooked
    assert watcher is not None, "the default watchdog is expected on"

    def off() -> float:
        _checked.set_hooks(None, None)
        try:
            with unchecked():
                return fn()
        finally:
            _checked.set_hooks(pre_call, watcher, general=hooked)

    return off


def _by_turns(
    on: Callable[[], float], off: Callable[[], float], pairs: int
) -> tuple[list[float], list[float]]:
    """Run ``on`` and ``off`` ``pairs`` times each by turns, the order alternating per pair."""
    on_ms: list[float] = []
    off_ms: list[float] = []
    for index in range(pairs):
        if index % 2 == 0:
            on_ms.append(on())
            off_ms.append(off())
        else:
            off_ms.append(off())
            on_ms.append(on())
    return on_ms, off_ms


def _steps_ab(out: str, pairs: int) -> dict[str, Any]:
    """On each rank: ``pairs`` pairs of demo training steps, protections on and off by turns."""
    import torch

    import distcompat
    from distcompat.demo import _train, _trainer
    from distcompat.demo._config import DemoConfig

    torch.set_num_threads(1)  # as the demo: one thread per rank
    config = DemoConfig(out=Path(out), steps=2 * pairs + _WARMUP_STEPS, batch_size=32, seq_len=256)
    info = distcompat.init_distributed(device="cpu")
    corpus = _train._prepare_corpus(config, first_attempt=True)
    trainer = _trainer.Trainer.build(config, corpus, info.device, init_seed=config.seed)
    thread = next(t for t in threading.enumerate() if t.name == "distcompat-watchdog")
    assert thread.ident is not None
    clock = time.pthread_getcpuclockid(thread.ident)

    def step() -> float:
        return trainer.train_step().step_ms

    for _ in range(_WARMUP_STEPS):
        step()
    cpu0, wall0 = time.clock_gettime(clock), time.perf_counter()
    on, off = _by_turns(step, _protections_off(step), pairs)
    watchdog_cpu = time.clock_gettime(clock) - cpu0
    wall = time.perf_counter() - wall0
    shapes = [p.numel() for p in trainer.model.parameters()]
    trainer.close()
    replay_on, replay_off = _replay(shapes, 10 * pairs)
    return {
        "on_ms": on,
        "off_ms": off,
        "watchdog_cpu_s": watchdog_cpu,
        "wall_s": wall,
        "replay_on_ms": replay_on,
        "replay_off_ms": replay_off,
        "collectives_per_step": 2 * len(shapes) + 1,
    }


def _replay(sizes: list[int], pairs: int) -> tuple[list[float], list[float]]:
    """The demo step's collectives alone, protections on and off by turns; ms per step.

    Per step, as ``ZeroAdamW`` and the loss average issue them: an async AVG all_reduce of one
    float, an async AVG reduce_scatter_tensor of each parameter's (padded) gradient, then an
    async all_gather_into_tensor of each shard, every handle waited on. No compute, so the
    protections' own cost per step stands out of the noise of a 1-second training step.
    """
    import torch

    import distcompat.distributed as dist

    world = dist.get_world_size()
    grads = [torch.zeros(-(-n // world) * world) for n in sizes]
    shards = [torch.empty(g.numel() // world) for g in grads]
    fulls = [torch.empty(g.numel()) for g in grads]
    loss = torch.ones(1)
    avg = dist.ReduceOp.AVG

    def collectives() -> float:
        dist.barrier()
        start = time.perf_counter()
        mean = dist.all_reduce(loss, op=avg, async_op=True)
        works = [
            dist.reduce_scatter_tensor(s, g, op=avg, async_op=True)
            for s, g in zip(shards, grads, strict=True)
        ]
        for work in works:
            work.wait()
        gathers = [
            dist.all_gather_into_tensor(f, s, async_op=True)
            for f, s in zip(fulls, shards, strict=True)
        ]
        for work in gathers:
            work.wait()
        mean.wait()
        return (time.perf_counter() - start) * 1e3

    off = _protections_off(collectives)
    for _ in range(5):
        collectives(), off()
    return _by_turns(collectives, off, pairs)


def _median_interval(values: list[float]) -> tuple[float, float, float]:
    """The median and a ~95 % interval for it from order statistics (binomial, n >= 10)."""
    ordered = sorted(values)
    n = len(ordered)
    half = 0.98 * n**0.5  # 1.96 * sqrt(n) / 2
    low = max(0, int(n / 2 - half))
    high = min(n - 1, int(n / 2 + half + 0.999))
    return statistics.median(ordered), ordered[low], ordered[high]


def _by_steps(options: argparse.Namespace) -> None:
    from distcompat.testing import run_on_ranks

    with tempfile.TemporaryDirectory(prefix="bench-defaults-steps-") as tmp:
        ranks = run_on_ranks(_steps_ab, 2, args=(tmp, options.pairs), timeout=3600)
    per_rank = []
    for rank, got in enumerate(ranks):
        ratios = [a / b for a, b in zip(got["on_ms"], got["off_ms"], strict=True)]
        median, low, high = _median_interval(ratios)
        share = got["watchdog_cpu_s"] / got["wall_s"]
        replay = [a - b for a, b in zip(got["replay_on_ms"], got["replay_off_ms"], strict=True)]
        extra_ms, extra_low, extra_high = _median_interval(replay)
        step_ms = statistics.median(got["on_ms"] + got["off_ms"])
        per_rank.append(
            {
                "rank": rank,
                "pairs": len(ratios),
                "on_step_ms_median": statistics.median(got["on_ms"]),
                "off_step_ms_median": statistics.median(got["off_ms"]),
                "ratio_on_over_off_median": median,
                "ratio_95_interval": [low, high],
                "watchdog_cpu_share": share,
                "collectives_per_step": got["collectives_per_step"],
                "replay_on_ms_median": statistics.median(got["replay_on_ms"]),
                "replay_off_ms_median": statistics.median(got["replay_off_ms"]),
                "replay_extra_ms_median": extra_ms,
                "replay_extra_95_interval_ms": [extra_low, extra_high],
                "replay_extra_share_of_step": extra_ms / step_ms,
                "raw": got,
            }
        )
        print(
            f"rank {rank}: step on {per_rank[-1]['on_step_ms_median']:.0f} ms, off "
            f"{per_rank[-1]['off_step_ms_median']:.0f} ms; on/off per pair: median "
            f"{median:.4f} ({low:.4f}-{high:.4f}, ~95 %); watchdog thread CPU "
            f"{share * 100:.3f} % of the run",
            flush=True,
        )
        print(
            f"rank {rank}: the step's {got['collectives_per_step']} collectives alone: on "
            f"{per_rank[-1]['replay_on_ms_median']:.2f} ms, off "
            f"{per_rank[-1]['replay_off_ms_median']:.2f} ms; on - off per pair: median "
            f"{extra_ms:+.3f} ms ({extra_low:+.3f} to {extra_high:+.3f}), "
            f"{extra_ms / step_ms * 100:+.3f} % of a {step_ms:.0f} ms step",
            flush=True,
        )
    summary = {
        "what": "demo training steps on 2 gloo ranks, default protections on and off by turns "
        "in one process tree (off: watchdog hooks removed, mismatch check paused)",
        "config": {"pairs": options.pairs, "warmup_steps": _WARMUP_STEPS},
        "goal": "on/off <= 1.01",
        "ranks": per_rank,
        **machine_facts(),
    }
    output = options.output if options.output != RESULTS else STEPS_RESULTS
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {output}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument(
        "--pairs", type=int, default=0, help="step by step instead: this many on/off step pairs"
    )
    options = parser.parse_args()
    for name in OFF:  # the "defaults" side must see distcompat's own defaults
        os.environ.pop(name, None)
    if options.pairs:
        _by_steps(options)
        return

    runs: dict[str, list[dict[str, float]]] = {"defaults": [], "off": []}
    ratios = []
    with tempfile.TemporaryDirectory(prefix="bench-defaults-") as tmp:
        for round_index in range(options.rounds):
            order = ("defaults", "off") if round_index % 2 == 0 else ("off", "defaults")
            got = {}
            for side in order:
                out = Path(tmp) / f"round{round_index}-{side}"
                env = OFF if side == "off" else None
                got[side] = run_once(options.nproc, options, out, env)
                runs[side].append(got[side])
            ratios.append(got["defaults"]["tokens_per_sec"] / got["off"]["tokens_per_sec"])
            print(
                f"round {round_index}: defaults {got['defaults']['tokens_per_sec']:,.0f} tok/s, "
                f"off {got['off']['tokens_per_sec']:,.0f} tok/s, ratio {ratios[-1]:.4f}",
                flush=True,
            )
    median = {side: statistics.median(r["tokens_per_sec"] for r in runs[side]) for side in runs}
    summary = {
        "what": "distcompat demo tokens/s, default protections vs DISTCOMPAT_WATCHDOG=off and "
        "DISTCOMPAT_MISMATCH_CHECK=off, interleaved rounds",
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(options).items()},
        "tokens_per_sec_median": median,
        "ratio_per_round": ratios,
        "ratio_median": statistics.median(ratios),
        "goal": "defaults >= 0.99 x off",
        "runs": runs,
        **machine_facts(),
    }
    options.output.parent.mkdir(parents=True, exist_ok=True)
    options.output.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: summary[k] for k in ("tokens_per_sec_median", "ratio_median")}))
    print(f"wrote {options.output}")


if __name__ == "__main__":
    main()
