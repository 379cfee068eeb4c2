"""Start ``distcompat bench`` on N local ranks when no launcher started it, and wait for them.

The same worker contract as the demo's launcher and the test harness
(:func:`distcompat.launch._local_ranks.local_rank_environ`): the parent holds a ``TCPStore`` on a
port the OS picks, and each child is a rank torchrun could have started::

    code = run_local_ranks(["--quick"], nproc=2)   # python -m distcompat bench --quick, twice

When a rank fails, the others get a few seconds to notice the lost peer and are then stopped;
Ctrl-C or SIGTERM in the parent stops every child.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence

import torch.distributed as dist

from distcompat.launch._local_ranks import is_launcher_variable, local_rank_environ

__all__ = ["SPAWNED_VAR", "run_local_ranks"]

#: Set in each child, so its header can say who started the ranks.
SPAWNED_VAR = "DISTCOMPAT_BENCH_LOCAL_RANKS"
_FAILURE_GRACE_S = 5.0
_TERMINATE_GRACE_S = 5.0
_POLL_S = 0.05


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for proc in processes:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for proc in processes:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait(processes: list[subprocess.Popen[bytes]]) -> int:
    """Wait for every child; after the first failure give the rest a grace period. Exit code."""
    failed_at: float | None = None
    first_failure = 0
    while True:
        codes = [proc.poll() for proc in processes]
        for code in codes:
            if code not in (None, 0) and failed_at is None:
                failed_at, first_failure = time.monotonic(), code
        if all(code is not None for code in codes):
            return first_failure
        if failed_at is not None and time.monotonic() - failed_at > _FAILURE_GRACE_S:
            return first_failure  # the others wait for a peer that is gone; _stop ends them
        time.sleep(_POLL_S)


def run_local_ranks(argv: Sequence[str], nproc: int) -> int:
    """Run ``python -m distcompat bench ARGV`` as ``nproc`` local ranks; return the exit code.

    0 when every rank succeeded, else the first failing rank's code (negative: a signal).

    Example:
        >>> run_local_ranks(["--quick"], nproc=2)  # doctest: +SKIP
        0
    """
    if nproc < 1:
        raise ValueError(f"--nproc={nproc} must be at least 1")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    command = [sys.executable, "-m", "distcompat", "bench", *argv]
    inherited = {k: v for k, v in os.environ.items() if not is_launcher_variable(k)}
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(nproc):
            environ = inherited | local_rank_environ(rank, nproc, store.port)
            environ[SPAWNED_VAR] = str(nproc)
            processes.append(subprocess.Popen(command, env=environ))
        return _wait(processes)
    except KeyboardInterrupt:
        return 130
    finally:
        _stop(processes)
