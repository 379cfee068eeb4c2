"""Who goes on after a lost rank: the agreement through the store, and the state's source.

The agreement runs here on one process's threads over a ``HashStore`` (each thread one
survivor); the runs with real rank processes are in ``test_inplace.py``.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from distcompat._store import QuickStore
from distcompat.inplace import FencedError, ShrinkRefusedError, StateLostError
from distcompat.inplace._members import Members, agree_survivors
from distcompat.inplace._state import Position, choose_source


def _agree_all(
    store: dist.Store, members: Members, alive: list[int], ended: set[int], wait_s: float = 5.0
) -> dict[int, Members | BaseException]:
    """Run ``agree_survivors`` for each of ``alive`` on its own thread; what each returned."""
    out: dict[int, Members | BaseException] = {}

    def one(me: int) -> None:
        try:
            out[me] = agree_survivors(
                QuickStore(store, "inplace"),
                members,
                me=me,
                ended=lambda: set(ended),
                deadline=time.monotonic() + wait_s,
            )
        except BaseException as exc:
            out[me] = exc

    threads = [threading.Thread(target=one, args=(me,)) for me in alive]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return out


def test_the_survivors_agree_on_the_same_members_in_rank_order() -> None:
    got = _agree_all(dist.HashStore(), Members(0, (0, 1, 2, 3)), alive=[3, 0, 1], ended={2})
    assert got == {me: Members(1, (0, 1, 3)) for me in (0, 1, 3)}
    assert got[3].rank_of(3) == 2  # type: ignore[union-attr]


def test_a_member_neither_alive_nor_proven_ended_is_waited_for_then_refused() -> None:
    """Rank 2 is not proven ended (a stopped process): the survivors do not go on without it."""
    started = time.monotonic()
    got = _agree_all(dist.HashStore(), Members(0, (0, 1, 2)), alive=[0, 1], ended=set(), wait_s=0.5)
    assert time.monotonic() - started >= 0.5
    for me in (0, 1):
        assert isinstance(got[me], ShrinkRefusedError), got[me]
        assert "rank(s) 2 neither came" in str(got[me])


def test_a_rank_declared_ended_that_comes_later_is_fenced() -> None:
    store = dist.HashStore()
    members = Members(0, (0, 1, 2))
    first = _agree_all(store, members, alive=[0, 1], ended={2})
    assert first[0] == Members(1, (0, 1))
    late = _agree_all(store, members, alive=[2], ended=set())
    assert isinstance(late[2], FencedError), late[2]
    assert "went on without it at epoch 1" in str(late[2])


def test_epochs_follow_each_other_under_one_prefix() -> None:
    store = dist.HashStore()
    first = _agree_all(store, Members(0, (0, 1, 2)), alive=[0, 1], ended={2})[0]
    assert isinstance(first, Members)
    second = _agree_all(store, first, alive=[1], ended={0})
    assert second == {1: Members(2, (1,))}


def test_the_source_is_the_lowest_rank_at_the_furthest_whole_step() -> None:
    assert choose_source([Position(4, False), Position(5, False), Position(5, False)]) == 1
    assert choose_source([Position(5, True), Position(4, False)]) == 1  # torn: not a source
    with pytest.raises(StateLostError, match="none holds a whole step"):
        choose_source([Position(5, True), Position(5, True)])
