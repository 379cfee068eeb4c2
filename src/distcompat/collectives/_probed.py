"""The probe results the collectives act on: those every member of a group holds.

:func:`distcompat.capabilities` finds out what a group's backend does correctly; the results it
returns are the same on every rank (the probe agrees on them with one MIN all-reduce). It
remembers them here for the group it probed, and from then on the reductions on that group take
the backend's native path where the probe saw it give the right answer (gloo's AVG on floats)
and a named shim where it did not (a backend whose float16 SUM raises). A group that was never
probed uses the plans that are correct on every backend.

A plan must be the same on every rank of a group (different plans would send different
collectives), so results are kept per group object, never per backend: only ranks that probed
this very group together act on them.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

__all__ = ["ProbedCells", "forget", "probed_for", "remember"]


@dataclass(frozen=True, slots=True)
class ProbedCells:
    """Agreed probe results for one group: ``cells[(op, dtype name, ReduceOp name)]``."""

    backend: str
    device_type: str  # the probe's tensors were on this device type; other devices are not covered
    cells: Mapping[tuple[str, str, str], str]
    #: plans already made from these cells, by (op, dtype, world size, collective): planning
    #: from the cells costs 8-20 us, a lookup well under 1 us
    plans: dict[tuple[Any, ...], Any] = field(default_factory=dict, compare=False)


_probed: weakref.WeakKeyDictionary[Any, ProbedCells] = weakref.WeakKeyDictionary()


#: Whether any group was ever probed in this process: the common case skips the lookup, which
#: every all_reduce makes (a weak-key lookup costs far more right after a barrier than warm).
_any = False


def remember(group: Any, probed: ProbedCells) -> None:
    """Let collectives on ``group`` act on ``probed`` (every member calls this together)."""
    global _any
    _probed[group if group is not None else dist.group.WORLD] = probed
    _any = True


def forget(group: Any) -> None:
    """Go back to the plans that are correct on every backend for ``group``."""
    global _any
    _probed.pop(group if group is not None else dist.group.WORLD, None)
    _any = bool(_probed)  # none left: the fast paths need not look


def probed_for(group: Any) -> ProbedCells | None:
    """Return the agreed probe results for ``group``, or None if it was never probed.

    Example:
        >>> probed_for(None) is None   # no process group, nothing probed
        True
    """
    if not _any:
        return None
    key = group if group is not None else dist.group.WORLD
    return _probed.get(key) if key is not None else None
