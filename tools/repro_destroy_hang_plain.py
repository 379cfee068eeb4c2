"""The gloo destroy_process_group hang with plain torch: no distcompat in the rank processes.

    .nox/torch_versions-torch_version-2-4-1/bin/python tools/repro_destroy_hang_plain.py 10

Each trial starts 2, then 3 fresh rank processes (plain ``subprocess``, a parent-owned TCPStore on
port 0); each rank runs CYCLES rounds of init_process_group("gloo") under a fresh store prefix,
one all_reduce and destroy_process_group, printing before and after each destroy. A trial still
running after 15 s + 4 s per cycle is killed and counted, with the destroy calls that never
returned. Nothing here imports distcompat, so a hang here is torch's, not ours.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist


def rank_main() -> None:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False)
    for cycle in range(int(os.environ["CYCLES"])):
        prefixed = dist.PrefixStore(f"cycle-{cycle}", store)
        dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=world_size)
        dist.all_reduce(torch.ones(1))
        print(f"before destroy {cycle}", flush=True)
        dist.destroy_process_group()
        print(f"after destroy {cycle}", flush=True)


def trial(world_size: int, cycles: int) -> tuple[bool, int, int]:
    """Run one group of ranks; return (hung, destroy calls entered, destroy calls returned)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**os.environ, "MASTER_PORT": str(store.port), "WORLD_SIZE": str(world_size)}
    env |= {"CYCLES": str(cycles), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "rank"],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world_size)
    ]
    deadline = time.monotonic() + 15 + 4 * cycles
    hung, outputs = False, []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung = True
            proc.kill()
            out, _ = proc.communicate()
        outputs.append(out)
    entered = sum(out.count("before destroy") for out in outputs)
    returned = sum(out.count("after destroy") for out in outputs)
    return hung, entered, returned


def main() -> None:
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    cycles = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    hung_trials = entered = returned = 0
    started = time.monotonic()
    for number in range(trials):
        for world_size in (2, 3):
            hung, calls_in, calls_out = trial(world_size, cycles)
            entered, returned = entered + calls_in, returned + calls_out
            if hung:
                hung_trials += 1
                print(f"trial {number}, {world_size} ranks: hung ({calls_in - calls_out} destroys)")
    print(
        f"torch {torch.__version__}: {hung_trials} of {2 * trials} trials hung; "
        f"{entered - returned} of {entered} destroy_process_group calls never returned; "
        f"{time.monotonic() - started:.0f} s"
    )


if __name__ == "__main__":
    if sys.argv[1:] == ["rank"]:
        rank_main()
    else:
        main()
