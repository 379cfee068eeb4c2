"""torchrun's worker contract for ranks that distcompat starts itself, on this machine.

The test harness (``distcompat.testing``) and the demo launcher (``distcompat demo``) both start N
local rank processes that join a gloo group through the parent's ``TCPStore``. Each rank gets::

    environ = local_rank_environ(rank, world_size, store_port)   # RANK, WORLD_SIZE, MASTER_*...

and none of an outer launcher's variables (a test run or demo started inside torchrun or SLURM
must not make its children believe they are that launcher's ranks).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["LAUNCHER_PREFIXES", "is_launcher_variable", "local_rank_environ"]

#: Prefixes of an outer launcher's variables, which a locally started rank must not inherit.
LAUNCHER_PREFIXES = (
    "TORCHELASTIC_", "PET_", "GROUP_", "ROLE_", "SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL",
    "MV2_", "JSM_", "LSB_", "SM_", "AZUREML_", "AZ_BATCH", "KUBERNETES_",
)  # fmt: skip
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK")


def is_launcher_variable(name: str) -> bool:
    """Return whether ``name`` belongs to an outer launcher (stripped from local ranks).

    Example:
        >>> is_launcher_variable("SLURM_PROCID"), is_launcher_variable("PATH")
        (True, False)
    """
    return name.startswith(LAUNCHER_PREFIXES) or name in _RANK_VARIABLES


def local_rank_environ(
    rank: int, world_size: int, store_port: int, *, omp_threads: str | None = None
) -> dict[str, str]:
    """Return the variables of rank ``rank`` of a single-node launch using the parent's store.

    ``TORCHELASTIC_USE_AGENT_STORE`` makes every rank a client of the parent's ``TCPStore`` on
    ``store_port`` (port 0 at creation: the OS picked a free one). ``omp_threads``: the value of
    ``OMP_NUM_THREADS`` (default: the parent's, else 1).

    Example:
        >>> local_rank_environ(1, 2, 29500)["RANK"]
        '1'
    """
    environ = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "NODE_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store_port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "OMP_NUM_THREADS": omp_threads or os.environ.get("OMP_NUM_THREADS", "1"),
    }
    # gloo picks its interface from the host name, which is not always routable (Accelerate pins
    # lo for the same reason); every rank of such a launch is on this machine.
    if "GLOO_SOCKET_IFNAME" not in os.environ and Path("/sys/class/net/lo").exists():
        environ["GLOO_SOCKET_IFNAME"] = "lo"
    return environ
