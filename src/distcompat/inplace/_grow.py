"""A newcomer joins the running group at a step boundary that every member agrees on.

A newcomer (``distcompat.process_group._joining``: a replaced rank, or a process started by
hand) is answered at init and says it is ready once its ``InPlace`` exists. Then, under the
group's in-place prefix:

1. the leader (rank 0 of the epoch) proposes ``epoch{E}/grow{N}``: the ready newcomers, and a
   step boundary ``at`` two past its own. Members are never more than one step apart (each
   step's collectives wait for all), so ``at`` is still ahead of every member when proposed;
2. each member's watch answers (``ack/ID``): ``yes`` if its loop has not passed ``at``, else
   ``no``. The answer and the loop's boundary take one lock, so a member says yes only while it
   will still stop at ``at``;
3. at ``at`` the leader reads every answer. All yes: it claims the next epoch's members (the key
   a shrink's agreement decides, with ``compare_set``: a grow and a shrink cannot both decide
   one epoch) and admits the newcomers (``admit/ID``). It writes ``decided`` (yes or no); the
   other members wait for it at ``at``. A member lost meanwhile ends every wait
   (:class:`MemberLostError`), and the survivors recover as from any loss;
4. everyone admitted regroups as a shrink does (``_regroup``) and takes the furthest state.
   A newcomer seen to end (its request names its process) is not proposed; one that does not
   come to the regroup is left out there (``_regroup.JOIN_S``), and the members agree again.

The watch is a thread that polls the store every :data:`POLL_S`; the loop pays one lock per
step. Example:

    >>> Proposal(epoch=1, number=0, at=7, ids=(3,)).key
    'epoch1/grow0'
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from distcompat import peers
from distcompat._ranks import rendezvous
from distcompat._store import QuickStore, StoreUnreachable
from distcompat.inplace._errors import NotAdmittedError
from distcompat.inplace._members import Members
from distcompat.inplace._regroup import MemberLostError, wait_for
from distcompat.process_group._joining import Announcement, announce, answer, requester

__all__ = ["POLL_S", "Admissions", "Proposal", "announce_members", "wait_admitted", "went_on"]

#: How often each member's watch looks at the store for newcomers and proposals (seconds).
POLL_S = 0.05
#: How many steps past the leader's own a grow is proposed for.
AHEAD = 2
#: What the leader writes in a waiting newcomer's admission when its loop ended.
_CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class Proposal:
    """A grow the leader proposed: at step boundary ``at``, the newcomers ``ids``."""

    epoch: int
    number: int
    at: int
    ids: tuple[int, ...]

    @property
    def key(self) -> str:
        """Its key under the in-place prefix."""
        return f"epoch{self.epoch}/grow{self.number}"


class Admissions:
    """One member's side of the grow protocol: its watch thread and its loop's boundary.

    ``store``: the in-place prefix; ``first``: the group's first size (newcomers' ids follow);
    ``total``: the steps of the loop (no grow is proposed for the last ones); ``announce``:
    the leader's watch calls it with each epoch's members until it returns True (the
    announcement names their processes).
    """

    def __init__(
        self,
        store: QuickStore,
        members: Members,
        me: int,
        first: int,
        total: int,
        announce: Callable[[Members], bool],
    ) -> None:
        self._store, self._me, self._first, self._total = store, me, first, total
        self._announce, self._announced = announce, -1  # the epoch announced last
        self._lock = threading.Lock()
        self._members = members
        self._passed = -1  # the last step boundary this member's loop passed
        self._number = 0  # the proposal of this epoch looked for next
        self._pending: Proposal | None = None  # the proposal this member said yes to
        self._admitted: set[int] = set()
        self._identities: dict[int, peers.Identity] = {}  # newcomers' processes, as they asked
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="distcompat-inplace", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the watch (the loop ended); the leader closes every newcomer's admission.

        A newcomer still waiting would wait for the group timeout: it is told at once, and
        raises :class:`NotAdmittedError` (``compare_set``: an admission already written stays).
        """
        self._stop.set()
        self._thread.join(timeout=2 * POLL_S + 1.0)
        with self._lock:
            leader = self._members.rank_of(self._me) == 0
        if leader:
            with contextlib.suppress(StoreUnreachable):  # best effort: its deadline still holds
                for member in set(self._newcomers()) - self._admitted:
                    self._store.compare_set(f"admit/{member}", "", _CLOSED)

    def reset(self, members: Members) -> None:
        """Go on with ``members`` (a regroup made a new epoch): proposals start again."""
        with self._lock:
            self._members, self._number, self._pending = members, 0, None
            self._admitted |= set(members.ids)

    def boundary(self, step: int) -> Proposal | None:
        """Pass the loop's boundary of ``step``; return the grow to make here, if one was agreed."""
        with self._lock:
            self._passed = step
            pending = self._pending
        return pending if pending is not None and pending.at == step else None

    def decide(
        self, proposal: Proposal, ended: Callable[[], set[int]], deadline: float
    ) -> Members | None:
        """At ``proposal.at``: the next epoch's members if the grow was agreed, else None."""
        store = self._store
        with self._lock:
            members = self._members
        decided = f"{proposal.key}/decided"
        if members.rank_of(self._me) == 0:
            acks = [f"{proposal.key}/ack/{m}" for m in members.ids]
            _wait(store, acks, members, ended, deadline)
            agreed = all(value == b"yes" for value in store.multi_get(acks))
            grown = tuple(members.ids) + proposal.ids
            if agreed:
                raw = store.compare_set(f"epoch{members.epoch + 1}/members", "", json.dumps(grown))
                agreed = tuple(json.loads(raw)) == grown
            if agreed:
                for member in proposal.ids:
                    store.set(f"admit/{member}", json.dumps([members.epoch + 1, grown]))
            store.set(decided, "yes" if agreed else "no")
        else:
            _wait(store, [decided], members, ended, deadline)
            agreed = store.get(decided) == b"yes"
        with self._lock:  # this proposal is over: the watch looks for the next one
            self._pending = None
            self._number += 1
            if agreed:
                self._admitted |= set(proposal.ids)
        if not agreed:
            return None
        ids = json.loads(store.get(f"epoch{members.epoch + 1}/members"))
        return Members(members.epoch + 1, tuple(int(m) for m in ids))

    def ended_newcomers(self, ids: set[int]) -> set[int]:
        """Return the newcomers among ``ids`` whose process was seen to end (on this machine).

        A newcomer on another machine has no link to the members yet: it is left out on time
        alone (``_regroup.JOIN_S``).
        """
        ended = set()
        for member in ids:
            if member not in self._identities:
                found = requester(self._store, member)
                if found is None:
                    continue
                self._identities[member] = found
            identity = self._identities[member]
            if peers.seen_ended(identity):
                ended.add(member)
        return ended

    # -- the watch thread ---------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self._look()
            except StoreUnreachable:
                continue  # asked again at the next poll; the loop's own calls say more

    def _look(self) -> None:
        store = self._store
        with self._lock:
            members, number, passed, pending = (
                self._members, self._number, self._passed, self._pending
            )  # fmt: skip
        leader = members.rank_of(self._me) == 0
        if leader:
            self._answer_newcomers()
            if self._announced != members.epoch and self._announce(members):
                self._announced = members.epoch
        key = Proposal(members.epoch, number, 0, ()).key
        if pending is not None:
            return
        if store.check([key]):
            at, ids = json.loads(store.get(key))
            self._say(Proposal(members.epoch, number, int(at), tuple(ids)), members)
        elif leader:
            ready = self._ready() - self._admitted
            at = passed + AHEAD
            if ready and passed >= 0 and at < self._total:
                proposal = Proposal(members.epoch, number, at, tuple(sorted(ready)))
                store.compare_set(key, "", json.dumps([at, list(proposal.ids)]))

    def _say(self, proposal: Proposal, members: Members) -> None:
        """Answer ``proposal``: yes while this member's loop is still before its boundary."""
        with self._lock:
            if self._members != members or self._pending is not None:
                return  # a regroup came in between: that epoch's proposals are over
            yes = self._passed < proposal.at
            if yes:
                self._pending = proposal
        self._store.set(f"{proposal.key}/ack/{self._me}", "yes" if yes else "no")
        if not yes:  # the leader decides no at its boundary; the next proposal follows
            decided = f"{proposal.key}/decided"
            while not self._store.check([decided]) and not self._stop.is_set():
                time.sleep(POLL_S)
            with self._lock:
                if self._members == members:
                    self._number += 1

    def _newcomers(self) -> range:
        count = self._store.add("joiners", 0)
        return range(self._first, self._first + count)

    def _answer_newcomers(self) -> None:
        """Answer each newcomer's request at init (it learns the group runs)."""
        for member in self._newcomers():
            if member not in self._admitted and not self._store.check([f"answer/{member}"]):
                answer(self._store, member)

    def _ready(self) -> set[int]:
        """Return the newcomers ready to be admitted (not those seen to end meanwhile)."""
        ready = {m for m in self._newcomers() if self._store.check([f"ready/{m}"])}
        return ready - self.ended_newcomers(ready - self._admitted)


