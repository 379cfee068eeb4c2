"""The fast paths that reduce: all_reduce (SUM, MIN, MAX) and reduce_scatter_tensor.

Each is written out in one function, as ``direct``'s module docstring says; ``allreduce`` also
counts its call for the mismatch check in place::

    done = allreduce(tensor, op, group, async_op)
"""

from __future__ import annotations

from time import monotonic as _monotonic
from typing import Any

import torch
from torch.overrides import has_torch_function

from distcompat.collectives import _checked, _probed
from distcompat.collectives._errors import raise_typed
from distcompat.collectives._wire import REDUCE_NATIVE
from distcompat.collectives._work import CompatWork
from distcompat.collectives.agree import _state as _agree
from distcompat.collectives.agree import check as _agree_check
from distcompat.collectives.agree._state import HISTORY as _HISTORY
from distcompat.collectives.direct._common import (
    _DRAIN_AT,
    _MAX,
    _MIN,
    _NO_TIMEOUT,
    _SUM,
    _WORLD,
    SKIP,
    Outcome,
    _a2a_opts,
    _all_to_all_options,
    _exchange,
    _exchanges,
    _late,
    _reduce_options,
    _reduce_opts,
    _settle,
)
from distcompat.collectives.shm import Engine
from distcompat.collectives.shm import _path as _shm_path

__all__ = ["allreduce", "reducescatter"]


