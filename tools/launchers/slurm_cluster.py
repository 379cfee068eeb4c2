"""A single-node Slurm cluster in a temp dir: munged, slurmctld and slurmd, started and stopped.

    with SlurmCluster.start(work / "slurm") as cluster:
        env = {**os.environ, **cluster.env}          # SLURM_CONF points at its slurm.conf
        subprocess.run(["srun", "-n", "3", "hostname"], env=env)

Everything lives in the temp dir (config, state, spool, logs, munge socket); the daemons run in
the foreground as our children, so stopping them is a signal to a pid we hold. munged refuses
root and runs as the ``munge`` user with the key the Debian package made. Ports are picked free
at start, so a second cluster on the machine (another session) does not collide. The node
declares 4 CPUs on this 2-core machine (``SlurmdParameters=config_overrides``) so that
``srun -n 3`` fits; the tasks only wait on each other.
"""

from __future__ import annotations

import os
import pwd
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import procs

READY_TIMEOUT_S = 60.0
MUNGE_KEY = Path("/etc/munge/munge.key")
_CPUS = 4
#: Seconds a job step's credential is valid, and a requeued job's wait before it starts again.
CRED_EXPIRE_S = 10
#: Seconds between the scheduler's full passes over the pending jobs.
SCHED_INTERVAL_S = 5


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _config(root: Path, node: str, ports: tuple[int, int]) -> str:
    return "\n".join(
        [
            f"ClusterName=dc{os.getpid() % 100000}",
            f"SlurmctldHost={node}(127.0.0.1)",
            f"SlurmctldPort={ports[0]}",
            f"SlurmdPort={ports[1]}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # a requeued job waits cred_expire + 1 s before it may start again (slurm.conf(5));
            # 120 by default, which would make the requeue case wait two minutes for nothing
            f"AuthInfo=socket={root / 'munge' / 'socket'},cred_expire={CRED_EXPIRE_S}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/builtin",
            # a job whose begin time passed (a requeued one) starts at the next full scheduling
            # pass, every 60 s by default: up to a minute idle in the requeue case
            f"SchedulerParameters=sched_interval={SCHED_INTERVAL_S}",
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd.pid'}",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
            f"NodeName={node} NodeAddr=127.0.0.1 CPUs={_CPUS} State=UNKNOWN",
            f"PartitionName=probe Nodes={node} Default=YES MaxTime=INFINITE State=UP "
            "OverSubscribe=YES",
            "",
        ]
    )


@dataclass(slots=True, kw_only=True)
class SlurmCluster:
    """The running daemons; ``env`` is what a client command needs (``SLURM_CONF``)."""

    root: Path
    env: dict[str, str]
    daemons: list[procs.Job] = field(default_factory=list)

    @classmethod
    def start(cls, root: Path) -> SlurmCluster:
        """Write the config, start munged, slurmctld and slurmd, wait for the node to be idle."""
        for sub in ("munge", "state", "spool", "log"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        node = socket.gethostname().split(".")[0]
        config = root / "slurm.conf"
        config.write_text(_config(root, node, (_free_port(), _free_port())), encoding="utf-8")
        cluster = cls(root=root, env={"SLURM_CONF": str(config)})
        try:
            cluster._start_daemons()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _start_daemons(self) -> None:
        if not MUNGE_KEY.exists():
            raise RuntimeError(f"{MUNGE_KEY} is missing (the munge package creates it)")
        munge_dir = self.root / "munge"
        munge = pwd.getpwnam("munge")
        for path in (self.root.parent, self.root):
            path.chmod(0o755)  # munged checks that every directory above its socket is traversable
        os.chown(munge_dir, munge.pw_uid, munge.pw_gid)
        env = {**os.environ, **self.env}
        self.daemons.append(
            procs.start(
                [
                    "munged",
                    "--foreground",
                    f"--socket={munge_dir / 'socket'}",
                    f"--key-file={MUNGE_KEY}",
                    f"--log-file={munge_dir / 'munged.log'}",
                    f"--pid-file={munge_dir / 'munged.pid'}",
                    f"--seed-file={munge_dir / 'munged.seed'}",
                ],
                env=env,
                log=self.root / "log" / "munged.out",
                user=munge.pw_name,
            )
        )
        self._wait_for(lambda: (munge_dir / "socket").exists(), "munged's socket")
        for daemon in ("slurmctld", "slurmd"):
            self.daemons.append(
                procs.start([daemon, "-D"], env=env, log=self.root / "log" / f"{daemon}.out")
            )
        self._wait_for(self._node_idle, "the node to be idle in sinfo")

    def _node_idle(self) -> bool:
        return self._client("sinfo", "-h", "-o", "%t").strip() == "idle"

    def _wait_for(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready():
            dead = [d for d in self.daemons if d.process.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead[0].process.args!r} exited: {_tail(dead[0].log)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {READY_TIMEOUT_S:.0f} s waiting for {what}")
            time.sleep(0.25)

    def _client(self, *argv: str) -> str:
        done = subprocess.run(
            list(argv),
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        return done.stdout

    def stop(self) -> None:
        """Cancel every job (bounded wait for the queue to drain), then stop the daemons."""
        if len(self.daemons) == 3:
            self._client("scancel", "--full", "--user=root")
            deadline = time.monotonic() + 15
            while self._client("squeue", "-h") and time.monotonic() < deadline:
                time.sleep(0.25)
        for daemon in reversed(self.daemons):
            procs.stop(daemon)
        self.daemons.clear()

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()


def _tail(log: Path) -> str:
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "(no output)"
    return " | ".join(line.strip() for line in lines[-3:] if line.strip())
