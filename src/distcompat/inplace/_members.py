"""Who goes on after a lost rank: the survivors agree through the rendezvous store, once.

Each process keeps the :class:`Members` of its group's current epoch: the launch ranks of the
members in rank order (a member's *id* is its rank when the group was made, which never changes).
When a peer is lost, every survivor calls :func:`agree_survivors`::

    nxt = agree_survivors(store, members, me=launch_rank, ended=proven_dead, deadline=t)

It says it is alive under the next epoch's key, then waits until every member is either alive
there or **proven ended** (``ended()``: its process is gone, seen by the peer watch through a
pidfd or its link's end). Only then does it propose the alive ones, with ``compare_set`` on one
key: the first proposal is the next epoch's members, for every rank, and no other can be. The
rules this gives:

* a peer is left behind only on proof that its process ended; one that is stopped (SIGSTOP) or
  cut off may still run, so the survivors wait for it until the deadline and then raise
  :class:`ShrinkRefusedError` (the job ends as before, and a restart resumes it): never two
  halves going on alone;
* the store decides: a rank that cannot reach it cannot take part, and the members of an epoch
  are one value, whoever wrote it;
* a rank that is alive but not among the members (it was wrongly declared ended) is fenced:
  :class:`FencedError`, never a silent rejoin.

Example:
    >>> Members(epoch=0, ids=(0, 1, 2)).rank_of(2)
    2
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from distcompat._store import QuickStore, StoreUnreachable
from distcompat.inplace._errors import FencedError, ShrinkRefusedError

__all__ = ["POLL_S", "STORE_SILENCE_S", "Members", "StoreSilence", "agree_survivors"]

#: How often a survivor looks at the store while its peers come to the regroup (seconds).
POLL_S = 0.002
#: How long the store may stay silent before the survivors give up (seconds): each request is
#: bounded (``QuickStore``) and asked again until then.
STORE_SILENCE_S = 15.0


@dataclass(frozen=True, slots=True)
class Members:
    """The members of one epoch of the group: their ids (launch ranks) in rank order.

    Example:
        >>> m = Members(epoch=1, ids=(0, 2))
        >>> m.size, m.rank_of(2), m.id_of(1)
        (2, 1, 2)
    """

    epoch: int
    ids: tuple[int, ...]

    @property
    def size(self) -> int:
        """The world size of this epoch."""
        return len(self.ids)

    def rank_of(self, member: int) -> int:
        """Return the rank of ``member`` (an id) in this epoch."""
        return self.ids.index(member)

    def id_of(self, rank: int) -> int:
        """Return the id of the member at ``rank`` in this epoch."""
        return self.ids[rank]


class StoreSilence:
    """How long the store has not answered a wait's requests (each bounded, asked again).

    Example:
        >>> silence = StoreSilence("during a test")
        >>> silence.answered()
    """

    def __init__(self, during: str) -> None:
        self._during = during
        self._since: float | None = None

    def answered(self) -> None:
        """Note that the store answered: the silence is over."""
        self._since = None

    def missed(self, error: StoreUnreachable) -> None:
        """Note a request that timed out; past :data:`STORE_SILENCE_S` of silence, give up."""
        self._since = time.monotonic() if self._since is None else self._since
        if time.monotonic() - self._since > STORE_SILENCE_S:
            raise ShrinkRefusedError(
                f"the rendezvous store did not answer for {STORE_SILENCE_S:g}s {self._during} "
                f"({error}): its host may be the rank that was lost; a restart resumes the job"
            ) from error


def _key(epoch: int, what: str) -> str:
    return f"epoch{epoch}/{what}"


def agree_survivors(
    store: QuickStore,
    members: Members,
    *,
    me: int,
    ended: Callable[[], set[int]],
    deadline: float,
) -> Members:
    """Agree with the other survivors on the next epoch's members; return them.

    ``store``: the group's rendezvous store under a prefix of its own (every rank the same);
    ``me``: this process's id; ``ended()``: the ids proven ended so far (asked again each poll);
    ``deadline``: ``time.monotonic()`` past which a member that neither came nor was proven
    ended makes it raise :class:`ShrinkRefusedError`. Raises :class:`FencedError` when the
    members agreed on do not include ``me``.
    """
    epoch = members.epoch + 1
    decided_key = _key(epoch, "members")
    said = False
    silence = StoreSilence(f"during the regroup of epoch {epoch}")
    while True:
        try:
            if not said:
                store.set(_key(epoch, f"alive/{me}"), "1")
                said = True
            if store.check([decided_key]):
                return _adopt(store.get(decided_key), epoch, me)
            alive = {m for m in members.ids if store.check([_key(epoch, f"alive/{m}")])}
            gone = ended() - alive
            pending = set(members.ids) - alive - gone
            if not pending:
                proposal = json.dumps(sorted(alive))
                return _adopt(store.compare_set(decided_key, "", proposal), epoch, me)
            silence.answered()
        except StoreUnreachable as exc:
            # every request here may be asked again; one of another caller may hold the
            # process's store thread a while (a request for a key a lost rank never wrote)
            silence.missed(exc)
            continue
        if time.monotonic() > deadline:
            raise ShrinkRefusedError(
                f"rank(s) {_named(members, pending)} neither came to the regroup of epoch "
                f"{epoch} nor were seen to end: a stopped or cut-off peer may still run, so "
                "the survivors do not go on without it (a restart resumes the job)"
            )
        time.sleep(POLL_S)


def _named(members: Members, ids: set[int]) -> str:
    return ", ".join(str(members.rank_of(m)) for m in sorted(ids))


def _adopt(raw: bytes, epoch: int, me: int) -> Members:
    ids = tuple(int(m) for m in json.loads(raw))
    if me not in ids:
        raise FencedError(
            f"this rank (launch rank {me}) was declared lost and the group went on without it "
            f"at epoch {epoch} (members: launch ranks {list(ids)}); it must not rejoin"
        )
    return Members(epoch=epoch, ids=ids)
