"""Rank script for tests/test_diagnostics_on_demand.py: a live job, one rank stopped.

    python _dump_script.py DIR      # under torchrun, 3 ranks, every default on

Each rank writes its pid to ``DIR/pid<R>``; after one all_reduce rank 1 stops itself
(SIGSTOP) and the others wait in the next one until the test resumes it (SIGCONT). Then every
rank all-reduces once more and prints ``rank R: sum S``: the dump stopped nothing.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import torch

import distcompat.distributed as dist


def main() -> None:
    directory = sys.argv[1]
    logging.basicConfig(format="%(message)s")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with open(os.path.join(directory, f"pid{rank}"), "w") as out:
        out.write(str(os.getpid()))
    dist.all_reduce(torch.ones(1))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # until the test sends SIGCONT
    total = torch.ones(1)
    dist.all_reduce(total)
    dist.all_reduce(total)
    print(f"rank {rank}: sum {total.item():g}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