def _wait(
    store: QuickStore,
    keys: list[str],
    members: Members,
    ended: Callable[[], set[int]],
    deadline: float,
) -> None:
    """Wait for the members' answers or the decision; a member lost ends the wait."""
    wait_for(
        store, keys, lambda: ended() & set(members.ids), deadline,
        during="while the group grew", missing=f"the members did not all answer {keys[0]} in time",
    )  # fmt: skip


def wait_admitted(store: QuickStore, member: int, deadline: float) -> Members:
    """Say this newcomer is ready, wait to be admitted; return the members it joins.

    Raises :class:`NotAdmittedError` when the group's loop ended first, and
    :class:`ShrinkRefusedError` when it is not admitted by ``deadline`` (no step boundary came).
    """
    store.set(f"ready/{member}", "1")
    key = f"admit/{member}"
    missing = (
        f"newcomer {member} was not admitted to the running group in time: the group ended, "
        "or reached no step boundary"
    )
    during = "while this newcomer waited to be admitted"
    wait_for(store, [key], set, deadline, during=during, missing=missing)  # no member to lose yet
    admitted = store.get(key)
    if admitted == _CLOSED.encode():
        raise NotAdmittedError(
            f"the running group finished its loop before it admitted newcomer {member}: "
            "there is nothing left to join (this process holds no trained state)"
        )
    epoch, ids = json.loads(admitted)
    return Members(int(epoch), tuple(int(m) for m in ids))


