"""Per-call overhead of ``run_on_ranks``: cold (new pool) vs warm, beside a fresh spawn per call.

    python benchmarks/bench_run_on_ranks.py [--world-size 2] [--warm-calls 50] [--cold-calls 3]

The baseline is what a naive harness does for every test: ``torch.multiprocessing.spawn`` of
fresh ranks that each import torch, join a gloo group through a parent-owned TCPStore, run a
trivial function and tear down. All three are measured in the same run on the same machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from distcompat.testing import run_on_ranks, shutdown_pools


def trivial() -> int:
    return dist.get_rank()


def _spawned_rank(rank: int, world_size: int, port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    trivial()
    dist.destroy_process_group()


def fresh_spawn(world_size: int) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    tmp.spawn(  # type: ignore[no-untyped-call]
        _spawned_rank, args=(world_size, store.port), nprocs=world_size, join=True
    )


def timed(fn: object, *args: object) -> float:
    start = time.perf_counter()
    fn(*args)  # type: ignore[operator]
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--warm-calls", type=int, default=50)
    parser.add_argument("--cold-calls", type=int, default=3)
    options = parser.parse_args()
    ws = options.world_size

    cold = []
    for _ in range(options.cold_calls):
        shutdown_pools()
        cold.append(timed(run_on_ranks, trivial, ws))
    warm = [timed(run_on_ranks, trivial, ws) for _ in range(options.warm_calls)]
    shutdown_pools()
    spawn = [timed(fresh_spawn, ws) for _ in range(options.cold_calls)]

    result = {
        "world_size": ws,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": __import__("os").cpu_count(),
        "cold_median_s": statistics.median(cold),
        "warm_median_ms": statistics.median(warm) * 1e3,
        "warm_p95_ms": sorted(warm)[int(0.95 * (len(warm) - 1))] * 1e3,
        "fresh_spawn_median_s": statistics.median(spawn),
    }
    result["spawn_over_warm"] = result["fresh_spawn_median_s"] / (result["warm_median_ms"] / 1e3)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
