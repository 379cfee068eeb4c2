"""A live job dumped on demand (``diagnostics._on_demand``, ``distcompat dump``).

Real processes under torchrun, every default on (the report-only watchdog init starts): 3
ranks, rank 1 stopped (SIGSTOP) while the others wait for it in an all_reduce. ``distcompat
dump`` signals rank 0; every answering rank writes its dump (distcompat's JSON and the Flight
Recorder format), rank 0 logs the report naming rank 1, and after SIGCONT the job completes.
They run in the ``matrix`` nox session, beside the defaults matrix (``nox -s matrix``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from distcompat.cli._diagnose import diagnose
from distcompat.diagnostics._on_demand import install, request

SCRIPT = Path(__file__).with_name("_dump_script.py")


def _wait_for(check: object, what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what} did not happen within {seconds:g}s"
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return ""


def test_a_dump_asked_of_any_rank_covers_every_rank_names_the_stopped_one_and_stops_nothing(
    tmp_path: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["TMPDIR"] = str(tmp_path)  # the dumps go to <TMPDIR>/distcompat-hangs
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
         str(SCRIPT), str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    pid = {}
    try:
        _wait_for(lambda: all((tmp_path / f"pid{r}").exists() for r in range(3)), "start")
        pid = {r: int((tmp_path / f"pid{r}").read_text()) for r in range(3)}
        _wait_for(lambda: _state(pid[1]) == "T", "rank 1's stop")
        time.sleep(1)  # ranks 0 and 2 are in the all_reduce
        asked = subprocess.run(
            [sys.executable, "-m", "distcompat", "dump", str(pid[0])],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert asked.returncode == 0, asked.stderr
        folder = tmp_path / "distcompat-hangs"
        _wait_for(lambda: len(list(folder.glob("*/incident-*/rank*.json"))) >= 2, "the dumps")
    finally:
        if pid:
            os.kill(pid[1], signal.SIGCONT)
        said, _ = job.communicate(timeout=150)
    assert job.returncode == 0, said[-3000:]
    assert all(f"rank {r}: sum 9" in said for r in range(3))  # nothing stopped
    assert "[rank 0] on-demand dump 1 of job" in said
    assert f"SIGUSR2 to rank 0 (pid {pid[0]})" in said
    assert "rank 1 did not answer" in said
    assert "[rank 2] on-demand dump 1 of job" in said  # the other rank's line
    incident = next(folder.glob("*/incident-1"))
    written = {p.name for p in incident.glob("rank*.json")}
    assert {"rank0.json", "rank2.json"} <= written  # rank 1 answers too, once resumed
    flight = {p.name for p in incident.glob("comm_lib_trace_rank_*")}  # Flight Recorder format
    assert {"comm_lib_trace_rank_0", "comm_lib_trace_rank_2"} <= flight
    read = diagnose(str(folder))  # rank 1's late answer is read beside the others
    assert read.exit_code == 0
    assert f"trigger: on demand: SIGUSR2 to rank 0 (pid {pid[0]})" in read.text
    assert "waiting in #1 all_reduce" in read.text


def test_no_watchdog_no_dump() -> None:
    assert install().split(":")[0] in ("installed", "not installed")
    assert request("a test") is False
