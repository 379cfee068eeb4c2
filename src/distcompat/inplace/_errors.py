"""What can stop a lost rank's survivors from going on in place: each a typed error.

Example:
    >>> issubclass(FencedError, InPlaceError)
    True
"""

from __future__ import annotations

__all__ = [
    "FencedError",
    "InPlaceError",
    "InPlaceUnsupportedError",
    "NotAdmittedError",
    "ShrinkRefusedError",
    "StateLostError",
]


class InPlaceError(RuntimeError):
    """The group could not go on in place; the job ends as it did before (a restart resumes it)."""


class FencedError(InPlaceError):
    """The group declared this rank lost and went on without it: it must not rejoin silently."""


class ShrinkRefusedError(InPlaceError):
    """A peer neither came to the regroup nor was proven dead in time (stopped, or cut off).

    A peer is left behind only on proof that its process ended: one that is stopped or out of
    reach may still run, and two halves of a job must never go on alone.
    """


class StateLostError(InPlaceError):
    """No survivor holds the state of a whole step (each was inside its optimizer's update)."""


class InPlaceUnsupportedError(InPlaceError):
    """The group or the training state cannot go on in place (the message says which, and why)."""


class NotAdmittedError(InPlaceError):
    """A newcomer came too late: the running group finished its loop before it admitted it."""
