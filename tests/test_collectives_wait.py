"""The one wait on peers (``collectives._wait``): its adapters and its deadline, in one process.

Unit tests without a process group (``gone_peers`` finds nothing to look at); the waits on real
peers are tested where they are used (test_collectives_p2p_wait.py, test_checkpoint.py,
test_diagnostics_matrix.py).
"""

from __future__ import annotations

import functools
import threading
import time

import pytest

from distcompat.collectives import CollectiveTimeoutError, _blocking, _wait
from distcompat.collectives._wait import Wait, current, until


def test_a_wait_ends_at_its_deadline_naming_the_peer() -> None:
    release = threading.Event()
    seen: list[str] = []
    started = time.monotonic()
    wait = Wait(
        op="recv",
        phase="backend wait",
        group=None,
        started=started,
        deadline=started + 0.8,
        awaited=lambda: (3,),
    )
    with pytest.raises(CollectiveTimeoutError) as caught:
        until(release.wait, wait, between=lambda: seen.append(str(current(threading.get_ident()))))
    release.set()
    assert 0.8 <= time.monotonic() - started < 1.5
    assert caught.value.peers == (3,)
    assert "in the backend wait of recv: not every rank arrived (rank 3)" in str(caught.value)
    assert seen, "no slice ran out before the deadline"
    assert "phase='backend wait'" in seen[0]  # the wait was current while it lasted


class _Seen:
    """A stand-in for the watchdog's observer that records what it is shown."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def watch(self, wait: Wait) -> None:
        self.calls.append(("watch", wait.describe()))

    def release(self, wait: Wait) -> None:
        self.calls.append(("release", wait.describe()))


def test_a_call_made_beside_is_shown_once_it_outlasts_a_slice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = _Seen()
    monkeypatch.setattr(_wait, "observer", seen)
    during: list[Wait | None] = []

    def slow() -> int:
        time.sleep(3 * _wait.POLL_S)
        during.append(_wait.current(threading.get_ident()))
        return 5

    def make(started: float) -> Wait:
        return Wait(op="recv", phase="backend wait", group=None, started=started)

    assert _blocking.beside(slow, make) == 5
    assert during[0] is not None
    assert during[0].describe() == "in the backend wait of recv"
    assert ("watch", "in the backend wait of recv") in seen.calls
    assert seen.calls[-1] == ("release", "in the backend wait of recv")
    assert _wait.current(threading.get_ident()) is None


def test_a_fast_call_made_beside_costs_no_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _Seen()
    monkeypatch.setattr(_wait, "observer", seen)

    def never(started: float) -> Wait:
        raise AssertionError("a call that ends within a slice is never looked at")

    calls = [functools.partial(int, n) for n in range(1000)]
    assert [_blocking.beside(call, never) for call in calls] == list(range(1000))
    time.sleep(2 * _wait.POLL_S)  # the watcher looks twice meanwhile: nothing left to see
    assert seen.calls == []
    assert _blocking._beside == {}
