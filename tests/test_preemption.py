"""``distcompat.preemption``: told to stop, every rank saves one step, exits, and the rerun resumes.

Signals are real: ``tests/_preempt_script.py`` runs as one process per rank (torchrun's worker
contract, ``_rank_processes.run_ranks``, every default on) and a rank sends itself SIGTERM
before a step, in the middle of a save (while its state is pickled), or from a thread at a
random moment; a second launch resumes, and its parameters are compared bit for bit with an
uninterrupted launch. One case runs under torchrun itself, whose agent restarts the workers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from _rank_processes import Ended, run_ranks
from distcompat.checkpoint import committed_steps
from distcompat.launch import comeback_plan
from distcompat.preemption import Preemption, PreemptionError

SCRIPT = Path(__file__).with_name("_preempt_script.py")
TERM = 128 + signal.SIGTERM


def _launch(tmp_path: Path, name: str, *flags: str) -> list[Ended]:
    args = ["--ckpt", str(tmp_path / "ckpt"), "--result", str(tmp_path / f"{name}.json"), *flags]
    return run_ranks(SCRIPT, 2, args=args, timeout=90)


def _finished(tmp_path: Path, name: str, ends: list[Ended]) -> dict[str, Any]:
    codes = [e.returncode for e in ends]
    assert codes == [0] * len(ends), f"{name}: exit codes {codes}\n{ends[0].stderr[-3000:]}"
    result: dict[str, Any] = json.loads((tmp_path / f"{name}.json").read_text())
    return result


def _stopped(tmp_path: Path, name: str, ends: list[Ended]) -> list[dict[str, Any]]:
    """Every rank exited 143 after writing its stop report; return the reports."""
    codes = [e.returncode for e in ends]
    assert codes == [TERM] * len(ends), f"{name}: exit codes {codes}\n{ends[0].stderr[-3000:]}"
    return [json.loads((tmp_path / f"{name}.json.stop-{e.rank}.json").read_text()) for e in ends]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("uninterrupted")
    return _finished(root, "ref", _launch(root, "ref"))


@pytest.mark.slow
def test_a_signal_on_one_rank_stops_every_rank_at_one_step_and_the_rerun_matches(
    tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    """SIGTERM to rank 1 only: both ranks save step 5 (not a periodic one), exit 143; the
    rerun resumes there, sees each sample once, and ends with the uninterrupted bits."""
    reports = _stopped(tmp_path, "first", _launch(tmp_path, "first", "--term", "1@5"))
    assert {r["step"] for r in reports} == {5}
    assert all(r["first_rank"] == 1 and r["ranks_signalled"] == [1] for r in reports)
    assert all(r["save_s"] is not None and r["total_s"] < r["grace_s"] for r in reports)
    assert committed_steps(tmp_path / "ckpt") == [4, 5]

    result = _finished(tmp_path, "rerun", _launch(tmp_path, "rerun"))
    assert result["resumed_step"] == 5
    assert result["seen"] == [1] * 24
    assert result["sha256"] == uninterrupted["sha256"]


@pytest.mark.slow
def test_a_signal_during_a_save_lets_it_commit_and_stops_at_that_step(tmp_path: Path) -> None:
    """SIGTERM while rank 1 pickles its state in the save of step 4: the save ends, committed on
    every rank, and that is the step every rank stops at (no second save)."""
    ends = _launch(tmp_path, "first", "--term", "1@4", "--term-in", "save")
    reports = _stopped(tmp_path, "first", ends)
    assert {r["step"] for r in reports} == {4}
    assert all(r["save_s"] is None for r in reports)
    assert committed_steps(tmp_path / "ckpt") == [4]


@pytest.mark.slow
def test_a_save_past_the_grace_is_abandoned_and_the_previous_step_stands(tmp_path: Path) -> None:
    """grace 3 s, and rank 1's stop save would take 60 s: every rank exits 143 about 1 s after
    the signal (3 s less the 2 s kept for the exit); step 4 stays the newest committed."""
    started = time.monotonic()
    ends = _launch(tmp_path, "first", "--term", "0@6", "--grace", "3", "--slow-save", "1")
    assert [e.returncode for e in ends] == [TERM, TERM], ends[0].stderr[-3000:]
    assert time.monotonic() - started < 30
    assert all("did not end within the grace period" in e.stderr for e in ends)
    assert committed_steps(tmp_path / "ckpt") == [4]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1])
def test_a_signal_at_a_random_moment_of_a_step_stops_every_rank_together(
    tmp_path: Path, seed: int
) -> None:
    """The signal lands wherever a thread's timer puts it (inside a collective, the optimizer,
    the agreement itself): the ranks still agree on one step, and it is committed."""
    flags = ("--term", "1@3", "--term-in", "random", "--seed", str(seed))
    reports = _stopped(tmp_path, "first", _launch(tmp_path, "first", *flags))
    steps = {r["step"] for r in reports}
    assert len(steps) == 1, steps
    assert steps <= {3, 4}, steps
    assert committed_steps(tmp_path / "ckpt")[-1] == steps.pop()


@pytest.mark.slow
def test_under_torchrun_a_stopped_worker_is_restarted_and_resumes(
    tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    """torchrun --max-restarts=1: rank 1 gets SIGTERM; every worker saves step 5 and exits 143;
    the agent restarts them, they resume at 5 and end with the uninterrupted bits."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    ran = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--max-restarts", "1", str(SCRIPT), "--ckpt", str(tmp_path / "ckpt"),
         "--result", str(tmp_path / "run.json"), "--term", "1@5"],
        capture_output=True, text=True, timeout=180, env=env, check=False,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "every rank stops after step 5" in ran.stderr
    result = json.loads((tmp_path / "run.json").read_text())
    assert result["resumed_step"] == 5
    assert result["seen"] == [1] * 24
    assert result["sha256"] == uninterrupted["sha256"]


