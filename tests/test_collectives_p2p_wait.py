"""Blocking send and recv wait on their peer as a collective does, on real gloo groups.

The wait is ``collectives._wait.until``'s: a peer that never takes part ends it at the group's
timeout with :class:`CollectiveTimeoutError` naming that peer, a killed peer gives
:class:`PeerLostError` at once, and the watchdog's report names the phase ("in the backend wait
of recv"). The rank bodies are the module-level ``_rank_*`` functions (``run_on_ranks``); the
last test starts ``_p2p_script.py`` as a launcher would, because what it checks is how the
process ends.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

import distcompat
import distcompat.distributed as dist
from _rank_processes import run_ranks
from distcompat.collectives import CollectiveTimeoutError, PeerLostError
from distcompat.testing import RankFailedError, run_on_ranks

GROUP_TIMEOUT_S = 3.0
SLACK_S = 2.0  # the machine is shared with other test runs


def _rank_exchange() -> list[Any]:
    """Blocking send/recv: values, a non-contiguous target, any source, ranks within a subgroup."""
    rank, world = dist.get_rank(), dist.get_world_size()
    got: list[Any] = []
    if rank == 0:
        into = torch.zeros(3, 2).t()  # non-contiguous: staged, then copied back
        got.append(dist.recv(into, src=1))
        got.append(into.flatten().tolist())
        got.append(dist.recv(torch.zeros(1)))  # any source: returns the sender's rank
        dist.send(torch.tensor([7.0]), dst=1)
    elif rank == 1:
        dist.send(torch.arange(6.0).view(2, 3), dst=0)
        dist.send(torch.ones(1), dst=0)
        into = torch.zeros(1)
        dist.recv(into, src=0)
        got.append(into.item())
    pair = dist.new_group(ranks=[world - 2, world - 1])  # group ranks differ from global ones
    if rank == world - 2:
        dist.send(torch.tensor([float(rank)]), group=pair, group_dst=1)
    elif rank == world - 1:
        into = torch.zeros(1)
        got.append(dist.recv(into, group=pair, group_src=0))
        got.append(into.item())
    return got


def test_blocking_send_and_recv_move_data_and_name_the_sender() -> None:
    zero, one, two = run_on_ranks(_rank_exchange, 3)
    assert zero == [1, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], 1]
    assert one == [7.0]
    assert two == [1, 1.0]  # the sender's global rank, as torch returns it


def _rank_peer_never_comes(op: str, timeout_s: float) -> tuple[str, float, list[int], str] | None:
    """Rank 0 sends to, or receives from, the last rank, which never takes part."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(ranks=list(range(world)), timeout=timedelta(seconds=timeout_s))
    absent = world - 1
    if rank != 0:
        return None
    started = time.monotonic()
    try:
        if op == "recv":
            dist.recv(torch.zeros(4), src=absent, group=group)
        else:
            dist.send(torch.ones(4), dst=absent, group=group)
    except CollectiveTimeoutError as exc:
        return type(exc).__name__, time.monotonic() - started, list(exc.peers), str(exc)
    return "returned", time.monotonic() - started, [], ""


@pytest.mark.parametrize(("op", "world_size"), [("recv", 3), ("send", 2)])
def test_a_peer_that_never_comes_is_named_at_the_group_timeout(op: str, world_size: int) -> None:
    """gloo blocks a send until its peer receives: both wait on the peer, and both are bounded."""
    first, *_ = run_on_ranks(_rank_peer_never_comes, world_size, args=(op, GROUP_TIMEOUT_S))
    assert first is not None
    kind, taken, peers, message = first
    assert kind == "CollectiveTimeoutError", first
    assert GROUP_TIMEOUT_S - 0.1 <= taken < GROUP_TIMEOUT_S + SLACK_S, first
    assert peers == [world_size - 1]
    toward = "from" if op == "recv" else "to"
    assert message.startswith(
        f"{op}: timed out after {GROUP_TIMEOUT_S:g}s (the group's timeout elapsed) in the backend "
        f"wait of {op} {toward} rank {world_size - 1}: not every rank arrived "
        f"(rank {world_size - 1})"
    ), message


