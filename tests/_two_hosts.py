"""Two "machines" on this one, for tests and benchmarks of what crosses machines.

    needs_namespaces()                       # pytest.skip without root, `ip`, `unshare` or tools/
    with two_nodes() as nodes:
        ranks = run_pair(nodes, script, ("arg",), port=29511)   # [Ran(rank 0), Ran(rank 1)]

Each rank runs in its own network namespace (``tools/launchers/netns.py``: a veth pair,
10.77.0.1 and 10.77.0.2, nothing else) and its own pid namespace (``unshare --pid``), so its
identity's machine (boot id + pid namespace, ``peers._identity``) differs from the other's
and no pidfd can reach it. What is simulated: the kernel and boot id are shared. ``netns`` is
imported when the nodes are made: the sdist's tests have the package only, no ``tools/``.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from distcompat.launch._local_ranks import is_launcher_variable

_LAUNCHERS = Path(__file__).resolve().parents[1] / "tools" / "launchers"

__all__ = ["Ran", "needs_namespaces", "run_pair", "two_nodes"]


@dataclass(frozen=True, slots=True)
class Ran:
    """One rank process on its node: exit code and output."""

    returncode: int
    stdout: str
    stderr: str


def needs_namespaces() -> None:
    if not (_LAUNCHERS / "netns.py").exists():
        pytest.skip("tools/launchers/netns.py is not here (the sdist has no tools/)")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            pytest.skip(f"`{tool}` is not installed")


def _netns() -> Any:
    """``tools/launchers/netns.py`` (no package: its folder goes on the path)."""
    if str(_LAUNCHERS) not in sys.path:
        sys.path.insert(0, str(_LAUNCHERS))
    import netns

    return netns


def two_nodes() -> AbstractContextManager[Any]:
    """Make the two nodes (``netns.TwoNodes.create()``); removed when the block ends."""
    return _netns().TwoNodes.create()  # type: ignore[no-any-return]


def run_pair(
    nodes: Any, script: Path, args: Sequence[str], port: int, *, nofile: int | None = None
) -> list[Ran]:
    """Run ``script`` on 2 ranks, rank k on node k in its own pid namespace; wait for both.

    Rank 0 hosts the store at ``port`` on its node (``torchrun --nnodes=2``'s contract).
    ``nofile``: the ranks' open-file limit (``RLIMIT_NOFILE``, soft and hard).
    """

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    base = {k: v for k, v in os.environ.items() if not is_launcher_variable(k)}
    for name in ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME"):
        base.pop(name, None)
    procs = []
    for rank in (0, 1):
        environ = base | {
            "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": str(rank), "NODE_RANK": str(rank), "MASTER_ADDR": _netns().ADDRESSES[0],
            "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
        }  # fmt: skip
        # sh stays pid 1 of the pid namespace (`; exit`), so the rank may SIGKILL itself; a
        # timed-out unshare, killed below, takes its namespace with it (--kill-child)
        argv = ["unshare", "--pid", "--kill-child", "--mount-proc",
                "sh", "-c", '"$0" "$@"; exit $?', sys.executable, str(script), *args]  # fmt: skip
        procs.append(
            subprocess.Popen(
                nodes.exec_in(rank, argv),
                env=environ,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                preexec_fn=limit,
            )
        )
    ran = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        ran.append(Ran(proc.returncode, out, err))
    return ran
