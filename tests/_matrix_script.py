"""A training-script stand-in for the defaults matrix (test_diagnostics_matrix.py), run as ranks.

``python _matrix_script.py SCENARIO``: default ``init_distributed`` (no ``watchdog=``; the test
sets ``DISTCOMPAT_WATCHDOG``, ``DISTCOMPAT_SHM`` and ``DISTCOMPAT_MISMATCH_CHECK``), a group
timeout of ``MATRIX_TIMEOUT`` seconds; the last rank is the culprit. Scenarios:

* ``recover``: the culprit is late (``MATRIX_LATE`` s, in ``read_shard``) at the first
  collective, then at a call with a new signature, then at a repeated one; the job completes.
* ``never``: the culprit never reaches the first collective (it reads its shard for a minute).
* ``killed`` / ``stopped``: after one collective together, the culprit SIGKILLs / SIGSTOPs
  itself before the next.
* ``mismatch-first`` / ``mismatch-later``: the culprit calls ``broadcast`` where the others call
  ``all_reduce``, at the first call or after one call together.
* ``raising-first``: the first call is made inside ``distcompat.watchdog(timeout=3)``; the
  culprit never reaches it.

Each rank prints ``CALL <label> <time>`` right before the call the scenario is about,
``RESULT <label> <value>`` when it returns, and ``FAILED_AT <time> <error type> <message's first
line>`` when it raises (then re-raises: the process must end with the error, promptly).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import torch

import distcompat

STUCK_S = 60.0


def read_shard(seconds: float) -> None:
    """The user's slow code: a report must point here."""
    time.sleep(seconds)


def _call(label: str, tensor: torch.Tensor, *, broadcast: bool = False) -> None:
    print("CALL", label, time.time(), flush=True)
    if broadcast:
        distcompat.broadcast(tensor, src=0)
    else:
        distcompat.all_reduce(tensor)
    print("RESULT", label, tensor[0].item(), flush=True)


def run(scenario: str, rank: int, culprit: int) -> None:
    """Run ``scenario`` on this rank."""
    late = float(os.environ.get("MATRIX_LATE", "5"))
    if scenario == "recover":
        if rank == culprit:
            read_shard(late)
        _call("first", torch.ones(4))
        if rank == culprit:
            read_shard(late)
        _call("new", torch.ones(6))  # a signature the group has not agreed on yet
        if rank == culprit:
            read_shard(late)
        _call("repeat", torch.ones(6))  # the same signature again
    elif scenario == "raising-first":
        if rank == culprit:
            read_shard(STUCK_S)
        with distcompat.watchdog(timeout=3):
            _call("first", torch.ones(4))
    elif scenario == "never":
        if rank == culprit:
            read_shard(STUCK_S)
        _call("first", torch.ones(4))
    elif scenario in ("killed", "stopped"):
        _call("warm", torch.ones(4))
        if rank == culprit:
            os.kill(os.getpid(), signal.SIGKILL if scenario == "killed" else signal.SIGSTOP)
        _call("after", torch.ones(4))
    elif scenario in ("mismatch-first", "mismatch-later"):
        if scenario == "mismatch-later":
            _call("warm", torch.ones(4))
        _call("mismatch", torch.ones(4), broadcast=rank == culprit)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")


def main() -> None:
    """Init with defaults, run the scenario given, report how it ended."""
    logging.basicConfig(format="%(created).3f %(name)s %(message)s")
    info = distcompat.init_distributed(
        device="cpu", timeout=float(os.environ.get("MATRIX_TIMEOUT", "10"))
    )
    try:
        run(sys.argv[1], info.rank, info.world_size - 1)
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        peer = getattr(exc, "peer", None)
        print("FAILED_AT", time.time(), type(exc).__name__, f"peer={peer}", first, flush=True)
        raise
    distcompat.destroy_distributed()


if __name__ == "__main__":
    main()
