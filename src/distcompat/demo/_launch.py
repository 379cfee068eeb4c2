"""Start the demo's ranks as local processes, watch them, and leave none behind.

The two lines the CLI writes when no launcher started it::

    outcome = launch_ranks(config, nproc=2)     # runs `python -m distcompat demo ...` per rank
    print(outcome.message); sys.exit(outcome.exit_code)

The parent owns a ``TCPStore`` on port 0 (the OS picks a free port, so two demos never collide)
and gives each child torchrun's worker contract (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` of that store, ``TORCHELASTIC_USE_AGENT_STORE=True``), the same
contract as the test harness in :mod:`distcompat.testing`. So a child is exactly a rank that
torchrun could have started.

Failure handling: each child writes ``rank-R.json`` into a status folder (exit code, error and
traceback) just before it exits. When a rank fails, the others get a few seconds to notice the
lost peer, then are terminated; the first rank that failed is reported with its traceback. On
Ctrl-C or SIGTERM every child is terminated, then killed if it lingers, and on Linux a child also
dies with its parent (``PR_SET_PDEATHSIG``), so no rank outlives the demo.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import Any

import torch.distributed as dist

from distcompat.checkpoint import atomic_write_json
from distcompat.demo._config import DemoConfig
from distcompat.demo._restarts import RESTART_COUNT_VAR
from distcompat.demo._train import EXIT_CHECK_FAILED
from distcompat.launch._local_ranks import is_launcher_variable, local_rank_environ

__all__ = [
    "FINISHED",
    "PARENT_PID_VAR",
    "STATUS_DIR_VAR",
    "LaunchOutcome",
    "bind_to_parent",
    "launch_ranks",
    "write_status",
]

#: Set in each child: the launcher's pid (the child dies with it) and where it reports.
PARENT_PID_VAR = "DISTCOMPAT_DEMO_PARENT_PID"
STATUS_DIR_VAR = "DISTCOMPAT_DEMO_STATUS_DIR"
#: ``LaunchOutcome.message`` of a launch where every rank finished and exited by itself.
FINISHED = "ranks finished"
#: After one rank fails, how long the others get to notice the lost peer and report.
_FAILURE_GRACE_S = 5.0
#: After every rank reported, how long a process may take to exit before it is killed (torch
#: 2.4's gloo teardown can hang in destroy_process_group: tools/repro_destroy_hang.py).
_EXIT_GRACE_S = 15.0
#: How long a terminated child gets before SIGKILL.
_TERMINATE_GRACE_S = 5.0
_POLL_S = 0.05
_PR_SET_PDEATHSIG = 1
#: The signals whose exit status (128 + number) a rank reports after a stop on purpose.
_SIGNALS = {int(s): s.name for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchOutcome:
    """How a launch ended: the exit code for the shell and a message for the user.

    ``failed_rank`` is the first rank that failed (None when none did); ``exit_code`` is 0, the
    ranks' common code (3: a check failed), 1 when a rank failed, 130 when interrupted.
    ``failure_seen_at`` (wall time) is when the watch loop saw the first rank fail, and
    ``stopped_at`` when every rank of the launch had exited.
    """

    exit_code: int
    failed_rank: int | None
    message: str
    failure_seen_at: float | None = None
    stopped_at: float | None = None


def bind_to_parent() -> None:
    """In a child the demo started: die with the launcher (Linux), or exit if it is gone already.

    A no-op in a process the demo did not start.

    Example:
        >>> bind_to_parent()   # not a demo child: nothing happens
    """
    parent = os.environ.get(PARENT_PID_VAR)
    if parent is None:
        return
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(parent):  # the launcher died before prctl took effect
        os._exit(1)


def write_status(rank: int, exit_code: int, error: BaseException | None, trace: str) -> bool:
    """In a child the demo started, record how this rank ended; return False elsewhere.

    Example:
        >>> write_status(0, 0, None, "")   # not a demo child
        False
    """
    folder = os.environ.get(STATUS_DIR_VAR)
    if folder is None:
        return False
    summary = None if error is None else f"{type(error).__module__}.{type(error).__name__}: {error}"
    status = {"rank": rank, "exit_code": exit_code, "error": summary, "traceback": trace}
    atomic_write_json(Path(folder, f"rank-{rank}.json"), status)
    return True


def _child_environ(
    rank: int, nproc: int, port: int, status_dir: Path, attempt: int
) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not is_launcher_variable(k)}
    environ.update(local_rank_environ(rank, nproc, port, omp_threads="1"))
    environ.update({PARENT_PID_VAR: str(os.getpid()), STATUS_DIR_VAR: str(status_dir)})
    environ[RESTART_COUNT_VAR] = str(attempt)  # as torchrun's agent counts its restarts
    return environ


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """Turn SIGTERM into SystemExit while ranks run, so the cleanup in ``finally`` runs."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    try:
        previous: Any = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: signals cannot be handled here
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop(processes: list[subprocess.Popen[bytes]]) -> list[int]:
    """Terminate, then kill, every child still running; return the ranks that had to be killed."""
    killed = []
    for proc in processes:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for rank, proc in enumerate(processes):
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            killed.append(rank)
    return killed


def _read_status(status_dir: Path, rank: int) -> dict[str, Any] | None:
    try:
        status: dict[str, Any] = json.loads((status_dir / f"rank-{rank}.json").read_text())
    except (OSError, ValueError):
        return None
    return status


