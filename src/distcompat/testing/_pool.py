"""The parent side of the test harness: a warm pool of rank processes per (world size, backend).

The parent owns a ``TCPStore`` on port 0 (the OS picks a free port, so parallel test runs never
race for one) and starts one spawn-context process per rank with torchrun's worker contract
(``RANK``, ``WORLD_SIZE``, ``MASTER_PORT`` of the parent's store, ``TORCHELASTIC_USE_AGENT_STORE``).
Workers stay up between calls, so a second call costs a message round trip instead of a spawn,
an ``import torch`` and a rendezvous.

A pool that may be inconsistent (a rank timed out, died, or is stuck in a collective after a
peer raised) is killed and rebuilt on the next call; no process outlives a failed call.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import multiprocessing as mp
import os
import pickle
import shutil
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch.distributed as dist

from distcompat.launch._local_ranks import is_launcher_variable, local_rank_environ
from distcompat.testing._startup import StderrTail, check_main_guard, startup_hint
from distcompat.testing._worker import STACK_SIGNAL, worker_main

__all__ = ["RankFailedError", "RankTimeoutError", "WorkerPool", "get_pool", "shutdown_pools"]

#: After one rank raises, how long the others get to report before the pool is declared stuck.
_ERROR_GRACE_S = 2.0
#: How long a signalled rank gets to write its stacks before it is killed.
_STACK_DUMP_S = 0.5
#: Warm rank processes kept at once, over all pools (each holds torch: about 230 MB resident);
#: the least recently used pools are closed beyond this. Ten keeps world sizes 1 to 4 warm
#: together: with two pools at most, a suite that alternates three world sizes restarted a pool
#: on most calls (47 pool starts in this project's suite, about 3 s each on 2 cores).
_MAX_WARM_RANKS = 10


class RankFailedError(RuntimeError):
    """A rank raised (or died) inside :func:`~distcompat.testing.run_on_ranks`.

    ``rank`` is the lowest failing rank, ``failures`` maps every failing rank to its error summary,
    ``remote_traceback`` is the lowest failing rank's traceback text, and ``exception`` is its
    exception object when it could be sent across processes (also chained as ``__cause__``).
    """

    def __init__(
        self,
        rank: int,
        failures: dict[int, str],
        remote_traceback: str,
        exception: BaseException | None,
    ) -> None:
        others = {r: s for r, s in failures.items() if r != rank}
        also = "".join(f"\n  rank {r}: {s}" for r, s in sorted(others.items()))
        super().__init__(
            f"rank {rank} raised {failures[rank]}"
            + (f"\nother ranks also failed:{also}" if also else "")
            + f"\n\n--- remote traceback (rank {rank}) ---\n{remote_traceback}"
        )
        self.rank = rank
        self.failures = failures
        self.remote_traceback = remote_traceback
        self.exception = exception


class RankTimeoutError(TimeoutError):
    """Ranks did not finish within the timeout; they were killed after dumping their stacks.

    ``ranks`` lists the ranks that never answered; ``stacks`` maps each to its Python stacks.
    """

    def __init__(self, ranks: list[int], timeout: float, stacks: dict[int, str]) -> None:
        shown = "".join(
            f"\n\n--- rank {r} stacks ---\n{stacks.get(r) or '(no stacks written)'}" for r in ranks
        )
        super().__init__(
            f"rank(s) {', '.join(map(str, ranks))} did not finish within {timeout:g}s; "
            f"all ranks of the pool were killed{shown}"
        )
        self.ranks = ranks
        self.timeout = timeout
        self.stacks = stacks


@dataclass(slots=True)
class _Rank:
    rank: int
    process: BaseProcess
    conn: Connection
    stack_path: Path
    stderr: StderrTail
    started: bool = False  # the process said "ready": it got past spawn's re-import of main


class WorkerPool:
    """``world_size`` warm rank processes sharing one gloo (or other backend) group."""

    def __init__(self, world_size: int, backend: str, group_timeout_s: float) -> None:
        self.world_size = world_size
        self.backend = backend
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self._dir = Path(tempfile.mkdtemp(prefix="distcompat-ranks-"))
        self._task_ids = itertools.count()
        self._reset_group = False
        self.ranks: list[_Rank] = []
        ctx = mp.get_context("spawn")
        # spawn's first start launches multiprocessing's resource tracker, which would inherit
        # fd 2 while it points at a rank's stderr pipe: that pipe would never end, and reading
        # its tail (closing that pool, or that rank's death) waited its full second
        resource_tracker.ensure_running()
        saved = {k: os.environ.pop(k) for k in list(os.environ) if is_launcher_variable(k)}
        self._stderr = os.dup(2)  # where the ranks' stderr is copied to, as it arrives
        try:
            for rank in range(world_size):
                ours, theirs = ctx.Pipe()
                stack_path = self._dir / f"rank{rank}.stacks"
                process = ctx.Process(
                    target=worker_main,
                    args=(
                        theirs,
                        local_rank_environ(rank, world_size, self._store.port),
                        backend,
                        group_timeout_s,
                        str(stack_path),
                    ),
                    name=f"distcompat-rank{rank}",
                    daemon=True,
                )
                tail = _start_capturing_stderr(process, self._stderr)
                theirs.close()
                self.ranks.append(_Rank(rank, process, ours, stack_path, tail))
        except BaseException:
            self.close(kill=True)
            raise
        finally:
            os.environ.update(saved)

    @property
    def pids(self) -> list[int]:
        """Process ids of the ranks, in rank order."""
        return [r.process.pid or -1 for r in self.ranks]

    def run(
        self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the values in rank order."""
        task_id = next(self._task_ids)
        try:
            message = pickle.dumps(("run", task_id, fn, args, kwargs, self._reset_group))
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            what = "its arguments are" if _picklable(fn) else f"the function {fn!r} is"
            raise TypeError(
                f"run_on_ranks needs a picklable function and arguments, and {what} not: {exc}. "
                "Pass a function defined at module level (not a lambda, a closure or a nested "
                "function), and arguments pickle can copy"
            ) from exc
        self._reset_group = False
        for rank in self.ranks:
            with contextlib.suppress(OSError):  # a dead rank shows up as EOF below
                rank.conn.send_bytes(message)
        values, failures, pending = self._collect(task_id, timeout)
        if failures:
            self._raise_failure(failures, pending)
        if pending:
            self._raise_timeout(sorted(pending), timeout)
        return [values[r] for r in range(self.world_size)]

    def _collect(
        self, task_id: int, timeout: float
    ) -> tuple[dict[int, Any], dict[int, tuple[Any, ...]], set[int]]:
        deadline = time.monotonic() + timeout
        values: dict[int, Any] = {}
        failures: dict[int, tuple[Any, ...]] = {}
        pending = set(range(self.world_size))
        first_failure = 0.0
        while pending:
            limit = deadline if not failures else min(deadline, first_failure + _ERROR_GRACE_S)
            left = limit - time.monotonic()
            if left <= 0:
                break
            by_conn = {self.ranks[r].conn: r for r in pending}
            for conn in wait(list(by_conn), timeout=left):
                rank = by_conn[conn]  # type: ignore[index]
                reply = self._receive(rank)
                if reply[0] == "ready":
                    self.ranks[rank].started = True
                    continue
                pending.discard(rank)
                if reply[0] == "ok" and reply[1] == task_id:
                    values[rank] = reply[2]
                else:
                    if not failures:
                        first_failure = time.monotonic()
                    failures[rank] = reply
        return values, failures, pending

    def _receive(self, rank: int) -> tuple[Any, ...]:
        slot = self.ranks[rank]
        try:
            return pickle.loads(slot.conn.recv_bytes())  # type: ignore[no-any-return]
        except (EOFError, OSError):
            slot.process.join(timeout=1.0)
            code = slot.process.exitcode
            stderr = slot.stderr.text()
            if slot.started:
                summary = f"the rank process died (exit code {code})"
            else:
                summary = (
                    f"the rank process died while starting (exit code {code}), before it could "
                    f"run anything: {startup_hint(stderr)}"
                )
            shown = "(no traceback: the process ended)\n"
            if stderr.strip():
                shown = f"(the process ended; its stderr ends with:)\n{stderr}"
            return ("err", -1, None, summary, shown)
        except Exception as exc:  # the value arrived but cannot be rebuilt here
            return ("err", -1, None, f"its result could not be unpickled: {exc!r}", "")

    def _raise_failure(self, failures: dict[int, tuple[Any, ...]], pending: set[int]) -> None:
        if pending or not self.alive:
            self.close(kill=True)  # someone is stuck in a collective, or gone: the group is broken
        else:
            self._reset_group = True  # all answered: keep the processes, rebuild the group
        rank = min(failures)
        _, _, blob, _, remote_tb = failures[rank]
        exception: BaseException | None = None
        if blob is not None:
            with contextlib.suppress(Exception):
                exception = pickle.loads(blob)
        summaries = {r: reply[3] for r, reply in failures.items()}
        stuck = "".join(f"\n  rank {r}: still running after a peer failed" for r in sorted(pending))
        error = RankFailedError(rank, summaries, remote_tb + stuck, exception)
        raise error from exception

    def _raise_timeout(self, pending: list[int], timeout: float) -> None:
        for rank in pending:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.ranks[rank].process.pid or -1, STACK_SIGNAL)
        time.sleep(_STACK_DUMP_S)
        stacks = {}
        for rank in pending:
            with contextlib.suppress(OSError):
                stacks[rank] = self.ranks[rank].stack_path.read_text()
        self.close(kill=True)
        raise RankTimeoutError(pending, timeout, stacks)

    @property
    def alive(self) -> bool:
        """True while every rank process is running."""
        return bool(self.ranks) and all(r.process.is_alive() for r in self.ranks)

    def close(self, *, kill: bool = False) -> None:
        """Stop the ranks (politely unless ``kill``), wait for them, and remove their files."""
        if not kill:
            for rank in self.ranks:
                with contextlib.suppress(OSError):
                    rank.conn.send_bytes(pickle.dumps(("stop",)))
            for rank in self.ranks:
                rank.process.join(timeout=5.0)
        for rank in self.ranks:
            if rank.process.is_alive():
                rank.process.kill()
            rank.process.join(timeout=5.0)
            rank.conn.close()
            rank.stderr.text()  # let the copy reach the pipe's end before its target closes
        self.ranks = []
        shutil.rmtree(self._dir, ignore_errors=True)
        if self._stderr >= 0:
            os.close(self._stderr)
            self._stderr = -1


