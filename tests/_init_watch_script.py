"""Rank script for tests/test_process_group_init_watch.py: a rank that comes late to init.

    python _init_watch_script.py LATE_RANK LATE_S [tcp://ADDR:PORT]   # under run_ranks/torchrun

Rank ``LATE_RANK`` sleeps ``LATE_S`` seconds before its init (the drop-in
``distcompat.distributed.init_process_group``; with a URL, torch's ``tcp://`` rendezvous);
then every rank all-reduces once and prints ``rank R: sum S``.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import torch

import distcompat.distributed as dist


def main() -> None:
    late_rank, late_s = int(sys.argv[1]), float(sys.argv[2])
    logging.basicConfig(format="%(message)s")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank == late_rank:
        time.sleep(late_s)
    if len(sys.argv) > 3:  # torch's tcp:// rendezvous: rank 0 hosts it, not the parent's store
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        dist.init_process_group("gloo", init_method=sys.argv[3], rank=rank, world_size=world)
    else:
        dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"rank {rank}: sum {total.item():g}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
