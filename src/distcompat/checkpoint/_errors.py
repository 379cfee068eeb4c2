"""The exceptions :mod:`distcompat.checkpoint` raises, and the warning of a resume without RNG.

Each exception subclasses the matching builtin; :class:`RngStateWarning` is what
:func:`~distcompat.checkpoint.resume` warns when per-rank RNG states cannot be restored.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CheckpointCorruptError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointSyncError",
    "CheckpointWriteError",
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


class CheckpointWriteError(CheckpointSyncError, OSError):
    """A save was not committed: a rank could not write its part, or rank 0 the manifest.

    Raised alike on every rank of the save, so one ``except`` serves them all. ``failures`` maps
    each rank that failed to what it said (a full disk: "no space left on device at <path>:
    needed ..., ... free of ..."); ``rank`` is the first of them and ``cause`` its text;
    ``errno`` is that rank's (``errno.ENOSPC`` for a full disk), else None. On the failing rank
    its own exception is chained (``__cause__``). Every committed step is untouched.

    Example:
        >>> error = CheckpointWriteError("not committed", failures={1: "no space left"}, code=28)
        >>> error.rank, error.cause, error.errno, isinstance(error, OSError)
        (1, 'no space left', 28, True)
    """

    def __init__(
        self, message: str, *, failures: dict[int, str] | None = None, code: int | None = None
    ) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})
        self.rank = min(self.failures) if self.failures else None
        self.cause = self.failures[self.rank] if self.rank is not None else ""
        self.errno = code

    def __reduce__(self) -> tuple[Any, ...]:  # keyword arguments and errno survive a pickle
        return (_write_error, (str(self), self.failures, self.errno))


def _write_error(message: str, failures: dict[int, str], code: int | None) -> CheckpointWriteError:
    return CheckpointWriteError(message, failures=failures, code=code)
