"""The backend's own call for plain CPU tensors, without torch's Python wrapper around it.

``torch.distributed.all_reduce`` is Python around ``ProcessGroup.allreduce``: torch-function
dispatch, argument checks, an options object. On 2 gloo ranks sharing 2 cores, a tiny call made
right after a barrier spends about 10 us there (benchmarks/README.md), twice distcompat's budget
for its own per-call cost. For the common case, ``all_reduce``, ``broadcast``,
``all_to_all_single``, ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` first try the
functions here, which do the mismatch check's bookkeeping and call the ProcessGroup method the
wrapper would call, with the same options (``reduce_scatter_tensor``: the all-to-all and the row
reduction its general path does)::

    done = allreduce(tensor, op, group, async_op)
    if done is not SKIP:
        return done          # else: the general path (staging, plans, shims)

The common case: a plain ``torch.Tensor`` (no subclass, no torch-function mode: those go
through torch's dispatch) on the CPU, dense, of a dtype the backend handles natively, on a group
of more than one rank that an earlier call already looked up; no checked mode, single-rank region
or capability-probe results that would change the call. The options keep ``asyncOp`` at its
default (True): the work is waited on here, as torch waits on it for a synchronous call.

Where the group's ranks share a machine (``shm``) and the tensor is at or above the
path's floor, the same functions send the call through shared memory instead of the
ProcessGroup, with the same checks and records: an async call becomes the engine's work, and a
synchronous one runs in place (``Engine.all_reduce_now`` / ``Engine.run_now``), handing back a
work only if its wait outlasted the first slice or it failed. A group whose path is unusable
goes to the general path, which then takes the backend.

An active watchdog (on by default) keeps the fast path: the call is recorded right after it is
issued, by appending its raw record (``diagnostics._records.Raw``) to ``Watchdog.queue`` in
place, not through a method: right after a wait, one more Python call cost a tiny all_reduce
3-5 us end to end, the inline append about 1 us (benchmarks/README.md). Where the mismatch
check must first check a new step with the peers, the call is recorded before it
(``Watchdog.note``), so a report made during that wait shows it. An async handle is tracked as
in ``issue()``, and a synchronous call waits one slice (``Watchdog.first_wait``) here; only a
call that outlasts it becomes the watchdog's bounded wait (``Watchdog.wait_late``). After a
declared hang the fast paths step aside (``_checked._general``) and the general path's
pre-call refuses the call.

Each Python call or object made here costs a tiny collective several times its warm cost, since
it runs right after a wait with cold caches (benchmarks/README.md): hence options objects made
once, the ReduceOp compared by identity, the synchronous wait written out in each function, and
the common-case checks written out in ``allreduce``, ``broadcast``, ``alltoall`` and
``reducescatter`` (through ``_ready`` a tiny broadcast or all-to-all read about 4 us more), and
``reducescatter``'s receive buffers kept for reuse (``_spare_rows``). ``allreduce``, the most common
call, also counts its call for the mismatch check in place (``_agree.count`` written out, held
to it by tests/test_collectives_direct.py).
"""

from __future__ import annotations

import enum
from datetime import timedelta
from time import monotonic as _monotonic
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d
from torch.overrides import has_torch_function

from distcompat.collectives import _checked, _probed
from distcompat.collectives._errors import raise_typed
from distcompat.collectives._wire import MOVE_NATIVE, REDUCE_NATIVE, Finish
from distcompat.collectives._work import CompatWork
from distcompat.collectives.agree import _state as _agree
from distcompat.collectives.agree import check as _agree_check
from distcompat.collectives.agree import wait_answering as _wait_answering
from distcompat.collectives.agree._state import HISTORY as _HISTORY
from distcompat.collectives.shm import Engine
from distcompat.collectives.shm import _path as _shm_path

__all__ = ["SKIP", "allgather", "allreduce", "alltoall", "broadcast", "reducescatter"]

#: ReduceOps every backend does natively on REDUCE_NATIVE dtypes: sent as they are. Compared by
#: identity (torch hands out these objects; an equal copy takes the general path): a pybind
#: enum's hash costs about 0.25 us, a tenth of the whole check.
_SUM, _MIN, _MAX = dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX


class _ViaProperty:
    """Stands in for torch's ``_world`` where that has no ``_default_pg``: the public property."""

    @property
    def _default_pg(self) -> Any:
        return dist.GroupMember.WORLD


