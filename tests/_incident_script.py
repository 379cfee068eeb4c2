"""Three hang incidents in one job, run as real rank processes by test_diagnostics_flight_dump.py.

``python _incident_script.py DUMP_DIR``: default ``init_distributed`` (every default on), then,
under a report-only watchdog of ``TIMEOUT`` seconds writing to DUMP_DIR, with the last rank as
the culprit:

1. a late rank: the culprit reads its shard past the report before call #1;
2. a point-to-point wait: rank 0 receives from the culprit, which sends late (the other ranks
   sleep meanwhile: they are not in the exchange);
3. a mismatch at call #3: the culprit broadcasts where the others all_reduce (the mismatch check
   off for it, so the watchdog sees it), under a raising watchdog that ends the job.

Each rank prints ``ENDED <error type> full|pointer`` (whether the error's message holds the
full report or one line that points to it) and leaves with ``os._exit`` (the group holds the
mismatched op).
"""

from __future__ import annotations

import logging
import os
import sys
import time

import torch

import distcompat
from distcompat.collectives import PeerLostError, unchecked
from distcompat.diagnostics import HangError, watchdog

TIMEOUT = 1.0  # watchdog seconds
GRACE = 1.0  # seconds the reporting rank waits for the others' accounts
LATE = TIMEOUT + GRACE + 0.5  # the culprit is late past the report


def read_shard(seconds: float) -> None:
    """The culprit's slow code."""
    time.sleep(seconds)


def main() -> None:
    """Run the three incidents; print how the job ended."""
    dumps = sys.argv[1]
    logging.basicConfig(format="%(created).3f %(name)s %(message)s")
    info = distcompat.init_distributed(device="cpu", timeout=60)
    rank, culprit = info.rank, info.world_size - 1
    t = torch.ones(4)
    ended = "none"
    with watchdog(timeout=TIMEOUT, action="report", dump_dir=dumps, grace=GRACE):
        distcompat.all_reduce(t)  # call #0: everyone
        if rank == culprit:
            read_shard(LATE)  # incident 1: late for call #1
        distcompat.all_reduce(t)
        if rank == 0:
            distcompat.recv(t, src=culprit)  # incident 2: a wait outside any collective
        elif rank == culprit:
            read_shard(LATE)
            distcompat.send(t, dst=0)
        else:
            time.sleep(LATE + 0.5)  # not in the exchange, nor waiting on it
        distcompat.all_reduce(t)  # call #2: everyone again
        with unchecked(), watchdog(timeout=TIMEOUT, dump_dir=dumps, grace=GRACE):
            try:
                if rank == culprit:  # incident 3: call #3 differs
                    distcompat.broadcast(t, src=0)
                else:
                    distcompat.all_reduce(t)
            except (HangError, PeerLostError) as exc:  # a peer may have left first
                # the rank that printed the report carries it; the others one line pointing to it
                told = "full" if "findings:" in str(exc) else "pointer"
                ended = f"{type(exc).__name__} {told}"
    print("ENDED", ended, flush=True)
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
