"""Typed collective errors: a peer that died is not a peer that is stuck.

gloo reports both as a plain ``RuntimeError`` (reliability.md, 2.2): a dead peer shows up within
about 0.1 s as "Connection reset by peer" / "Connection closed by peer"; a stuck one only when
the group's timeout expires, as "Timed out waiting ...ms". After a timeout the group is unusable
on every rank. distcompat raises::

    try:
        all_reduce(loss)
    except PeerLostError:          # a ConnectionError: restart the job from a checkpoint
        ...
    except CollectiveTimeoutError: # a TimeoutError: some rank is stuck; dump stacks, abort
        ...
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NoReturn

import torch.distributed as dist

from distcompat.collectives._group import global_rank

__all__ = [
    "CollectiveError",
    "CollectiveTimeoutError",
    "PeerLostError",
    "raise_typed",
    "translate",
    "typed_errors",
]

_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe")
_TIMEOUT = ("timed out", "application timeout caused pair closure", "operation timed out")


class CollectiveError(RuntimeError):
    """A collective failed; ``peer`` is the rank at fault when it can be known, else None."""

    def __init__(self, message: str, *, op: str, peer: int | None) -> None:
        super().__init__(message)
        self.op = op
        self.peer = peer


class PeerLostError(CollectiveError, ConnectionError):
    """A peer process went away (crashed, was killed, or exited) during the collective."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """The collective did not complete within the group's timeout: a peer is alive but stuck.

    The process group cannot be used afterwards, on any rank.
    """


def _other_rank(group: Any) -> int | None:
    """Return the peer's global rank when the group has exactly two ranks, else None."""
    try:
        if dist.get_world_size(group) != 2:
            return None
        me = dist.get_rank(group)
        other = 1 - me
        return global_rank(group, other)
    except (RuntimeError, ValueError):
        return None


def translate(exc: BaseException, op: str, group: Any) -> BaseException:
    """Return a typed error for a backend failure, or ``exc`` itself if it is not one we know.

    Example:
        >>> lost = RuntimeError("Read error: Connection reset by peer")
        >>> type(translate(lost, "all_reduce", None)).__name__
        'PeerLostError'
    """
    if isinstance(exc, CollectiveError) or not isinstance(exc, RuntimeError):
        return exc
    text = str(exc)
    lowered = text.lower()
    if any(marker in lowered for marker in _LOST):
        kind: type[CollectiveError] = PeerLostError
        what = "a peer process went away"
    elif any(marker in lowered for marker in _TIMEOUT):
        kind = CollectiveTimeoutError
        what = "timed out: a peer is alive but not taking part (the group is unusable now)"
    else:
        return exc
    peer = _other_rank(group) if dist.is_available() and dist.is_initialized() else None
    named = f" (rank {peer})" if peer is not None else ""
    error = kind(f"{op}: {what}{named}. Backend said: {text}", op=op, peer=peer)
    error.__cause__ = exc
    return error


@contextlib.contextmanager
def typed_errors(op: str, group: Any) -> Iterator[None]:
    """Re-raise backend failures inside the block as :class:`CollectiveError` subclasses."""
    try:
        yield
    except RuntimeError as exc:
        raise_typed(exc, op, group)


def raise_typed(exc: RuntimeError, op: str, group: Any) -> NoReturn:
    """Raise the typed form of ``exc`` (chained to it), or ``exc`` itself if it has none."""
    error = translate(exc, op, group)
    if error is exc:
        raise exc
    raise error from exc
