"""A process started after its group (a launcher's restart, or by hand) joins it in place.

A group that goes on in place (``distcompat.inplace``) announces itself in its rendezvous store.
``init_distributed`` in a new process finds the announcement before it would rendezvous and
asks to join::

    joining = ask_to_join(store, launch_rank)       # None: no group runs here; init as usual

The group's leader (rank 0 of its current members) answers within its watch's poll; a group
that does not answer within :data:`ANSWER_S` is a stale announcement (the whole job restarted):
the request is withdrawn and init rendezvouses as usual. The announcement names its members'
processes once the leader knows them all: when every one of them is seen to have ended (all on
this machine), it is stale at once, with no wait. A process that was answered starts as
a group of its own, one rank, until ``InPlace`` admits it at a step boundary (its model and
optimizer made: DDP's construction, a broadcast at one rank, needs no peer).

The keys (the leader's side is ``distcompat.inplace._grow``): ``OPEN_KEY`` holds the
announcement; under :func:`prefix` each newcomer counts itself (``joiners``, ids after the
first members') and writes ``request/ID`` (its launch rank and its process's identity, by
which the members know it ended); the leader claims ``answer/ID`` with ``compare_set``,
as the newcomer does to withdraw, so exactly one of the two wins.

Example:
    >>> prefix("3")
    'distcompat/inplace/generation3/members'
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from distcompat.peers import Identity, seen_ended

__all__ = [
    "ANSWER_S",
    "OPEN_KEY",
    "Announcement",
    "Joining",
    "announce",
    "answer",
    "ask_to_join",
    "forget",
    "init_prefix",
    "pending",
    "prefix",
    "requester",
    "withdraw_announcement",
]

#: The key a group that goes on in place announces itself under (the store's root).
OPEN_KEY = "distcompat/inplace/open"
#: How long a newcomer waits for the leader's answer before it takes the announcement for stale
#: (seconds); the leader's watch answers within its poll (50 ms).
ANSWER_S = 2.0
_POLL_S = 0.01
_ANSWERED, _WITHDRAWN = "answered", "withdrawn"


def prefix(base: str) -> str:
    """Return the key prefix of the in-place group of init generation ``base``."""
    return f"distcompat/inplace/generation{base}/members"


def init_prefix(base: str) -> str:
    """Return the prefix of the store init made generation ``base``'s group from."""
    return f"distcompat/generation{base}"


@dataclass(frozen=True, slots=True)
class Announcement:
    """What a running group tells newcomers: its generation, first size, and peer links."""

    base: str
    first: int  # the world size the group was made with: newcomers' ids come after
    links: bool  # whether its peer watch links to other machines
    group_name: str  # torch's name of its default group (a reconfigure meets under it)
    members: tuple[str, ...] = ()  # its members' processes (Identity JSON); () while unknown

    def to_json(self) -> str:
        """Serialize (the announcement's stored form)."""
        return json.dumps(
            {"base": self.base, "first": self.first, "links": self.links,
             "name": self.group_name, "members": list(self.members)}
        )  # fmt: skip

    def outlived(self) -> bool:
        """Whether every member it names was seen to end (on this machine): the job is gone.

        Example:
            >>> Announcement("1", 2, False, "0").outlived()   # members unknown: no evidence
            False
        """
        if not self.members:
            return False
        found = [Identity.from_json(member) for member in self.members]
        return all(seen_ended(member) for member in found)


@dataclass(frozen=True, slots=True)
class Joining:
    """A newcomer answered by a running group: its id there, and the group's announcement."""

    id: int
    launch_rank: int
    group: Announcement


_pending: Joining | None = None


def pending() -> Joining | None:
    """Return the running group this process asked to join, until ``InPlace`` admits it."""
    return _pending


def forget() -> None:
    """Drop the pending join (admitted, or the group destroyed)."""
    global _pending
    _pending = None


def announce(store: Any, announcement: Announcement) -> None:
    """Tell newcomers that a group goes on in place under ``store`` (its leader calls it)."""
    store.set(OPEN_KEY, announcement.to_json())


def withdraw_announcement(store: Any, base: str) -> None:
    """Take the announcement back if it is generation ``base``'s (the group's loop ended)."""
    current = store.get(OPEN_KEY) if store.check([OPEN_KEY]) else b""
    if current and json.loads(current).get("base") == base:
        store.compare_set(OPEN_KEY, current.decode(), "{}")


def _read(store: Any) -> Announcement | None:
    if not store.check([OPEN_KEY]):
        return None
    raw = json.loads(store.get(OPEN_KEY))
    if not raw:
        return None
    members = tuple(str(member) for member in raw.get("members", ()))
    return Announcement(
        str(raw["base"]), int(raw["first"]), bool(raw["links"]), str(raw["name"]), members
    )


def ask_to_join(store: Any, launch_rank: int) -> Joining | None:
    """Ask the group announced in ``store`` to take this process; None: none answers.

    Example:
        >>> ask_to_join(dist.HashStore(), 2) is None   # nothing announced
        True
    """
    global _pending
    announced = _read(store)
    if announced is None or announced.outlived():  # a job that ended: no wait for an answer
        return None
    view = dist.PrefixStore(prefix(announced.base), store)
    member = announced.first - 1 + view.add("joiners", 1)
    request = {"launch_rank": launch_rank, "identity": Identity.here().to_json()}
    view.set(f"request/{member}", json.dumps(request))
    deadline = time.monotonic() + ANSWER_S
    while not view.check([f"answer/{member}"]) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    if view.compare_set(f"answer/{member}", "", _WITHDRAWN) == _WITHDRAWN.encode():
        return None  # nobody answered: the announcement outlived its group
    _pending = Joining(member, launch_rank, announced)
    return _pending


def requester(view: Any, member: int) -> Identity | None:
    """Return the process of newcomer ``member`` (``view``: under :func:`prefix`), if it asked."""
    key = f"request/{member}"
    if not view.check([key]):
        return None
    return Identity.from_json(json.loads(view.get(key))["identity"])


def answer(view: Any, member: int) -> bool:
    """Answer newcomer ``member`` as the leader (``view``: under :func:`prefix`).

    Returns False when the newcomer withdrew first (it waited past :data:`ANSWER_S`).
    """
    return bytes(view.compare_set(f"answer/{member}", "", _ANSWERED)) == _ANSWERED.encode()
