"""What every fast path shares: the common-case test, options made once, the synchronous wait.

The module docstring of ``direct`` says why each piece is written the way it is (each Python
call of a tiny collective costs about 1 us right after a wait)::

    pg, state = _ready(group, tensor)      # state None: not the common case
    raw = _admit(state, sig, group, tensor.shape, root)     # counted; a new step checked
    return _complete(work, "broadcast", group, [tensor], async_op, raw, record)
"""

from __future__ import annotations

import enum
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.overrides import has_torch_function

from distcompat import _torch
from distcompat.collectives import _checked, _probed
from distcompat.collectives._errors import raise_typed
from distcompat.collectives._wire import MOVE_NATIVE, Finish
from distcompat.collectives._work import CompatWork, finish_now
from distcompat.collectives.agree import _state as _agree
from distcompat.collectives.agree import check as _agree_check
from distcompat.collectives.agree import wait_answering as _wait_answering
from distcompat.collectives.shm import _path as _shm_path

__all__ = ["SKIP", "Outcome"]

#: ReduceOps every backend does natively on REDUCE_NATIVE dtypes: sent as they are. Compared by
#: identity (torch hands out these objects; an equal copy takes the general path): a pybind
#: enum's hash costs about 0.25 us, a tenth of the whole check.
_SUM, _MIN, _MAX = dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX


#: The default group, read from torch's own record (the seam's C-level getter): no property calls
#: of ``GroupMember.WORLD`` (1.5-3 us of a tiny call right after a wait, benchmarks/README.md).
_default_group = _torch.default_group


class _Skip(enum.Enum):
    SKIP = "not the common case"


#: Returned when the call is not the common case: take the general path.
SKIP = _Skip.SKIP
Outcome = CompatWork | None | Literal[_Skip.SKIP]


def _ready(group: Any, *tensors: torch.Tensor) -> tuple[Any, Any]:
    """Return ``(process group, its record)``; the record is None off the common case.

    Off the common case: a group not looked up last; checked mode, a diagnostics hook or
    capability-probe results installed (each could change what is sent); a tensor that is not a
    plain dense CPU tensor of a dtype moved natively, or that torch would dispatch elsewhere.
    """
    pg = group if group is not None else _default_group()
    last = _agree.last
    if last is None or last[0]() is not pg or _checked._general or _probed._any:
        return pg, None
    for tensor in tensors:
        if (
            type(tensor) is not torch.Tensor
            or tensor.dtype not in MOVE_NATIVE
            or not tensor.is_cpu
            or not tensor.is_contiguous()
            or has_torch_function((tensor,))
        ):
            return pg, None
    return pg, last[1]


#: ``Work.wait``'s own default: no timeout.
_NO_TIMEOUT = timedelta(0)


#: ``AllreduceOptions`` by ``id()`` of its ReduceOp (one of _SUM, _MIN, _MAX: never freed).
_reduce_opts: dict[int, Any] = {}


def _reduce_options(op: Any) -> Any:
    """Make the one ``AllreduceOptions`` for ``op``; it is never changed after.

    Building the pybind object cost about 4 us per tiny call right after a wait (cold caches);
    the backend copies what it needs from it at the call, so sharing it is safe.
    """
    opts: Any = dist.AllreduceOptions()
    opts.reduceOp = op  # a RedOpType, as torch's all_reduce sets it
    _reduce_opts[id(op)] = opts
    return opts


def _floor(collective: str, world: int) -> float:
    """Return the shared-memory path's smallest tensor for ``collective`` (the cache first)."""
    floor = _shm_path.floors.get((collective, world))
    return _shm_path.floor_bytes(collective, world) if floor is None else floor


#: ``BroadcastOptions`` by root rank (see :func:`_reduce_options`).
_bcast_opts: dict[int, Any] = {}


def _broadcast_options(root: int) -> Any:
    """Make the one ``BroadcastOptions`` for ``root``; it is never changed after."""
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    _bcast_opts[root] = opts
    return opts


#: The one ``AllToAllOptions`` (defaults), under key 0, made on first use (see
#: :func:`_reduce_options`).
_a2a_opts: dict[int, Any] = {}


