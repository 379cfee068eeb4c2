"""A script whose rank 0 receives from a rank 1 that never sends, run as real rank processes.

``python _p2p_script.py``: default ``init_distributed`` (the test sets ``DISTCOMPAT_WATCHDOG``) with
a group timeout of ``P2P_TIMEOUT`` seconds; one all_reduce together, then rank 0 calls
``recv(src=1)`` while rank 1 reads its shard for a minute. Rank 0 prints ``CALL <time>`` right
before the recv and ``FAILED_AT <time> <error type> peers=<peers> <message's first line>`` when it
raises (then re-raises: the process must end with the error, promptly).
"""

from __future__ import annotations

import logging
import os
import time

import torch

import distcompat

STUCK_S = 60.0


def read_shard(seconds: float) -> None:
    """The user's slow code: a report must point here."""
    time.sleep(seconds)


def main() -> None:
    """Init with defaults, all_reduce once, then receive from a rank that never sends."""
    logging.basicConfig(format="%(created).3f %(name)s %(message)s")
    info = distcompat.init_distributed(
        device="cpu", timeout=float(os.environ.get("P2P_TIMEOUT", "4"))
    )
    distcompat.all_reduce(torch.ones(4))
    if info.rank == 1:
        read_shard(STUCK_S)
        return
    print("CALL", time.time(), flush=True)
    try:
        distcompat.recv(torch.zeros(4), src=1)
    except Exception as exc:
        first = str(exc).splitlines()[0]
        peers = ",".join(map(str, getattr(exc, "peers", ())))
        print("FAILED_AT", time.time(), type(exc).__name__, f"peers={peers}", first, flush=True)
        raise


if __name__ == "__main__":
    main()
