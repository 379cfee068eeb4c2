"""Unchanged framework programs under ``distcompat run`` (``nox -s frameworks``; issue 48).

Each program in this folder is plain PyTorch or Lightning and never imports distcompat. Each is
run for real, on 2 CPU ranks, by its own launcher (torchrun, ``mp.spawn``, Lightning's re-launch
of ``sys.argv``, ``accelerate launch`` (torchrun's agent, or Open MPI's ``mpirun`` with a
hostfile), Open MPI's ``mpirun`` and Slurm's ``srun`` where installed), once plainly and once as
``distcompat run <the same command>``, with every distcompat default on:

* the same bits: the final parameters' digest and the last loss are equal, and only the
  ``distcompat run`` run prints the rank-0 line;
* a stall, then a mismatch, in one job: a stalled rank (rank 1 sleeps 6 s in step 3,
  ``DISTCOMPAT_WATCHDOG=2``) is named with its line (``_common.py``'s ``time.sleep``) while it
  is still stalled, and the report ends nothing: later in that step the ranks all-reduce a
  metric of 6 and 7 elements, which raises ``CollectiveMismatchError`` on the ranks;
* a killed rank (SIGKILL 1 s into a step, rank 0 waiting) is named: ``PeerLostError`` naming
  rank 1 (under ``mp.spawn``, what rank 0 could say before ``mp.spawn`` ended it: see below).

torchrun runs with ``--monitor-interval=3`` in the kill case (``accelerate launch``, which runs
torchrun's agent in its own process, with ``--monitor_interval 3``): with its default (0.1 s) the
agent SIGTERMs rank 0 about 0.1 s after rank 1's death, before the error reaches Python (the peer
watch's ``rank 1 ... ended`` line comes within 15 ms); with 1 s, its poll came 0.28 s after the
death once (torch 2.15, 2 cores), before rank 0's ``PeerLostError`` was out. ``mp.spawn`` and
``mpirun`` end the other ranks as soon as one dies: rank 0 gets out the peer watch's line at
most; the table says which.

Accelerate (1.15) has no multi-CPU flag for one machine: ``accelerate launch --cpu
--num_processes 2`` starts a single process, and ``--multi_gpu`` without ``Accelerator(cpu=True)``
starts two that never form a group (each ``DistributedType.NO``), on plain torch as under
``distcompat run``. The program asks for ``cpu=True``; the two launches here are ``--multi_gpu``
(torchrun's agent) and Accelerate's documented multi-CPU route, ``--cpu --mpirun_hostfile``
(Open MPI only here: Accelerate writes MPICH's options for any other ``mpirun``, and the hostfile
is Open MPI's format). ``HF_HOME`` points at an empty folder so that no ``accelerate config``
file of the machine changes the launch.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import TABLE

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
TORCHRUN = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2"]
THRESHOLD_S = 2.0
#: torchrun's agent poll in the kill case: long enough for rank 0's error to come out first.
MONITOR_S = 3
#: Long enough to be named inside it: reports came 2.2-3.0 s in (CI, 2 cores, torch 2.15).
STALL_S = 6.0
SLEEP_LINE = next(
    n for n, line in enumerate((HERE / "_common.py").read_text().splitlines(), 1)
    if "time.sleep(STALL_S)" in line
)  # fmt: skip


#: ``accelerate launch`` for 2 processes (the port: its default, 29500, may be taken here).
ACCELERATE = [str(BIN / "accelerate"), "launch", "--num_processes", "2", "--main_process_port"]
ACCELERATE_TORCHRUN = "Accelerate (accelerate launch: torchrun)"
ACCELERATE_MPIRUN = "Accelerate (accelerate launch: mpirun)"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _mpirun() -> list[str]:
    """Open MPI's launcher for 2 local ranks; the test skips where it is not installed."""
    mpirun = shutil.which("mpirun.openmpi")
    if mpirun is None:
        pytest.skip("no mpirun.openmpi here (tools/launchers/install.py installs openmpi-bin)")
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return [mpirun, "-np", "2", "--oversubscribe", *root]


