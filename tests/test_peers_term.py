"""SIGTERM after a peer ended: the watch's line first, then the default end (``peers._term``).

Real rank processes, every default on, with the fastest launcher there can be: the test sends
SIGTERM to the survivor the moment the other rank's process ends (``run_ranks(term_after=1)``;
torchrun's agent looks every 0.1 s and then does the same). Before ``_term``, the survivor
died at that signal with no line in 2 runs of 2.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from _rank_processes import run_ranks
from distcompat.peers import _term, _watch

SCRIPT = Path(__file__).with_name("_peer_watch_script.py")
LINE = re.compile(r"distcompat: rank 1 \(pid \d+ on \S+\) (ended|exited after .*) \(seen at ")
TERMINATED = -signal.SIGTERM

needs_pidfd = pytest.mark.skipif(not _watch.supported(), reason="needs pidfd_open (Linux)")


@pytest.fixture
def default_sigterm() -> Iterator[None]:
    """SIGTERM's default action and no wakeup fd, for the test; what was there is put back."""
    handler = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    wakeup = signal.set_wakeup_fd(-1)
    yield
    _term.uninstall()
    signal.signal(signal.SIGTERM, handler)
    signal.set_wakeup_fd(wakeup)


@needs_pidfd
@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["raise", "kill"])
def test_the_line_is_written_before_sigterm_ends_the_survivor(
    scenario: str, tmp_path: Path
) -> None:
    ranks = run_ranks(SCRIPT, 2, args=(scenario, str(tmp_path)), timeout=120, term_after=1)
    assert ranks[0].returncode == TERMINATED, ranks[0].stderr[-3000:]  # as the default action
    match = LINE.search(ranks[0].stderr)
    assert match, ranks[0].stderr[-3000:]
    if scenario == "raise":
        assert match.group(1).startswith("exited after ValueError: bad batch 7 at ")


@needs_pidfd
@pytest.mark.slow
def test_a_main_thread_in_native_code_ends_at_sigterm_all_the_same(tmp_path: Path) -> None:
    """Rank 0 is inside a matmul of seconds (8000 x 8000, float64: 6.6 s on this machine's two
    cores), where Python runs no handler: the watch thread writes the line and ends it."""
    ranks = run_ranks(SCRIPT, 2, args=("compute", str(tmp_path)), timeout=120, term_after=1)
    assert ranks[0].returncode == TERMINATED, ranks[0].stderr[-3000:]
    assert LINE.search(ranks[0].stderr), ranks[0].stderr[-3000:]
    assert "rank 0: computed" not in ranks[0].stdout
    assert ranks[0].ended - ranks[1].ended < 1.0  # not when the matmul returns


@needs_pidfd
@pytest.mark.slow
def test_a_program_handler_that_calls_ours_keeps_the_process(tmp_path: Path) -> None:
    """The program installed its own SIGTERM handler after init and calls the one it replaced:
    ours returns at once, the process goes on as the program decides, the line is written."""
    ranks = run_ranks(SCRIPT, 2, args=("composed", str(tmp_path)), timeout=120, term_after=1)
    assert ranks[0].returncode == 3, ranks[0].stderr[-3000:]
    assert "rank 0: caught SIGTERM" in ranks[0].stdout
    assert "rank 0: raised PeerLostError" in ranks[0].stdout
    assert LINE.search(ranks[0].stderr), ranks[0].stderr[-3000:]


@pytest.mark.usefixtures("default_sigterm")
def test_installed_where_sigterm_has_its_default_action_and_put_back_after() -> None:
    assert _term.install(lambda: True).startswith("installed")
    assert _term.installed()
    assert signal.set_wakeup_fd(-1) == _term._wakeup_pipe()[1]  # ours, at once
    signal.set_wakeup_fd(_term._wakeup_pipe()[1])
    _term.uninstall()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert signal.set_wakeup_fd(-1) == -1


@pytest.mark.usefixtures("default_sigterm")
def test_a_program_handler_is_left_alone() -> None:
    def mine(signum: int, frame: object) -> None:
        pass

    signal.signal(signal.SIGTERM, mine)
    assert _term.install(lambda: True) == "not installed: the program handles SIGTERM itself"
    assert signal.getsignal(signal.SIGTERM) is mine
    _term.uninstall()
    assert signal.getsignal(signal.SIGTERM) is mine


@pytest.mark.usefixtures("default_sigterm")
def test_a_wakeup_fd_set_before_stays_and_the_handler_still_goes_in() -> None:
    theirs, other = socket.socketpair()
    theirs.setblocking(False)
    try:
        signal.set_wakeup_fd(theirs.fileno())
        assert "another wakeup fd" in _term.install(lambda: True)
        assert _term.installed()
        assert signal.set_wakeup_fd(-1) == theirs.fileno()
        signal.set_wakeup_fd(theirs.fileno())
        _term.uninstall()
        assert signal.set_wakeup_fd(-1) == theirs.fileno()  # not ours to take away
    finally:
        theirs.close()
        other.close()


@pytest.mark.usefixtures("default_sigterm")
def test_outside_the_main_thread_nothing_is_installed() -> None:
    said: list[str] = []
    thread = threading.Thread(target=lambda: said.append(_term.install(lambda: True)))
    thread.start()
    thread.join()
    assert said == ["not installed: init ran outside the main thread, where signals are set"]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


@pytest.mark.usefixtures("default_sigterm")
def test_a_forked_child_gets_the_default_action_and_no_wakeup_fd() -> None:
    """A DataLoader worker made by fork must not write its signals into this process's pipe."""
    _term.install(lambda: True)
    pid = os.fork()
    if pid == 0:  # the child: 0 when both are as before init
        default = signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        os._exit(0 if default and signal.set_wakeup_fd(-1) == -1 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _term.installed()  # the parent keeps its own


@pytest.mark.usefixtures("default_sigterm")
def test_sigterm_is_seen_in_the_pipe_the_watch_polls() -> None:
    """The C half of Python's signal handling writes the number at once (no handler run yet)."""
    _term.install(lambda: True)
    assert not _term.woken_by_term()
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # a program's: it must not end us
    signal.raise_signal(signal.SIGTERM)
    assert _term.woken_by_term()
    assert not _term.woken_by_term()  # read once


@pytest.mark.usefixtures("default_sigterm")
def test_no_fd_left_for_the_pipe_installs_the_handler_without_a_wakeup_fd(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Simulated: ``os.pipe`` fails as it does at the open-file limit (EMFILE)."""

    def no_fd() -> tuple[int, int]:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(_term, "_pipe", None)
    monkeypatch.setattr(os, "pipe", no_fd)
    said = _term.install(lambda: True)
    assert said.startswith("installed: SIGTERM waits for the watch's lines (no wakeup fd: ")
    assert "open" in said
    assert _term.installed()
    assert _term.read_fd() is None
    assert signal.set_wakeup_fd(-1) == -1
