"""Init watched (``process_group._init_watch``): a late or absent rank named, with the phase.

Real processes, every default on, ``DISTCOMPAT_WATCHDOG=2``: the report must come within the
threshold + 8 s. Under ``run_ranks`` (torchrun's environment contract, the parent's store) and
under torchrun itself. The four jobs run at once (a module fixture): each waits on purpose.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from _rank_processes import run_ranks
from distcompat.process_group._init_watch import InitWatch

SCRIPT = Path(__file__).with_name("_init_watch_script.py")
WATCHDOG = {"DISTCOMPAT_WATCHDOG": "2"}
WAITED = re.compile(r"rank 0 has waited (\d+)s in init, in the ([a-z' ()]+): (.*)")
LATE = "4"  # seconds: the report is due at 2


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _late_rank() -> Any:
    return run_ranks(SCRIPT, 3, args=("2", LATE), env=WATCHDOG, timeout=120)


def _torchrun() -> Any:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(SCRIPT), "1", LATE],
        capture_output=True, text=True, timeout=120, env=env | WATCHDOG,
    )  # fmt: skip


def _tcp() -> Any:
    url = f"tcp://127.0.0.1:{_free_port()}"
    return run_ranks(SCRIPT, 2, args=("1", LATE, url), env=WATCHDOG, timeout=120)


def _no_store() -> tuple[int, str]:
    """Rank 1 of 2 alone, its store host (rank 0) never started: its first line, the report."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "LOCAL_"))}
    env |= WATCHDOG | {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}  # fmt: skip
    child = subprocess.Popen([sys.executable, str(SCRIPT), "-1", "0"], env=env,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert child.stderr is not None
        return port, child.stderr.readline()
    finally:
        child.kill()
        child.communicate()


JOBS: dict[str, Callable[[], Any]] = {
    "late": _late_rank, "torchrun": _torchrun, "tcp": _tcp, "no-store": _no_store,
}  # fmt: skip


@pytest.fixture(scope="module")
def ran() -> dict[str, Any]:
    with ThreadPoolExecutor(len(JOBS)) as pool:
        futures = {name: pool.submit(job) for name, job in JOBS.items()}
        return {name: future.result() for name, future in futures.items()}


def _first_report(output: str) -> tuple[int, str, str]:
    match = WAITED.search(output)
    assert match, output[-3000:]
    return int(match.group(1)), match.group(2), match.group(3)


@pytest.mark.slow
def test_a_late_rank_is_named_in_the_rendezvous_and_the_job_goes_on(ran: dict[str, Any]) -> None:
    ranks = ran["late"]
    assert [r.returncode for r in ranks] == [0, 0, 0], [r.stderr[-2000:] for r in ranks]
    waited, phase, said = _first_report(ranks[0].stderr)
    assert waited <= 2 + 8
    assert phase == "rendezvous"
    assert said.startswith("rank 2 has not arrived (arrived: rank 0 on ")
    assert "rank 1 on " in said
    assert all(f"rank {r}: sum 3" in ranks[r].stdout for r in range(3))


@pytest.mark.slow
def test_under_torchrun_a_late_rank_is_named(ran: dict[str, Any]) -> None:
    done = ran["torchrun"]
    assert done.returncode == 0, done.stderr[-3000:]
    waited, phase, said = _first_report(done.stderr)
    assert waited <= 2 + 8
    assert (phase, said.split(" (")[0]) == ("rendezvous", "rank 1 has not arrived")


@pytest.mark.slow
def test_torchs_own_rendezvous_is_reported_by_phase(ran: dict[str, Any]) -> None:
    """tcp:// is torch's rendezvous: distcompat knows no store to read arrivals from."""
    ranks = ran["tcp"]
    assert [r.returncode for r in ranks] == [0, 0], [r.stderr[-2000:] for r in ranks]
    waited, phase, said = _first_report(ranks[0].stderr)
    assert waited <= 2 + 8
    assert phase == "rendezvous (torch's init)"
    assert said == "not every rank has come (which ones: unknown here)"


@pytest.mark.slow
def test_a_store_that_is_not_up_is_reported_with_its_address(ran: dict[str, Any]) -> None:
    port, line = ran["no-store"]
    match = re.search(r"rank 1 has waited (\d+)s in init, in the store connection: (.*)", line)
    assert match, line
    assert int(match.group(1)) <= 2 + 8
    assert match.group(2) == (
        f"the rendezvous store at 127.0.0.1:{port} (hosted by rank 0) does not answer yet"
    )


def test_the_report_says_who_arrived_from_the_store() -> None:
    import torch.distributed as dist

    store = dist.HashStore()
    watch = InitWatch(1.0, 0, 3, "here")
    watch.arrived(store, "p")
    store.set("p/arrived/2", "node2")
    assert watch.describe(store).endswith(
        "in the rendezvous: rank 1 has not arrived (arrived: rank 0 on "
        f"{socket.gethostname()}, rank 2 on node2)"
    )
