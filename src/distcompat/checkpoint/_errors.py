"""The exceptions :mod:`distcompat.checkpoint` raises, each subclassing the matching builtin."""

from __future__ import annotations

__all__ = [
    "CheckpointCorruptError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointSyncError",
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


class CheckpointSyncError(RuntimeError):
    """The ranks did not save together: one never arrived, steps differ, or a peer failed."""
