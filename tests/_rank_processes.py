"""Start a script as N real rank processes (torchrun's worker contract), for process-exit tests.

``run_on_ranks`` keeps its ranks alive and catches every error, so how a process *ends* (exit
code, how long teardown takes, what it printed) needs ranks started like a launcher does: one
process per rank joining a gloo group through this process's ``TCPStore``::

    ranks = run_ranks(script, 2, env={"DISTCOMPAT_WATCHDOG": "3"}, timeout=60)
    assert [r.returncode for r in ranks] == [0, 0]
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from distcompat.launch._local_ranks import is_launcher_variable, local_rank_environ

#: How long ranks still running at the deadline get to log their stacks before they are killed
#: (SIGUSR2: distcompat's on-demand dump), so that a hang says where it was.
DUMP_S = 3.0


@dataclass(frozen=True, slots=True)
class Ended:
    """How one rank process ended: exit code (None: killed by us), output, when (time.time())."""

    rank: int
    returncode: int | None
    stdout: str
    stderr: str
    ended: float


def run_ranks(
    script: Path,
    world_size: int,
    *,
    env: Mapping[str, str] | None = None,
    args: Sequence[str] = (),
    timeout: float = 60.0,
    stop_after: int | None = None,
    grace_s: float = 0.5,
    restart: Sequence[int] = (),
    term_after: int | None = None,
) -> list[Ended]:
    """Run ``script`` on ``world_size`` ranks until all exit (or ``timeout``); kill what is left.

    ``stop_after``: once that rank has exited, give the others ``grace_s``, then kill them (a
    peer left stuck on purpose). A rank killed by us has ``returncode`` None; at the deadline
    each is first asked for its stacks (:data:`DUMP_S`), which its stderr then holds.
    ``restart``: ranks whose process a signal ends are started once more with the same
    environment and ``TORCHELASTIC_RESTART_COUNT=1``, as torchrun's agent does with
    ``--max-restarts``; each replacement's :class:`Ended` follows the first ``world_size`` (the
    same ``rank``).
    ``term_after``: the moment that rank's process ends, send SIGTERM to every other rank (a
    launcher's agent at its fastest: torchrun's looks every 0.1 s, then does this).
    """
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    base = {k: v for k, v in os.environ.items() if not is_launcher_variable(k)}
    base.update(env or {})

    def start(rank: int, restarts: int) -> subprocess.Popen[str]:
        environ = dict(base)
        environ.update(local_rank_environ(rank, world_size, store.port))
        environ["TORCHELASTIC_RESTART_COUNT"] = str(restarts)
        return subprocess.Popen(
            [sys.executable, str(script), *args],
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    procs = [(rank, start(rank, 0)) for rank in range(world_size)]
    watched = select.poll()
    pidfd = None if term_after is None else os.pidfd_open(procs[term_after][1].pid)
    if pidfd is not None:
        watched.register(pidfd, select.POLLIN)
    left = set(restart)
    ended: dict[int, float] = {}  # index in procs -> when it ended
    deadline = time.monotonic() + timeout
    stop_at: float | None = None
    while len(ended) < len(procs) and time.monotonic() < deadline:
        for index, (rank, proc) in enumerate(list(procs)):
            if index not in ended and proc.poll() is not None:
                ended[index] = time.time()
                if rank == stop_after:
                    stop_at = time.monotonic() + grace_s
                if pidfd is not None and index == term_after:
                    for other, (_, peer) in enumerate(procs):
                        if other not in ended and peer.poll() is None:
                            peer.send_signal(signal.SIGTERM)
                    watched.unregister(pidfd)
                    os.close(pidfd)
                    pidfd = None
                if rank in left and proc.returncode < 0:
                    left.discard(rank)
                    procs.append((rank, start(rank, 1)))
        if stop_at is not None and time.monotonic() > stop_at:
            break
        watched.poll(50)  # a pidfd wakes it the moment ``term_after`` ends; else a pause
    if time.monotonic() >= deadline:  # hung (not a peer left stuck on purpose): where?
        for index, (_, proc) in enumerate(procs):
            if index not in ended:
                proc.send_signal(signal.SIGUSR2)
        time.sleep(DUMP_S)
    results = []
    for index, (rank, proc) in enumerate(procs):
        killed = index not in ended
        if killed:
            proc.kill()
        out, err = proc.communicate(timeout=30)
        results.append(
            Ended(
                rank, None if killed else proc.returncode, out, err, ended.get(index, time.time())
            )
        )
    return results


def end_stopped_rank(pid: int, record: str, survivors: int) -> None:
    """Kill the SIGSTOPped rank ``pid`` once ranks ``0..survivors-1`` wrote ``<record>.rank<r>``
    (at most 10 s on): run on a surviving rank, so that ``run_on_ranks`` need not wait out its
    timeout for a rank that never answers."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(
        os.path.exists(f"{record}.rank{r}") for r in range(survivors)
    ):
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
