"""The grow protocol: a proposed step boundary, each member's answer, the leader's decision.

Two members' :class:`Admissions` (their watch threads) run in this process over one
``HashStore``; the newcomer is a ``ready`` key. The runs with real rank processes and a real
replacement are in ``test_inplace.py``.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

from distcompat._store import QuickStore
from distcompat.inplace import NotAdmittedError
from distcompat.inplace._grow import Admissions, Proposal, wait_admitted
from distcompat.inplace._members import Members


def _told(members: Members) -> bool:
    """The leader's announcement (not under test here): done at once."""
    del members
    return True


def _pair(store: dist.Store) -> tuple[Admissions, Admissions]:
    members = Members(0, (0, 1))
    return tuple(  # type: ignore[return-value]
        Admissions(QuickStore(store, "grow"), members, me, first=2, total=100, announce=_told)
        for me in (0, 1)
    )


def _ready_newcomer(store: dist.Store) -> None:
    view = dist.PrefixStore("grow", store)
    view.add("joiners", 1)
    view.set("ready/2", "1")


def _proposed(member: Admissions, step: int, timeout: float = 5.0) -> Proposal:
    """Pass boundaries at ``step`` until the member's watch said yes to a proposal."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        member.boundary(step)
        pending = member._pending
        if pending is not None:
            return pending
        time.sleep(0.01)
    raise AssertionError("no proposal came")


def _decide_both(pair: tuple[Admissions, Admissions], proposal: Proposal) -> list[object]:
    out: list[object] = [None, None]

    def one(i: int) -> None:
        out[i] = pair[i].decide(proposal, set, time.monotonic() + 5)

    threads = [threading.Thread(target=one, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


def test_members_grow_at_the_boundary_they_all_said_yes_to() -> None:
    store = dist.HashStore()
    pair = _pair(store)
    try:
        _ready_newcomer(store)
        proposal = _proposed(pair[0], 5)
        assert proposal.at == 7
        assert proposal.ids == (2,)
        assert _proposed(pair[1], 5) == proposal
        assert pair[0].boundary(6) is None
        assert pair[1].boundary(6) is None
        assert pair[0].boundary(7) == proposal
        assert pair[1].boundary(7) == proposal
        grown = Members(1, (0, 1, 2))
        assert _decide_both(pair, proposal) == [grown, grown]
        admitted = wait_admitted(QuickStore(store, "grow"), 2, time.monotonic() + 1)
        assert admitted == grown
    finally:
        for member in pair:
            member.stop()


def test_a_member_already_past_the_boundary_says_no_and_nobody_grows_there() -> None:
    """Member 1's loop passed step 9 before its watch saw the proposal for 7: it says no and
    never stops at 7; the leader, at 7, decides no, and the next proposal comes later."""
    store = dist.HashStore()
    pair = _pair(store)
    try:
        pair[1].boundary(9)
        _ready_newcomer(store)
        proposal = _proposed(pair[0], 5)
        time.sleep(0.3)  # member 1's watch answers within its poll
        assert pair[1]._pending is None
        assert pair[0].boundary(7) == proposal
        assert pair[0].decide(proposal, set, time.monotonic() + 5) is None
        later = _proposed(pair[0], 10)
        assert later.number == proposal.number + 1
        assert later.at == 12
    finally:
        for member in pair:
            member.stop()


def test_a_newcomer_still_waiting_when_the_loop_ends_is_told_at_once() -> None:
    """Newcomer 2 said it is ready but no boundary admits it before the members' loop ends:
    the leader closes its admission, and its wait raises NotAdmittedError, not at its deadline
    (the group timeout) but at once."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    pair = _pair(store)
    _ready_newcomer(store)
    raised: list[BaseException] = []

    def newcomer() -> None:
        try:
            wait_admitted(QuickStore(store, "grow"), 2, time.monotonic() + 60)
        except BaseException as error:
            raised.append(error)

    thread = threading.Thread(target=newcomer)
    thread.start()
    for member in pair:  # no boundary passed: nothing is proposed, then the loop ends
        member.stop()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert len(raised) == 1
    assert isinstance(raised[0], NotAdmittedError)
    assert "finished its loop before it admitted newcomer 2" in str(raised[0])