def announce_members(announced: Announcement, members: Members) -> bool:
    """Tell newcomers the group runs, naming ``members``' processes (the leader's watch).

    False while not every member's identity is published yet, or the store did not take it
    (asked again at the watch's poll): a newcomer of a later job tells from them that this
    one ended (:meth:`Announcement.outlived`).
    """
    found = rendezvous()
    if found is None:
        return True
    identities = peers.identities_of(set(range(members.size)))
    if len(identities) < members.size:
        return False
    named = tuple(identities[rank].to_json() for rank in range(members.size))
    try:
        announce(found[0], dataclasses.replace(announced, members=named))
    except (RuntimeError, OSError):
        return False
    return True


def went_on(
    store: QuickStore, new: Members, me: int, gone: Callable[[], set[int]]
) -> Callable[[], set[int]]:
    """Return what a newcomer's regroup waits ask instead of a peer watch it does not have yet.

    It learns that a member was lost when the others go on to the next epoch's agreement
    (their ``alive`` keys): :class:`MemberLostError`, and it agrees with them. Otherwise the
    members of ``new`` among ``gone()`` (left out, as a regroup found them).
    """
    alive = [f"epoch{new.epoch + 1}/alive/{m}" for m in new.ids if m != me]

    def lost() -> set[int]:
        with contextlib.suppress(StoreUnreachable):  # asked again at the next poll
            if any(store.check([key]) for key in alive):
                raise MemberLostError(
                    f"the members went on to epoch {new.epoch + 1}: one was lost while this "
                    "newcomer joined"
                )
        return gone() & set(new.ids)

    return lost
