"""The defaults matrix: where real jobs hang, with every default on, on real rank processes.

Scenarios (``_matrix_script.py``; the culprit is the last rank) x ``DISTCOMPAT_SHM`` {auto, off}
x the mismatch check {on, off}, at 2 ranks, and the first three scenarios at 3 ranks. The
watchdog is the default one (report-only), with ``DISTCOMPAT_WATCHDOG`` set short; each case
asserts what a user must see:

* a culprit that is alive but late or absent is named in the waiting rank's log, with its frame
  (``read_shard``), within threshold + 6 s of the call;
* a job whose culprit never comes ends on the waiting rank with a typed error
  (:class:`CollectiveTimeoutError` naming the culprit) by the group timeout + 10 s, and the
  process exits within seconds of it; a killed culprit gives :class:`PeerLostError` at once;
* report-only never kills a job that recovers: a late culprit's job completes, every rank 0;
* a mismatched call ends in a typed error on every rank that reached it (never SIGABRT, never
  a wait past the group timeout).

The cases run six at a time (a module fixture), so the whole matrix takes under two minutes;
the timing margins are the issue's own (threshold + 6 s, timeout + 10 s).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from _rank_processes import Ended, run_ranks

SCRIPT = Path(__file__).with_name("_matrix_script.py")
THRESHOLD_S = 2.0  # DISTCOMPAT_WATCHDOG
TIMEOUT_S = 10.0  # the group timeout
LATE_S = 5.0  # how late a recovering culprit is
REPORT_SLACK_S = 6.0  # the bound: a report within threshold + 6 s
ERROR_SLACK_S = 10.0  # the bound: a typed error within the group timeout + 10 s
EXIT_SLACK_S = 6.0  # a process ends within seconds of its error

SCENARIOS = (
    "never",
    "recover",
    "mismatch-first",
    "killed",
    "stopped",
    "mismatch-later",
)
CONFIGS = tuple((shm, check) for shm in ("auto", "off") for check in ("on", "off"))


@dataclass(frozen=True, slots=True)
class Case:
    """One cell of the matrix."""

    scenario: str
    world: int
    shm: str
    check: str

    @property
    def id(self) -> str:
        return f"{self.scenario}-{self.world}ranks-shm_{self.shm}-check_{self.check}"


CASES = tuple(
    Case(scenario, world, shm, check)
    for scenario in SCENARIOS
    for world in (2, 3)
    for shm, check in CONFIGS
    if world == 2 or scenario in ("never", "recover", "mismatch-first")
)


def _run(case: Case, tmp: Path) -> list[Ended]:
    env = {
        "DISTCOMPAT_WATCHDOG": str(THRESHOLD_S),
        "DISTCOMPAT_SHM": case.shm,
        "DISTCOMPAT_MISMATCH_CHECK": case.check,
        "MATRIX_TIMEOUT": str(TIMEOUT_S),
        "MATRIX_LATE": str(LATE_S),
        "TMPDIR": str(tmp / case.id),
    }
    (tmp / case.id).mkdir()
    # a culprit that never comes (or is stopped) is killed once rank 0 has ended
    stop = 0 if case.scenario in ("never", "stopped") else None
    return run_ranks(SCRIPT, case.world, env=env, args=[case.scenario], timeout=90, stop_after=stop)


@pytest.fixture(scope="module")
def outcomes(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[Case, list[Ended]]]:
    """Run every selected case, four at a time; map each case to how its ranks ended."""
    tmp = tmp_path_factory.mktemp("matrix")
    selected = [
        case
        for item in request.session.items
        if isinstance(item, pytest.Function)
        and item.originalname == "test_defaults_matrix"
        and isinstance(case := item.callspec.params["case"], Case)
    ]
    # Six at a time: the cases mostly wait (on a late rank, the group timeout). On the 2-core VM
    # the matrix took 137 s four at a time, 100 s six or eight at a time.
    with ThreadPoolExecutor(max_workers=6) as pool:
        futures = {case: pool.submit(_run, case, tmp) for case in selected}
        yield {case: future.result() for case, future in futures.items()}


def _calls(ended: Ended) -> dict[str, float]:
    return {m[0]: float(m[1]) for m in re.findall(r"^CALL (\S+) ([0-9.]+)", ended.stdout, re.M)}


def _failure(ended: Ended) -> tuple[float, str, str] | None:
    match = re.search(r"^FAILED_AT ([0-9.]+) (\S+) ?(.*)$", ended.stdout, re.M)
    return None if match is None else (float(match[1]), match[2], match[3])


def _reports(ended: Ended) -> list[tuple[float, str]]:
    """The hang reports this rank logged: (time, text), in order."""
    heads = list(re.finditer(r"^([0-9.]+) distcompat.diagnostics \[rank \d+\]", ended.stderr, re.M))
    ends = [h.start() for h in heads[1:]] + ([len(ended.stderr)] if heads else [])
    return [
        (float(h[1]), ended.stderr[h.start() : end]) for h, end in zip(heads, ends, strict=True)
    ]


def _report_after(ended: Ended, since: float, until: float | None = None) -> tuple[float, str]:
    """The first report logged after ``since`` (and before ``until``): its delay and text."""
    for at, text in _reports(ended):
        if at >= since and (until is None or at < until):
            return at - since, text
    raise AssertionError(f"rank {ended.rank} logged no hang report after the call:\n{ended.stderr}")


def _names(text: str, culprit: int, *, frame: bool = True) -> bool:
    named = re.search(rf"rank {culprit}\b", text) is not None
    return named and (
        not frame or re.search(r"_matrix_script.py:\d+ in read_shard", text) is not None
    )


def _detail(ranks: list[Ended]) -> str:
    return "\n".join(
        f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.stdout}\n{r.stderr[-4000:]}"
        for r in ranks
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_defaults_matrix(case: Case, outcomes: dict[Case, list[Ended]]) -> None:
    ranks = outcomes[case]
    culprit = case.world - 1
    waiters = ranks[:culprit]
    detail = _detail(ranks)
    assert all(r.returncode != -6 for r in ranks), "SIGABRT\n" + detail
    if case.scenario == "recover":  # report-only never kills a job that recovers
        assert [r.returncode for r in ranks] == [0] * case.world, detail
        for waiter in waiters:
            calls = _calls(waiter)
            for label, until in (("first", "new"), ("new", "repeat"), ("repeat", None)):
                delay, text = _report_after(waiter, calls[label], calls.get(until or ""))
                assert THRESHOLD_S - 0.5 <= delay < THRESHOLD_S + REPORT_SLACK_S, (label, detail)
                assert _names(text, culprit), (label, text)
        return
    if case.scenario in ("mismatch-first", "mismatch-later"):
        for ended in ranks:
            failed = _failure(ended)
            assert failed is not None, detail
            at, kind, _ = failed
            # a rank whose peer already gave up on the call may see it go away instead
            assert kind in ("CollectiveMismatchError", "CollectiveTimeoutError", "PeerLostError")
            taken = at - _calls(ended)["mismatch"]
            bound = 5.0 if case.check == "on" else TIMEOUT_S + ERROR_SLACK_S
            assert taken < bound, (taken, detail)
            assert ended.returncode not in (0, None), detail
            assert ended.ended - at < EXIT_SLACK_S, detail
        return
    label = "first" if case.scenario == "never" else "after"
    for waiter in waiters:
        failed = _failure(waiter)
        assert failed is not None, detail
        at, kind, message = failed
        taken = at - _calls(waiter)[label]
        assert waiter.returncode not in (0, None), detail
        assert waiter.ended - at < EXIT_SLACK_S, detail  # the process ends with its error
        if case.scenario == "killed":
            assert kind == "PeerLostError", detail
            assert taken < 5.0, detail
            assert f"rank {culprit}" in message, message
            continue
        assert kind == "CollectiveTimeoutError", detail
        assert TIMEOUT_S - 1 <= taken < TIMEOUT_S + ERROR_SLACK_S, (taken, detail)
        assert f"rank {culprit}" in message, message
        delay, text = _report_after(waiter, _calls(waiter)[label])
        assert delay < THRESHOLD_S + REPORT_SLACK_S, (delay, detail)
        assert _names(text, culprit, frame=case.scenario == "never"), text


@pytest.mark.slow
@pytest.mark.parametrize("shm", ["auto", "off"])
def test_a_raising_watchdog_around_the_first_call_names_the_absent_rank(
    shm: str, tmp_path: Path
) -> None:
    """``with distcompat.watchdog(timeout=3)`` around a first call whose peer never comes."""
    env = {"DISTCOMPAT_SHM": shm, "TMPDIR": str(tmp_path), "MATRIX_TIMEOUT": "30"}
    ranks = run_ranks(SCRIPT, 2, env=env, args=["raising-first"], timeout=60, stop_after=0)
    waiter = ranks[0]
    failed = _failure(waiter)
    assert failed is not None, _detail(ranks)
    at, kind, message = failed
    assert kind == "HangError", _detail(ranks)
    assert message.startswith("peer=1 "), message
    assert at - _calls(waiter)["first"] < 10.0, _detail(ranks)
    assert "rank 1 is behind on group" in waiter.stderr
