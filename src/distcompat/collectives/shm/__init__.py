"""The shared-memory path: CPU collectives of ranks on one machine, through one segment.

Which calls take it and why (``_path``), how a group sets it up with every rank (``_setup``),
the segment and its barrier (``_segment``, ``_barrier``), and the engine that runs the ops
(``_engine`` schedules, ``_ops`` are the steps, ``_folds`` the arithmetic, ``_work`` the handle)::

    engine = engine_for(group, "all_reduce", wire)   # None: use the backend
    status(group).reason                             # why this group takes the path, or not
"""

from distcompat.collectives.shm._engine import Engine
from distcompat.collectives.shm._path import (
    MIN_BYTES,
    WIRED,
    choice,
    engaged,
    engine_for,
    floor_bytes,
    floors,
    forced,
    host_reason,
    reduces,
    reset,
    status,
)
from distcompat.collectives.shm._setup import SLOT_BYTES, SharedMemoryFallbackWarning, ShmStatus

__all__ = [
    "MIN_BYTES",
    "SLOT_BYTES",
    "WIRED",
    "Engine",
    "SharedMemoryFallbackWarning",
    "ShmStatus",
    "choice",
    "engaged",
    "engine_for",
    "floor_bytes",
    "floors",
    "forced",
    "host_reason",
    "reduces",
    "reset",
    "status",
]
