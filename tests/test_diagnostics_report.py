"""The cross-rank verdict and the post-mortem reader, on fabricated rank accounts (no processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distcompat.diagnostics import CollectiveRecord, HangReport, RankState, read_dumps
from distcompat.diagnostics._postmortem import DumpReadError


def _record(seq: int, op: str = "all_reduce", group: str = "0") -> CollectiveRecord:
    reduce_op = "SUM" if op == "all_reduce" else None
    return CollectiveRecord(
        seq=seq, op=op, group=group, shape=(4,), dtype="float32", reduce_op=reduce_op,
        root=None, site="train.py:10", started=100.0,
    )  # fmt: skip


def _state(rank: int, issued: int, waiting: str | None) -> RankState:
    in_flight = (_record(issued - 1, waiting),) if waiting is not None and issued > 0 else ()
    done = issued - len(in_flight)
    return RankState(
        rank=rank, host="h", pid=100 + rank, reason="test", world_group="0",
        started={"0": issued}, completed={"0": done}, in_flight=in_flight,
        recent=tuple(_record(s) for s in range(max(0, issued - 3), issued)), published=101.0,
        stacks=f"Thread 0x1 (most recent call first):\n  File \"train.py\", line {rank}",
    )  # fmt: skip


accounts = st.lists(
    st.one_of(
        st.none(),
        st.tuples(st.integers(1, 5), st.sampled_from([None, "all_reduce", "broadcast"])),
    ),
    min_size=2,
    max_size=5,
)


@settings(max_examples=60, deadline=None)
@given(accounts)
def test_verdict_names_missing_behind_and_diverged(
    raw: list[tuple[int, str | None] | None],
) -> None:
    states = {r: None if a is None else _state(r, *a) for r, a in enumerate(raw)}
    verdict = HangReport(incident=1, written_by=0, timeout=1.0, world_size=len(raw),
                         trigger="t", states=states).verdict  # fmt: skip
    answered = {r: a for r, a in enumerate(raw) if a is not None}
    assert verdict.missing == tuple(r for r, a in enumerate(raw) if a is None)
    if answered:
        frontier = max(n for n, _ in answered.values())
        assert verdict.behind == tuple(sorted(r for r, (n, _) in answered.items() if n < frontier))
    waiting: dict[int, set[str]] = {}
    for n, op in answered.values():
        if op is not None:
            waiting.setdefault(n - 1, set()).add(op)
    expect_diverged = {
        r for r, (n, op) in answered.items() if op is not None and len(waiting[n - 1]) > 1
    }
    assert set(verdict.diverged) == expect_diverged
    assert verdict.findings  # always says something


def test_a_wait_outside_any_collective_is_said_in_its_own_words() -> None:
    """A rank in a point-to-point wait, its peer elsewhere: no collective is blamed for it."""
    waiting = RankState.from_json(
        _state(1, 2, None).to_json() | {"phase": "in the backend wait of recv from rank 0"}
    )
    states: dict[int, RankState | None] = {0: _state(0, 2, None), 1: waiting}
    report = HangReport(incident=1, written_by=1, timeout=1.0, world_size=2, trigger="t",
                        states=states)  # fmt: skip
    assert report.verdict.findings == (
        "rank 1 waits in the backend wait of recv from rank 0, outside any collective",
    )
    assert waiting.doing() == (
        "not in a distcompat collective, in the backend wait of recv from rank 0"
    )


@settings(max_examples=30, deadline=None)
@given(accounts)
def test_report_json_round_trip(raw: list[tuple[int, str | None] | None]) -> None:
    states = {r: None if a is None else _state(r, *a) for r, a in enumerate(raw)}
    report = HangReport(incident=2, written_by=1, timeout=3.0, world_size=len(raw),
                        trigger="t", states=states)  # fmt: skip
    again = HangReport.from_json(json.loads(json.dumps(report.to_json())))
    assert again == report
    assert again.describe(stacks=True) == report.describe(stacks=True)


def _dump(directory: Path, rank: int, report: HangReport) -> None:
    own = report.states[rank]
    data = {
        "format": "distcompat-hang/2", "job": report.job, "incident": report.incident,
        "rank": rank, "world_size": report.world_size,
        "written": 0.0, "history": [r.to_json() for r in own.recent] if own else [],
        "report": report.to_json(), "text": report.describe(),
    }  # fmt: skip
    (directory / f"rank{rank}.json").write_text(json.dumps(data))


def test_postmortem_merges_newest_incident_and_skips_junk(tmp_path: Path) -> None:
    states = {0: _state(0, 3, "all_reduce"), 1: _state(1, 2, None), 2: None}
    new = HangReport(
        incident=2, written_by=0, timeout=1.0, world_size=3, trigger="t", states=states
    )
    old = HangReport(
        incident=1, written_by=1, timeout=1.0, world_size=3, trigger="t", states=states
    )
    _dump(tmp_path, 0, new)
    _dump(tmp_path, 1, old)
    (tmp_path / "rank7.json").write_text("{not json")
    post = read_dumps(tmp_path)
    assert post.report.incident == 2
    assert list(post.files) == [0]
    assert any("rank7.json" in s for s in post.skipped)
    assert any("older incident" in s for s in post.skipped)
    text = post.describe()
    assert "rank 1 is behind on group 0" in text
    assert "rank 2 did not answer" in text
    assert "=== rank 2 stacks ===\n(none" in text
    assert "#2    rank 0: all_reduce(float32[4], op=SUM) @ train.py:10" in text


def test_postmortem_refuses_an_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(DumpReadError, match="no hang dump"):
        read_dumps(tmp_path)


def test_postmortem_never_merges_two_jobs(tmp_path: Path) -> None:
    """Hand-made dumps: rank 0 of job "a", rank 1 of job "b", same incident number."""
    states: dict[int, RankState | None] = {
        0: _state(0, 3, "all_reduce"),
        1: _state(1, 3, "broadcast"),
    }
    for job, rank in (("a-job", 0), ("b-job", 1)):
        report = HangReport(incident=1, written_by=rank, timeout=1.0, world_size=2, trigger="t",
                            states=states, job=job)  # fmt: skip
        folder = tmp_path / job / "incident-1"
        folder.mkdir(parents=True)
        _dump(folder, rank, report)
    post = read_dumps(tmp_path)
    assert len(post.files) == 1  # one job's dump, never rank 0 of one job beside rank 1 of another
    other = "a-job" if post.report.job == "b-job" else "b-job"
    assert post.others == ((other, 1),)
    assert any(f"job {other} incident 1" in s and "another job" in s for s in post.skipped)
    assert read_dumps(tmp_path, job="a").report.job == "a-job"  # a unique prefix picks it
    with pytest.raises(DumpReadError, match="matches several jobs"):
        read_dumps(tmp_path, job="")
    with pytest.raises(DumpReadError, match="no dump of job='c'"):
        read_dumps(tmp_path, job="c")


def test_postmortem_refuses_dumps_that_name_no_job(tmp_path: Path) -> None:
    (tmp_path / "rank0.json").write_text(json.dumps({"format": "distcompat-hang/1", "rank": 0}))
    with pytest.raises(DumpReadError, match="older dumps name no job"):
        read_dumps(tmp_path)
