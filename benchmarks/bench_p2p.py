"""Blocking point-to-point on gloo: a ping-pong through distcompat against raw torch.distributed.

Usage::

    .venv/bin/python benchmarks/bench_p2p.py [--rounds 10] [--calls 300] [--numel 4]

Starts itself on 2 ranks under torchrun with every distcompat default on (``init_distributed``:
the watchdog, the mismatch check, shared memory ``auto``). Rank 0 sends a tensor and receives it
back, rank 1 receives and sends; a round times ``--calls`` such round trips with ``dist.send`` /
``dist.recv`` and then with ``distcompat.collectives.send`` / ``recv`` (the order reversed every
other round), and the best round of each is printed in microseconds per round trip. distcompat's
blocking send and recv on gloo stay on the calling thread, watched from beside it
(``collectives._blocking.beside``); staging and that registration are the difference.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable

import torch


def worker(rounds: int, calls: int, numel: int) -> None:
    import torch.distributed as dist

    import distcompat
    from distcompat.collectives import recv, send

    distcompat.init_distributed()
    rank = dist.get_rank()
    tensor = torch.zeros(numel)
    peer = 1 - rank

    def ping_pong(send_fn: Callable[..., object], recv_fn: Callable[..., object]) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            if rank == 0:
                send_fn(tensor, peer)
                recv_fn(tensor, peer)
            else:
                recv_fn(tensor, peer)
                send_fn(tensor, peer)
        return (time.perf_counter() - start) / calls * 1e6

    ways = {"torch.distributed": (dist.send, dist.recv), "distcompat": (send, recv)}
    best = dict.fromkeys(ways, float("inf"))
    for round_ in range(rounds):
        order = list(ways) if round_ % 2 == 0 else list(ways)[::-1]
        for name in order:
            best[name] = min(best[name], ping_pong(*ways[name]))
    if rank == 0:
        print(f"2 ranks, gloo, {numel} float32, best of {rounds} rounds of {calls} round trips")
        print("| way | us per round trip | vs torch.distributed |")
        print("|---|---|---|")
        for name, us in best.items():
            print(f"| {name} | {us:.1f} | {us / best['torch.distributed']:.2f}x |")
    distcompat.destroy_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--numel", type=int, default=4)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.rounds, args.calls, args.numel)
        return
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += [__file__, "--worker", f"--rounds={args.rounds}", f"--calls={args.calls}"]
    command += [f"--numel={args.numel}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sys.exit(subprocess.run(command, env=env, check=False).returncode)


if __name__ == "__main__":
    main()
