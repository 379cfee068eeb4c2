"""The watchdog on real 2-rank gloo groups: each kind of hang yields a named report in seconds.

Every scenario ends each rank with ``os._exit`` after writing what it saw to a file: a declared
hang leaves an abandoned op inside gloo, so the pool must be killed and rebuilt, never reused
(run_on_ranks then raises RankFailedError by design). Each test also checks that no rank process
is left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import distcompat
from distcompat.cli import main
from distcompat.collectives import PeerLostError, all_reduce, barrier, broadcast, unchecked
from distcompat.diagnostics import HangError, HangReport, watchdog
from distcompat.testing import RankFailedError, RankTimeoutError, run_on_ranks

TIMEOUT = 1.5  # watchdog seconds; reports must arrive within TIMEOUT + grace + slack
SLACK_S = 6.0  # generous: the machine is shared with other test runs


def _finish(out: Path, seen: dict[str, Any]) -> None:
    """Write this rank's observations and leave at once (the group holds an abandoned op)."""
    rank = distcompat.get_rank()
    seen["pid"] = os.getpid()
    (out / f"seen{rank}.json").write_text(json.dumps(seen))
    os._exit(0)


def _line_of(marker: str) -> int:
    """The line number of ``marker`` in this file (a call site is asserted by line)."""
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if marker in text and "_line_of" not in text)