#: Where the fast paths read the default group: torch's own record of it, without the two
#: property calls of ``GroupMember.WORLD`` (which returns ``_world.default_pg``, which returns
#: ``_world._default_pg``): 1.5-3 us of a tiny call right after a wait (benchmarks/README.md).
#: tests/test_collectives_direct.py checks that both name the same group.
_WORLD: Any = (
    _c10d._world if hasattr(getattr(_c10d, "_world", None), "_default_pg") else _ViaProperty()
)


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
    pg = group if group is not None else _WORLD._default_pg
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


#: Records the fast paths queue for an active watchdog before they have it drain the queue
#: (``Watchdog.queue``; the same bound as ``Recorder.note``).
_DRAIN_AT = 256

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


#: The one ``AllToAllOptions`` (defaults), made on first use (see :func:`_reduce_options`).
_a2a_opts: Any = None


def _all_to_all_options() -> Any:
    """Make :data:`_a2a_opts`, the one ``AllToAllOptions``, and return it."""
    global _a2a_opts
    _a2a_opts = dist.AllToAllOptions()
    return _a2a_opts


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


def _settle(
    work: Any,
    op: str,
    group: Any,
    result: list[torch.Tensor],
    async_op: bool,
    watcher: Any,
    raw: Any,
    finish: Finish | None = None,
) -> CompatWork | None:
    """Wait for a synchronous call, or wrap an async one in a :class:`CompatWork`.

    Without a watchdog the wait runs in ``_agree.POLL`` slices while the mismatch check listens
    (``_recover`` answers peers after the first). With one (``raw`` is its record of the call),
    a wait that outlasts the first slice goes on as the watchdog's bounded wait, which answers
    peers itself, so any error it lets out is final. ``finish`` runs when the op completes.
    """
    if not async_op:
        try:
            work.wait(
                watcher.first_wait if watcher else _agree.POLL if _agree.listening else _NO_TIMEOUT
            )
        except RuntimeError as exc:
            _late(exc, work, op, group, watcher, raw)
        if finish is not None:
            finish()
        return None
    handle = CompatWork.from_work(work, group, result, finish, op=op)
    if watcher is not None:
        watcher.track_async(handle, raw)
    return handle


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
            return SKIP  # the path is not usable on this group: the general path decides
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


def broadcast(
    tensor: torch.Tensor, src: int | None, group: Any, async_op: bool, group_src: int | None
) -> Outcome:
    """``pg.broadcast`` as ``dist.broadcast`` calls it (``src`` on the default group only).

    Written out as :func:`allreduce` is (no ``_ready`` or ``_floor`` call, each tensor property
    read once): through them a tiny broadcast read about 4 us more (benchmarks/README.md).
    """
    if type(tensor) is not torch.Tensor or _checked._general or _probed._any:
        return SKIP
    pg = group if group is not None else _WORLD._default_pg
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
    floor = _shm_path.floors.get(("broadcast", state.world))  # inline: no call when known
    engine = None
    if tensor.nbytes >= (
        _shm_path.floor_bytes("broadcast", state.world) if floor is None else floor
    ):
        engine = _shm_path.engaged(pg)
        if engine is None:
            return SKIP  # the path is not usable on this group: the general path decides
    shape = tensor.shape
    watcher = _checked.watch
    raw = None
    origin = src if group_src is None else group_src  # what the general path records
    if state.store is not None:
        sig = ("broadcast", dtype, shape, None, root)
        counted = _agree.count(state, sig)
        if counted is not None:  # as in allreduce
            if watcher is not None:
                raw = watcher.note("broadcast", shape, dtype, group, None, origin)
            _agree_check(state, counted, sig, group)
    try:
        if engine is None:
            opts = _bcast_opts.get(root) or _broadcast_options(root)
            work = pg.broadcast([tensor], opts)  # type: ignore[union-attr]  # pg is last[0]()
        else:  # shared memory: run below (sync) or on the group's thread (async)
            call = engine.broadcast(tensor if tensor.dim() == 1 else tensor.view(-1), root)
            work = engine.work("broadcast", call) if async_op else None
    except RuntimeError as exc:
        raise_typed(exc, "broadcast", group)
    if watcher is not None and raw is None:  # the record, inline: see the module doc
        raw = [None, "broadcast", group, shape, dtype, None, origin, None, _monotonic()]
        queue = watcher.queue
        queue.append(raw)
        if len(queue) >= _DRAIN_AT:
            watcher.drain()
    if not async_op:  # written out, as in allreduce (a call costs a tiny collective ~1 us)
        wait = watcher.first_wait if watcher else _agree.POLL if _agree.listening else _NO_TIMEOUT
        if engine is not None:  # as in allreduce
            work = engine.run_now("broadcast", call, wait)
            if work is None:
                return None
        try:
            work.wait(wait)
        except RuntimeError as exc:
            _late(exc, work, "broadcast", group, watcher, raw)
        return None
    return _settle(work, "broadcast", group, [tensor], async_op, watcher, raw)


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


