"""SIGKILL fault injection: a process saving in a loop is killed at random moments, many times.

A zygote process (tests/_crash_zygote.py) imports torch once and forks one saver per kill point,
so each kill point costs milliseconds. After every kill the parent checks, from disk alone, what a
resumed job would see: the newest committed step loads and verifies, every committed step is
whole, and no step committed earlier (and not yet due for retention) went missing.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from distcompat.checkpoint import (
    committed_steps,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

ZYGOTE = Path(__file__).with_name("_crash_zygote.py")
KEEP_LAST = 3
DIR_KILLS = 150
FILE_KILLS = 60
#: Kill delays are drawn uniformly from [0, SAVES_PER_WINDOW x one save's measured time], so kills
#: land in every phase (writing, manifest, rename, retention) and the loop still makes progress,
#: however fast or slow this disk's fsync is.
SAVES_PER_WINDOW = 4
#: Added to the window: a forked saver first scans the directory for where to resume.
CHILD_START_S = 0.015


def _window_s(scratch: Path) -> float:
    """Time a few saves like the zygote's on this disk; return the kill-delay window."""
    times = []
    for step in range(1, 6):
        started = time.perf_counter()
        save_checkpoint(scratch, step, {"w": torch.zeros(2048)}, keep_last=KEEP_LAST)
        times.append(time.perf_counter() - started)
    return CHILD_START_S + SAVES_PER_WINDOW * statistics.median(times)


class Zygote:
    def __init__(self, mode: str, target: Path, log: Path) -> None:
        self.log = log
        self._stderr = open(log, "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [sys.executable, str(ZYGOTE), mode, str(target)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )

    def _line(self, prefix: str) -> int:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith(prefix), f"zygote said {line!r}; its stderr:\n{self.log.read_text()}"
        return int(line.split()[1])

    def kill_after(self, delay: float) -> None:
        """Fork a saver, SIGKILL it ``delay`` seconds later, and check that the kill ended it."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        pid = self._line("pid")
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        status = self._line("end")
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        assert killed, (
            f"the saver ended with status {status} before the kill:\n{self.log.read_text()}"
        )

    def close(self) -> None:
        """Stop the zygote (end of input) and release its pipes; safe to call twice."""
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self._stderr.close()


@pytest.fixture
def zygote_factory(tmp_path: Path) -> Iterator[type[Zygote]]:
    made: list[Zygote] = []

    class Made(Zygote):
        def __init__(self, mode: str, target: Path, log: Path) -> None:
            super().__init__(mode, target, log)
            made.append(self)

    yield Made
    for zygote in made:
        zygote.close()


def _names(root: Path) -> set[str]:
    return {p.name for p in root.iterdir()} if root.exists() else set()


def _where(root: Path, new: set[str]) -> str:
    """Guess from the debris a kill left (names new since the last kill) which phase it hit."""
    if any(".deleting-" in n for n in new):
        return "retention"
    tmps = [root / n for n in new if ".tmp-" in n]
    if any((t / "manifest.json").exists() for t in tmps):
        return "manifest written, not renamed"
    if tmps:
        return "writing rank files"
    return "between saves or after commit"


@pytest.mark.slow
def test_sigkill_during_directory_saves(tmp_path: Path, zygote_factory: type[Zygote]) -> None:
    root = tmp_path / "ckpt"
    rng = random.Random(1234)
    window = _window_s(tmp_path / "calibration")
    zygote = zygote_factory("dir", root, tmp_path / "zygote.log")
    previous: list[int] = []
    best = 0
    outcomes: Counter[str] = Counter()
    started = time.monotonic()
    for _ in range(DIR_KILLS):
        before = _names(root)
        zygote.kill_after(rng.uniform(0.0, window))
        outcomes[_where(root, _names(root) - before)] += 1
        steps = committed_steps(root)
        for step in steps:  # every committed step is whole, checksums included
            manifest = verify_checkpoint(root, step)
            assert manifest.step == step
            assert manifest.metadata == {"s": step}
        latest = latest_checkpoint(root, checksums=True)
        if not steps:
            assert latest is None
            assert best == 0
            continue
        assert latest == steps[-1] >= best, f"resume point went back: {latest} after {best}"
        state = load_checkpoint(root, latest)
        assert state["step"] == latest
        assert torch.equal(state["w"], torch.full_like(state["w"], float(latest)))
        lost = [s for s in previous if s >= steps[0] and s not in steps]
        assert not lost, f"committed steps {lost} vanished without being due for retention"
        previous, best = steps, latest  # (more than KEEP_LAST if kills hit before retention)
    zygote.close()
    elapsed = time.monotonic() - started
    print(
        f"\n{DIR_KILLS} kills in {elapsed:.1f}s (window {window * 1e3:.0f} ms), reached step "
        f"{best}; kills hit: {dict(outcomes)}"
    )
    assert best >= 5, "the saver barely made progress: the kill delays are too short"
    # the next uninterrupted save applies retention and clears every older leftover
    save_checkpoint(root, best + 1, {"step": best + 1}, keep_last=KEEP_LAST)
    kept = {f"step-{step}" for step in range(best - KEEP_LAST + 2, best + 2)}
    assert {p.name for p in root.iterdir()} == kept
    assert outcomes["between saves or after commit"] < DIR_KILLS, "no kill landed inside a save"


@pytest.mark.slow
def test_sigkill_during_atomic_save(tmp_path: Path, zygote_factory: type[Zygote]) -> None:
    target = tmp_path / "model.pt"
    rng = random.Random(4321)
    window = _window_s(tmp_path / "calibration")
    zygote = zygote_factory("file", target, tmp_path / "zygote.log")
    best = 0
    for _ in range(FILE_KILLS):
        zygote.kill_after(rng.uniform(0.0, window))
        if not target.exists():
            assert best == 0
            continue
        state = torch.load(target, weights_only=True)  # never torn: old or new, whole
        assert state["step"] >= best
        assert torch.equal(state["w"], torch.full_like(state["w"], float(state["step"])))
        best = state["step"]
    zygote.close()
    assert best >= 3
