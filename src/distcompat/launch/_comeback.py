"""How a job told to stop comes back, per launcher: the exit status, and a Slurm requeue.

A rank that stopped on purpose (``distcompat.preemption``) has saved its step; what brings the
job back is its launcher, and each reads the exit differently::

    plan = comeback_plan(signal.SIGTERM)     # from the environment, read here once
    plan.exit_code, plan.requeue_job, plan.how

* torchrun restarts the workers (``--max-restarts``) when one exits non-zero; an exit of 0 on
  every rank means the job is done. So the status is the one a process ended by the signal
  reports to a shell, ``128 + signum`` (143 for SIGTERM): a failure to every launcher, the same
  one the signal itself would have caused, which Kubernetes' ``restartPolicy: OnFailure``
  restarts too.
* Slurm: a preemption with ``PreemptMode=REQUEUE`` requeues the job by itself. The time-limit
  warning (``--signal=[B:]USR1@SECONDS``) does not: a job that should come back after it asks
  with ``scontrol requeue $SLURM_JOB_ID`` (rank 0 does, for a job started with ``--requeue``
  semantics; ``requeue_job`` names it). SIGUSR1 is that warning by convention (Lightning's too).
* A plain re-run: the same status; the next run resumes from the saved step.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass

from distcompat.launch._env import detect_launcher

__all__ = ["ComebackPlan", "comeback_plan"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ComebackPlan:
    """What a stopped rank does last: its exit status, and the Slurm job to requeue (or None)."""

    launcher: str
    exit_code: int
    requeue_job: str | None
    how: str


def comeback_plan(
    signum: int,
    *,
    requeue: bool | None = None,
    exit_code: int | None = None,
    launcher: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> ComebackPlan:
    """Say how this rank should end after a stop that ``signum`` asked for.

    ``requeue``: ask Slurm to requeue the job (None: on Slurm, for SIGUSR1, the time-limit
    warning). ``exit_code`` None means ``128 + signum``. ``launcher``: the one init detected
    (``DistInfo.launcher``); None detects it from ``environ``, which after ``init_distributed``
    holds the torchrun variables distcompat exported for another launcher, so pass it then.

    Example:
        >>> plan = comeback_plan(signal.SIGTERM, environ={"TORCHELASTIC_RUN_ID": "x",
        ...     "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
        >>> plan.exit_code, plan.requeue_job
        (143, None)
        >>> comeback_plan(signal.SIGUSR1, environ={"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0",
        ...     "SLURM_PROCID": "0"}).requeue_job
        '42'
    """
    env = os.environ if environ is None else environ
    launcher = detect_launcher(env) if launcher is None else launcher
    code = 128 + int(signum) if exit_code is None else exit_code
    if not 0 <= code <= 255:
        raise ValueError(f"exit_code={code} must be in [0, 255] (an exit status)")
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if requeue is None:
        requeue = job is not None and signum == signal.SIGUSR1
    if requeue and job is None:
        raise ValueError("requeue=True needs a Slurm job: SLURM_JOB_ID is not set")
    name = signal.Signals(signum).name
    if requeue:
        how = f"rank 0 runs `scontrol requeue {job}`; every rank exits with {code}"
    elif launcher == "torchrun":
        how = f"exit {code}: torchrun restarts the workers while --max-restarts allows"
    elif job is not None:
        how = f"exit {code}: Slurm requeues a preempted job itself (PreemptMode=REQUEUE)"
    else:
        how = f"exit {code}, as {name} itself would end the process; the next run resumes"
    return ComebackPlan(
        launcher=launcher, exit_code=code, requeue_job=job if requeue else None, how=how
    )
