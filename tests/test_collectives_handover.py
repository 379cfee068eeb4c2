"""An error owed to a thread whose C++ call an op failed in (``_handover``): raised there once.

No process group: the C++ call (DDP's ``loss.backward()``) is stood in for by a Python frame the
error is handed over in; the watcher thread that would raise it asynchronously is held back
(monkeypatched) where the test needs the entry to come first, as on a loaded machine.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType

import pytest
import torch

from distcompat.collectives import _entry, _handover
from distcompat.collectives._errors import PeerLostError
from distcompat.collectives._handover import FAILED, OWED, Caller, forget, raise_owed, shielded


@pytest.fixture(autouse=True)
def _nothing_handed_over() -> Iterator[None]:
    """Each test starts and ends with no error owed or on record in this process."""
    forget()
    yield
    forget()


@pytest.fixture
def slow_watcher(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Hold every watcher thread until the event is set (a loaded machine's late thread)."""
    go = threading.Event()
    late = _handover._raise_when_back
    started: list[threading.Thread] = []

    def held(owed: object) -> None:
        go.wait(10)
        late(owed)  # type: ignore[arg-type]

    def start(owed: object) -> None:
        thread = threading.Thread(target=held, args=(owed,), daemon=True)
        started.append(thread)
        thread.start()

    monkeypatch.setattr(_handover, "_watch", start)
    yield go
    go.set()
    for thread in started:
        thread.join(10)
    OWED.clear()


def _lost() -> PeerLostError:
    return PeerLostError("all_reduce: a peer process went away (rank 1)", op="all_reduce", peer=1)


def _failed_future() -> torch.futures.Future[object]:
    failed: torch.futures.Future[object] = torch.futures.Future()
    failed.set_exception(_lost())
    return failed


@_entry.entry
def _collective() -> str:
    return "ran"


def _backward(owe: list[torch.futures.Future[object]]) -> FrameType:
    """Stand in for a C++ call made from this frame: an op fails in it, and is handed over."""
    caller = Caller(threading.get_ident(), sys._getframe())
    owe.append(shielded(_failed_future(), ["outputs"], caller))
    assert _collective() == "ran"  # the reducer's next bucket, inside the call: not raised here
    return sys._getframe()


def test_the_next_collective_raises_the_owed_error_once(slow_watcher: threading.Event) -> None:
    futures: list[torch.futures.Future[object]] = []
    _backward(futures)
    assert futures[0].value() == ["outputs"]  # the C++ caller's future never fails
    with pytest.raises(PeerLostError, match=r"rank 1"):
        _collective()  # before its body: no collective starts with the error on its way
    assert not OWED
    assert _collective() == "ran"  # raised once
    slow_watcher.set()  # the watcher, late, finds it claimed: nothing more is raised here


def test_a_later_failure_of_the_same_call_adds_nothing(slow_watcher: threading.Event) -> None:
    caller = Caller(threading.get_ident(), sys._getframe())
    shielded(_failed_future(), None, caller)
    first = OWED[threading.get_ident()]
    shielded(_failed_future(), None, caller)  # another bucket of the same backward
    assert OWED[threading.get_ident()] is first
    OWED.clear()


def test_nothing_owed_and_an_ended_threads_error_raise_nothing() -> None:
    raise_owed()  # nothing owed here
    ended: list[Caller] = []

    def run() -> None:
        ended.append(Caller(threading.get_ident(), sys._getframe()))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    owed = _handover._Owed(ended[0], _lost())
    OWED[ended[0].thread] = owed
    _handover._raise_when_back(owed)  # the thread is gone: claimed, raised nowhere
    assert ended[0].thread not in OWED


def test_the_watcher_raises_in_the_thread_once_it_is_back() -> None:
    """The watcher's way (no collective comes): the error lands in the thread's next bytecodes."""
    seen: list[BaseException] = []

    def thread_body() -> None:
        try:
            futures: list[torch.futures.Future[object]] = []
            _backward(futures)
            done = threading.Event()
            while not done.wait(0.001):  # Python keeps running: the async error lands here
                pass
        except PeerLostError as exc:
            seen.append(exc)

    thread = threading.Thread(target=thread_body)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    assert len(seen) == 1
    assert "rank 1" in str(seen[0])
    assert not OWED


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)


def _clean_backward() -> None:
    """Stand in for the next backward: a C++ call from another frame hands over an op."""
    done: torch.futures.Future[object] = torch.futures.Future()
    done.set_result(["reduced"])
    shielded(done, None, Caller(threading.get_ident(), sys._getframe()))


def test_each_step_after_a_failed_backward_raises_until_the_next_backward(
    slow_watcher: threading.Event,
) -> None:
    """The watcher is late: the step claims the owed error, so the watcher raises nothing."""
    opt = _optimizer()
    before = opt.param_groups[0]["params"][0].detach().clone()
    opt.param_groups[0]["params"][0].grad = torch.ones(2)  # what a failed reduction left
    _backward([])
    for _ in range(2):  # caught, and stepped again: still the gradients of the failed backward
        with pytest.raises(PeerLostError, match=r"rank 1"):
            opt.step()
    assert not OWED
    assert torch.equal(opt.param_groups[0]["params"][0], before)  # no step was applied
    slow_watcher.set()
    _clean_backward()
    assert not FAILED
    opt.step()
    assert not torch.equal(opt.param_groups[0]["params"][0], before)


def _spin(seconds: float, swallow: bool) -> int:
    """Run Python for ``seconds``; with ``swallow``, as importlib's path scans do (``except
    OSError``) around each stat. Return how many errors were swallowed."""
    swallowed = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            os.stat("/")
        except OSError:
            if not swallow:
                raise
            swallowed += 1
    return swallowed


def test_a_swallowed_raise_is_raised_again_by_the_step() -> None:
    """The watcher's raise lands in code that catches ``OSError`` (a ``PeerLostError`` is a
    ``ConnectionError``): the optimizer step raises it all the same."""
    opt = _optimizer()
    _backward([])
    swallowed = 0
    deadline = time.monotonic() + 10
    while not swallowed and OWED and time.monotonic() < deadline:
        swallowed = _spin(0.01, swallow=True)  # the watcher raises once the call is back
    assert swallowed == 1
    assert not OWED
    with pytest.raises(PeerLostError, match=r"rank 1"):
        opt.step()


def test_the_error_lands_once_whoever_raises_it_first() -> None:
    """The watcher and the step race (the step comes 0 to 2 ms after the call returns): the
    error is raised exactly once, and nothing lands in the Python that runs afterwards."""
    opt = _optimizer()
    for attempt in range(40):
        _backward([])
        raised = 0
        try:
            time.sleep(attempt % 5 * 0.0005)
            opt.step()
        except PeerLostError:
            raised += 1
        try:
            _spin(0.01, swallow=False)  # a raise still on its way would land here
        except PeerLostError:
            raised += 1
        assert raised == 1, attempt
        _clean_backward()
