"""The side channel ranks use when the group is stuck: the rendezvous store, not a collective.

A stuck collective blocks the process group, but the TCPStore the group was created from still
answers. Keys (under a prefix unique to the group's generation)::

    job                        the job's name, agreed at start: the first rank's proposal wins
    alarm                      incident counter: a rank that declares a hang bumps it
    i<N>/trigger               who declared incident N and why
    i<N>/writer                the rank that prints incident N's report (first claim wins)
    i<N>/state/<rank>          each rank's RankState (JSON, no stacks)
    i<N>/stacks/<rank>         each rank's Python stacks (text)
    i<N>/count                 how many ranks have published for incident N

Every call here is a short store request; :class:`ChannelError` wraps a store that failed.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator

import torch.distributed as dist

from distcompat.diagnostics._report import RankState

__all__ = ["ChannelError", "SideChannel"]

_COLLECT_POLL_S = 0.05


class ChannelError(RuntimeError):
    """The rendezvous store did not answer (its host may be gone)."""


class SideChannel:
    """Store-backed exchange of hang accounts between ranks.

    Example:
        >>> import torch.distributed as dist
        >>> store = dist.HashStore()
        >>> channel = SideChannel(store, "demo", rank=0, world_size=1)
        >>> channel.current(), channel.raise_alarm(0)
        (0, 1)
    """

    def __init__(self, store: dist.Store, prefix: str, *, rank: int, world_size: int) -> None:
        self._store = dist.PrefixStore(prefix, store)
        self.rank = rank
        self.world_size = world_size

    def current(self) -> int:
        """Return the latest incident number (0: none yet), without blocking."""
        with _guard("add"):
            return int(self._store.add("alarm", 0))

    def agree(self, key: str, proposal: str) -> str:
        """Return the value every rank agrees on for ``key``: the first proposal made.

        Example:
            >>> import torch.distributed as dist
            >>> channel = SideChannel(dist.HashStore(), "demo", rank=0, world_size=2)
            >>> channel.agree("job", "a"), channel.agree("job", "b")
            ('a', 'a')
        """
        with _guard("compare_set"):
            return bytes(self._store.compare_set(key, "", proposal)).decode()

    def raise_alarm(self, seen: int) -> int:
        """Declare incident ``seen + 1`` unless another rank already did; return the current one."""
        self.current()  # creates the counter ("0") so compare_set has a value to compare
        with _guard("compare_set"):
            value = self._store.compare_set("alarm", str(seen), str(seen + 1))
        return int(bytes(value).decode())

    def set_trigger(self, incident: int, text: str) -> None:
        """Record who declared ``incident`` and why (first writer wins)."""
        with _guard("compare_set"):
            self._store.compare_set(f"i{incident}/trigger", "", text)

    def claim_report(self, incident: int) -> int:
        """Claim printing ``incident``'s report; return the rank that prints it (first claim wins).

        The declaring rank claims right after raising the alarm; every rank claims again when its
        report is ready, which only reads the winner (or names the first to finish, should the
        declaring rank have failed before claiming).

        Example:
            >>> import torch.distributed as dist
            >>> store = dist.HashStore()
            >>> first = SideChannel(store, "demo", rank=1, world_size=2)
            >>> second = SideChannel(store, "demo", rank=0, world_size=2)
            >>> first.claim_report(1), second.claim_report(1)
            (1, 1)
        """
        with _guard("compare_set"):
            return int(bytes(self._store.compare_set(f"i{incident}/writer", "", str(self.rank))))

    def _get(self, key: str) -> bytes | None:
        """Return the value of ``key``, or None if it is not set (never blocks)."""
        with _guard("get"):
            if not self._store.check([key]):
                return None
            return bytes(self._store.get(key))

    def trigger(self, incident: int) -> str | None:
        """Who declared ``incident`` and why, if recorded."""
        raw = self._get(f"i{incident}/trigger")
        return None if raw is None else raw.decode()

    def publish(self, incident: int, state: RankState) -> None:
        """Publish this rank's account (stacks under their own key)."""
        compact = json.dumps(state.to_json(with_stacks=False))
        with _guard("set"):
            self._store.set(f"i{incident}/state/{self.rank}", compact)
            self._store.set(f"i{incident}/stacks/{self.rank}", state.stacks or "")
            self._store.add(f"i{incident}/count", 1)

    def collect(self, incident: int, grace: float) -> dict[int, RankState | None]:
        """Every rank's account, waiting up to ``grace`` seconds for all to publish."""
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            with _guard("add"):
                if self._store.add(f"i{incident}/count", 0) >= self.world_size:
                    break
            time.sleep(_COLLECT_POLL_S)
        states: dict[int, RankState | None] = {}
        for rank in range(self.world_size):
            raw = self._get(f"i{incident}/state/{rank}")
            states[rank] = None if raw is None else RankState.from_json(json.loads(raw))
        return states

    def stacks(self, incident: int, rank: int) -> str | None:
        """Rank ``rank``'s stacks for ``incident``, if it published them."""
        raw = self._get(f"i{incident}/stacks/{rank}")
        return raw.decode() or None if raw is not None else None


@contextlib.contextmanager
def _guard(what: str) -> Iterator[None]:
    """Turn a failing store request into :class:`ChannelError`."""
    try:
        yield
    except (RuntimeError, OSError, ValueError) as exc:
        raise ChannelError(f"the rendezvous store failed a {what} request: {exc}") from exc