def alltoall(
    output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool, even: bool
) -> Outcome:
    """Call the all-to-all with even splits, as ``dist.all_to_all_single`` calls it.

    Written out as :func:`allreduce` is (no ``_ready`` call; the ProcessGroup's method looked
    up by class in a dict).
    """
    if (
        type(input) is not torch.Tensor
        or type(output) is not torch.Tensor
        or _checked._general
        or _probed._any
    ):
        return SKIP
    pg = group if group is not None else _WORLD._default_pg
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
    state = last[1]
    shape = input.shape
    watcher = _checked.watch
    raw = None
    if state.store is not None:
        sig = ("all_to_all_single", dtype, shape[1:], None, None)
        counted = _agree.count(state, sig)
        if counted is not None:  # as in allreduce
            if watcher is not None:
                raw = watcher.note("all_to_all_single", shape, dtype, group, None, None)
            _agree_check(state, counted, sig, group)
    exchange = _exchanges.get(pg.__class__) or _exchange(pg.__class__)
    try:
        work = exchange(pg, output, input, [], [], _a2a_opts or _all_to_all_options())
    except RuntimeError as exc:
        raise_typed(exc, "all_to_all_single", group)
    if watcher is not None and raw is None:  # the record, inline: see the module doc
        raw = [None, "all_to_all_single", group, shape, dtype, None, None, None, _monotonic()]
        queue = watcher.queue
        queue.append(raw)
        if len(queue) >= _DRAIN_AT:
            watcher.drain()
    if not async_op:  # written out, as in allreduce (a call costs a tiny collective ~1 us)
        try:
            work.wait(
                watcher.first_wait if watcher else _agree.POLL if _agree.listening else _NO_TIMEOUT
            )
        except RuntimeError as exc:
            _late(exc, work, "all_to_all_single", group, watcher, raw)
        return None
    return _settle(work, "all_to_all_single", group, [output], async_op, watcher, raw)


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
            return SKIP  # the path is not usable on this group: the general path decides
    else:
        gather = getattr(pg, "all_gather_single", None)
        if gather is None:
            return SKIP
    watcher = _checked.watch
    raw = None
    if state.store is not None:
        sig = ("all_gather_into_tensor", input.dtype, input.shape, None, None)
        counted = _agree.count(state, sig)
        if counted is not None:  # as in allreduce
            if watcher is not None:
                raw = watcher.note(
                    "all_gather_into_tensor", input.shape, input.dtype, group, None, None
                )
            _agree_check(state, counted, sig, group)
    try:
        if gather is not None:
            work = gather(output, input)  # default options: asyncOp True, as everywhere here
        else:  # shared memory: run below (sync) or on the group's thread (async)
            assert engine is not None
            call = engine.all_gather(output, input)
            work = engine.work("all_gather_into_tensor", call) if async_op else None
    except RuntimeError as exc:
        raise_typed(exc, "all_gather_into_tensor", group)
    if watcher is not None and raw is None:  # the record, inline: see the module doc
        shape, dtype = input.shape, input.dtype
        raw = [None, "all_gather_into_tensor", group, shape, dtype, None, None, None, _monotonic()]
        queue = watcher.queue
        queue.append(raw)
        if len(queue) >= _DRAIN_AT:
            watcher.drain()
    if work is None:  # shared memory, synchronous: as in allreduce
        assert engine is not None
        wait = watcher.first_wait if watcher else _agree.POLL if _agree.listening else _NO_TIMEOUT
        work = engine.run_now("all_gather_into_tensor", call, wait)
        if work is None:
            return None
    return _settle(work, "all_gather_into_tensor", group, [output], async_op, watcher, raw)


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
            return SKIP  # the path is not usable on this group: the general path decides
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
        work = exchange(pg, rows, flat, [], [], _a2a_opts or _all_to_all_options())
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
