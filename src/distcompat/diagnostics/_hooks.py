"""The diagnostics side of distcompat's collective pre-call hook: what is active, per thread.

:func:`pre_call` is installed into :func:`distcompat.collectives._checked.verify` only while a
watchdog or a single-rank region is active anywhere in the process (:func:`refresh`); otherwise
verify() returns after one global lookup.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from distcompat.collectives import _checked
from distcompat.diagnostics._errors import SingleRankCollectiveError
from distcompat.diagnostics._records import call_site

__all__ = ["local", "pre_call", "refresh", "region_check", "state"]


class _State:
    """Process-wide: the active watchdogs (innermost last) and how many threads are in a region."""

    def __init__(self) -> None:
        self.watchdogs: list[Any] = []
        self.region_threads = 0
        self.lock = threading.RLock()


state = _State()
#: Per thread: ``regions`` is the stack of single-rank region labels this thread is inside.
local = threading.local()


def region_check(op: str) -> None:
    """Raise :class:`SingleRankCollectiveError` if this thread is inside a single-rank region."""
    regions: list[str] | None = getattr(local, "regions", None)
    if regions:
        raise SingleRankCollectiveError(op, call_site(), regions[-1])


def pre_call(
    op: str, tensor: torch.Tensor | None, group: Any, reduce_op: Any, root: int | None
) -> None:
    """Refuse collectives in single-rank regions, then let the watchdog record the call."""
    region_check(op)
    watchdogs = state.watchdogs
    if watchdogs:
        watchdogs[-1].before(op, tensor, group, reduce_op, root)


def refresh() -> None:
    """Install or remove the hooks to match what is active now."""
    with state.lock:
        watch = state.watchdogs[-1] if state.watchdogs else None
        active = watch is not None or state.region_threads > 0
        # the fast paths step aside while a region is open or a declared hang poisons the group
        general = state.region_threads > 0 or (watch is not None and watch.poisoned)
        _checked.set_hooks(pre_call if active else None, watch, general=general)
