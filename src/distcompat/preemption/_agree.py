"""The ranks agree to stop at one step: one tiny all-gather of what each rank caught.

Signals reach the ranks at different moments (one pod, one node first; only one rank, under
``mpirun``), and a save is a collective: every rank must stop at the same step. Each call gathers
every rank's first caught signal (its number and time, zeros when none) over the group a save
uses (the default group when it carries CPU tensors, else a gloo side group), so every rank reads
the same table and decides the same::

    table = exchange(catcher.first, group)     # one entry per rank: Caught or None
    earliest(table)                            # (rank, Caught) of the first signal, or None

The table is CPU ``float64`` (a signal time keeps its microseconds); a CUDA job's agreement
never touches the GPU or syncs its stream.
"""

from __future__ import annotations

import torch

from distcompat.checkpoint._sync import SaveGroup
from distcompat.collectives import all_gather_into_tensor
from distcompat.preemption._signals import Caught

__all__ = ["earliest", "exchange"]


def exchange(mine: Caught | None, where: SaveGroup) -> list[Caught | None]:
    """Return every rank's first caught signal, in rank order (a collective on ``where``).

    Example:
        >>> from distcompat.checkpoint._sync import SaveGroup
        >>> exchange(None, SaveGroup(rank=0, world_size=1, group=None, active=False))
        [None]
    """
    if not where.active:
        return [mine]
    row = torch.tensor([mine.signum, mine.wall] if mine else [0.0, 0.0], dtype=torch.float64)
    table = torch.empty(where.world_size * 2, dtype=torch.float64)
    all_gather_into_tensor(table, row, group=where.group)
    return [
        Caught(signum=int(signum), wall=float(wall)) if signum else None
        for signum, wall in table.view(-1, 2).tolist()
    ]


def earliest(table: list[Caught | None]) -> tuple[int, Caught] | None:
    """Return the rank that caught the first signal and what it caught (None: no rank did).

    Example:
        >>> earliest([None, Caught(signum=15, wall=2.0), Caught(signum=10, wall=1.0)])
        (2, Caught(signum=10, wall=1.0))
    """
    caught = [(rank, entry) for rank, entry in enumerate(table) if entry is not None]
    return min(caught, key=lambda found: (found[1].wall, found[0])) if caught else None
