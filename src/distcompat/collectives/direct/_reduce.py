"""The fast paths that reduce: all_reduce (SUM, MIN, MAX) and reduce_scatter_tensor.

Each checks the common case in one function, as ``direct``'s module docstring says, then shares
the protections (:func:`~._common._admit`) and the wait (:func:`~._common._complete`)::

    done = allreduce(tensor, op, group, async_op)
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import has_torch_function

from distcompat.collectives import _checked, _probed
from distcompat.collectives._errors import raise_typed
from distcompat.collectives._wire import REDUCE_NATIVE
from distcompat.collectives.agree import _state as _agree
from distcompat.collectives.direct._common import (
    _MAX,
    _MIN,
    _SUM,
    SKIP,
    Outcome,
    _a2a_opts,
    _admit,
    _all_to_all_options,
    _complete,
    _default_group,
    _exchange,
    _exchanges,
    _reduce_options,
    _reduce_opts,
)
from distcompat.collectives.shm import _path as _shm_path

__all__ = ["allreduce", "reducescatter"]


def allreduce(tensor: torch.Tensor, op: Any, group: Any, async_op: bool) -> Outcome:
    """``pg.allreduce`` as ``dist.all_reduce`` calls it, for a plain SUM, MIN or MAX.

    The common-case test written out in one function: each Python call made there costs about
    1 us of a tiny collective's end-to-end time on the measured machine.
    """
    if type(tensor) is not torch.Tensor or _checked._general or _probed._any:
        return SKIP  # a subclass; checked mode, a region or a declared hang; probe results
    # the op by identity (a pybind enum's hash costs more than the rest of this line)
    name = "SUM" if op is _SUM else "MAX" if op is _MAX else "MIN" if op is _MIN else None
    pg = group if group is not None else _default_group()
    last = _agree.last
    dtype = tensor.dtype
    if (
        name is None
        or last is None
        or pg is not last[0]()
        or dtype not in REDUCE_NATIVE
        or not tensor.is_cpu
        or not tensor.is_contiguous()
        or has_torch_function((tensor,))
    ):
        return SKIP
    state = last[1]
    engine = None
    floor = _shm_path.floors.get(("all_reduce", state.world))  # inline: no call when known
    if tensor.nbytes >= (
        _shm_path.floor_bytes("all_reduce", state.world) if floor is None else floor
    ):
        engine = _shm_path.engaged(pg)
        if engine is None:
            return SKIP  # not set up yet, or not usable here: the general path decides
    shape = tensor.shape
    raw = _admit(state, ("all_reduce", dtype, shape, name, None), group, shape, None)
    now = None
    try:
        if engine is None:
            opts = _reduce_opts.get(id(op)) or _reduce_options(op)
            work = pg.allreduce([tensor], opts)  # type: ignore[union-attr]  # pg is last[0]()
        elif async_op:  # shared memory, on the group's thread
            work = engine.work("all_reduce", engine.all_reduce(tensor.view(-1), op), (tensor,))
        else:  # shared memory, here in _complete: a work only if not done in the first slice
            work, now = None, lambda wait: engine.all_reduce_now(tensor, op, wait)
    except RuntimeError as exc:
        raise_typed(exc, "all_reduce", group)
    record = (shape, dtype, name, None)
    return _complete(work, "all_reduce", group, [tensor], async_op, raw, record, now)


#: Receive buffers of finished tiny reduce-scatters, by (dtype, ranks, chunk elements): a fresh
#: ``new_empty`` cost 2 us of a 4-byte call (benchmarks/README.md). A buffer comes back here
#: only after its rows were reduced (the backend is done with it); a failed call's is dropped.
#: At most ``_SPARE_KEYS`` sizes and ``_SPARE_EACH`` buffers of each (calls that take gloo: the
#: shared-memory path off, or a group across machines) are kept.
_spare_rows: dict[tuple[torch.dtype, int, int], list[torch.Tensor]] = {}
_SPARE_KEYS = 32
_SPARE_EACH = 4


def _fold_rows(rows: torch.Tensor, out: torch.Tensor, name: str, key: Any) -> None:
    """Reduce ``rows`` (row r: rank r's chunk) into ``out``, then keep ``rows`` for reuse."""
    if name == "SUM":
        torch.sum(rows, 0, out=out)  # written into the output: no temporary, no copy
    elif name == "MAX":
        torch.amax(rows, 0, out=out)
    else:
        torch.amin(rows, 0, out=out)
    spare = _spare_rows.get(key)
    if spare is None:
        if len(_spare_rows) < _SPARE_KEYS:
            _spare_rows[key] = [rows]
    elif len(spare) < _SPARE_EACH:
        spare.append(rows)


def reducescatter(
    output: torch.Tensor, input: torch.Tensor, op: Any, group: Any, async_op: bool
) -> Outcome:
    """Reduce-scatter with SUM, MIN or MAX as the general path does, without its staging.

    ``all_to_all_single`` of the flat input into a (world, chunk) buffer, then the same local
    reduction over the rows (``_reduce_ops.local_reduce``: bit-identical results), for
    contiguous tensors (through shared memory at or above its floor). gloo's own reduce_scatter
    took longer than its all-to-all here (benchmarks/README.md), and has no future. The receive
    buffer comes from :data:`_spare_rows` when one is free.
    """
    if (
        type(input) is not torch.Tensor
        or type(output) is not torch.Tensor
        or _checked._general
        or _probed._any
    ):
        return SKIP
    name = "SUM" if op is _SUM else "MAX" if op is _MAX else "MIN" if op is _MIN else None
    pg = group if group is not None else _default_group()
    last = _agree.last
    dtype = input.dtype
    if (
        name is None
        or last is None
        or pg is not last[0]()
        or dtype not in REDUCE_NATIVE
        or output.dtype is not dtype
        or not input.is_cpu
        or not output.is_cpu
        or not input.is_contiguous()
        or not output.is_contiguous()
        or has_torch_function((input, output))
    ):
        return SKIP
    state = last[1]
    world, count = state.world, output.numel()
    if input.numel() != world * count:
        return SKIP  # the general path says what is wrong
    engine = None
    floor = _shm_path.floors.get(("reduce_scatter_tensor", world))  # inline: no call when known
    if input.nbytes >= (
        _shm_path.floor_bytes("reduce_scatter_tensor", world) if floor is None else floor
    ):
        engine = _shm_path.engaged(pg)
        if engine is None:
            return SKIP  # not set up yet, or not usable here: the general path decides
    op_name, shape = "reduce_scatter_tensor", input.shape
    raw = _admit(state, (op_name, dtype, shape, name, None), group, shape, None)
    flat = input if input.dim() == 1 else input.view(-1)
    out_flat = output if output.dim() == 1 else output.view(-1)  # out= must not resize it
    now = finish = None
    try:
        if engine is not None:  # shared memory: run in _complete (sync) or on its thread
            call = engine.reduce_scatter(out_flat, flat, op)
            work = engine.work(op_name, call, (input,)) if async_op else None
            now = lambda wait: engine.run_now(op_name, call, wait, (input,))  # noqa: E731
        else:  # even splits: one row of ``rows`` from each rank, reduced when it completes
            key = (dtype, world, count)
            try:
                rows = _spare_rows[key].pop()
            except (KeyError, IndexError):  # none kept yet, or all in use
                rows = input.new_empty((world, count))  # row r: rank r's chunk for this rank
            exchange = _exchanges.get(pg.__class__) or _exchange(pg.__class__)
            work = exchange(pg, rows, flat, [], [], _a2a_opts.get(0) or _all_to_all_options())
            finish = lambda: _fold_rows(rows, out_flat, name, key)  # noqa: E731
    except RuntimeError as exc:
        raise_typed(exc, op_name, group)
    record = (shape, dtype, name, None)
    return _complete(work, op_name, group, [output], async_op, raw, record, now, finish)
