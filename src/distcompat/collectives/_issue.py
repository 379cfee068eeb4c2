"""Issue one backend collective and hand back a :class:`CompatWork` (async) or finish it (sync).

Every distcompat collective ends in :func:`issue`: the call that the watchdog bounds, whose
backend errors come out typed, and whose finishing step (divide, copy back, trim) runs when the
op completes::

    return issue("all_reduce", lambda a: dist.all_reduce(wire, op=native, async_op=a), group,
                 tensor, finish, async_op)
"""

from __future__ import annotations

from typing import Any

from distcompat.collectives import _checked
from distcompat.collectives._errors import raise_typed
from distcompat.collectives._group import refuse_stale
from distcompat.collectives._wire import Finish, Transport
from distcompat.collectives._work import CompatWork, done_if_async, finish_now
from distcompat.collectives.agree import _state, wait_answering

__all__ = ["issue"]


def issue(
    op: str,
    call: Transport | None,
    group: Any,
    result: Any,
    finish: Finish | None,
    async_op: bool,
) -> CompatWork | None:
    """Run ``call(async_op)``; finish now (sync) or when the op completes (async).

    Backend failures come out typed (:class:`PeerLostError`, :class:`CollectiveTimeoutError`).
    ``call`` None: nothing to send (one rank), ``finish`` runs now. A group an in-place regroup
    fenced raises :class:`StaleGroupError` before anything is sent.
    """
    refuse_stale(group)
    if call is None:
        if finish is not None:
            finish_now(finish, result)
        return done_if_async(result, async_op)
    watcher = _checked.watch  # distcompat.diagnostics' watchdog, None unless one is active
    try:
        if not async_op:
            if watcher is None:
                if _state.listening:  # bounded slices: a peer may ask what this rank is doing
                    wait_answering(call(True), group, op)
                else:
                    call(False)
            else:  # a bounded wait: a hang becomes a report and HangError, not a group timeout
                watcher.wait_sync(call(True), op, group)
            if finish is not None:
                finish_now(finish, result)
            return None
        work = call(True)
    except RuntimeError as exc:  # inline, not typed_errors(): this is every call's hot path
        raise_typed(exc, op, group)
    handle = CompatWork.from_work(work, group, result, finish, op=op)
    if watcher is not None:
        watcher.track_async(handle)
    return handle
