"""What the peer watch costs a collective: a tiny all_reduce with the watch running and stopped.

Usage::

    .venv/bin/python benchmarks/bench_peer_watch.py [--pairs 40] [--calls 200]

Two local gloo ranks (``torchrun``'s contract, the drop-in init, every default on). Each pair
times ``--calls`` all_reduces of 4 floats with the pidfd watch running (init started it), then
with it stopped (``peers.stop()``), then started again, the order alternating between
pairs so that drift falls on both sides (each restart is given 0.2 s to read its peers'
identities from the store before the calls are timed: a start-up cost, not a per-call one; the
stopped side sleeps as long). Prints the median time per call of each side and the
median of the per-pair ratios (watch / none): issue 41 asks for no per-call cost.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from _self_on_ranks import run_self

ROOT = Path(__file__).resolve().parents[1]


def _rank(pairs: int, calls: int) -> None:
    import torch

    import distcompat.distributed as dist
    from distcompat import peers

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tensor = torch.ones(4)

    def timed() -> float:
        dist.barrier()
        started = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(tensor)
        return (time.perf_counter() - started) / calls

    timed()  # warm-up: the shared-memory set-up, the first check
    on, off, ratios = [], [], []
    for index in range(pairs):
        took = {}
        for side in ("on", "off") if index % 2 == 0 else ("off", "on"):
            if side == "off":
                peers.stop()
                time.sleep(0.2)
            else:
                peers.start(rank, world)
                time.sleep(0.2)  # it reads its peers' identities first: not the calls' cost
            took[side] = timed()
        on.append(took["on"])
        off.append(took["off"])
        ratios.append(took["on"] / took["off"])
    if rank == 0:
        print(f"watch running  median {statistics.median(on) * 1e6:.1f} us per all_reduce")
        print(f"watch stopped  median {statistics.median(off) * 1e6:.1f} us per all_reduce")
        ratio = statistics.median(ratios)
        print(f"ratio (running / stopped), median of {pairs} pairs: {ratio:.3f}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        _rank(args.pairs, args.calls)
        return
    run_self(__file__, 2, ("--rank", f"--pairs={args.pairs}", f"--calls={args.calls}"))


if __name__ == "__main__":
    main()