def _rank_peer_killed(record: str) -> None:
    """The last rank SIGKILLs itself; rank 0 receives from it on a group with a long timeout."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(ranks=list(range(world)), timeout=timedelta(seconds=60))
    dist.barrier(group=group)
    victim = world - 1
    if rank == victim:
        time.sleep(0.3)  # rank 0 is in its recv by then
        os.kill(os.getpid(), signal.SIGKILL)
    if rank != 0:
        return
    started = time.monotonic()
    seen: dict[str, Any] = {"error": "none"}
    try:
        dist.recv(torch.zeros(4), src=victim, group=group)
    except PeerLostError as exc:
        seen = {"error": type(exc).__name__, "peers": list(exc.peers), "message": str(exc)}
    seen["after_s"] = time.monotonic() - started
    Path(record).write_text(json.dumps(seen))


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_killed_peer_gives_peer_lost_error_at_once(world_size: int, tmp_path: Path) -> None:
    record = tmp_path / "seen.json"
    with pytest.raises(RankFailedError):  # the victim died, by design
        run_on_ranks(_rank_peer_killed, world_size, args=(str(record),), timeout=30)
    seen = json.loads(record.read_text())
    assert seen["error"] == "PeerLostError", seen
    assert seen["peers"] == [world_size - 1], seen
    assert seen["after_s"] < 0.3 + SLACK_S, seen


def _rank_late_sender(late_s: float, dump_dir: str) -> tuple[str, str] | None:
    """Rank 1 sends late; rank 0's recv outlasts a 1 s report-only watchdog and is reported."""
    rank = dist.get_rank()
    with distcompat.watchdog(timeout=1.0, action="report", dump_dir=dump_dir) as watching:
        # A finished collective first: the recv's wait must not be charged to its record.
        dist.all_reduce(torch.ones(1))
        if rank == 1:
            time.sleep(late_s)
            dist.send(torch.ones(2), dst=0)
            return None
        dist.recv(torch.zeros(2), src=1)
        report = watching.last_report
    assert report is not None, "no hang report"
    state = report.states[0]
    assert state is not None
    return state.phase, report.describe()


def test_the_watchdog_reports_the_recv_phase(tmp_path: Path) -> None:
    first, _ = run_on_ranks(_rank_late_sender, 2, args=(3.0, str(tmp_path)), timeout=60)
    assert first is not None
    phase, text = first
    assert phase == "in the backend wait of recv from rank 1"
    assert re.search(r"trigger: rank 0: recv from rank 1 at \S+p2p_wait.py:\d+ not complete", text)
    assert "rank 0 waits in the backend wait of recv from rank 1, outside any collective" in text
    assert re.search(
        r"rank 0 \(.*\): not in a distcompat collective, in the backend wait of recv from rank 1",
        text,
    ), text
    assert "every rank is in the same collective" not in text


def test_the_default_watchdog_reports_the_recv_and_the_timeout_names_the_sender(
    tmp_path: Path,
) -> None:
    """Real processes, every default on: a report within seconds, the typed error at the group
    timeout naming rank 1, and the process ends promptly with it (never SIGABRT: the recv that
    the group's timeout ends right after the wait gave up finishes before teardown)."""
    timeout_s = 4.0
    env = {"DISTCOMPAT_WATCHDOG": "1", "P2P_TIMEOUT": str(timeout_s), "TMPDIR": str(tmp_path)}
    script = Path(__file__).with_name("_p2p_script.py")
    waiter, _ = run_ranks(script, 2, env=env, timeout=60, stop_after=0)
    detail = f"exit {waiter.returncode}\n{waiter.stdout}\n{waiter.stderr[-3000:]}"
    call = float(re.findall(r"^CALL ([0-9.]+)", waiter.stdout, re.M)[0])
    failed = re.search(r"^FAILED_AT ([0-9.]+) (\S+) peers=(\S*) (.*)$", waiter.stdout, re.M)
    assert failed is not None, detail
    assert failed[2] == "CollectiveTimeoutError", detail
    assert failed[3] == "1", detail
    assert timeout_s - 0.1 <= float(failed[1]) - call < timeout_s + SLACK_S, detail
    assert waiter.returncode not in (0, None, -signal.SIGABRT), detail
    assert waiter.ended - float(failed[1]) < 6.0, detail
    reports = re.findall(r"^([0-9.]+) distcompat.diagnostics \[rank 0\]", waiter.stderr, re.M)
    assert reports, detail
    assert float(reports[0]) - call < 1.0 + SLACK_S + 2.0, detail
    assert "in the backend wait of recv" in waiter.stderr, detail
    assert re.search(r"main thread at \S*_p2p_script.py:\d+ in read_shard", waiter.stderr), detail
