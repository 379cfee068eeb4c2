"""The program of the watch cases (``watched.py``): a late rank at init, or a rank that is killed.

    mpirun -np 2 python watch_probe.py late  --out DIR    # rank 1 sleeps 4 s before its init
    mpirun -np 2 python watch_probe.py kill  --out DIR    # rank 1 SIGKILLs itself in a wait
    mpirun -np 2 python watch_probe.py raise --out DIR    # rank 1 dies of a ValueError
    mpirun -np 3 python watch_probe.py stop  --out DIR    # rank 1 SIGSTOPs itself in a wait

Every rank uses the drop-in ``distcompat.distributed.init_process_group("gloo")`` with every
default on (``DISTCOMPAT_WATCHDOG=2`` set by the case); the rank comes from whatever launcher
started it (distcompat's ``LaunchEnv``). ``kill`` writes the time of the kill to ``DIR/killed``
first; the survivor's lines go to the launcher's output, which the case reads.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time
from pathlib import Path

import torch

import distcompat.distributed as dist
from distcompat.launch import LaunchEnv


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("late", "kill", "raise", "stop"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    logging.basicConfig(format="%(message)s")
    rank = LaunchEnv.from_environ().rank
    if args.mode == "late" and rank == 1:
        time.sleep(4)
    dist.init_process_group("gloo")
    (args.out / f"pid{rank}").write_text(str(os.getpid()), encoding="utf-8")
    total = torch.ones(1)
    dist.all_reduce(total)
    if args.mode == "stop":
        if rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)  # until the case sends SIGCONT
        dist.all_reduce(total)
    if args.mode in ("kill", "raise"):
        if rank == 1:
            time.sleep(1)
            (args.out / "killed").write_text(repr(time.time()), encoding="utf-8")
            if args.mode == "raise":
                raise ValueError("bad batch 7")
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(total)  # rank 1 never comes: the watch names it first
    print(f"rank {rank}: sum {total.item():g}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
