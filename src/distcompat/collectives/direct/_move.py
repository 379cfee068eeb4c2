"""The fast paths that move data: broadcast, all_to_all_single, all_gather_into_tensor.

Each checks the common case in one function, as ``direct``'s module docstring says, then shares
the protections (:func:`~._common._admit`) and the wait (:func:`~._common._complete`)::

    done = broadcast(tensor, src, group, async_op, group_src)
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import has_torch_function

from distcompat.collectives import _checked, _probed
from distcompat.collectives._errors import raise_typed
from distcompat.collectives._wire import MOVE_NATIVE
from distcompat.collectives.agree import _state as _agree
from distcompat.collectives.direct._common import (
    SKIP,
    Outcome,
    _a2a_opts,
    _admit,
    _all_to_all_options,
    _bcast_opts,
    _broadcast_options,
    _complete,
    _default_group,
    _exchange,
    _exchanges,
    _floor,
    _ready,
)
from distcompat.collectives.shm import _path as _shm_path

__all__ = ["allgather", "alltoall", "broadcast"]


def broadcast(
    tensor: torch.Tensor, src: int | None, group: Any, async_op: bool, group_src: int | None
) -> Outcome:
    """``pg.broadcast`` as ``dist.broadcast`` calls it (``src`` on the default group only).

    The common-case test written out as :func:`allreduce`'s is (no ``_ready`` call, each tensor
    property read once): through it a tiny broadcast read about 4 us more (benchmarks/README.md).
    """
    if type(tensor) is not torch.Tensor or _checked._general or _probed._any:
        return SKIP
    pg = group if group is not None else _default_group()
    last = _agree.last
    dtype = tensor.dtype
    if (
        last is None
        or pg is not last[0]()
        or dtype not in MOVE_NATIVE
        or not tensor.is_cpu
        or not tensor.is_contiguous()
        or has_torch_function((tensor,))
    ):
        return SKIP
    state = last[1]
    root = group_src if group_src is not None else src if group is None else None
    if root is None or not 0 <= root < state.world:
        return SKIP
    engine = None
    floor = _shm_path.floors.get(("broadcast", state.world))  # inline: no call when known
    if tensor.nbytes >= (
        _shm_path.floor_bytes("broadcast", state.world) if floor is None else floor
    ):
        engine = _shm_path.engaged(pg)
        if engine is None:
            return SKIP  # not set up yet, or not usable here: the general path decides
    shape = tensor.shape
    origin = src if group_src is None else group_src  # what the general path records
    raw = _admit(state, ("broadcast", dtype, shape, None, root), group, shape, origin)
    now = call = None
    try:
        if engine is None:
            opts = _bcast_opts.get(root) or _broadcast_options(root)
            work = pg.broadcast([tensor], opts)  # type: ignore[union-attr]  # pg is last[0]()
        else:  # shared memory: run in _complete (sync) or on the group's thread (async)
            call = engine.broadcast(tensor if tensor.dim() == 1 else tensor.view(-1), root)
            work = engine.work("broadcast", call, (tensor,)) if async_op else None
            now = lambda wait: engine.run_now("broadcast", call, wait, (tensor,))  # noqa: E731
    except RuntimeError as exc:
        raise_typed(exc, "broadcast", group)
    record = (shape, dtype, None, origin)
    return _complete(work, "broadcast", group, [tensor], async_op, raw, record, now)


def alltoall(
    output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool, even: bool
) -> Outcome:
    """Call the all-to-all with even splits, as ``dist.all_to_all_single`` calls it.

    The common-case test written out (no ``_ready`` call); the ProcessGroup's method looked up
    by class in a dict.
    """
    if (
        type(input) is not torch.Tensor
        or type(output) is not torch.Tensor
        or _checked._general
        or _probed._any
    ):
        return SKIP
    pg = group if group is not None else _default_group()
    last = _agree.last
    dtype = input.dtype
    if (
        not even
        or last is None
        or pg is not last[0]()
        or dtype not in MOVE_NATIVE
        or output.dtype is not dtype
        or not input.is_cpu
        or not output.is_cpu
        or not input.is_contiguous()
        or not output.is_contiguous()
        or has_torch_function((input, output))
        or input.dim() == 0
    ):
        return SKIP
    shape = input.shape
    sig = ("all_to_all_single", dtype, shape[1:], None, None)
    raw = _admit(last[1], sig, group, shape, None)
    exchange = _exchanges.get(pg.__class__) or _exchange(pg.__class__)
    try:
        work = exchange(pg, output, input, [], [], _a2a_opts.get(0) or _all_to_all_options())
    except RuntimeError as exc:
        raise_typed(exc, "all_to_all_single", group)
    record = (shape, dtype, None, None)
    return _complete(work, "all_to_all_single", group, [output], async_op, raw, record)


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
    ):
        return SKIP
    engine = gather = None
    if output.nbytes >= _floor("all_gather_into_tensor", state.world):
        engine = _shm_path.engaged(pg)
        if engine is None:
            return SKIP  # not set up yet, or not usable here: the general path decides
    else:
        gather = getattr(pg, "all_gather_single", None)
        if gather is None:
            return SKIP
    op, shape, dtype = "all_gather_into_tensor", input.shape, input.dtype
    raw = _admit(state, (op, dtype, shape, None, None), group, shape, None)
    now = None
    try:
        if gather is not None:
            work = gather(output, input)  # default options: asyncOp True, as everywhere here
        else:  # shared memory: run in _complete (sync) or on the group's thread (async)
            assert engine is not None
            call = engine.all_gather(output, input)
            work = engine.work(op, call, (input,)) if async_op else None
            now = lambda wait: engine.run_now(op, call, wait, (input,))  # noqa: E731
    except RuntimeError as exc:
        raise_typed(exc, op, group)
    return _complete(work, op, group, [output], async_op, raw, (shape, dtype, None, None), now)
