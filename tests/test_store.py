"""The mismatch check's store requests stay bounded when the store does not answer.

A network partition is *simulated* here: the TCPStore server runs in a child process that the
test stops with SIGSTOP, so its socket stays open and nothing answers (as when packets are
dropped). The real partition, between two network-namespace nodes, is the launchers session's
``partition`` fault.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from distcompat._store import STUCK_GRACE_S, TIMEOUT_S, QuickStore, StoreUnreachable

_SERVER = """
import sys, time
from datetime import timedelta
from typing import Any
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=600),
                      wait_for_workers=False)
store.set("agree/k", "1")
print(store.port, flush=True)
time.sleep(600)
"""


@pytest.fixture
def server() -> Iterator[tuple[subprocess.Popen[str], int]]:
    child = subprocess.Popen(
        [sys.executable, "-c", _SERVER],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert child.stdout is not None
    port = int(child.stdout.readline())
    try:
        yield child, port
    finally:
        child.kill()
        child.wait()
        child.stdout.close()


def _stop(pid: int) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped.

    The signal is asynchronous: on a loaded machine the server's thread can still answer a
    request sent right after ``kill`` (seen in CI), which the test would read as no bound.
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat") as stat:
                states.append(stat.read().rsplit(")", 1)[1].split()[0])
        if all(state in ("T", "t") for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"the store server (pid {pid}) did not stop within 10 s")


def _quick(port: int) -> QuickStore:
    client = dist.TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=600))
    return QuickStore(dist.PrefixStore("agree", client))


def _silenced(child: subprocess.Popen[str], port: int) -> QuickStore:
    """Connect to the server, see it answer, then stop it (SIGSTOP): a silent store."""
    quick = _quick(port)
    assert quick.check(["k"])
    assert quick.multi_get(["k"]) == [b"1"]
    _stop(child.pid)
    return quick


def test_requests_are_bounded_while_the_store_is_silent_and_resume_after(
    server: tuple[subprocess.Popen[str], int],
) -> None:
    child, port = server
    quick = _silenced(child, port)
    try:
        for _ in range(3):  # the first gives up after TIMEOUT_S; later ones do not pile up
            started = time.monotonic()
            with pytest.raises(StoreUnreachable, match="did not answer"):
                quick.check(["k"])
            assert time.monotonic() - started < TIMEOUT_S + 1.5
    finally:
        os.kill(child.pid, signal.SIGCONT)
    quick.set("k2", "2")  # the stuck request came back: the same connection is used on
    assert quick.multi_get(["k", "k2"]) == [b"1", b"2"]


def test_while_a_request_is_stuck_past_its_bound_the_next_ones_fail_at_once(
    server: tuple[subprocess.Popen[str], int],
) -> None:
    """One request waits its bound; the ones after it do not each wait it again."""
    child, port = server
    quick = _silenced(child, port)
    try:
        started = time.monotonic()
        with pytest.raises(StoreUnreachable, match="did not answer check within"):
            quick.check(["k"])
        assert TIMEOUT_S - 0.1 <= time.monotonic() - started < TIMEOUT_S + 1.5
        for _ in range(3):
            started = time.monotonic()
            with pytest.raises(StoreUnreachable, match="an earlier check is still unanswered"):
                quick.multi_get(["k"])
            assert time.monotonic() - started < STUCK_GRACE_S + 0.5
    finally:
        os.kill(child.pid, signal.SIGCONT)
    assert quick.multi_get(["k"]) == [b"1"]


def test_a_store_that_went_away_is_unreachable(
    server: tuple[subprocess.Popen[str], int],
) -> None:
    child, port = server
    quick = _quick(port)
    assert quick.multi_get(["k"]) == [b"1"]
    child.kill()
    child.wait()
    started = time.monotonic()
    with pytest.raises(StoreUnreachable, match="did not answer"):
        quick.check(["k"])
    assert time.monotonic() - started < TIMEOUT_S + 1.5


class _Counted(dist.Store):
    """A store that counts its clones (new connections) and serves requests through ``store``."""

    def __init__(self, store: Any) -> None:
        super().__init__()
        self.store, self.clones = store, 0

    def clone(self) -> Any:
        self.clones += 1
        return self.store.clone()

    def set(self, key: str, value: str) -> None:
        self.store.set(key, value)

    def check(self, keys: list[str]) -> bool:
        return bool(self.store.check(keys))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return list(self.store.multi_get(keys))


def test_requests_go_over_the_stores_own_connection_under_each_prefix(
    server: tuple[subprocess.Popen[str], int],
) -> None:
    """A new connection can make every rank's store wait the resolver's 5 s (see _store's
    docstring): the check, the shared-memory set-ups and the peer lookup make none."""
    _, port = server
    source = _Counted(dist.TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=60)))
    first, second = QuickStore(source, "agree"), QuickStore(source, "shm/0")
    first.set("k3", "3")
    second.set("k3", "4")
    assert first.multi_get(["k", "k3"]) == [b"1", b"3"]  # each under its own prefix
    assert second.check(["k3"])
    assert second.multi_get(["k3"]) == [b"4"]
    assert QuickStore(source).multi_get(["agree/k3", "shm/0/k3"]) == [b"3", b"4"]
    assert source.clones == 0
