"""Two ranks started as two machines on this one, under limits, for tests/test_hostile.py.

    store, ranks = start_ranks(script, ("train", str(tmp)), nofile=1024)  # rank 0's, rank 1's
    results = finish(ranks)                                                 # [Ran(...), Ran(...)]
    with private_mounts(("/dev/shm", "size=256k")) as mounts:               # a tiny /dev/shm
        store, ranks = start_ranks(script, args, wrap=mounts.wrap)

Each rank gets torchrun's environment for ``--nnodes=2 --nproc-per-node=1`` (``LOCAL_WORLD_SIZE=1``,
``NODE_RANK`` = its rank) and joins this process's ``TCPStore``, so every rank listens for peer
links as on a real multi-machine job; both run here, on loopback. What is simulated: the two
"machines" share a kernel (each sees the other's process; ``tests/_two_hosts.py`` separates them).
``nofile``: the ranks' open-file limit (``RLIMIT_NOFILE``, soft and hard). ``wrap``: an argv
prefix the rank runs under: :func:`private_mounts` gives one that runs it where small tmpfs
file systems of the test's own are mounted (a mount namespace, gone with the block; needs root,
``unshare`` and ``nsenter``, else the test is skipped).
"""

from __future__ import annotations

import contextlib
import os
import resource
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch.distributed as dist

from distcompat.launch._local_ranks import is_launcher_variable

__all__ = ["Mounts", "Ran", "finish", "private_mounts", "start_ranks"]


@dataclass(frozen=True, slots=True)
class Ran:
    """One rank process: exit code (None: killed at the timeout) and output."""

    returncode: int | None
    stdout: str
    stderr: str


def start_ranks(
    script: Path,
    args: Sequence[str],
    *,
    nofile: int | None = None,
    env: Mapping[str, str] | None = None,
    wrap: Sequence[str] = (),
) -> tuple[object, list[subprocess.Popen[str]]]:
    """Start rank 0 and rank 1 of a two-machine launch; return the store (keep it) and both."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    base = {k: v for k, v in os.environ.items() if not is_launcher_variable(k)}
    base.update(env or {})

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    procs = []
    for rank in (0, 1):
        environ = base | {
            "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": str(rank), "NODE_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
            "OMP_NUM_THREADS": "1",
        }  # fmt: skip
        procs.append(
            subprocess.Popen(
                [*wrap, sys.executable, str(script), *args],
                env=environ,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                preexec_fn=limit,
            )
        )
    return store, procs


def finish(procs: list[subprocess.Popen[str]], timeout: float = 90.0) -> list[Ran]:
    """Wait for every rank (``timeout`` each at most; kill what is left); return how each ended."""
    ran = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            code = None
        ran.append(Ran(code, out, err))
    return ran


@dataclass(frozen=True, slots=True)
class Mounts:
    """A mount namespace held open: ``wrap`` runs a command in it, ``seen(path)`` reads it."""

    wrap: tuple[str, ...]
    pid: int

    def seen(self, path: Path) -> Path:
        """Return ``path`` as this process reaches it inside the namespace."""
        return Path(f"/proc/{self.pid}/root") / path.relative_to("/")


@contextlib.contextmanager
def private_mounts(*mounts: tuple[Path | str, str]) -> Iterator[Mounts]:
    """Mount a tmpfs at each (target, options) in a new mount namespace, for the block only.

    Skips the test where that cannot be done (not root, no ``unshare``/``nsenter``, a container
    that refuses ``mount``).
    """
    if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("nsenter")):
        pytest.skip("a private tmpfs needs root, unshare and nsenter")
    steps = [
        f"mount -t tmpfs -o {opts} tmpfs {shlex.quote(str(target))}" for target, opts in mounts
    ]
    holder = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         " && ".join([*steps, "echo ready", "exec sleep 3600"])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout is not None
    if holder.stdout.readline().strip() != "ready":
        holder.kill()
        _, err = holder.communicate()
        pytest.skip(f"cannot mount a tmpfs here: {err.strip()}")
    try:
        yield Mounts(("nsenter", f"--mount=/proc/{holder.pid}/ns/mnt", "--"), holder.pid)
    finally:
        holder.kill()
        holder.communicate()  # reaps it and closes its pipes
