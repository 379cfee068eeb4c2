"""A training-script stand-in run as real rank processes by test_diagnostics_defaults.py.

Modes (``python _hang_script.py MODE ARG``):

* ``late SECONDS``: default init (no ``watchdog=``); rank 1 spends SECONDS in ``read_shard``
  before the second all_reduce; both print the result and end normally.
* ``stuck KIND``: ``watchdog=2`` (raising); rank 1 never reaches the second all_reduce: it spins
  in Python (``busy``), sleeps (``sleep``) or sits in native code holding the GIL (``native``);
  rank 0 runs the all_reduce in ``try: ... finally: destroy_distributed()``, as scripts do.
* ``timeout KIND``: the same with the default (report-only) watchdog and a 4 s group timeout:
  the group timeout ends the wait with CollectiveTimeoutError.
* ``atexit KIND``: like ``stuck``, but the cleanup is torch's own ``destroy_process_group``,
  registered with atexit: the wait happens in interpreter teardown.

Rank 0 prints ``FAILED_AT <time.time()>`` when the collective raises.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import sys
import time

import torch
import torch.distributed as dist

import distcompat

STUCK_S = 60.0


def read_shard(seconds: float) -> None:
    """The user's slow code: the report must point here."""
    time.sleep(seconds)


def spin_forever(kind: str) -> None:
    """Never reach the next collective: busy in Python, asleep, or in native code with the GIL."""
    end = time.monotonic() + STUCK_S
    if kind == "busy":
        while time.monotonic() < end:
            sum(range(1000))
    elif kind == "sleep":
        time.sleep(STUCK_S)
    else:
        ctypes.PyDLL(None).sleep(int(STUCK_S))  # libc sleep(3), GIL held throughout


def main() -> None:
    """Run the mode given on the command line."""
    mode, arg = sys.argv[1], sys.argv[2]
    logging.basicConfig(format="%(created).3f %(name)s %(message)s")
    if mode == "late":
        info = distcompat.init_distributed(device="cpu", timeout=60)
    elif mode == "timeout":
        info = distcompat.init_distributed(device="cpu", timeout=4)
    else:
        info = distcompat.init_distributed(device="cpu", timeout=60, watchdog=2)
    if mode == "atexit":
        atexit.register(dist.destroy_process_group)
    print("REASON", info.reason.replace("\n", " | "), flush=True)
    t = torch.ones(4)
    distcompat.all_reduce(t)
    if mode == "late":
        if info.rank == 1:
            read_shard(float(arg))
        print("CALL", time.time(), flush=True)
        distcompat.all_reduce(t)
        print("RESULT", t.tolist(), flush=True)
        distcompat.destroy_distributed()
        return
    if info.rank == 1:
        spin_forever(arg)
        return
    try:
        distcompat.all_reduce(t)
    except Exception as exc:
        print("FAILED_AT", time.time(), type(exc).__name__, flush=True)
        raise
    finally:
        if mode != "atexit":
            distcompat.destroy_distributed()


if __name__ == "__main__":
    main()