def _describe_failure(
    status_dir: Path, order: list[int], codes: list[int], nproc: int
) -> LaunchOutcome:
    first = order[0]
    status = _read_status(status_dir, first)
    code = codes[first]
    if status is not None and status.get("error"):
        what = f"rank {first} of {nproc} failed: {status['error']}"
        detail = status.get("traceback") or ""
    elif code is not None and code < 0:
        what = f"rank {first} of {nproc} was killed by signal {-code}"
        detail = ""
    elif code is not None and code > 128 and code - 128 in _SIGNALS:
        what = (
            f"rank {first} of {nproc} exited with code {code}, as {_SIGNALS[code - 128]} ends a "
            "process: the ranks stopped on purpose after saving"
        )
        detail = ""
    else:
        what = f"rank {first} of {nproc} exited with code {code} without reporting an error"
        detail = ""
    others = [
        f"  rank {r}: {(_read_status(status_dir, r) or {}).get('error') or f'exit code {codes[r]}'}"
        for r in order[1:]
    ]
    lines = [what]
    if detail:
        lines += [f"--- traceback of rank {first} ---", detail.rstrip()]
    if others:
        lines += ["other ranks that failed (after it, often because it was gone):", *others]
    return LaunchOutcome(exit_code=1, failed_rank=first, message="\n".join(lines))


def launch_ranks(config: DemoConfig, nproc: int, *, attempt: int = 0) -> LaunchOutcome:
    """Run the demo on ``nproc`` local ranks (child processes) and wait for all of them.

    ``attempt`` is passed on as ``TORCHELASTIC_RESTART_COUNT``: 0 the first time, N on the
    N-th restart, when the ranks resume from the newest committed checkpoint.

    Example:
        >>> launch_ranks(DemoConfig(out=Path("demo-out")), nproc=2).exit_code  # doctest: +SKIP
        0
    """
    status_dir = config.out / ".ranks"
    shutil.rmtree(status_dir, ignore_errors=True)
    status_dir.mkdir(parents=True)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    per_rank = replace(config, nproc=nproc, sweep=False)  # a rank never sweeps
    command = [sys.executable, "-m", "distcompat", "demo", *per_rank.to_argv()]
    processes: list[subprocess.Popen[bytes]] = []
    order: list[int] = []  # ranks in the order they were seen failing
    # --in-place: the rank --kill names is SIGKILLed on purpose and the others go on without it
    target = config.kill_target if config.in_place and attempt == 0 else None
    spared = {target[0]} if target is not None else set()
    with _sigterm_as_exit():
        try:
            for rank in range(nproc):
                env = _child_environ(rank, nproc, store.port, status_dir, attempt)
                processes.append(subprocess.Popen(command, env=env))
            failure_seen_at = _watch(processes, status_dir, order, spared)
        except KeyboardInterrupt:
            _stop(processes)
            return LaunchOutcome(exit_code=130, failed_rank=None, message="interrupted: stopped")
        finally:
            hung = _stop(processes)
    stopped_at = time.time()
    statuses = [_read_status(status_dir, r) for r in range(nproc)]
    # A rank killed after reporting (hung on teardown) keeps the exit code it reported.
    codes = [
        int(s["exit_code"]) if s is not None else p.returncode
        for s, p in zip(statuses, processes, strict=True)
    ]
    lost = {r for r in spared if processes[r].returncode == -signal.SIGKILL}
    if order or any(s is None for r, s in enumerate(statuses) if r not in lost):
        order += [r for r, s in enumerate(statuses) if s is None and r not in {*order, *lost}]
        failure = _describe_failure(status_dir, order, codes, nproc)
        return replace(failure, failure_seen_at=failure_seen_at, stopped_at=stopped_at)
    note = f" (rank(s) {hung} reported but hung on exit and were killed)" if hung else ""
    if lost:
        note += f"; rank(s) {sorted(lost)} killed as planned, the others went on in place"
    shutil.rmtree(status_dir, ignore_errors=True)
    exit_code = max(code for r, code in enumerate(codes) if r not in lost)
    return LaunchOutcome(exit_code=exit_code, failed_rank=None, message=FINISHED + note)


def _watch(
    processes: list[subprocess.Popen[bytes]],
    status_dir: Path,
    order: list[int],
    spared: set[int],
) -> float | None:
    """Poll until every child exited; record failing ranks in ``order``; give up on stragglers.

    A rank in ``spared`` that is SIGKILLed (``--in-place``'s planned kill) is no failure: the
    others go on without it. Returns when (wall time) the first failure was seen, or None.
    """
    nproc = len(processes)
    failed_at: float | None = None
    seen_at: float | None = None
    reported_at: float | None = None
    while True:
        codes = [p.poll() for p in processes]
        now = time.monotonic()
        for rank, code in enumerate(codes):
            if rank in spared and code == -signal.SIGKILL:
                continue
            if code not in (None, 0, EXIT_CHECK_FAILED) and rank not in order:
                order.append(rank)
                failed_at = failed_at or now
                seen_at = seen_at or time.time()
        if all(code is not None for code in codes):
            return seen_at
        if failed_at is not None and now - failed_at > _FAILURE_GRACE_S:
            return seen_at  # the rest are stuck waiting for a peer that is gone
        gone = {r for r in spared if codes[r] == -signal.SIGKILL}
        if all(_read_status(status_dir, r) is not None for r in range(nproc) if r not in gone):
            reported_at = reported_at or now
            if now - reported_at > _EXIT_GRACE_S:
                return seen_at  # every rank is done; one hangs on teardown
        time.sleep(_POLL_S)
