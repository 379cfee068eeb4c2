"""Preemption cases: a job told to stop mid-run saves one step on every rank, then resumes.

    verdict = openmpi_preempt_one_rank(context)      # one line, like the launchers'
    print(f"launcher openmpi-preempt-one-rank: {verdict.line}")

Each runs ``elastic_train.py --preempt`` (a ``distcompat.preemption.Preemption`` asked each
step) under a real launcher, told to stop, then brought back (the uninterrupted run it is
compared with is the session's one, ``elastic.uninterrupted``); it
passes when both ranks' stop reports name the same step and the exit the signal asks for
(``128 + signum``), the run that comes back resumes after exactly that step, and from there on
it matches the uninterrupted run (``elastic.judge_resumed``: the losses and the final
parameters bit for bit, each sample seen once).

* ``torchrun-preempt-agent``: ``torchrun --standalone --nproc-per-node=2``; SIGTERM to the
  agent once step ``SIGNAL_AFTER`` is logged. The agent forwards it to both workers; they save
  and exit 143; the same torchrun again resumes.
* ``openmpi-preempt-one-rank``: ``mpirun -np 2``; SIGTERM to rank 1's process only (its pid
  file). Rank 0 learns of it through the agreement; both save and exit 143; the re-run resumes.
* ``slurm-preempt-term``: ``srun -n 2`` in the session's cluster; ``scancel --signal=TERM JOB``
  (what a preemption sends first). Both ranks save and exit 143; the same srun again resumes
  (Slurm requeues a real preemption itself, with ``PreemptMode=REQUEUE``; here the case runs
  it again).
* ``slurm-preempt-usr1-requeue``: ``sbatch --requeue --signal=B:USR1@10 -t 1``; the batch
  script traps USR1 and forwards it to its ``srun`` (``B:`` signals only the batch shell). The
  ranks wait at step ``HOLD_AT`` for the warning (it came 27-37 s into the minute here), save,
  rank 0 runs ``scontrol requeue`` (logged), they exit 138 or are ended by the requeue, which
  cancels the step after the save committed; Slurm starts the job again (``Restarts=1``,
  ``SLURM_RESTART_COUNT=1``), and that run resumes and completes (``COMPLETED``, exit 0:0).
  The session's cluster keeps a requeued job's wait short (``slurm_cluster.CRED_EXPIRE_S``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import procs
from cases import Context
from elastic import (
    Restart,
    judge_resumed,
    launch,
    mpirun_head,
    script_argv,
    srun_head,
    start_script,
    torchrun_head,
    uninterrupted,
)
from verdict import Verdict

STEP_S = "0.25"  # a pause after each step (24 steps), so that the signal lands mid-run
SIGNAL_AFTER = 8  # the case signals once rank 0 logged this step
HOLD_AT = 8  # the requeue case's first run waits here for the time-limit warning
RANKS = 2
#: The time limit (minutes) and warning (seconds before it) of the requeue case. Slurm sends the
#: warning when it checks time limits, up to 60 s early (sbatch(1)): 27-37 s into the job here,
#: after the ranks are at step HOLD_AT (about 10 s) and before the 60 s limit.
LIMIT_MIN, WARN_S = 1, 10


def _stops(out: Path, run: str) -> list[dict[str, Any]]:
    """The stop reports ``elastic_train.py`` wrote for run ``run``, one per rank that stopped."""
    found = []
    for rank in range(RANKS):
        try:
            text = (out / f"stop-{run}-{rank}.json").read_text(encoding="utf-8")
        except OSError:
            continue
        found.append({"rank": rank, **json.loads(text)})
    return found


def _judge_stops(stops: list[dict[str, Any]], signum: int, launcher: str) -> tuple[list[str], int]:
    """Problems with the ranks' stop reports, and the step they agreed on (-1: none).

    ``launcher``: the one each report must name (what init detected, not the torchrun variables
    distcompat exports under another launcher)."""
    if len(stops) != RANKS:
        return [f"stop reports from ranks {[s['rank'] for s in stops]}, not all {RANKS}"], -1
    problems = []
    steps = {s["step"] for s in stops}
    if len(steps) != 1:
        problems.append(f"the ranks stopped at different steps: {sorted(steps)}")
    name, code = signal.Signals(signum).name, 128 + signum
    told = {(s["signal"], s["plan"]["exit_code"]) for s in stops}
    if told != {(name, code)}:
        problems.append(f"stop reports say {sorted(told)}, not {name} and exit {code}")
    named = {s["plan"]["launcher"] for s in stops}
    if named != {launcher}:
        problems.append(f"stop reports name launcher {sorted(named)}, not {launcher}")
    return problems, min(steps)


def _reached(out: Path, run: str, step: int, job: procs.Job, timeout: float) -> bool:
    """Wait until rank 0 logged ``step`` of run ``run`` (False: the job ended or time ran out)."""
    deadline = time.monotonic() + timeout
    log = out / "losses.jsonl"
    while time.monotonic() < deadline and job.process.poll() is None:
        if log.exists():
            lines = [json.loads(x) for x in log.read_text(encoding="utf-8").splitlines() if x]
            if any(x["run"] == run and x["step"] >= step for x in lines):
                return True
        time.sleep(0.05)
    return False


def _fail(why: str, started: float) -> Verdict:
    return Verdict(ok=False, line=f"FAIL {why} ({time.monotonic() - started:.1f} s)")


def _stop_summary(stops: list[dict[str, Any]], step: int) -> str:
    """The ranks' own figures: who caught the signal first, and signal to exit per rank."""
    first = stops[0]
    exits = ", ".join(f"{s['total_s']:.2f}" for s in stops)
    return (
        f"{first['signal']} reached rank {first['first_rank']} first (caught by ranks "
        f"{first['ranks_signalled']}), agreed step {step} {first['agreed_s']:.2f} s after it, "
        f"signal to each rank's exit {exits} s"
    )


