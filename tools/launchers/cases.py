"""The launches of the session: one probe program under each launcher, as a user would start it.

    for case in CASES:                 # torchrun, openmpi, mpich, slurm-*, torchrun-2node, ray
        finished = case.launch(context)

Each case builds the user's command (``mpirun -np 3 python probe.py ...``), runs it with a
deadline, and returns how its processes ended; the ranks' reports land in ``context.work``.
``needs`` names the shared set-up a case runs inside (``run.py`` starts it once per group).
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import procs
from netns import ADDRESSES, TwoNodes
from slurm_cluster import SlurmCluster
from truth import EXPECT_IFNAME_VAR

HERE = Path(__file__).resolve().parent
PROBE = HERE / "probe.py"
RAY_JOB = HERE / "ray_job.py"
RDZV_PORT = 29400  # inside node 0's private namespace: nothing else listens there

Need = Literal["host", "slurm", "netns"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Context:
    """What a launch needs: its own directory, a clean environment, and the shared set-up."""

    work: Path
    env: dict[str, str]
    python: str
    timeout: float
    cluster: SlurmCluster | None = None
    nodes: TwoNodes | None = None

    @property
    def bin(self) -> Path:
        """The directory of this venv's console scripts (``torchrun``, ``distcompat``)."""
        return Path(self.python).parent


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    """One launcher: its name, how many ranks it starts, and how to start it."""

    name: str
    ranks: int
    needs: Need
    timeout: float
    launch: Callable[[Context], list[procs.Finished]]
    binaries: tuple[str, ...] = ()  # beyond those of ``needs`` (run.py checks them first)
    module: str = ""  # a Python module the session's venv must have


def probe_argv(ctx: Context, *, truth: str, expect: str, world: int, reason: str = "") -> list[str]:
    """``python probe.py ...`` writing its reports into ``ctx.work``."""
    argv = [ctx.python, str(PROBE), "--truth", truth, "--expect", expect, "--world", str(world)]
    argv += ["--out", str(ctx.work)]
    return argv + (["--reason-contains", reason] if reason else [])


def _run(ctx: Context, argv: list[str], env: dict[str, str] | None = None) -> list[procs.Finished]:
    log = ctx.work / "launch.log"
    return [procs.run(argv, env=env or ctx.env, log=log, timeout=ctx.timeout, cwd=ctx.work)]


def torchrun_standalone(ctx: Context) -> list[procs.Finished]:
    torchrun = [str(ctx.bin / "torchrun"), "--standalone", "--nproc-per-node=3"]
    return _run(ctx, torchrun + probe_argv(ctx, truth="torchrun", expect="torchrun", world=3)[1:])


def openmpi(ctx: Context) -> list[procs.Finished]:
    mpirun = ["mpirun.openmpi", "--allow-run-as-root", "--oversubscribe", "-np", "3"]
    return _run(ctx, mpirun + probe_argv(ctx, truth="openmpi", expect="openmpi", world=3))


def mpich(ctx: Context) -> list[procs.Finished]:
    mpiexec = ["mpiexec.mpich", "-n", "3"]
    return _run(ctx, mpiexec + probe_argv(ctx, truth="mpich", expect="mpich", world=3))


def _slurm_env(ctx: Context) -> dict[str, str]:
    assert ctx.cluster is not None, "a slurm case runs inside the cluster run.py started"
    return {**ctx.env, **ctx.cluster.env}


def slurm_srun(ctx: Context) -> list[procs.Finished]:
    srun = ["srun", "-n", "3"]
    argv = srun + probe_argv(ctx, truth="slurm", expect="slurm", world=3)
    return _run(ctx, argv, _slurm_env(ctx))


def slurm_torchrun(ctx: Context) -> list[procs.Finished]:
    """srun starting torchrun: torchrun's variables must win over the step's (docs/launching.md)."""
    head = ["srun", "-n", "1", str(ctx.bin / "torchrun"), "--standalone", "--nproc-per-node=3"]
    probe = probe_argv(
        ctx, truth="torchrun", expect="torchrun", world=3, reason="Slurm variables ignored"
    )
    return _run(ctx, head + probe[1:], _slurm_env(ctx))


def slurm_sbatch(ctx: Context) -> list[procs.Finished]:
    """An sbatch script whose one line is ``srun python probe.py``; poll until the job is gone."""
    env = _slurm_env(ctx)
    output = ctx.work / "launch.log"
    script = ctx.work / "job.sh"
    probe = " ".join(probe_argv(ctx, truth="slurm", expect="slurm", world=3))
    script.write_text(
        f"#!/bin/sh\n#SBATCH -n 3\n#SBATCH -o {output}\n#SBATCH -t 5\nsrun {probe}\n",
        encoding="utf-8",
    )
    started = time.monotonic()
    submit = subprocess.run(
        ["sbatch", "--parsable", str(script)], env=env, capture_output=True, text=True, timeout=30
    )
    job = submit.stdout.strip().split(";")[0]
    if submit.returncode != 0 or not job.isdigit():
        output.write_text(f"sbatch failed: {submit.stderr}", encoding="utf-8")
        return [procs.Finished(returncode=submit.returncode or 1, log=output, seconds=0.0)]
    while _squeue_has(env, job):
        if time.monotonic() - started > ctx.timeout:
            subprocess.run(["scancel", job], env=env, capture_output=True, timeout=10)
            return [procs.Finished(returncode=None, log=output, seconds=ctx.timeout)]
        time.sleep(0.5)
    code = _job_exit_code(env, job)
    return [procs.Finished(returncode=code, log=output, seconds=time.monotonic() - started)]


