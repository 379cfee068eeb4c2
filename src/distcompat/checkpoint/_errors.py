"""The exceptions :mod:`distcompat.checkpoint` raises, and the warning of a resume without RNG.

Each exception subclasses the matching builtin; :class:`RngStateWarning` is what
:func:`~distcompat.checkpoint.resume` warns when per-rank RNG states cannot be restored.
"""

from __future__ import annotations

__all__ = [
    "CheckpointCorruptError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointSyncError",
    "PerRankStateError",
    "ResumeStateError",
    "RngStateWarning",
    "WorldSizeMismatchError",
]


class CheckpointNotFoundError(FileNotFoundError):
    """No committed checkpoint (or not the requested step) exists in the directory."""


class CheckpointExistsError(FileExistsError):
    """The step is already committed; a committed checkpoint is never overwritten."""


class CheckpointCorruptError(ValueError):
    """A committed checkpoint fails verification: bad manifest, missing file, size or checksum."""


class WorldSizeMismatchError(ValueError):
    """Per-rank state saved by one world size cannot be loaded, as is, by another."""


class ResumeStateError(ValueError):
    """A committed checkpoint does not hold what :func:`resume` was asked to restore."""


class PerRankStateError(WorldSizeMismatchError):
    """State that differs across the saving ranks cannot follow a new world size.

    Raised by :func:`~distcompat.checkpoint.resume` on every rank, before anything is restored,
    naming the object and the keys that differ (an optimizer sharded per rank that is not
    :class:`~distcompat.checkpoint.Reshardable`), or the per-rank RNG states with
    ``rng_change="error"``.
    """


class RngStateWarning(UserWarning):
    """Per-rank RNG states saved by another world size were not restored: draws change."""


class CheckpointSyncError(RuntimeError):
    """The ranks did not save together: one never arrived, steps differ, or a peer failed."""