def _told_and_rerun(
    ctx: Context,
    head: list[str],
    *,
    tell: Callable[[procs.Job, Path], str],
    launcher: str,
    suffix: str = "",
) -> Verdict:
    """Uninterrupted; then told by ``tell`` (which signals and says whom) after step
    ``SIGNAL_AFTER``; then the same command again. ``suffix``: what the launcher adds to the
    run's tag (torchrun: ``-0``)."""
    started = time.monotonic()
    plain = uninterrupted(ctx, head)
    if isinstance(plain, Verdict):
        return plain
    out = ctx.work / "preempted"
    job = start_script(ctx, out, head, "--preempt", "--step-s", STEP_S, run="first")
    if not _reached(out, "first" + suffix, SIGNAL_AFTER, job, ctx.timeout / 2):
        first = procs.wait(job, 0)
        return _fail(f"the run never reached step {SIGNAL_AFTER}: {first.tail()}", started)
    told_at = time.monotonic()
    whom = tell(job, out)
    with contextlib.suppress(subprocess.TimeoutExpired):
        job.process.wait(timeout=ctx.timeout / 2)  # the launcher exits after its last rank
    exited_s = time.monotonic() - told_at
    first = procs.wait(job, 0)
    if first.returncode in (0, None):
        what = "hung" if first.returncode is None else "exited 0"
        return _fail(f"the told run {what} after SIGTERM to {whom}: {first.tail()}", started)
    stops = _stops(out, "first" + suffix)
    problems, step = _judge_stops(stops, signal.SIGTERM, launcher)
    if problems:
        return _fail("; ".join(problems) + f": {first.tail()}", started)
    rerun = launch(ctx, out, head, "--preempt", run="rerun")
    if rerun.returncode != 0:
        return _fail(f"re-run: exit {rerun.returncode}: {rerun.tail()}", started)
    return judge_resumed(
        plain,
        out,
        run="rerun" + suffix,
        resumed_after=step,
        what=(
            f"SIGTERM to {whom} after step {SIGNAL_AFTER}: {_stop_summary(stops, step)}; "
            f"the launcher exited {first.returncode} {exited_s:.2f} s after the signal"
        ),
        how="the same command again",
        seconds=time.monotonic() - started,
    )