def _squeue_has(env: dict[str, str], job: str) -> bool:
    done = subprocess.run(
        ["squeue", "-h", "-j", job], env=env, capture_output=True, text=True, timeout=10
    )
    return bool(done.stdout.strip())


def _job_exit_code(env: dict[str, str], job: str) -> int:
    """The job's exit code from ``scontrol show job`` (``ExitCode=0:0``); 1 when unreadable."""
    done = subprocess.run(
        ["scontrol", "show", "job", job], env=env, capture_output=True, text=True, timeout=10
    )
    match = re.search(r"\bExitCode=(\d+):(\d+)", done.stdout)
    if match is None:
        return 1
    return int(match.group(1)) or int(match.group(2))


def two_node_argv(
    ctx: Context, node: int, run_id: str, payload: list[str], per_node: int
) -> list[str]:
    """torchrun on node ``node`` of the two namespaces, c10d rendezvous hosted on node 0."""
    assert ctx.nodes is not None, "a two-node case runs inside the namespaces run.py created"
    torchrun = [
        str(ctx.bin / "torchrun"),
        "--nnodes=2",
        f"--nproc-per-node={per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={ADDRESSES[0]}:{RDZV_PORT}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf=is_host={1 if node == 0 else 0}",
        f"--local-addr={ADDRESSES[node]}",
    ]
    return ctx.nodes.exec_in(node, torchrun + payload)


def node_env(ctx: Context, node: int, *, ifname: bool = True, shm: bool = False) -> dict[str, str]:
    """The environment on node ``node``, with ``GLOO_SOCKET_IFNAME`` its veth unless told not,
    and the shared-memory path off unless ``shm`` (then distcompat's default, ``auto``, decides).

    Without it, ``EXPECT_IFNAME_VAR`` tells the probe which interface init should pick itself.
    """
    assert ctx.nodes is not None
    env = dict(ctx.env)
    # The namespace nodes stand in for two machines, but they share this one's boot id, pid
    # namespace and /dev/shm, so distcompat would rightly join their ranks through shared
    # memory: off keeps the collectives on the veth, as between real hosts (and under its faults).
    if not shm:
        env["DISTCOMPAT_SHM"] = "off"
    if ifname:
        env["GLOO_SOCKET_IFNAME"] = ctx.nodes.interfaces[node]
    else:
        env.pop("GLOO_SOCKET_IFNAME", None)
        env[EXPECT_IFNAME_VAR] = ctx.nodes.interfaces[node]
    return env


def start_two_nodes(
    ctx: Context,
    payload: list[str],
    *,
    per_node: int,
    ifname: bool = True,
    shm: bool = False,
    tag: str = "launch",
) -> list[procs.Job]:
    """Start ``payload`` under torchrun on both nodes; logs ``<tag>-node<K>.log``."""
    run_id = f"{tag}{time.monotonic_ns() % 10**9}"
    return [
        procs.start(
            two_node_argv(ctx, node, run_id, payload, per_node),
            env=node_env(ctx, node, ifname=ifname, shm=shm),
            log=ctx.work / f"{tag}-node{node}.log",
            cwd=ctx.work,
        )
        for node in (0, 1)
    ]


def torchrun_two_nodes(ctx: Context) -> list[procs.Finished]:
    payload = probe_argv(ctx, truth="torchrun", expect="torchrun", world=4)[1:]
    return procs.wait_all(start_two_nodes(ctx, payload, per_node=2), ctx.timeout)


def torchrun_two_nodes_auto_ifname(ctx: Context) -> list[procs.Finished]:
    """Two nodes, one rank each, no GLOO_SOCKET_IFNAME: init must pick each node's veth."""
    payload = probe_argv(ctx, truth="torchrun", expect="torchrun", world=2)[1:]
    jobs = start_two_nodes(ctx, payload, per_node=1, ifname=False, tag="autoif")
    return procs.wait_all(jobs, ctx.timeout)


def ray_train(ctx: Context) -> list[procs.Finished]:
    return _run(ctx, [ctx.python, str(RAY_JOB), "--workers", "2", "--out", str(ctx.work)])


CASES = (
    Case(name="torchrun", ranks=3, needs="host", timeout=120, launch=torchrun_standalone),
    Case(
        name="openmpi",
        ranks=3,
        needs="host",
        timeout=120,
        launch=openmpi,
        binaries=("mpirun.openmpi",),
    ),
    Case(
        name="mpich", ranks=3, needs="host", timeout=120, launch=mpich, binaries=("mpiexec.mpich",)
    ),
    Case(name="slurm-srun", ranks=3, needs="slurm", timeout=120, launch=slurm_srun),
    Case(name="slurm-sbatch", ranks=3, needs="slurm", timeout=120, launch=slurm_sbatch),
    Case(name="slurm-torchrun", ranks=3, needs="slurm", timeout=120, launch=slurm_torchrun),
    Case(name="torchrun-2node", ranks=4, needs="netns", timeout=150, launch=torchrun_two_nodes),
    Case(
        name="torchrun-2node-auto-ifname",
        ranks=2,
        needs="netns",
        timeout=150,
        launch=torchrun_two_nodes_auto_ifname,
    ),
    Case(name="ray", ranks=2, needs="host", timeout=300, launch=ray_train, module="ray"),
)
