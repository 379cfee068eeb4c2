"""Typed collective errors: a peer that died is not a peer that is stuck.

gloo reports both as a plain ``RuntimeError`` (reliability.md, 2.2): a dead peer shows up within
about 0.1 s as "Connection reset by peer" / "Connection closed by peer"; a stuck one only when
the group's timeout expires, as "Timed out waiting ...ms". After a timeout the group is unusable
on every rank. The rank at fault is named: in a pair it is the other rank; in larger groups
``_peers`` finds it from the identities ranks published at init. distcompat raises::

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
from distcompat.peers import farewells, lost_peers, stopped_peers

__all__ = [
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "PeerLostError",
    "gone_error",
    "raise_typed",
    "translate",
    "typed_errors",
]

_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe")
_TIMEOUT = ("timed out", "application timeout caused pair closure", "operation timed out")


class CollectiveError(RuntimeError):
    """A collective failed; ``peer`` is the rank at fault when it can be known, else None.

    ``peers`` holds every rank found at fault (global ranks, lowest first); ``peer`` is the first.
    """

    def __init__(self, message: str, *, op: str, peer: int | None, peers: tuple[int, ...] = ()):
        super().__init__(message)
        self.op = op
        self.peer = peer
        self.peers = peers or (() if peer is None else (peer,))


class CollectiveMismatchError(ValueError):
    """Ranks called different collectives (or the same one with different arguments)."""


class PeerLostError(CollectiveError, ConnectionError):
    """A peer process went away (crashed, was killed, or exited) during the collective."""


def gone_error(op: str, gone: tuple[int, ...], where: str) -> PeerLostError:
    """Return the error of ``op`` whose peers ``gone`` (global ranks, at least one) ended.

    ``where`` says what this rank was doing; each lost rank's farewell follows, where it left
    one.

    Example:
        >>> str(gone_error("all_reduce", (1, 3), "while this rank waited"))
        'all_reduce: a peer process went away (ranks 1, 3) while this rank waited'
    """
    ranks = f"rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))}"
    return PeerLostError(
        f"{op}: a peer process went away ({ranks}) {where}{farewells(gone)}",
        op=op,
        peer=gone[0],
        peers=gone,
    )


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """The collective did not complete within the group's timeout: a peer is alive but stuck.

    The process group cannot be used afterwards, on any rank.
    """


def _at_fault(group: Any, lost: bool, text: str) -> tuple[int, ...]:
    """Return the global ranks to blame: the other rank of a pair, else what ``_peers`` finds."""
    if not (dist.is_available() and dist.is_initialized()):
        return ()
    try:
        if dist.get_world_size(group) == 2:
            return (global_rank(group, 1 - dist.get_rank(group)),)
        return lost_peers(group, text) if lost else stopped_peers(group)
    except (RuntimeError, ValueError):
        return ()


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
    peers = _at_fault(group, kind is PeerLostError, text)
    named = f" (rank{'s' if len(peers) > 1 else ''} {', '.join(map(str, peers))})" if peers else ""
    said = farewells(peers) if kind is PeerLostError else ""
    error = kind(
        f"{op}: {what}{named}{said}. Backend said: {text}",
        op=op,
        peer=peers[0] if peers else None,
        peers=peers,
    )
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