def _term_agent(job: procs.Job, out: Path) -> str:
    os.kill(job.process.pid, signal.SIGTERM)
    return "torchrun's agent"


def _term_rank_1(job: procs.Job, out: Path) -> str:
    os.kill(int((out / "pid-first-1").read_text(encoding="utf-8")), signal.SIGTERM)
    return "rank 1 only"


def torchrun_preempt_agent(ctx: Context) -> Verdict:
    """SIGTERM to torchrun's agent: forwarded, both workers save one step; the re-run resumes."""
    return _told_and_rerun(
        ctx, torchrun_head(ctx), tell=_term_agent, launcher="torchrun", suffix="-0"
    )


def openmpi_preempt_one_rank(ctx: Context) -> Verdict:
    """SIGTERM to one rank under mpirun: both save the same step; the re-run resumes."""
    return _told_and_rerun(ctx, mpirun_head(ctx), tell=_term_rank_1, launcher="openmpi")


def _slurm(ctx: Context, *argv: str) -> str:
    assert ctx.cluster is not None, "a slurm case runs inside the cluster run.py started"
    done = subprocess.run(
        list(argv), env={**ctx.env, **ctx.cluster.env}, capture_output=True, text=True, timeout=30
    )
    return done.stdout.strip() if done.returncode == 0 else f"({argv[0]} failed: {done.stderr})"


def slurm_preempt_term(ctx: Context) -> Verdict:
    """``scancel --signal=TERM`` to an srun job: both ranks save one step; the re-run resumes."""

    def scancel_term(job: procs.Job, out: Path) -> str:
        jobs = _slurm(ctx, "squeue", "-h", "-t", "R", "-o", "%i").split()
        for found in jobs:
            _slurm(ctx, "scancel", "--signal=TERM", found)
        return f"job {','.join(jobs)} (scancel --signal=TERM)"

    return _told_and_rerun(ctx, srun_head(ctx), tell=scancel_term, launcher="slurm")


def _batch_script(ctx: Context, out: Path) -> Path:
    """The requeue case's job: srun in the background, USR1 forwarded to it, its status kept."""
    hold = ("--preempt", "--hold-at", str(HOLD_AT))
    train = " ".join([*srun_head(ctx), *script_argv(out, "", "requeue-$RUN", *hold)])
    script = out / "job.sh"
    script.write_text(
        "\n".join(
            [
                "#!/bin/bash",
                f"#SBATCH -n {RANKS}",
                f"#SBATCH -t {LIMIT_MIN}",
                "#SBATCH --requeue",
                f"#SBATCH --signal=B:USR1@{WARN_S}",
                f"#SBATCH -o {out / 'job.log'}",
                "#SBATCH --open-mode=append",
                "RUN=${SLURM_RESTART_COUNT:-0}",
                'echo "batch: run $RUN of job $SLURM_JOB_ID started at $(date +%s.%N)"',
                f"{train} &",
                "step=$!",
                # B: signals only this shell: hand the warning to the ranks through srun
                "trap 'echo \"batch: USR1 at $(date +%s.%N), to srun\"; kill -USR1 $step' USR1",
                # wait returns early for each trapped signal; wait again until srun is gone
                'while :; do wait "$step"; kill -0 "$step" 2>/dev/null || break; done',
                'wait "$step"; code=$?',
                'echo "batch: srun exited $code"',
                'exit "$code"',
                "",
            ]
        ),
        encoding="utf-8",
    )
    return script


def _job_fields(ctx: Context, job: str) -> dict[str, str]:
    """``scontrol show job``'s ``Key=Value`` fields (JobState, Restarts, ExitCode, ...)."""
    text = _slurm(ctx, "scontrol", "show", "job", job)
    return dict(f.split("=", 1) for f in text.split() if "=" in f)


