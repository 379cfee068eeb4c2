"""torchrun's worker variables for a process another launcher started: which ones are missing.

Most training code reads its place from ``RANK`` / ``WORLD_SIZE`` (nanochat's ``get_dist_info``,
nanoGPT, many data loaders). Under ``mpiexec`` or ``srun`` those are unset, so such a helper says
"rank 0 of 1" on every rank and every rank reads the same shard. After init, distcompat fills in
what is missing from what it resolved (``process_group`` does the writing)::

    missing = torchrun_exports(TorchrunValues(rank=1, ...), os.environ)   # {"RANK": "1", ...}

A variable that is set is never in the answer, whatever its value: the launcher's (or the user's)
word wins. This module only decides.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["TORCHRUN_VARIABLES", "TorchrunValues", "torchrun_exports"]

#: The torchrun variables distcompat fills in after init, in torchrun's own order.
TORCHRUN_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
    "MASTER_PORT",
)  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class TorchrunValues:
    """What init resolved, in torchrun's terms; an unknown master is None (never exported)."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str | None
    master_port: int | None


def torchrun_exports(values: TorchrunValues, environ: Mapping[str, str]) -> dict[str, str]:
    """Return the torchrun variables ``environ`` lacks, with the values init resolved.

    Example:
        >>> values = TorchrunValues(rank=1, local_rank=1, world_size=2, local_world_size=2,
        ...     node_rank=0, master_addr="127.0.0.1", master_port=29500)
        >>> torchrun_exports(values, {"OMPI_COMM_WORLD_RANK": "1", "MASTER_PORT": "1234"})
        {'RANK': '1', 'LOCAL_RANK': '1', 'WORLD_SIZE': '2', 'LOCAL_WORLD_SIZE': '2', 'GROUP_RANK': '0', 'MASTER_ADDR': '127.0.0.1'}
    """  # noqa: E501
    resolved = {
        "RANK": values.rank,
        "LOCAL_RANK": values.local_rank,
        "WORLD_SIZE": values.world_size,
        "LOCAL_WORLD_SIZE": values.local_world_size,
        "GROUP_RANK": values.node_rank,
        "MASTER_ADDR": values.master_addr,
        "MASTER_PORT": values.master_port,
    }
    return {
        name: str(resolved[name])
        for name in TORCHRUN_VARIABLES
        if name not in environ and resolved[name] is not None
    }
