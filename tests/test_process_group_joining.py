"""A process started after its group asks to join it: the announcement, the answer, staleness.

One process plays both sides over a real ``TCPStore``: the newcomer's ``ask_to_join`` on the
test's thread, the leader's answer (what ``inplace._grow``'s watch does) on another. The runs
with real rank processes, a killed rank and its replacement, are in ``test_inplace.py``.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from distcompat.peers import Identity
from distcompat.process_group import _joining


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)


def _announce(store: dist.Store, first: int = 3) -> None:
    _joining.announce(store, _joining.Announcement("1", first, links=False, group_name="0"))


def test_nothing_announced_is_an_ordinary_init(store: dist.TCPStore) -> None:
    assert _joining.ask_to_join(store, 2) is None
    assert _joining.pending() is None


def test_an_answered_newcomer_takes_the_next_id_after_the_first_members(
    store: dist.TCPStore,
) -> None:
    _announce(store)
    view = dist.PrefixStore(_joining.prefix("1"), store)

    def leader() -> None:  # answers each request, as the leader's watch does
        deadline = time.monotonic() + 5
        while not view.check(["request/3"]) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert _joining.answer(view, 3)

    thread = threading.Thread(target=leader)
    thread.start()
    try:
        joining = _joining.ask_to_join(store, 2)
    finally:
        thread.join()
    assert joining is not None
    assert joining.id == 3
    assert joining.launch_rank == 2
    assert joining.group.first == 3
    assert joining.group.group_name == "0"
    assert _joining.pending() == joining
    _joining.forget()
    assert _joining.pending() is None


def test_an_announcement_nobody_answers_is_stale_and_the_leader_cannot_answer_later(
    store: dist.TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole job restarted under a store that outlived it: the newcomer withdraws and
    rendezvouses as usual; a leader that answers after the withdrawal loses."""
    monkeypatch.setattr(_joining, "ANSWER_S", 0.1)
    _announce(store)
    assert _joining.ask_to_join(store, 1) is None
    view = dist.PrefixStore(_joining.prefix("1"), store)
    assert not _joining.answer(view, 3)


def test_the_announcement_is_taken_back_only_by_its_own_generation(store: dist.TCPStore) -> None:
    _announce(store)
    _joining.withdraw_announcement(store, "2")  # another generation's group ended
    assert store.get(_joining.OPEN_KEY) != b"{}"
    _joining.withdraw_announcement(store, "1")
    assert _joining.ask_to_join(store, 2) is None  # withdrawn: nothing to join


def _ended_identity() -> str:
    """The identity of a process that has ended (a child that printed it and exited)."""
    code = "from distcompat.peers import Identity; print(Identity.here().to_json())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_an_announcement_whose_members_all_ended_is_stale_at_once(
    store: dist.TCPStore,
) -> None:
    """A whole job that ended on this machine: no wait for an answer (ANSWER_S, 2 s), and no
    request left behind for a leader to answer."""
    dead = _ended_identity()
    announced = _joining.Announcement("1", 2, links=False, group_name="0", members=(dead, dead))
    _joining.announce(store, announced)
    started = time.monotonic()
    assert _joining.ask_to_join(store, 1) is None
    assert time.monotonic() - started < _joining.ANSWER_S / 4
    assert dist.PrefixStore(_joining.prefix("1"), store).add("joiners", 0) == 0


def test_an_announcement_with_a_member_alive_waits_for_the_answer(
    store: dist.TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One member still runs (this process): its group may answer, so the newcomer waits."""
    monkeypatch.setattr(_joining, "ANSWER_S", 0.3)
    alive = Identity.here().to_json()
    members = (_ended_identity(), alive)
    _joining.announce(store, _joining.Announcement("1", 2, False, "0", members=members))
    started = time.monotonic()
    assert _joining.ask_to_join(store, 1) is None  # nobody answers here: stale after the wait
    assert time.monotonic() - started >= 0.3
