"""What a default init does about hangs, on real rank processes started as a launcher would.

* the default (report-only) watchdog names a late rank in the waiting rank's log, and the job
  then completes;
* a collective that failed ends the process within seconds, whatever the stuck peer does;
* two jobs that hang one after the other leave their dumps apart, and ``distcompat diagnose``
  reads one job's incident at a time.

The ranks are started by ``_rank_processes.run_ranks`` (one process per rank, torchrun's worker
contract, this process's TCPStore), because what is tested is how processes end.
They run in the ``matrix`` nox session, beside the defaults matrix (``nox -s matrix``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from _rank_processes import Ended, run_ranks
from distcompat.cli import main
from distcompat.diagnostics import read_dumps

SCRIPT = Path(__file__).with_name("_hang_script.py")
SLACK_S = 6.0  # generous: the machine is shared with other test runs


def _marker(ended: Ended, name: str) -> float:
    match = re.search(rf"^{name} ([0-9.]+)", ended.stdout, re.MULTILINE)
    assert match, f"rank {ended.rank} printed no {name}:\n{ended.stdout}\n{ended.stderr}"
    return float(match.group(1))


def test_default_watchdog_names_a_late_rank_and_the_job_completes(tmp_path: Path) -> None:
    threshold, late = 3.0, 10.0
    env = {"DISTCOMPAT_WATCHDOG": str(threshold), "TMPDIR": str(tmp_path)}
    ranks = run_ranks(SCRIPT, 2, env=env, args=["late", str(late)], timeout=90)
    for ended in ranks:  # report-only: nothing was killed, both finished the collective
        assert ended.returncode == 0, ended.stderr
        assert "RESULT [4.0, 4.0, 4.0, 4.0]" in ended.stdout
        assert "watchdog: report-only after 3s: DISTCOMPAT_WATCHDOG=3" in ended.stdout
    rank0 = ranks[0]
    reports = re.findall(r"^([0-9.]+) distcompat.diagnostics \[rank 0\]", rank0.stderr, re.M)
    assert len(reports) == 1, rank0.stderr  # one report, not one per poll
    waited = float(reports[0]) - _marker(rank0, "CALL")
    assert threshold <= waited < threshold + SLACK_S, waited
    assert "rank 1 is behind on group" in rank0.stderr
    # what the late rank is doing: its own code, file:line and function, not time.sleep
    assert re.search(r"main thread at \S*_hang_script.py:\d+ in read_shard", rank0.stderr)
    assert "per-rank dump: " + str(tmp_path / "distcompat-hangs") in rank0.stderr
    assert "report-only: this rank keeps waiting" in rank0.stderr


@pytest.mark.parametrize(
    ("mode", "peer"),
    [
        ("stuck", "busy"),  # the peer spins in Python
        ("stuck", "sleep"),  # the peer sleeps
        ("stuck", "native"),  # the peer is in native code, holding the GIL
        ("atexit", "sleep"),  # the group is destroyed by torch itself, at interpreter exit
        ("timeout", "sleep"),  # default watchdog: the group timeout ends the wait
    ],
)
def test_a_failed_collective_ends_the_process_promptly(
    mode: str, peer: str, tmp_path: Path
) -> None:
    env = {"TMPDIR": str(tmp_path)}
    ranks = run_ranks(SCRIPT, 2, env=env, args=[mode, peer], timeout=90, stop_after=0)
    rank0 = ranks[0]
    assert rank0.returncode is not None, "rank 0 did not exit:\n" + rank0.stderr[-3000:]
    assert rank0.returncode != 0
    error = "CollectiveTimeoutError" if mode == "timeout" else "HangError"
    assert re.search(rf"^FAILED_AT [0-9.]+ {error}", rank0.stdout, re.M), rank0.stdout
    after = rank0.ended - _marker(rank0, "FAILED_AT")
    assert after < SLACK_S, f"rank 0 exited {after:.1f}s after its error"
    assert "this process ends within" in rank0.stderr  # the exit guard said what it does
    if mode == "timeout":
        assert "rank 1 is behind on group" in rank0.stderr  # reported before the timeout
    assert ranks[1].returncode is None  # still stuck: killed by the test


def _job(tmp_path: Path) -> str:
    """Run one job whose rank 1 is late past a 1 s watchdog; return the job's dump folder."""
    default_dir = tmp_path / "distcompat-hangs"  # <TMPDIR>/distcompat-hangs: the default
    before = set(default_dir.iterdir()) if default_dir.exists() else set()
    env = {"DISTCOMPAT_WATCHDOG": "1", "TMPDIR": str(tmp_path)}
    ranks = run_ranks(SCRIPT, 2, env=env, args=["late", "4"], timeout=60)
    assert [r.returncode for r in ranks] == [0, 0], [r.stderr for r in ranks]
    (new,) = set(default_dir.iterdir()) - before
    return new.name


def test_two_jobs_that_hang_are_diagnosed_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    jobs = [_job(tmp_path), _job(tmp_path)]  # one after the other, same default location
    default_dir = tmp_path / "distcompat-hangs"
    for job in jobs:
        post = read_dumps(default_dir, job=job)
        assert post.report.job == job
        assert sorted(post.files) == [0, 1]
        assert all(path.parts[-3] == job for path in post.files.values())  # never a mix
        assert post.others == tuple((other, 1) for other in jobs if other != job)
        assert post.report.verdict.behind == (1,)
    capsys.readouterr()
    assert main(["diagnose", str(default_dir)]) == 0
    text = capsys.readouterr().out
    assert f"job {jobs[1]}, incident 1" in text  # the newest job's incident
    assert f"skipped job {jobs[0]} incident 1 (ranks 0, 1, written " in text
    assert "another job, not merged" in text
    assert main(["diagnose", str(default_dir), "--job", jobs[0]]) == 0
    assert f"job {jobs[0]}, incident 1" in capsys.readouterr().out
    assert main(["diagnose", str(default_dir), "--job", "no-such-job"]) == 2