def _busy(seconds: float) -> None:
    """Pure-Python work (holds and releases the GIL like real compute)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(1000))


def _scenario(kind: str, out: str) -> None:
    directory = Path(out)
    rank = distcompat.get_rank()
    t = torch.ones(4)
    seen: dict[str, Any] = {}
    # a dead rank never answers: keep its grace under run_on_ranks' 2 s wait for the survivor
    grace = 1.0 if kind == "killed" else None
    # These scenarios test the watchdog's report: the default mismatch check, which would stop
    # the mismatched ones first (tests/test_collectives_checked.py), is off for them; except
    # where the fast paths are tested, which only the checked calls take.
    check = contextlib.nullcontext() if kind == "sleeps_then_calls" else unchecked()
    with check, watchdog(timeout=TIMEOUT, dump_dir=directory / "dumps", grace=grace) as w:
        if kind == "sleeps_after_a_group_ended":  # its calls stay in the history the dump reads
            import distcompat.distributed as dist

            group = dist.new_group(ranks=[0, 1])
            all_reduce(t, group=group)
            dist.destroy_process_group(group)
        all_reduce(t)  # call #0: everyone agrees
        started = time.monotonic()
        try:
            if rank == 1 and kind == "never_calls":
                _busy(TIMEOUT + 3.0)  # skips the collective, computes elsewhere
            elif rank == 1 and kind in ("sleeps", "sleeps_after_a_group_ended"):
                time.sleep(TIMEOUT + 3.0)
            elif rank == 1 and kind == "sleeps_then_calls":
                while w.last_report is None:  # rank 0 declares the hang; this rank handles it
                    time.sleep(0.05)  # (run_on_ranks' timeout ends a wait that never ends)
                started = time.monotonic()
                all_reduce(t)  # a call the fast path would take: it must refuse at once
            elif rank == 1 and kind == "mismatch":
                broadcast(t, src=0)
            elif kind == "rank0_only":
                if rank == 0:
                    all_reduce(t)  # the classic: a collective inside `if rank == 0:`
                else:
                    barrier()  # ...while rank 1 goes on to the next collective
            elif rank == 1 and kind == "killed":
                time.sleep(0.3)  # let rank 0 enter the collective first
                os.kill(os.getpid(), signal.SIGKILL)
            else:
                all_reduce(t)
            seen["error"] = None
        except (HangError, PeerLostError) as exc:
            seen["error"] = type(exc).__name__
            seen["message"] = str(exc) + "".join(getattr(exc, "__notes__", []))
            seen["peer"] = exc.peer
            report = getattr(exc, "report", None)
            seen["report"] = report.to_json() if report is not None else None
        seen["after_s"] = time.monotonic() - started
    _finish(directory, seen)


def _run(kind: str, tmp_path: Path) -> dict[int, dict[str, Any]]:
    with pytest.raises((RankFailedError, RankTimeoutError)):  # the ranks exit: by design
        run_on_ranks(_scenario, 2, args=(kind, str(tmp_path)), timeout=40)
    seen = {}
    for rank in (0, 1):
        path = tmp_path / f"seen{rank}.json"
        if path.exists():
            seen[rank] = json.loads(path.read_text())
    for record in seen.values():  # no process is left behind
        with pytest.raises(ProcessLookupError):
            os.kill(record["pid"], 0)
    return seen


def _dump_report(tmp_path: Path, rank: int) -> HangReport:
    # dumps are kept per job and incident: dumps/<job>/incident-<N>/rank<R>.json (one job here)
    (path,) = (tmp_path / "dumps").glob(f"*/incident-*/rank{rank}.json")
    data = json.loads(path.read_text())
    return HangReport.from_json(data["report"])


@pytest.mark.parametrize("kind", ["never_calls", "sleeps", "sleeps_after_a_group_ended"])
def test_a_rank_that_is_elsewhere_is_named_behind(kind: str, tmp_path: Path) -> None:
    """``sleeps_after_a_group_ended``: a group's calls recorded, then the group destroyed; the
    Flight Recorder-format dump once failed on it (torch's KeyError for a destroyed group) and
    took the whole report with it ("other ranks not asked")."""
    seen = _run(kind, tmp_path)[0]
    assert seen["error"] == "HangError"
    assert seen["after_s"] < TIMEOUT + SLACK_S
    assert seen["peer"] == 1
    report = HangReport.from_json(seen["report"])
    assert report.verdict.behind == (1,)
    assert "rank 1 is behind on group" in seen["message"]
    assert "rank 1 is not in a distcompat collective" in seen["message"]
    stacks = report.states[1].stacks  # type: ignore[union-attr]
    assert stacks is not None
    assert "_busy" in stacks if kind == "never_calls" else "_scenario" in stacks
    # the late rank noticed the alarm (not being in a collective) and wrote its own dump
    assert _dump_report(tmp_path, 1).verdict.behind == (1,)


def test_after_a_declared_hang_the_next_collective_raises_at_once(tmp_path: Path) -> None:
    seen = _run("sleeps_then_calls", tmp_path)
    assert seen[0]["error"] == "HangError"
    assert 1 in seen, "rank 1 did not come back from its next collective"
    assert seen[1]["error"] == "HangError"
    assert "a hang was already declared" in seen[1]["message"]
    assert seen[1]["after_s"] < 1.0  # at once, not after a wait of its own


def test_mismatched_ops_report_both_sides(tmp_path: Path) -> None:
    seen = _run("mismatch", tmp_path)
    for rank in (0, 1):
        assert seen[rank]["error"] == "HangError"
        assert seen[rank]["after_s"] < TIMEOUT + SLACK_S
        assert "ranks disagree on call #1" in seen[rank]["message"]
    report = HangReport.from_json(seen[0]["report"])
    assert report.verdict.diverged == (0, 1)
    text = report.describe()
    assert "rank 0: #1 all_reduce(float32[4], op=SUM)" in text
    assert "rank 1: #1 broadcast(float32[4], root=0)" in text


def test_collective_on_rank_zero_only(tmp_path: Path) -> None:
    seen = _run("rank0_only", tmp_path)
    assert seen[0]["error"] == "HangError"
    assert seen[0]["after_s"] < TIMEOUT + SLACK_S
    report = HangReport.from_json(seen[0]["report"])
    assert report.verdict.diverged == (0, 1)  # rank 0's #1 is all_reduce, rank 1's is barrier
    assert "rank 1: #1 barrier()" in seen[0]["message"]
    assert "test_diagnostics.py" in seen[0]["message"]  # the call sites are the user's lines
    # rank 0's all_reduce took the fast path (a lean record without a site): its site was found
    # from the live frames once it outlasted the first wait
    (stuck,) = report.states[0].in_flight  # type: ignore[union-attr]
    assert stuck.op == "all_reduce"
    assert stuck.site.endswith(f"test_diagnostics.py:{_line_of('the classic: a collective')}")


def test_killed_rank_is_reported_gone(tmp_path: Path) -> None:
    seen = _run("killed", tmp_path)
    assert 1 not in seen  # SIGKILLed before writing anything
    assert seen[0]["error"] == "PeerLostError"
    assert seen[0]["after_s"] < SLACK_S
    if sys.version_info >= (3, 11):  # the report rides on the error as a note (add_note, 3.11+)
        assert "rank 1 did not answer" in seen[0]["message"]
    assert _dump_report(tmp_path, 0).verdict.missing == (1,)
    # the post-mortem reads the survivor's dump
    assert main(["diagnose", str(tmp_path / "dumps")]) == 0


def test_diagnose_prints_both_sides_and_stacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _run("mismatch", tmp_path)
    capsys.readouterr()
    assert main(["diagnose", str(tmp_path / "dumps")]) == 0
    text = capsys.readouterr().out
    assert "2 dump(s)" in text
    assert "ranks disagree on call #1" in text
    assert "=== rank 0 stacks ===" in text
    assert "=== rank 1 stacks ===" in text
    assert "rank 0: all_reduce" in text
    assert "rank 1: broadcast" in text
    assert main(["diagnose", str(tmp_path / "nothing-here")]) == 2
    assert "cannot read" in capsys.readouterr().err


def _healthy_loop() -> list[float]:
    import threading

    def watchdog_threads() -> list[threading.Thread]:
        return [th for th in threading.enumerate() if th.name == "distcompat-watchdog"]

    t = torch.ones(8)
    before = watchdog_threads()  # init's default (report-only) watchdog, paused while nested
    with watchdog(timeout=10) as w:
        assert w.why() == "all ranks, through the rendezvous store"
        for _ in range(5):
            all_reduce(t)
        work = all_reduce(t, async_op=True)
        work.wait()
        barrier()
    alive = watchdog_threads()
    assert len(alive) == len(before), alive  # the block's own thread is gone
    return t.tolist()


def test_no_hang_no_report_and_results_unchanged() -> None:
    for values in run_on_ranks(_healthy_loop, 2):
        assert values == [64.0] * 8  # 6 sums over 2 ranks: 2**6


def _rank_inner_incident(dump_dir: str) -> tuple[bool, bool]:
    """A nested watchdog reports a late rank; the outer one, resumed, must not report it again."""
    from distcompat.diagnostics import _hooks

    outer = _hooks.state.watchdogs[-1]  # init's default (report-only) watchdog
    before = outer.last_report
    with watchdog(timeout=1.0, action="report", dump_dir=dump_dir) as inner:
        if distcompat.get_rank() == 1:
            time.sleep(2.5)
        all_reduce(torch.ones(1))
    time.sleep(outer.config.poll_s + 1.0)  # the outer thread's first look after it resumed
    return inner.last_report is not None, outer.last_report is before


def test_an_outer_watchdog_does_not_report_the_inner_ones_incident_again(tmp_path: Path) -> None:
    for reported, outer_quiet in run_on_ranks(_rank_inner_incident, 2, args=(str(tmp_path),)):
        assert reported
        assert outer_quiet


def _init_option() -> tuple[bool, bool]:
    from distcompat.collectives import _checked
    from distcompat.testing import DEFAULT_TIMEOUT_S

    distcompat.destroy_distributed()
    distcompat.init_distributed(device="cpu", timeout=DEFAULT_TIMEOUT_S, watchdog=5.0)
    on = _checked.watch is not None
    all_reduce(torch.ones(1))
    distcompat.destroy_distributed()
    off = _checked.watch is None
    distcompat.init_distributed(device="cpu", timeout=DEFAULT_TIMEOUT_S)
    return on, off


def test_init_distributed_watchdog_option() -> None:
    assert run_on_ranks(_init_option, 2) == [(True, True)] * 2
