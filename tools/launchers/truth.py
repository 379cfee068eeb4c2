"""What the launcher itself says about this process, read from its own variables (not distcompat's).

    truth = launcher_truth("openmpi", os.environ)   # OMPI_COMM_WORLD_RANK and friends
    truth.rank, truth.local_rank, truth.world_size, truth.node_rank

The probe compares this with what ``init_distributed`` resolved. The reading is deliberately
naive, one line per launcher from its documentation, so it does not share distcompat's parsing.
Ray Train's truth comes from its train context instead (``ray_job.py``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

#: Set by the harness on a node started without GLOO_SOCKET_IFNAME: the interface (the node's veth)
#: whose route reaches the rendezvous host, which init should pick by itself.
EXPECT_IFNAME_VAR = "LAUNCHERS_EXPECT_IFNAME"


@dataclass(frozen=True, slots=True, kw_only=True)
class Truth:
    """This process's place in the job, as its launcher described it; ``source`` names how."""

    source: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int


#: launcher -> (rank, local rank, world size, local world size) variable names.
_NATIVE = {
    "torchrun": ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"),
    "openmpi": (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    "mpich": ("PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE", "MPI_LOCALNRANKS"),
    "slurm": ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_TASKS", ""),
}
KINDS = tuple(_NATIVE)


def _tasks_on_node(spec: str, node: int) -> int:
    """Entry ``node`` of a Slurm tasks-per-node list such as ``2(x3),1``."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(f"SLURM_STEP_TASKS_PER_NODE={spec!r} is not a tasks-per-node list")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node]


def launcher_truth(kind: str, environ: Mapping[str, str]) -> Truth:
    """Read ``kind``'s own variables (MPI has no node index: the session runs it on one host).

    Raises ``KeyError`` naming the variable the launcher did not set.
    """
    rank, local, world, local_world = _NATIVE[kind]
    names = [rank, local, world]
    if kind == "torchrun":
        node = int(environ["GROUP_RANK"])
        local_size = int(environ[local_world])
        names += [local_world, "GROUP_RANK"]
    elif kind == "slurm":
        node = int(environ["SLURM_NODEID"])
        local_size = _tasks_on_node(environ["SLURM_STEP_TASKS_PER_NODE"], node)
        names += ["SLURM_STEP_TASKS_PER_NODE", "SLURM_NODEID"]
    else:
        node = 0  # every MPI launch of the session runs on this one host
        local_size = int(environ[local_world])
        names += [local_world, "(one host: node 0)"]
    return Truth(
        source=", ".join(names),
        rank=int(environ[rank]),
        local_rank=int(environ[local]),
        world_size=int(environ[world]),
        local_world_size=local_size,
        node_rank=node,
    )
