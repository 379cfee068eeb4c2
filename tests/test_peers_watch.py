"""A peer that ends is named at once (``peers._watch``), with what ended it.

Real processes, every default on: under ``run_ranks`` (torchrun's environment contract, no
agent) and under torchrun itself with its default monitor interval (0.1 s), whose agent stops
the surviving rank as soon as it sees the other fail: the survivor's line must come first.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from _rank_processes import Ended, run_ranks
from distcompat.peers import Lost, _watch

SCRIPT = Path(__file__).with_name("_peer_watch_script.py")
SEEN = re.compile(
    r"distcompat: rank 1 \(pid \d+ on \S+\) (ended|exited after .*) \(seen at ([\d:.]+ UTC)\)"
)

pytestmark = pytest.mark.skipif(not _watch.supported(), reason="needs pidfd_open (Linux)")


def _seen_after_kill(output: str, directory: Path) -> float:
    """Seconds from rank 1's SIGKILL to the survivor's line naming it."""
    match = SEEN.search(output)
    assert match, output[-3000:]
    assert match.group(1) == "ended"  # a SIGKILLed rank leaves no farewell
    killed = float((directory / "killed").read_text())
    return _watch.read_clock(match.group(2), near=killed) - killed


@pytest.mark.slow
def test_a_killed_peer_is_named_within_100_ms_and_the_wait_raises_peer_lost(
    tmp_path: Path,
) -> None:
    ranks = run_ranks(SCRIPT, 2, args=("kill", str(tmp_path)), timeout=120)
    assert ranks[1].returncode == -9
    assert ranks[0].returncode == 3, ranks[0].stderr[-3000:]
    assert _seen_after_kill(ranks[0].stderr, tmp_path) < 0.1
    assert re.search(r"raised PeerLostError: all_reduce: .*\(rank 1\)", ranks[0].stdout)


@pytest.mark.parametrize("scenario", ["kill", "raise"])
@pytest.mark.slow
def test_under_torchrun_the_line_comes_before_the_agent_stops_the_survivor(
    scenario: str, tmp_path: Path
) -> None:
    """torchrun's default ``--monitor-interval`` (0.1 s): its agent SIGTERMs rank 0 soon after
    rank 1 ends; rank 0's line naming rank 1 (and, for ``raise``, its exception) is already
    written."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    ran = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(SCRIPT), scenario, str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert ran.returncode != 0
    said = ran.stdout + ran.stderr
    if scenario == "kill":
        assert _seen_after_kill(said, tmp_path) < 0.1
        return
    match = SEEN.search(said)
    assert match, said[-3000:]
    line = _line_of('raise ValueError("bad batch 7")')
    assert match.group(1) == f"exited after ValueError: bad batch 7 at _peer_watch_script.py:{line}"


@pytest.fixture(scope="module")
def ended_on_purpose(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Ended]]:
    """The ``raise`` and ``leave`` jobs, at once (their timing is not under test)."""
    with ThreadPoolExecutor(2) as pool:
        futures = {
            scenario: pool.submit(run_ranks, SCRIPT, 2, args=(scenario, str(
                tmp_path_factory.mktemp(scenario))), timeout=120)
            for scenario in ("raise", "leave")
        }  # fmt: skip
        return {scenario: future.result() for scenario, future in futures.items()}


@pytest.mark.slow
def test_an_exception_that_ends_a_peer_is_told_to_the_survivor(
    ended_on_purpose: dict[str, list[Ended]],
) -> None:
    ranks = ended_on_purpose["raise"]
    assert ranks[1].returncode == 1
    assert ranks[0].returncode == 3, ranks[0].stderr[-3000:]
    line = _line_of('raise ValueError("bad batch 7")')
    why = f"exited after ValueError: bad batch 7 at _peer_watch_script.py:{line}"
    match = SEEN.search(ranks[0].stderr)  # the watch's line
    assert match, ranks[0].stderr[-3000:]
    assert match.group(1) == why
    raised = ranks[0].stdout  # and the waiting call's error
    assert "raised PeerLostError" in raised
    assert f"rank 1 {why}" in raised


@pytest.mark.slow
def test_a_peer_that_leaves_on_purpose_is_not_reported(
    ended_on_purpose: dict[str, list[Ended]],
) -> None:
    ranks = ended_on_purpose["leave"]
    assert [r.returncode for r in ranks] == [0, 0], ranks[0].stderr[-3000:]
    assert "rank 0: left" in ranks[0].stdout
    assert "distcompat: rank 1" not in ranks[0].stderr


def test_lost_describes_the_rank_and_its_farewell() -> None:
    assert Lost(2, 7, "h", 0.0, "KeyError: 'x' at a.py:3").describe() == (
        "rank 2 (pid 7 on h) exited after KeyError: 'x' at a.py:3"
    )


def _line_of(text: str) -> int:
    lines = SCRIPT.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)
