"""The mismatch check's record per group: call numbers, agreed steps, and whether it is paused.

What ``_check`` compares is counted here (:func:`count`), and the fast paths (``direct``) read
this module's flags in place (``last``, ``paused``, ``listening``): read them as attributes of
this module, never import their values::

    from distcompat.collectives.agree import _state
    if _state.listening: ...
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from distcompat import _torch
from distcompat._ranks import side_store
from distcompat._store import QuickStore
from distcompat.collectives._group import FALLBACK_TIMEOUT_S, group_timeout_s
from distcompat.collectives._wait import POLL, POLL_S
from distcompat.launch._settings import MISMATCH_VARIABLE, choose_mismatch_check

__all__ = [
    "ENV_VAR",
    "HISTORY",
    "POLL",
    "POLL_S",
    "answering",
    "count",
    "forget",
    "last",
    "listening",
    "paused",
    "state_for",
    "unchecked",
]

ENV_VAR = MISMATCH_VARIABLE
#: Steps remembered per group; beyond this the set starts again (every rank at the same call).
_MAX_AGREED = 4096
#: Recent signatures kept per group, to answer a question about a call already made.
HISTORY = 256

_RED_OP_TYPE = type(dist.ReduceOp.SUM)

#: True once some group has a store to check through: issue() then waits in POLL_S slices.
listening = False


@dataclass(slots=True)
class _State:
    """One group's agreement record (the same on every rank while the ranks agree)."""

    store: QuickStore | None  # None: this group is not checked by default
    rank: int
    world: int
    wait_s: float = FALLBACK_TIMEOUT_S
    seq: int = 0
    agreed: set[Any] = field(default_factory=set)  # steps: (previous code, code), see record()
    previous: int = 0  # the last call's signature code (this process's hash of it)
    history: list[Any] = field(default_factory=lambda: [None] * HISTORY)
    posted: set[int] = field(default_factory=set)  # call numbers this rank posted for
    open: set[int] = field(default_factory=set)  # answered, still waiting for every post


_states: weakref.WeakKeyDictionary[Any, _State] = weakref.WeakKeyDictionary()
#: A call that joins a peer's pending call after a mismatch: not numbered, not checked.
_joining = False
#: Inside :func:`unchecked`: no call is numbered or checked.
_suspended = False
#: ``_joining or _suspended``, kept up to date: the one flag the fast paths read.
paused = False


def _pause(joining: bool, suspended: bool) -> None:
    """Set ``_joining`` and ``_suspended``, and :data:`paused` with them."""
    global _joining, _suspended, paused
    _joining, _suspended, paused = joining, suspended, joining or suspended


def answering() -> bool:
    """Return whether a waiting rank should answer peers' questions (the default check is on)."""
    return listening and not _suspended


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """Turn the default mismatch check off inside the block; every rank must do the same.

    Example:
        >>> with unchecked():
        ...     pass
    """
    previous = _suspended
    _pause(_joining, True)
    try:
        yield
    finally:
        _pause(_joining, previous)


def _enabled_by_env() -> bool:
    """Read ``DISTCOMPAT_MISMATCH_CHECK`` (unset, on, 1: on; off, 0: off), in launch's settings."""
    return choose_mismatch_check().on


def _new_state(key: Any) -> _State:
    """Set up ``key``'s record: checked through the rendezvous store of a group distcompat made."""
    global listening
    rank, world = dist.get_rank(key), dist.get_world_size(key)
    found = side_store() if _enabled_by_env() else None
    if found is None:
        return _State(store=None, rank=rank, world=world)
    _, prefix = found  # the prefix only: the requests go over the default store's connection
    name = getattr(key, "group_name", None) or ",".join(map(str, dist.get_process_group_ranks(key)))
    wait_s = group_timeout_s(key)  # the group's own: a subgroup may have a shorter one
    listening = True
    return _State(
        store=QuickStore(_torch.default_store(), f"{prefix}/agree/{name}"),
        rank=rank,
        world=world,
        wait_s=wait_s,
    )


#: The last group looked up and its record: the fast paths (``direct``) read it (a weakref
#: call) instead of making a weak-key lookup. A weakref: a destroyed group is not kept alive.
last: tuple[weakref.ref[Any], _State] | None = None


def state_for(group: Any) -> _State:
    """Return ``group``'s record (made on its first call; ``group`` has more than one rank)."""
    global last
    key = group if group is not None else dist.group.WORLD
    state = _states.get(key)
    if state is None:
        state = _states[key] = _new_state(key)
    last = (weakref.ref(key), state)
    return state


def forget(group: Any) -> None:
    """Drop ``group``'s record: its members changed (``distcompat.inplace``).

    The next call starts a new one, numbered from 0 under the new generation's keys.
    """
    global last
    key = group if group is not None else dist.group.WORLD
    if key is None:  # no group: no record
        return
    _states.pop(key, None)
    if last is not None and last[0]() is key:
        last = None


def count(state: _State, sig: tuple[Any, ...]) -> tuple[int, tuple[int, int]] | None:
    """Count a call (the first half of :func:`record`); return ``(seq, step)`` to check, or None.

    None: nothing to check (the step was agreed before, or the check is off or suspended).
    Otherwise the caller must :func:`check` what this returned before it issues the call (the
    call's number travels with it: another thread may count a call in between)::

        counted = count(state, sig)
        if counted is not None:
            check(state, counted, sig, group)

    The fast paths (``direct._common._admit``) count through this function too.
    """
    if state.store is None or paused:
        return None
    seq = state.seq
    state.seq = seq + 1
    state.history[seq % HISTORY] = sig
    code = hash(sig)  # a step is keyed by the two codes: hashing nested signatures costs more
    step = (state.previous, code)
    state.previous = code
    return None if step in state.agreed else (seq, step)