def _start_capturing_stderr(process: BaseProcess, copy_to: int) -> StderrTail:
    """Start ``process`` with a pipe as its stderr (fd 2 is inherited at spawn); copy it on.

    Our own fd 2 points at the pipe only while the process starts; anything this process writes
    to stderr meanwhile is copied on like the rank's own output.
    """
    read_fd, write_fd = os.pipe()
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        os.dup2(write_fd, 2)
        process.start()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(write_fd)
    return StderrTail(read_fd, copy_to)


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True


_pools: OrderedDict[tuple[int, str], WorkerPool] = OrderedDict()
_atexit_registered = False


def get_pool(world_size: int, backend: str, group_timeout_s: float) -> WorkerPool:
    """Return the warm pool for ``(world_size, backend)``, starting it if needed."""
    global _atexit_registered
    key = (world_size, backend)
    pool = _pools.get(key)
    if pool is not None and pool.alive:
        _pools.move_to_end(key)
        return pool
    if pool is not None:
        pool.close(kill=True)
        del _pools[key]
    check_main_guard()  # a script without the guard would start ranks from every rank
    while _pools and sum(p.world_size for p in _pools.values()) + world_size > _MAX_WARM_RANKS:
        _, oldest = _pools.popitem(last=False)
        oldest.close()
    if not _atexit_registered:
        atexit.register(shutdown_pools)
        _atexit_registered = True
    pool = WorkerPool(world_size, backend, group_timeout_s)
    _pools[key] = pool
    return pool


def shutdown_pools() -> None:
    """Stop every warm pool (run at interpreter exit; call it to free the processes sooner).

    Example:
        >>> shutdown_pools()
    """
    while _pools:
        _, pool = _pools.popitem()
        pool.close()
