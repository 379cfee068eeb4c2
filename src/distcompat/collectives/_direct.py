"""The backend's own call for plain CPU tensors, without torch's Python wrapper around it.

``torch.distributed.all_reduce`` is Python around ``ProcessGroup.allreduce``: torch-function
dispatch, argument checks, an options object. On 2 gloo ranks sharing 2 cores, a tiny call made
right after a barrier spends about 10 us there (benchmarks/README.md), twice distcompat's budget
for its own per-call cost. For the common case, ``all_reduce``, ``broadcast``,
``all_to_all_single`` and ``all_gather_into_tensor`` first try the functions here, which do the
mismatch check's bookkeeping and call the ProcessGroup method the wrapper would call, with the
same options::

    done = allreduce(tensor, op, group, async_op)
    if done is not SKIP:
        return done          # else: the general path (staging, plans, shims)

The common case: a plain ``torch.Tensor`` (no subclass, no torch-function mode: those go
through torch's dispatch) on the CPU, dense, of a dtype the backend handles natively, on a group
of more than one rank that an earlier call already looked up; no checked mode, diagnostics hook
or capability-probe results that would change the call. The options keep ``asyncOp`` at its
default (True): the work is waited on here, as torch waits on it for a synchronous call.
"""

from __future__ import annotations

import enum
import functools
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.overrides import has_torch_function

from distcompat.collectives import _agree, _checked, _probed, _shm_path
from distcompat.collectives._errors import raise_typed
from distcompat.collectives._wire import MOVE_NATIVE, REDUCE_NATIVE
from distcompat.collectives._work import CompatWork

__all__ = ["SKIP", "allgather", "allreduce", "alltoall", "broadcast"]

_RED_OP_TYPE = type(dist.ReduceOp.SUM)
#: ReduceOps every backend does natively on REDUCE_NATIVE dtypes: sent as they are.
_PLAIN_OPS = frozenset({dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX})


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
    pg = group if group is not None else dist.GroupMember.WORLD
    last = _agree.last
    if last is None or last[0]() is not pg or _checked._active or _probed._any:
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


def _recover(exc: RuntimeError, op: str, work: Any, group: Any) -> None:
    """Handle a failed call or a sync wait that ran out of its slice (``_agree.POLL``)."""
    if work is None or not _agree.listening:
        raise_typed(exc, op, group)
    try:
        _agree.wait_answering(work, group)  # re-raises at once if the op failed
    except RuntimeError as failed:
        raise_typed(failed, op, group)


def allreduce(tensor: torch.Tensor, op: Any, group: Any, async_op: bool) -> Outcome:
    """``pg.allreduce`` as ``dist.all_reduce`` calls it, for a plain SUM, MIN or MAX.

    Written out in one function: each Python call made here costs about 1 us of a tiny
    collective's end-to-end time on the measured machine.
    """
    pg = group if group is not None else dist.GroupMember.WORLD
    last = _agree.last
    if (
        last is None
        or pg is not last[0]()
        or _checked._active  # checked mode, a diagnostics hook or a watchdog
        or _probed._any  # probe results could change the plan
        or type(op) is not _RED_OP_TYPE
        or op not in _PLAIN_OPS
        or tensor.dtype not in REDUCE_NATIVE
        or type(tensor) is not torch.Tensor
        or not tensor.is_cpu
        or not tensor.is_contiguous()
        or has_torch_function((tensor,))
        or tensor.nbytes >= _shm_path.floor_bytes("all_reduce", last[1].world)  # shared memory?
    ):
        return SKIP
    state = last[1]
    if state.store is not None:
        _agree.record(state, ("all_reduce", tensor.dtype, tensor.shape, op, None), group)
    opts: Any = dist.AllreduceOptions()
    opts.reduceOp = op  # a RedOpType, as torch's all_reduce sets it
    work: Any = None
    try:
        work = pg.allreduce([tensor], opts)  # type: ignore[union-attr]  # pg is last[0]()
        if not async_op:
            work.wait(_agree.POLL if _agree.listening else _NO_TIMEOUT)
            return None
    except RuntimeError as exc:
        _recover(exc, "all_reduce", work, group)
        return None
    return CompatWork.from_work(work, group, [tensor], None, op="all_reduce")


def broadcast(
    tensor: torch.Tensor, src: int | None, group: Any, async_op: bool, group_src: int | None
) -> Outcome:
    """``pg.broadcast`` as ``dist.broadcast`` calls it (``src`` on the default group only)."""
    pg, state = _ready(group, tensor)
    root = group_src if group_src is not None else src if group is None else None
    if state is None or root is None or not 0 <= root < state.world:
        return SKIP
    if tensor.nbytes >= _shm_path.floor_bytes("broadcast", state.world):
        return SKIP  # shared memory may take it
    if state.store is not None:
        _agree.record(state, ("broadcast", tensor.dtype, tensor.shape, None, root), group)
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    work: Any = None
    try:
        work = pg.broadcast([tensor], opts)
        if not async_op:
            work.wait(_agree.POLL if _agree.listening else _NO_TIMEOUT)
            return None
    except RuntimeError as exc:
        _recover(exc, "broadcast", work, group)
        return None
    return CompatWork.from_work(work, group, [tensor], None, op="broadcast")


@functools.cache
def _all_to_all_method(pg_type: type) -> str:
    """Return the ProcessGroup method torch's ``all_to_all_single`` calls (renamed lately)."""
    return "all_to_all_single" if hasattr(pg_type, "all_to_all_single") else "alltoall_base"


def alltoall(
    output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool, even: bool
) -> Outcome:
    """Call the all-to-all with even splits, as ``dist.all_to_all_single`` calls it."""
    pg, state = _ready(group, input, output)
    if state is None or not even or input.dim() == 0 or input.dtype != output.dtype:
        return SKIP
    if state.store is not None:
        sig = ("all_to_all_single", input.dtype, input.shape[1:], None, None)
        _agree.record(state, sig, group)
    exchange = getattr(pg, _all_to_all_method(pg.__class__))
    work: Any = None
    try:
        work = exchange(output, input, [], [], dist.AllToAllOptions())
        if not async_op:
            work.wait(_agree.POLL if _agree.listening else _NO_TIMEOUT)
            return None
    except RuntimeError as exc:
        _recover(exc, "all_to_all_single", work, group)
        return None
    return CompatWork.from_work(work, group, [output], None, op="all_to_all_single")


def allgather(output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool) -> Outcome:
    """``pg.all_gather_single`` for 1-d tensors, as ``dist.all_gather_single`` calls it.

    Only where the ProcessGroup has that method (torch 2.13; older releases name it privately,
    and those take the general path).
    """
    pg, state = _ready(group, input, output)
    if (
        state is None
        or input.dim() != 1
        or output.dim() != 1
        or input.dtype != output.dtype
        or output.numel() != state.world * input.numel()  # the general path says what is wrong
        or output.nbytes >= _shm_path.floor_bytes("all_gather_into_tensor", state.world)
    ):
        return SKIP
    gather = getattr(pg, "all_gather_single", None)
    if gather is None:
        return SKIP
    if state.store is not None:
        sig = ("all_gather_into_tensor", input.dtype, input.shape, None, None)
        _agree.record(state, sig, group)
    work: Any = None
    try:
        work = gather(output, input)  # default options: asyncOp True, as everywhere here
        if not async_op:
            work.wait(_agree.POLL if _agree.listening else _NO_TIMEOUT)
            return None
    except RuntimeError as exc:
        _recover(exc, "all_gather_into_tensor", work, group)
        return None
    return CompatWork.from_work(work, group, [output], None, op="all_gather_into_tensor")
