"""Child processes with a deadline: a hung launcher is killed and reported, never waited on forever.

    job = start(["mpiexec.mpich", "-n", "3", ...], env=env, log=work / "mpich.log")
    finished = wait(job, timeout=120)      # Finished(returncode=None, ...) when it hung
    finished.timed_out, finished.tail()

Every child runs in its own session (process group), so stopping it also stops what it started
(ranks, MPI proxies, torchrun workers); it gets SIGTERM first, then SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

GRACE_S = 5.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """A started child: its process and where its output goes."""

    process: subprocess.Popen[bytes]
    log: Path
    started: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Finished:
    """How a child ended; ``returncode`` is None when it was killed at its deadline."""

    returncode: int | None
    log: Path
    seconds: float

    @property
    def timed_out(self) -> bool:
        """True when the child did not end by itself before its deadline."""
        return self.returncode is None

    def tail(self, lines: int = 4) -> str:
        """The last ``lines`` non-empty lines of its output, joined by `` | ``."""
        try:
            text = self.log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no output)"
        kept = [line.strip() for line in text.splitlines() if line.strip()]
        return " | ".join(kept[-lines:]) or "(no output)"


def start(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    log: Path,
    cwd: Path | None = None,
    user: str | None = None,
) -> Job:
    """Start ``argv`` in a new session with stdout and stderr going to ``log`` (as ``user``)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as sink:
        process = subprocess.Popen(
            list(argv),
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            user=user,
            group=user,
        )
    return Job(process=process, log=log, started=time.monotonic())


def stop(job: Job, grace: float = GRACE_S) -> None:
    """SIGTERM the child's process group, then SIGKILL whatever is left after ``grace`` s."""
    for sig, wait_s in ((signal.SIGTERM, grace), (signal.SIGKILL, grace)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.process.pid, sig)
        try:
            job.process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        if not _group_alive(job.process.pid):
            return


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _finish(job: Job, deadline: float) -> Finished:
    try:
        code: int | None = job.process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        code = None
    finally:  # also on SystemExit from a signal: ends children that outlived the leader, too
        stop(job)
    return Finished(returncode=code, log=job.log, seconds=time.monotonic() - job.started)


def wait(job: Job, timeout: float) -> Finished:
    """Wait until the child exits or ``timeout`` s have passed since it started; then stop it."""
    return _finish(job, job.started + timeout)


def run(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    log: Path,
    timeout: float,
    cwd: Path | None = None,
) -> Finished:
    """Start ``argv`` and wait for it, bounded by ``timeout`` seconds."""
    return wait(start(argv, env=env, log=log, cwd=cwd), timeout)


def wait_all(jobs: Sequence[Job], timeout: float) -> list[Finished]:
    """Wait for several children under one deadline (``timeout`` s from now); stop the late ones."""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and any(j.process.poll() is None for j in jobs):
            time.sleep(0.1)
    except BaseException:  # interrupted (a signal): leave nothing running behind
        for job in jobs:
            stop(job)
        raise
    return [_finish(j, deadline) for j in jobs]
