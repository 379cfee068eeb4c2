"""What ranks tell each other through the rendezvous store: identities and farewells.

``init_distributed`` publishes each rank's :class:`~distcompat.peers._identity.Identity`
(:func:`publish`); :func:`identities_of` reads them back. A rank that ends writes why
(:func:`leave_farewell`: the exception and where, or "left" on purpose), which its peers read
(:func:`farewell`) to say what ended it. Every request goes through a :class:`QuickStore` (none
waits past its short timeout: a store whose host is gone answers nothing) and never raises::

    publish(rank, port=links.port)      # at init
    identities_of({1, 2})               # {1: Identity(...), ...}: those published so far
    leave_farewell(exc)                 # at exit
    farewell(1)                         # "ValueError: bad batch 7 at train.py:88", or ""
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any

import torch.distributed as dist

from distcompat import _torch
from distcompat._store import QuickStore, StoreUnreachable
from distcompat.peers._identity import Identity, _machine

__all__ = [
    "LEFT",
    "farewell",
    "identities_of",
    "leave_farewell",
    "own_farewell",
    "publish",
    "quick_store",
    "rendezvous_store",
]

_KEY = "distcompat/peer/rank{}"

_FAREWELL = "distcompat/peer/farewell/rank{}"

#: The longest farewell kept (characters): a message can be a whole tensor's repr.
_FAREWELL_CHARS = 300


def _store() -> Any:
    """Return the default group's store (torch keeps it privately), or None."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return _torch.default_store()
    except (RuntimeError, ValueError):
        return None


def rendezvous_store() -> Any:
    """Return the default group's store, or None (no group).

    Example:
        >>> rendezvous_store() is None
        True
    """
    return _store()


def publish(rank: int | None = None, *, port: int = 0, listen: str = "") -> None:
    """Write this process's :class:`Identity` to the default group's store (no collective).

    ``init_distributed`` calls it, so a lost peer can be named in groups of any size; ``port``
    is where its peer watch takes links from other machines (``_watch.start``), on the
    address ``listen`` only when one is given (it comes first in the identity's addresses).

    Example:
        >>> publish()   # no process group: nothing to write to
    """
    store = _store()
    if store is None or not _machine():
        return
    rank = dist.get_rank() if rank is None else rank
    with contextlib.suppress(RuntimeError, ValueError):
        identity = dataclasses.replace(Identity.here(), port=port)
        if listen:
            rest = tuple(a for a in identity.addrs if a != listen)
            identity = dataclasses.replace(identity, addrs=(listen, *rest))
        store.set(_KEY.format(rank), identity.to_json())


#: The default store, asked through a QuickStore (no request waits past its short timeout).
_quick: tuple[Any, QuickStore] | None = None


def _asked(store: Any) -> QuickStore:
    global _quick
    if _quick is None or _quick[0] is not store:
        _quick = (store, QuickStore(store))
    return _quick[1]


def quick_store() -> QuickStore | None:
    """Return the default group's store asked through a :class:`QuickStore`, or None.

    Example:
        >>> quick_store() is None   # no process group
        True
    """
    store = _store()
    return None if store is None else _asked(store)


def identities_of(ranks: set[int]) -> dict[int, Identity]:
    """Return the identities among ``ranks`` (global) published so far; never blocks long.

    Example:
        >>> identities_of({1})   # no process group: none
        {}
    """
    store = _store()
    if store is None:
        return {}
    quick = _asked(store)
    wanted = sorted(ranks)
    names = [_KEY.format(rank) for rank in wanted]
    try:
        if names and quick.check(names):  # all published: two requests, not two per rank
            values = quick.multi_get(names)
            return {rank: Identity.from_json(v) for rank, v in zip(wanted, values, strict=True)}
    except (StoreUnreachable, ValueError, KeyError, TypeError):
        return {}  # the store does not answer: later, again
    found: dict[int, Identity] = {}
    for rank in wanted:
        name = _KEY.format(rank)
        try:
            if quick.check([name]):  # never blocks: a rank that did not publish is skipped
                found[rank] = Identity.from_json(quick.get(name))
        except (StoreUnreachable, ValueError, KeyError, TypeError):
            break  # the store does not answer (its host died, or a partition): later, again
    return found


#: The farewell of a rank that ended on purpose: its group destroyed, or its script done.
LEFT = "left"


def leave_farewell(exc: BaseException | None) -> None:
    """Write why this rank is ending, for its peers: ``exc`` and where, or (None) on purpose.

    An exception's farewell is never overwritten by a later "left".

    Called by ``diagnostics._exit`` (the exception hook, then at exit) and by destroy, before
    the process ends; a peer that sees this rank end names the exception (:func:`farewell`), or
    says nothing when it left on purpose.

    Example:
        >>> leave_farewell(ValueError("bad batch"))   # no process group: nothing to write to
    """
    global _farewell_left, _said
    store = _store()
    if store is None or (exc is None and _farewell_left):
        return
    if exc is None:
        text = LEFT
    else:
        where = ""
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is not None:
            where = f" at {os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno}"
        said = str(exc).splitlines()[0] if str(exc) else ""
        text = f"{type(exc).__name__}: {said}" if said else type(exc).__name__
        if len(text) > _FAREWELL_CHARS:
            text = text[: _FAREWELL_CHARS - 3] + "..."
        text += where
        _farewell_left = True
    _said = text
    with contextlib.suppress(StoreUnreachable, RuntimeError, ValueError):
        _asked(store).set(_FAREWELL.format(dist.get_rank()), text)


_farewell_left = False  # an exception's farewell was written: a later "left" must not replace it

_said = ""  # the farewell this process wrote last


def own_farewell() -> str:
    """Return the farewell this process wrote (:func:`leave_farewell`), or "" before any.

    Example:
        >>> own_farewell()
        ''
    """
    return _said


def farewell(rank: int) -> str:
    """Return what ``rank`` (global) left when it ended (:func:`leave_farewell`), or "".

    Example:
        >>> farewell(1)
        ''
    """
    store = _store()
    if store is None:
        return ""
    quick = _asked(store)
    name = _FAREWELL.format(rank)
    try:
        return quick.get(name).decode() if quick.check([name]) else ""
    except (StoreUnreachable, RuntimeError, ValueError, UnicodeDecodeError):
        return ""
