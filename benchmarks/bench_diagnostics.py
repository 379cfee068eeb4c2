"""Watchdog overhead when nothing hangs: 1 MiB all_reduce on 2 gloo ranks, with and without it.

    python benchmarks/bench_diagnostics.py [--rounds 20] [--iters 50] [--numel 262144]

Each round times ``--iters`` synchronous distcompat all_reduces of ``--numel`` float32 (1 MiB by
default; ``--numel 1`` for the tiny-call cost) without a watchdog (the group is re-made with
``watchdog=False``), then the same under the watchdog ``init_distributed`` starts by default
(report-only, 120 s), in the same processes, alternating which goes first, so machine noise hits
both alike. Reported: the
median per-call time of each and the overhead of the watchdog (goal: at most 3%), plus the cost
of the collective pre-call hook with nothing enabled (one call of ``verify``) and the watchdog's
own bookkeeping per call without communication (a noise-free bound on its overhead). Also writes
``benchmarks/results/diagnostics.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import timeit
from pathlib import Path

import torch

import distcompat
from distcompat.collectives import all_reduce
from distcompat.diagnostics import watchdog
from distcompat.launch._settings import DEFAULT_WATCHDOG_S
from distcompat.testing import DEFAULT_TIMEOUT_S, run_on_ranks, shutdown_pools


def _loop(tensor: torch.Tensor, iters: int) -> float:
    for _ in range(3):  # settle after a watchdog start (thread, store request) before timing
        all_reduce(tensor)
    start = time.perf_counter()
    for _ in range(iters):
        all_reduce(tensor)
    return (time.perf_counter() - start) / iters


def _rank(rounds: int, iters: int, numel: int) -> dict[str, list[float]]:
    distcompat.destroy_distributed()  # the harness's group has the default watchdog: re-make it
    distcompat.init_distributed(device="cpu", timeout=DEFAULT_TIMEOUT_S, watchdog=False)
    tensor = torch.ones(numel)
    _loop(tensor, iters)  # warm up the connections
    plain: list[float] = []
    watched: list[float] = []
    for round_ in range(rounds):
        for kind in ("plain", "watched") if round_ % 2 == 0 else ("watched", "plain"):
            if kind == "plain":
                plain.append(_loop(tensor, iters))
            else:
                with watchdog(timeout=DEFAULT_WATCHDOG_S, action="report"):
                    watched.append(_loop(tensor, iters))
    return {"plain": plain, "watched": watched}


def _hook_cost_ns() -> float:
    """Nanoseconds verify() adds with nothing enabled (over an empty call of the same shape)."""
    from distcompat.collectives._checked import verify

    t = torch.ones(1)
    n = 200_000
    hook = timeit.timeit(lambda: verify("all_reduce", t, None, reduce_op=None), number=n)
    empty = timeit.timeit(lambda: None, number=n)
    return (hook - empty) / n * 1e9


def _bookkeeping_us() -> float:
    """Microseconds of watchdog bookkeeping per collective, with a Work that is already done.

    Deterministic where the all_reduce timings are noisy: record, issue, bounded wait, finish.
    """
    from distcompat.diagnostics import Watchdog, WatchdogConfig, _records

    class DoneWork:
        def wait(self, timeout: object = None) -> bool:
            return True

    _records._labels.setdefault(None, "0")  # no group here: name the default group by hand
    dog = Watchdog(WatchdogConfig(timeout=DEFAULT_WATCHDOG_S, action="report"))
    work, t = DoneWork(), torch.ones(1)

    def one() -> None:
        dog.before("all_reduce", t, None, None, None)
        dog.wait_sync(work, "all_reduce", None)

    n = 50_000
    return (timeit.timeit(one, number=n) - timeit.timeit(lambda: None, number=n)) / n * 1e6


def main() -> None:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--numel", type=int, default=1 << 18)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    options = parser.parse_args()
    per_rank = run_on_ranks(
        _rank, 2, args=(options.rounds, options.iters, options.numel), timeout=1200
    )
    shutdown_pools()
    plain = statistics.median(per_rank[0]["plain"])
    watched = statistics.median(per_rank[0]["watched"])
    overhead = (watched - plain) / plain * 100
    result = {
        "machine": platform.platform(),
        "torch": torch.__version__,
        "numel": options.numel,
        "mib": options.numel * 4 / 2**20,
        "rounds": options.rounds,
        "iters": options.iters,
        "plain_us": plain * 1e6,
        "watchdog_us": watched * 1e6,
        "overhead_pct": overhead,
        "hook_off_ns": _hook_cost_ns(),
        "bookkeeping_us": _bookkeeping_us(),
        "per_round_rank0": per_rank[0],
    }
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "diagnostics.json").write_text(json.dumps(result, indent=2))
    print("| all_reduce 2 ranks gloo | per call (us) |")
    print("|---|---|")
    print(f"| {result['mib']:g} MiB, no watchdog | {plain * 1e6:.1f} |")
    print(f"| {result['mib']:g} MiB, default watchdog (report, 120 s) | {watched * 1e6:.1f} |")
    print(
        f"watchdog overhead: {overhead:+.2f}% (goal <= 3%), {(watched - plain) * 1e6:+.1f} us/call"
    )
    print(f"pre-call hook with nothing enabled: {result['hook_off_ns']:.0f} ns per collective")
    print(f"watchdog bookkeeping (no communication): {result['bookkeeping_us']:.1f} us per call")


if __name__ == "__main__":
    main()