@pytest.fixture(scope="module")
def slurm_env() -> Iterator[dict[str, str]]:
    """A one-node Slurm cluster (the launchers session's), for the ``srun`` program; skips
    where Slurm or root is missing."""
    if os.geteuid() != 0 or shutil.which("srun") is None or shutil.which("munged") is None:
        pytest.skip("no Slurm here, or not root (tools/launchers/install.py installs slurm-wlm)")
    sys.path.insert(0, str(HERE.parent / "tools" / "launchers"))
    from slurm_cluster import SlurmCluster  # tools/launchers/, in the repository only

    # not pytest's tmp_path: munged runs as its own user, who cannot enter pytest-of-root/
    with tempfile.TemporaryDirectory() as work, SlurmCluster.start(Path(work) / "slurm") as cluster:
        yield dict(cluster.env)


def _open_mpi_for_accelerate() -> dict[str, str]:
    """What ``accelerate launch --mpirun_hostfile`` needs: Open MPI as ``mpirun`` (Accelerate
    runs the first ``mpirun``/``mpiexec`` on PATH), allowed to run as root; skips otherwise."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("no `mpirun` here (tools/launchers/install.py installs Open MPI's)")
    said = subprocess.run([mpirun, "--version"], capture_output=True, text=True, check=False)
    if "Open MPI" not in said.stdout:
        pytest.skip(f"`mpirun` here is not Open MPI: {said.stdout.strip()[:80]!r}")
    root = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return root if os.geteuid() == 0 else {}


@pytest.fixture
def launcher_env(program: str, request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    """What the program's launcher needs in the environment (Slurm: its cluster's config;
    Accelerate: an empty ``HF_HOME``, so no ``accelerate config`` of this machine applies)."""
    if program == "Slurm srun DDP":
        return dict(request.getfixturevalue("slurm_env"))
    if program.startswith("Accelerate"):
        env = {"HF_HOME": str(tmp_path / "hf_home")}
        if program == ACCELERATE_MPIRUN:
            env.update(_open_mpi_for_accelerate())
        return env
    return {}


def _command(program: str, kill: bool = False) -> list[str]:
    torchrun = [*TORCHRUN, f"--monitor-interval={MONITOR_S}"] if kill else TORCHRUN
    accelerate, script = [*ACCELERATE, str(_free_port())], str(HERE / "accelerate_cpu.py")
    if program == ACCELERATE_TORCHRUN:  # the two launches: the module docstring
        monitor = ["--monitor_interval", str(MONITOR_S)] if kill else []
        return [*accelerate, "--multi_gpu", *monitor, script]
    if program == ACCELERATE_MPIRUN:
        hostfile = str(HERE / "accelerate_hostfile")
        return [*accelerate, "--cpu", "--mpirun_hostfile", hostfile, "--num_machines", "1", script]
    if program == "Open MPI DDP":
        return [*_mpirun(), sys.executable, str(HERE / "ddp_mpirun.py"), str(_free_port())]
    if program == "Slurm srun DDP":
        srun = ["srun", "-n", "2"]
        return [*srun, sys.executable, str(HERE / "ddp_srun.py"), str(_free_port())]
    return {
        "torchrun DDP": [*torchrun, str(HERE / "ddp_torchrun.py")],
        "mp.spawn tcp://": [sys.executable, str(HERE / "spawn_tcp.py"), str(_free_port())],
        "init_device_mesh + FSDP2": [*torchrun, str(HERE / "mesh_fsdp2.py")],
        "Lightning Trainer": [sys.executable, str(HERE / "lightning_trainer.py")],
        "Lightning Fabric": [sys.executable, str(HERE / "lightning_fabric.py")],
    }[program]


PROGRAMS = [
    "torchrun DDP", "mp.spawn tcp://", "init_device_mesh + FSDP2", "Lightning Trainer",
    "Lightning Fabric", ACCELERATE_TORCHRUN, ACCELERATE_MPIRUN, "Open MPI DDP", "Slurm srun DDP",
]  # fmt: skip


@dataclass(frozen=True, slots=True)
class Ran:
    returncode: int | None
    lines: list[tuple[float, str]]  # (time.time() when read, line)

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def said(self, rank: int, what: str) -> str:
        """The last value of ``rank R: WHAT VALUE`` (two ranks' lines may share a line)."""
        found = re.findall(rf"rank {rank}: {what} (\S+?)(?=rank \d+: |\s|$)", self.text)
        assert found, f"no 'rank {rank}: {what}' in:\n{self.text[-4000:]}"
        return str(found[-1])


def _run(
    program: str, *, wrapped: bool, env: dict[str, str] | None = None, timeout: float = 240
) -> Ran:
    """Run ``program`` (under ``distcompat run`` if ``wrapped``); stamp each output line."""
    command = _command(program, kill=(env or {}).get("FAULT") == "kill")
    if wrapped:
        distcompat = shutil.which("distcompat", path=str(BIN))
        assert distcompat is not None
        command = [distcompat, "run", *command]
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DISTCOMPAT_RUN")}
    environ.update(env or {})
    proc = subprocess.Popen(
        command, cwd=HERE, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.time(), line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        code = None
    reader.join(timeout=10)
    if proc.stdout is not None:
        proc.stdout.close()
    return Ran(code, lines)


#: What torch's gloo exit race prints (see :func:`_finished`).
EXIT_ABORT = "terminate called without an active exception"
#: How each launcher reports the rank that abort ended: torchrun's agent, Open MPI's mpirun.
ABORT_REPORTS = ("SIGABRT", "exited on signal 6 (Aborted)")
#: The return code of a program whose own process that abort ended (Fabric's rank 0 is the
#: process the test started; no launcher is there to report it).
ABORTED_HERE = -signal.SIGABRT


def _finished(ran: Ran) -> str | None:
    """How the run ended its work: ``""`` (it exited 0), ``"torch's exit abort"``, or None (failed).

    torch 2.13's gloo worker thread can drop the last reference to a finished ``AsyncWork``
    after the interpreter has begun to finalize; the tensors' ``decref`` asks for the GIL, Python
    ends the thread, and the unwinding through a ``noexcept`` destructor calls ``std::terminate``
    (a core dump's backtrace: ``ProcessGroupGloo::runLoop`` -> ``~AsyncWork`` -> ``TensorImpl::
    decref_pyobject`` -> ``take_gil`` -> ``pthread_exit``; pytorch PR 179291, abandoned). It ends
    a rank after it printed its results: the plain ``spawn_tcp.py`` did so in 11 of 40 runs on a
    2-core machine like CI's, 0 of 40 under ``distcompat run``; a fresh-clone CI run saw it once
    more in the plain ``accelerate launch`` (torchrun) program, and once in the plain ``accelerate
    launch`` (mpirun) program on torch 2.15 (Open MPI says ``exited on signal 6 (Aborted)``
    where torchrun's agent says ``SIGABRT``), and once in the plain Lightning Fabric program on
    torch 2.15, whose rank 0 is the process the test started (its return code says
    ``SIGABRT``; no launcher prints a word). Such a run counts as
    finished (its digests are compared) only when every rank printed its digest before the abort,
    and the table says so; any other failure fails the test.
    """
    if ran.returncode == 0:
        return ""
    printed = all(f"rank {rank}: digest " in ran.text for rank in (0, 1))
    aborted = ran.returncode == ABORTED_HERE or any(said in ran.text for said in ABORT_REPORTS)
    if printed and EXIT_ABORT in ran.text and aborted:
        return "torch's exit abort"
    return None


@pytest.mark.parametrize("program", PROGRAMS)
def test_the_same_bits_with_and_without_distcompat_run(
    program: str, launcher_env: dict[str, str]
) -> None:
    plain = _run(program, wrapped=False, env=launcher_env)
    wrapped = _run(program, wrapped=True, env=launcher_env)
    plain_end, wrapped_end = _finished(plain), _finished(wrapped)
    assert plain_end is not None, plain.text[-4000:]
    assert wrapped_end is not None, wrapped.text[-4000:]
    for rank in (0, 1):
        assert wrapped.said(rank, "digest") == plain.said(rank, "digest")
        assert wrapped.said(rank, "loss") == plain.said(rank, "loss")
    line = [text for _, text in wrapped.lines if text.startswith("distcompat run:")]
    assert len(line) == 1
    assert "protected group" in line[0]
    assert "DISTCOMPAT_RUN=off" in line[0]
    assert "distcompat" not in plain.text
    ends = [f"{which}: {end}" for which, end in (("plain", plain_end), ("run", wrapped_end)) if end]
    cell = f"equal ({'; '.join(ends)})" if ends else "equal"
    TABLE.setdefault(program, {})["bits plain vs run"] = cell


@pytest.mark.parametrize("program", PROGRAMS)
def test_a_stalled_rank_is_named_at_its_line_and_a_later_mismatch_raises(
    program: str, launcher_env: dict[str, str]
) -> None:
    """One job, two faults (one launch instead of two): the stall's report is report-only, so
    the job goes on to the metric of that step, whose mismatched shapes end it with
    ``CollectiveMismatchError``."""
    env = {"FAULT": "stall,mismatch", "STALL_S": str(STALL_S),
           "DISTCOMPAT_WATCHDOG": str(THRESHOLD_S)}  # fmt: skip
    env.update(launcher_env)
    ran = _run(program, wrapped=True, env=env, timeout=180)
    # printed with 3 decimals; another process's line may follow on the same line, unbroken
    # (seen under accelerate launch on torch 2.9.1: "1796298609.075step ...")
    printed = re.match(r"\d+\.\d{3}", ran.said(1, "stall starts at"))
    assert printed is not None, ran.said(1, "stall starts at")
    started = float(printed.group())
    named = re.compile(rf"rank 1\b.*_common\.py:{SLEEP_LINE}\b")
    when = [stamp for stamp, text in ran.lines if named.search(text)]
    assert when, ran.text[-4000:]
    after = when[0] - started
    assert after <= STALL_S, after  # named while rank 1 is still in its stall
    TABLE.setdefault(program, {})["stall named after"] = f"{after:.1f} s"
    # the job went on past the stall, to the mismatched metric after it
    assert ran.returncode not in (0, None), ran.text[-4000:]
    assert "CollectiveMismatchError" in ran.text, ran.text[-4000:]
    TABLE.setdefault(program, {})["then a mismatch"] = "CollectiveMismatchError"


@pytest.mark.parametrize("program", PROGRAMS)
def test_a_killed_rank_is_named(program: str, launcher_env: dict[str, str]) -> None:
    ran = _run(program, wrapped=True, env={"FAULT": "kill", **launcher_env})
    assert ran.returncode != 0
    assert "rank 1: killing itself" in ran.text
    lost = re.search(r"PeerLostError: .*\(rank 1\)", ran.text)
    ended = re.search(r"distcompat: rank 1 \(pid \d+ on .*\) ended", ran.text)
    if program in ("mp.spawn tcp://", "Open MPI DDP", ACCELERATE_MPIRUN):  # end rank 0 at once
        cell = (
            "PeerLostError (rank 1)" if lost
            else "rank 1 named (peer watch); the launcher ends rank 0 before an error" if ended
            else "the launcher ends rank 0 first"
        )  # fmt: skip
    else:
        assert lost, ran.text[-4000:]
        cell = "PeerLostError (rank 1)"
    TABLE.setdefault(program, {})["killed rank"] = cell