def slurm_preempt_usr1_requeue(ctx: Context) -> Verdict:
    """The time-limit warning under sbatch --requeue: save, scontrol requeue, run again, done."""
    started = time.monotonic()
    plain = uninterrupted(ctx, srun_head(ctx))
    if isinstance(plain, Verdict):
        return plain
    out = ctx.work / "requeued"
    out.mkdir(parents=True)
    job = _slurm(ctx, "sbatch", "--parsable", str(_batch_script(ctx, out))).split(";")[0]
    submitted = time.monotonic()
    if not job.isdigit():
        return _fail(f"sbatch: {job}", started)
    states: list[str] = []  # each change of the job's state, and when (from the submission)
    while time.monotonic() - started < ctx.timeout:
        state = _slurm(ctx, "squeue", "-h", "-j", job, "-o", "%T")
        if not state:
            break
        if not states or not states[-1].startswith(state):
            states.append(f"{state} at {time.monotonic() - submitted:.0f} s")
        time.sleep(0.5)
    else:
        _slurm(ctx, "scancel", job)
        return _fail(f"job {job} still {states[-1:]} at the deadline", started)
    fields = _job_fields(ctx, job)
    log = (out / "job.log").read_text(encoding="utf-8", errors="replace")
    problems = []
    ended = (fields.get("JobState"), fields.get("Restarts"), fields.get("ExitCode"))
    if ended != ("COMPLETED", "1", "0:0"):
        problems.append(
            f"job {job} ended {fields.get('JobState')} after {fields.get('Restarts')} restarts "
            f"(exit {fields.get('ExitCode')}), not COMPLETED after 1"
        )
    stops = _stops(out, "requeue-0")
    stop_problems, step = _judge_stops(stops, signal.SIGUSR1, "slurm")
    problems += stop_problems
    if not problems and stops[0]["plan"]["requeue_job"] != job:
        problems.append(f"the stop planned no requeue of job {job}: {stops[0]['plan']['how']}")
    if f"distcompat: Slurm requeues job {job}" not in log:
        problems.append(f"rank 0 did not log that scontrol requeue {job} succeeded")
    if problems:
        return _fail("; ".join(problems) + " | " + " | ".join(log.splitlines()[-4:]), started)
    warned = _warned_after(log)
    return judge_resumed(
        plain,
        out,
        run="requeue-1",
        resumed_after=step,
        what=(
            f"Slurm's USR1 warning came {warned} into the {LIMIT_MIN} min limit "
            f"(--signal=B:USR1@{WARN_S}, forwarded by the batch script): "
            f"{_stop_summary(stops, step)}; rank 0 ran scontrol requeue"
        ),
        how=(
            f"Slurm requeued job {job} ({', '.join(states)}; Restarts=1) and its second run "
            "completed"
        ),
        seconds=time.monotonic() - started,
    )


def _warned_after(log: str) -> str:
    """Seconds from the first run's start to the USR1 the batch script got, from its log."""
    times: dict[str, float] = {}
    for line in log.splitlines():
        words = line.split()
        if line.startswith("batch: run 0 ") and "at" in words:
            times.setdefault("start", float(words[-1]))
        if line.startswith("batch: USR1 at"):
            times.setdefault("usr1", float(words[3].rstrip(",")))
    if len(times) < 2:
        return "(time not in the log)"
    return f"{times['usr1'] - times['start']:.0f} s"


PREEMPTED = (
    Restart(name="torchrun-preempt-agent", timeout=150, run=torchrun_preempt_agent),
    Restart(
        name="openmpi-preempt-one-rank",
        timeout=150,
        run=openmpi_preempt_one_rank,
        binaries=("mpirun.openmpi",),
    ),
    Restart(
        name="slurm-preempt-term",
        timeout=150,
        run=slurm_preempt_term,
        needs="slurm",
        binaries=("scancel",),
    ),
    Restart(
        name="slurm-preempt-usr1-requeue",
        timeout=170,
        run=slurm_preempt_usr1_requeue,
        needs="slurm",
        binaries=("scancel",),
    ),
)