# --- one process ---------------------------------------------------------------------------------


def test_without_a_group_a_signal_is_a_stop_at_the_next_step() -> None:
    """One process, no group: the handler notes SIGTERM; ``should_stop`` says so; ``exit``
    raises SystemExit(143); the handlers found before are back."""
    before = signal.getsignal(signal.SIGTERM)
    preemption = Preemption(grace_s=30)
    assert not preemption.should_stop(1)
    os.kill(os.getpid(), signal.SIGTERM)
    assert preemption.signalled
    assert preemption.should_stop(2)
    assert preemption.should_stop(3)  # once agreed, it stays
    saved: list[int] = []
    report = preemption.stop(save=lambda: saved.append(2), exit=False)
    assert saved == [2]
    assert (report.step, report.signal, report.first_rank) == (2, "SIGTERM", 0)
    with pytest.raises(SystemExit) as ended:
        preemption.exit(report)
    assert ended.value.code == TERM
    assert signal.getsignal(signal.SIGTERM) == before
    assert _stop_threads() == []


def _stop_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "distcompat-stop"]


def test_every_agrees_only_every_nth_call_and_close_ends_the_deadline() -> None:
    """A stop agreed but never carried out: ``close`` ends its deadline thread, which would
    otherwise end this process (pytest's) 28 s later."""
    with Preemption(every=3) as preemption:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert _stop_threads() == ["distcompat-stop"]  # the deadline runs from the signal
        assert [preemption.should_stop(s) for s in (1, 2, 3)] == [False, False, True]
    assert _stop_threads() == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"grace_s": 1.0}, "grace_s=1.0 must be"),
        ({"grace_s": float("inf")}, "grace_s=inf must be"),
        ({"every": 0}, "every=0 must be at least 1"),
        ({"exit_code": 300}, "exit_code=300 must be in"),
        ({"signals": ()}, "catches nothing"),
        ({"signals": (signal.SIGKILL,)}, "SIGKILL cannot be caught"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs: dict[str, Any], message: str) -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(PreemptionError, match=message):
        Preemption(**kwargs)
    assert signal.getsignal(signal.SIGTERM) == before  # nothing left installed


def test_stop_before_an_agreement_is_refused() -> None:
    preemption = Preemption()
    with pytest.raises(PreemptionError, match="before should_stop"):
        preemption.stop()


def test_comeback_plan_per_launcher() -> None:
    """Environment dicts: this tests the parsing and the rule, not the launchers (the launchers
    session runs them)."""
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    slurm = {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0"}
    assert comeback_plan(signal.SIGTERM, environ=torchrun).exit_code == 143
    assert "torchrun restarts" in comeback_plan(signal.SIGTERM, environ=torchrun).how
    assert comeback_plan(signal.SIGTERM, environ=slurm).requeue_job is None  # Slurm requeues
    assert comeback_plan(signal.SIGUSR1, environ=slurm).requeue_job == "42"  # the time limit
    assert comeback_plan(signal.SIGUSR1, environ=slurm, requeue=False).requeue_job is None
    assert comeback_plan(signal.SIGTERM, environ={}, exit_code=0).exit_code == 0
    with pytest.raises(ValueError, match="SLURM_JOB_ID is not set"):
        comeback_plan(signal.SIGTERM, environ={}, requeue=True)