def allreduce(tensor: torch.Tensor, op: Any, group: Any, async_op: bool) -> Outcome:
    """``pg.allreduce`` as ``dist.all_reduce`` calls it, for a plain SUM, MIN or MAX.

    Written out in one function: each Python call made here costs about 1 us of a tiny
    collective's end-to-end time on the measured machine.
    """
    if type(tensor) is not torch.Tensor or _checked._general or _probed._any:
        return SKIP  # a subclass; checked mode, a region or a declared hang; probe results
    # the op by identity (a pybind enum's hash costs more than the rest of this line)
    name = "SUM" if op is _SUM else "MAX" if op is _MAX else "MIN" if op is _MIN else None
    pg = group if group is not None else _WORLD._default_pg
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
    floor = _shm_path.floors.get(("all_reduce", state.world))  # inline: no call when known
    engine = None
    if tensor.nbytes >= (
        _shm_path.floor_bytes("all_reduce", state.world) if floor is None else floor
    ):
        engine = _shm_path.engaged(pg)
        if engine is None:
            return SKIP  # not set up yet, or not usable here: the general path decides
    shape = tensor.shape
    watcher = _checked.watch
    raw = None
    if state.store is not None and not _agree.paused:
        # _agree.count written out (the most common call; see the module doc): keep the two alike
        sig = ("all_reduce", dtype, shape, name, None)
        seq = state.seq
        state.seq = seq + 1
        state.history[seq % _HISTORY] = sig
        code = hash(sig)
        step = (state.previous, code)
        state.previous = code
        if step not in state.agreed:  # a new step: checked first, and recorded first for reports
            if watcher is not None:
                raw = watcher.note("all_reduce", shape, dtype, group, name, None)
            _agree_check(state, (seq, step), sig, group)
    try:
        if engine is None:
            opts = _reduce_opts.get(id(op)) or _reduce_options(op)
            work = pg.allreduce([tensor], opts)  # type: ignore[union-attr]  # pg is last[0]()
        elif async_op:  # shared memory, on the group's thread
            work = engine.work("all_reduce", engine.all_reduce(tensor.view(-1), op))
    except RuntimeError as exc:
        raise_typed(exc, "all_reduce", group)
    if watcher is not None and raw is None:  # the record, inline: see the module doc
        raw = [None, "all_reduce", group, shape, dtype, name, None, None, _monotonic()]
        queue = watcher.queue
        queue.append(raw)
        if len(queue) >= _DRAIN_AT:
            watcher.drain()
    if not async_op:  # written out: the most common call of all
        wait = watcher.first_wait if watcher else _agree.POLL if _agree.listening else _NO_TIMEOUT
        if engine is not None:  # shared memory: runs here; a work only if not done in the slice
            work = engine.all_reduce_now(tensor, op, wait)
            if work is None:
                return None
        try:
            work.wait(wait)
        except RuntimeError as exc:
            _late(exc, work, "all_reduce", group, watcher, raw)
        return None
    return _settle(work, "all_reduce", group, [tensor], async_op, watcher, raw)


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
    contiguous tensors (through shared memory at or above its floor). gloo's own reduce_scatter took
    longer than its all-to-all here (benchmarks/README.md), and has no future. Written out as
    :func:`allreduce` is; the receive buffer comes from :data:`_spare_rows` when one is free.
    """
    if (
        type(input) is not torch.Tensor
        or type(output) is not torch.Tensor
        or _checked._general
        or _probed._any
    ):
        return SKIP
    name = "SUM" if op is _SUM else "MAX" if op is _MAX else "MIN" if op is _MIN else None
    pg = group if group is not None else _WORLD._default_pg
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
    world = state.world
    count = output.numel()
    numel = input.numel()
    if numel != world * count:
        return SKIP  # the general path says what is wrong
    floor = _shm_path.floors.get(("reduce_scatter_tensor", world))  # inline: no call when known
    engine = None
    if input.nbytes >= (
        _shm_path.floor_bytes("reduce_scatter_tensor", world) if floor is None else floor
    ):
        engine = _shm_path.engaged(pg)
        if engine is None:
            return SKIP  # not set up yet, or not usable here: the general path decides
    shape = input.shape
    watcher = _checked.watch
    raw = None
    if state.store is not None:
        sig = ("reduce_scatter_tensor", dtype, shape, name, None)
        counted = _agree.count(state, sig)
        if counted is not None:  # as in allreduce
            if watcher is not None:
                raw = watcher.note("reduce_scatter_tensor", shape, dtype, group, name, None)
            _agree_check(state, counted, sig, group)
    if engine is not None:
        return _reduce_scatter_shm(engine, output, input, op, name, group, async_op, watcher, raw)
    key = (dtype, world, count)
    try:
        rows = _spare_rows[key].pop()
    except (KeyError, IndexError):  # none kept yet, or all in use
        rows = input.new_empty((world, count))  # row r: rank r's chunk for this rank
    exchange = _exchanges.get(pg.__class__) or _exchange(pg.__class__)
    try:
        # even splits: one row of ``rows`` from each rank
        flat = input if input.dim() == 1 else input.view(-1)
        work = exchange(pg, rows, flat, [], [], _a2a_opts.get(0) or _all_to_all_options())
    except RuntimeError as exc:
        raise_typed(exc, "reduce_scatter_tensor", group)
    if watcher is not None and raw is None:  # the record, inline: see the module doc
        raw = [None, "reduce_scatter_tensor", group, shape, dtype, name, None, None, _monotonic()]
        queue = watcher.queue
        queue.append(raw)
        if len(queue) >= _DRAIN_AT:
            watcher.drain()
    out_flat = output if output.dim() == 1 else output.view(-1)  # out= must not resize it
    if not async_op:  # written out, as in allreduce (a call costs a tiny collective ~1 us)
        try:
            work.wait(
                watcher.first_wait if watcher else _agree.POLL if _agree.listening else _NO_TIMEOUT
            )
        except RuntimeError as exc:
            _late(exc, work, "reduce_scatter_tensor", group, watcher, raw)
        _fold_rows(rows, out_flat, name, key)
        return None
    return _settle(
        work,
        "reduce_scatter_tensor",
        group,
        [output],
        async_op,
        watcher,
        raw,
        lambda: _fold_rows(rows, out_flat, name, key),
    )


def _reduce_scatter_shm(
    engine: Engine,
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any,
    name: str,
    group: Any,
    async_op: bool,
    watcher: Any,
    raw: Any,
) -> CompatWork | None:
    """:func:`reducescatter` through the group's shared memory (checked and counted there)."""
    out_flat = output if output.dim() == 1 else output.view(-1)
    call = engine.reduce_scatter(out_flat, input if input.dim() == 1 else input.view(-1), op)
    work = engine.work("reduce_scatter_tensor", call) if async_op else None
    if watcher is not None and raw is None:  # the record, inline: see the module doc
        raw = [
            None, "reduce_scatter_tensor", group, input.shape, input.dtype, name, None, None,
            _monotonic(),
        ]  # fmt: skip
        queue = watcher.queue
        queue.append(raw)
        if len(queue) >= _DRAIN_AT:
            watcher.drain()
    if work is None:  # synchronous: as in allreduce
        wait = watcher.first_wait if watcher else _agree.POLL if _agree.listening else _NO_TIMEOUT
        work = engine.run_now("reduce_scatter_tensor", call, wait)
        if work is None:
            return None
    return _settle(work, "reduce_scatter_tensor", group, [output], async_op, watcher, raw)
