"""A stop every rank agrees on: told to stop, the job saves one step everywhere and exits.

The lines a training loop writes (every rank, after ``init_distributed``)::

    preemption = Preemption(grace_s=30)              # catches SIGTERM and SIGUSR1
    for step in range(resumed.step + 1, total + 1):
        train_step()
        if preemption.should_stop(step):             # the same answer on every rank, same step
            preemption.stop(save=lambda: save_checkpoint("ckpt", step, training_state(...)))

:meth:`Preemption.should_stop` is a collective (one tiny all-gather, ``_agree``): call it at
the same point of every step on every rank, like any collective. :meth:`Preemption.stop` runs
the save, bounded by the grace period counted from the first signal on any rank, logs how long
each phase took, and exits so that the launcher brings the job back
(:func:`distcompat.launch.comeback_plan`). If the save cannot finish in time, the process exits
without it: a checkpoint commits atomically, so the previous committed step stands.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NoReturn

from distcompat._ranks import recorded
from distcompat.checkpoint._sync import DEFAULT_SYNC_TIMEOUT_S, save_group
from distcompat.launch import ComebackPlan, comeback_plan
from distcompat.preemption._agree import earliest, exchange
from distcompat.preemption._signals import Catcher, Caught, PreemptionError

__all__ = ["EXIT_MARGIN_S", "Preemption", "StopReport"]

_log = logging.getLogger("distcompat.preemption")

#: Seconds kept back from the grace period for the exit itself (teardown, the launcher's look):
#: a save still running ``grace_s - EXIT_MARGIN_S`` after the first signal is abandoned.
EXIT_MARGIN_S = 2.0
_REQUEUE_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True, kw_only=True)
class StopReport:
    """What a stop did: the step, who was told first, and how long each phase took (seconds)."""

    step: int
    signal: str
    first_rank: int
    ranks_signalled: tuple[int, ...]
    signalled_at: float
    agreed_s: float
    save_s: float | None
    total_s: float
    grace_s: float
    plan: ComebackPlan

    def line(self) -> str:
        """One log line: the step and each phase's time.

        Example:
            >>> from distcompat.launch import comeback_plan
            >>> StopReport(step=60, signal="SIGTERM", first_rank=1, ranks_signalled=(1,),
            ...     signalled_at=0.0, agreed_s=0.05, save_s=1.2, total_s=1.3, grace_s=30.0,
            ...     plan=comeback_plan(15, environ={})).line()[:62]
            'distcompat: stopped at step 60: SIGTERM reached rank 1 first; '
        """
        saved = "no save at the stop (the loop had saved the step)"
        if self.save_s is not None:
            saved = f"saved step {self.step} in {self.save_s:.2f} s"
        return (
            f"distcompat: stopped at step {self.step}: {self.signal} reached rank "
            f"{self.first_rank} first; agreed {self.agreed_s:.2f} s after it; {saved}; "
            f"{self.total_s:.2f} s from the signal to the exit (grace {self.grace_s:g} s); "
            f"{self.plan.how}"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class _Agreed:
    step: int
    first_rank: int
    first: Caught
    ranks: tuple[int, ...]
    at: float  # time.time() of the agreement


class _Deadline:
    """Ends the process at ``until`` (``time.time()``) unless :meth:`cancel` came first.

    The exit is ``os._exit``: a save still writing leaves only its temp folder, and the previous
    committed step stands (``distcompat.checkpoint``'s atomic commit).
    """

    def __init__(self, until: float, code: int, why: str) -> None:
        self.until, self.code, self.why = until, code, why
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._run, name="distcompat-stop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._cancelled.wait(max(0.0, self.until - time.time())):
            return
        _log.error("distcompat: %s; exiting with %d without it", self.why, self.code)
        logging.shutdown()
        os._exit(self.code)

    def cancel(self) -> None:
        self._cancelled.set()
        if self._thread is not threading.current_thread():
            self._thread.join()  # it returns at once: nothing of it is left running


class Preemption:
    """Catch the stop signals; agree with every rank on a step to stop at; save it; exit.

    ``signals``: what to catch (default SIGTERM and SIGUSR1). ``grace_s``: from the first signal
    on any rank to every rank's exit; a save that cannot end ``EXIT_MARGIN_S`` before it is
    abandoned. ``every``: agree every this many calls of :meth:`should_stop` (1: each step).
    ``requeue`` / ``exit_code``: how the job comes back (:func:`~distcompat.launch.comeback_plan`).
    ``timeout_s`` bounds the side group's creation on a non-CPU default group.

    Every rank makes it together, on the main thread, after ``init_distributed``; a default
    group that does not carry CPU tensors (NCCL) gets a gloo side group here, a collective.

    Example:
        >>> preemption = Preemption(grace_s=30)
        >>> preemption.should_stop(1)     # no signal: keep training
        False
        >>> preemption.close()
    """

    def __init__(
        self,
        *,
        signals: Iterable[int] = (signal.SIGTERM, signal.SIGUSR1),
        grace_s: float = 30.0,
        every: int = 1,
        requeue: bool | None = None,
        exit_code: int | None = None,
        timeout_s: float = DEFAULT_SYNC_TIMEOUT_S,
    ) -> None:
        if not (grace_s > EXIT_MARGIN_S and math.isfinite(grace_s)):
            raise PreemptionError(
                f"grace_s={grace_s} must be a number of seconds above EXIT_MARGIN_S="
                f"{EXIT_MARGIN_S:g} (the time kept back for the exit)"
            )
        if every < 1:
            raise PreemptionError(f"every={every} must be at least 1")
        if exit_code is not None and not 0 <= exit_code <= 255:
            raise PreemptionError(f"exit_code={exit_code} must be in [0, 255]")
        self.grace_s, self.every = grace_s, every
        self._requeue, self._exit_code = requeue, exit_code
        self._where = save_group("Preemption", timeout_s)
        self._timeout_s = timeout_s
        self._calls = 0
        self._agreed: _Agreed | None = None
        self._deadline: _Deadline | None = None
        self._catcher = Catcher(signals, on_first=self._arm)

    @property
    def signalled(self) -> bool:
        """Whether this rank caught a stop signal (the others may not know yet)."""
        return self._catcher.first is not None

    def _arm(self, first: Caught) -> None:
        """Start the deadline at ``first`` (the earliest signal this rank knows of)."""
        until = first.wall + self.grace_s - EXIT_MARGIN_S
        if self._deadline is not None:
            if self._deadline.until <= until:
                return  # an earlier signal already set it
            self._deadline.cancel()
        code = self._plan(first.signum).exit_code
        self._deadline = _Deadline(
            until,
            code,
            f"the stop after {first.name} did not end within the grace period "
            f"({self.grace_s:g} s less {EXIT_MARGIN_S:g} s for the exit)",
        )

    def _plan(self, signum: int) -> ComebackPlan:
        info = recorded()  # the launcher init saw: init exports torchrun's variables for others
        return comeback_plan(
            signum,
            requeue=self._requeue,
            exit_code=self._exit_code,
            launcher=None if info is None else info.launcher,
        )

    def should_stop(self, step: int) -> bool:
        """Return whether every rank stops after ``step``: the same answer on every rank.

        A collective (one tiny all-gather of what each rank caught, every ``every`` calls):
        every rank calls it at the same point of each step. Once True, it stays True.

        Example:
            >>> with Preemption() as preemption:
            ...     preemption.should_stop(7)
            False
        """
        if self._agreed is not None:
            return True
        self._calls += 1
        if self._calls % self.every:
            return False
        info = recorded()
        if self._where.active and info is not None and info.world_size != self._where.world_size:
            # the default group changed members in place (distcompat.inplace): its new ranks
            self._where = save_group("Preemption", self._timeout_s)
        table = exchange(self._catcher.first, self._where)
        found = earliest(table)
        if found is None:
            return False
        first_rank, first = found
        self._arm(first)  # the deadline counts from the first signal on any rank
        self._agreed = _Agreed(
            step=step,
            first_rank=first_rank,
            first=first,
            ranks=tuple(r for r, caught in enumerate(table) if caught is not None),
            at=time.time(),
        )
        if self._where.rank == 0:  # the same on every rank: said once
            _log.warning(
                "distcompat: every rank stops after step %d: %s reached rank %d first, %.2f s ago",
                step,
                first.name,
                first_rank,
                self._agreed.at - first.wall,
            )
        return True

    def stop(self, save: Callable[[], object] | None = None, *, exit: bool = True) -> StopReport:
        """Run ``save`` (every rank, the step :meth:`should_stop` agreed on), then exit.

        The save is bounded by the grace period from the first signal: past it the process
        exits without it and the previous committed step stands. ``exit=False`` returns the
        report instead (then call :meth:`exit`). Pass ``save=None`` when the step was just
        saved.

        Example:
            >>> preemption = Preemption()
            >>> preemption.stop()
            Traceback (most recent call last):
              ...
            distcompat.preemption._signals.PreemptionError: stop() before should_stop() ...
        """
        agreed = self._agreed
        if agreed is None:
            self.close()
            raise PreemptionError(
                "stop() before should_stop() returned True: no stop was agreed on every rank"
            )
        save_s = None
        if save is not None:
            started = time.time()
            save()
            save_s = time.time() - started
        if self._deadline is not None:
            self._deadline.cancel()
        now = time.time()
        report = StopReport(
            step=agreed.step,
            signal=agreed.first.name,
            first_rank=agreed.first_rank,
            ranks_signalled=agreed.ranks,
            signalled_at=agreed.first.wall,
            agreed_s=agreed.at - agreed.first.wall,
            save_s=save_s,
            total_s=now - agreed.first.wall,
            grace_s=self.grace_s,
            plan=self._plan(agreed.first.signum),
        )
        if self._where.rank == 0:
            _log.warning("%s", report.line())
        if exit:
            self.exit(report)
        return report

    def exit(self, report: StopReport) -> NoReturn:
        """End this rank as ``report.plan`` says: a Slurm requeue on rank 0, then the status."""
        job = report.plan.requeue_job
        if job is not None and self._where.rank == 0:
            _requeue(job)
        self.close()
        raise SystemExit(report.plan.exit_code)

    def close(self) -> None:
        """Put back the signal handlers found at creation; cancel the deadline, if one runs.

        After ``close`` nothing of this object acts on the process any more: a stop agreed but
        never carried out no longer ends it at the deadline.
        """
        self._catcher.close()
        if self._deadline is not None:
            self._deadline.cancel()

    def __enter__(self) -> Preemption:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _requeue(job: str) -> None:
    """Ask Slurm to requeue ``job``; log what it said (a failure leaves a plain exit)."""
    try:
        done = subprocess.run(
            ["scontrol", "requeue", job],
            capture_output=True,
            text=True,
            timeout=_REQUEUE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        _log.error("distcompat: scontrol requeue %s failed: %s", job, exc)
        return
    if done.returncode != 0:
        _log.error(
            "distcompat: scontrol requeue %s failed (%d): %s",
            job,
            done.returncode,
            done.stderr.strip(),
        )
    else:
        _log.warning("distcompat: Slurm requeues job %s", job)