def _all_to_all_options() -> Any:
    """Make the one ``AllToAllOptions`` (:data:`_a2a_opts`) and return it."""
    opts = _a2a_opts[0] = dist.AllToAllOptions()
    return opts


def _recover(exc: RuntimeError, op: str, work: Any, group: Any) -> None:
    """Handle a failed call or a sync wait that ran out of its slice (``_agree.POLL``)."""
    if work is None or not _agree.listening:
        raise_typed(exc, op, group)
    try:
        _wait_answering(work, group, op)  # re-raises at once if the op failed
    except RuntimeError as failed:
        raise_typed(failed, op, group)


def _late(exc: RuntimeError, work: Any, op: str, group: Any, watcher: Any, raw: Any) -> None:
    """Go on after a synchronous call's first wait raised ``exc``: it failed, or ran out.

    With a watchdog, its bounded wait takes over (it answers peers and reports a hang itself,
    so an error it lets out is final); without one, ``_recover``.
    """
    if watcher is None:
        _recover(exc, op, work, group)
        return
    try:
        watcher.wait_late(work, raw, op, group)
    except RuntimeError as failed:
        raise_typed(failed, op, group)


def _admit(state: Any, sig: tuple[Any, ...], group: Any, shape: Any, origin: Any) -> Any:
    """Count the call ``sig`` for the mismatch check; check a new step with the peers first.

    The general path's check (``agree.record``), split so that a new step is recorded for the
    watchdog (``Watchdog.note``) before its wait: a report made during it shows the call.
    Returns that record, or None (the call is recorded once issued, by :func:`_complete`).
    """
    counted = _agree.count(state, sig)
    if counted is None:
        return None
    watcher = _checked.watch
    raw = None
    if watcher is not None:
        raw = watcher.note(sig[0], shape, sig[1], group, sig[3], origin)
    _agree_check(state, counted, sig, group)
    return raw


def _complete(
    work: Any,
    op: str,
    group: Any,
    result: list[torch.Tensor],
    async_op: bool,
    raw: Any,
    record: tuple[Any, ...],
    now: Any = None,
    finish: Finish | None = None,
) -> CompatWork | None:
    """Record an issued call, then wait for it (sync) or hand back its :class:`CompatWork`.

    ``record``: ``(shape, dtype, reduce op name, root)`` for the watchdog, unless :func:`_admit`
    recorded the call (``raw``). ``work`` None: a synchronous call through shared memory, which
    ``now(wait)`` runs here (``Engine.run_now``), handing back a work only if its wait outlasted
    the first slice or it failed. Without a watchdog a wait runs in ``_agree.POLL`` slices while
    the mismatch check listens (``_recover`` answers peers after the first); with one, a wait
    that outlasts the first slice goes on as the watchdog's bounded wait. ``finish`` runs when
    the op completes.
    """
    watcher = _checked.watch
    if watcher is not None and raw is None:
        raw = watcher.note(op, record[0], record[1], group, record[2], record[3])
    if async_op:
        handle = CompatWork.from_work(work, group, result, finish, op=op)
        if watcher is not None:
            watcher.track_async(handle, raw)
        return handle
    wait = watcher.first_wait if watcher else _agree.POLL if _agree.listening else _NO_TIMEOUT
    if work is None:
        work = now(wait)  # None: done within the slice
    if work is not None:
        try:
            work.wait(wait)
        except RuntimeError as exc:
            _late(exc, work, op, group, watcher, raw)
    if finish is not None:
        finish_now(finish, result)
    return None


#: The ProcessGroup class's all-to-all function, by class (see :func:`_exchange`).
_exchanges: dict[type, Any] = {}


def _exchange(pg_type: type) -> Any:
    """Return (and keep) the function torch's ``all_to_all_single`` calls on ``pg_type``.

    Looked up on the class, called with the group first: renamed lately (``alltoall_base`` in
    older releases).
    """
    name = "all_to_all_single" if hasattr(pg_type, "all_to_all_single") else "alltoall_base"
    _exchanges[pg_type] = function = getattr(pg_type, name)
    return function
