"""Rank script for tests/test_peers_watch.py: a peer that ends, every default on.

    python _peer_watch_script.py SCENARIO DIR      # under run_ranks or torchrun, 2 ranks

Rank 0 waits in an all_reduce that rank 1 never joins; rank 1, 1 s in, ends:

* ``kill``: SIGKILLs itself (after writing the time to ``DIR/killed``);
* ``raise``: raises ValueError outside any collective (an unhandled exception);
* ``leave``: destroys its group and exits 0 (rank 0 sleeps instead of waiting, then leaves);
* ``compute``: rank 0 sits in a long matmul (native code) instead of waiting; rank 1 raises
  ValueError once it has begun (``DIR/computing``);
* ``composed``: as ``raise``, and rank 0 first installs its own SIGTERM handler, which prints
  ``rank 0: caught SIGTERM`` and calls the handler it replaced;
* ``loop``: both ranks all_reduce in a loop; rank 1, 1 s in, SIGKILLs itself between two calls
  (tests/test_peers_links.py runs it with the ranks on two "machines").

Rank 0 prints ``rank 0: raised TYPE: MESSAGE`` for the error its all_reduce raised.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from types import FrameType

import torch

import distcompat.distributed as dist


def main() -> None:
    scenario, directory = sys.argv[1], sys.argv[2]
    logging.basicConfig(format="%(message)s")  # the watch's line, as a script's logging shows it
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.all_reduce(torch.ones(1))  # every rank is up, and the watch has its peers
    if scenario == "loop":
        _loop(rank, directory)
        return
    if scenario == "composed" and rank == 0:
        _compose_sigterm()
    computing = os.path.join(directory, "computing")
    if rank == 1:
        time.sleep(1)
        while scenario == "compute" and not os.path.exists(computing):
            time.sleep(0.01)
        if scenario == "kill":
            _kill_self(directory)
        if scenario in ("raise", "compute", "composed"):
            raise ValueError("bad batch 7")
        dist.destroy_process_group()
        return
    if scenario == "leave":
        time.sleep(3)  # rank 1 leaves meanwhile
        dist.destroy_process_group()
        print("rank 0: left", flush=True)
        return
    if scenario == "compute":
        big = torch.ones(8000, 8000, dtype=torch.float64)  # seconds in one native call
        open(computing, "w").close()
        _ = big @ big
        print("rank 0: computed", flush=True)
        return
    try:
        dist.all_reduce(torch.ones(1))
    except Exception as exc:  # the outcome under test
        print(f"rank 0: raised {type(exc).__name__}: {exc}", flush=True)
        sys.exit(3)


def _compose_sigterm() -> None:
    """A program's own SIGTERM handler, installed after init, that calls the one it replaced."""
    replaced = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: FrameType | None) -> None:
        print("rank 0: caught SIGTERM", flush=True)
        if callable(replaced):
            replaced(signum, frame)

    signal.signal(signal.SIGTERM, handler)


def _loop(rank: int, directory: str) -> None:
    started = time.monotonic()
    try:
        while True:
            dist.all_reduce(torch.ones(1))
            if rank == 1 and time.monotonic() - started > 1:
                _kill_self(directory)
    except Exception as exc:  # the outcome under test
        print(f"rank {rank}: raised {type(exc).__name__}: {exc}", flush=True)
        sys.exit(3)


def _kill_self(directory: str) -> None:
    with open(os.path.join(directory, "killed"), "w") as out:
        out.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
