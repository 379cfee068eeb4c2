"""The shared-memory collectives of one group: chunked pipelines through the segment's slots.

Each op moves a tensor through the segment in chunks of at most one slot per rank, alternating
between the segment's two buffers, so a fixed-size segment carries tensors of any size and a
chunk's writes never meet a peer's reads of the chunk before::

    engine.run("all_reduce", engine.all_reduce(flat, dist.ReduceOp.SUM), async_op=False)

``all_reduce`` is a reduce-scatter then an all-gather inside the segment: every rank copies its
chunk into its slot; after a barrier rank ``r`` reduces part ``r`` of the chunk over the inputs
of ranks 0, 1, ..., w-1 in that order (the same order for every part, on every run) and
publishes it in its slot; after a second barrier every rank copies the other reduced parts out.
The work of reducing is shared by the ranks, and every rank copies the same bytes, so results
are bit-identical on all ranks. Tensors up to ``SMALL_BYTES`` take one barrier instead: every
rank folds every slot itself, in the same order. ``broadcast``, ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` need one barrier per chunk.

An op is a generator that yields at each barrier, so it can be run in slices. Synchronous calls run
in the caller's thread (after any async ops of the group still pending), also when the watchdog
waits for them in bounded slices; while nothing is pending, the fast paths run them in place
(``run_now``, and ``all_reduce_now`` for a small all_reduce without even the generator) and make a
work only if the wait outlasts the first slice; async calls run in issue order on one thread per
group. Both hand back a ``ShmWork``, which has the ``wait(timeout)`` / ``get_future()`` of a backend
Work, so :func:`issue`, the watchdog and :class:`CompatWork` treat it as one.
"""

from __future__ import annotations

import ctypes
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distcompat.collectives._errors import CollectiveError
from distcompat.collectives._shm_barrier import Barrier
from distcompat.collectives._shm_segment import Segment
from distcompat.collectives._shm_work import Call, ShmWork, Steps, signature

__all__ = ["REDUCERS", "SMALL_BYTES", "Engine"]

R = dist.ReduceOp
_Reducer = Callable[..., torch.Tensor]
#: How a slot is folded into the running result, in place (``fn(acc, other, out=acc)``).
REDUCERS: dict[Any, _Reducer] = {
    R.SUM: torch.add,
    R.PRODUCT: torch.mul,
    R.MIN: torch.minimum,
    R.MAX: torch.maximum,
    R.BAND: torch.bitwise_and,
    R.BOR: torch.bitwise_or,
    R.BXOR: torch.bitwise_xor,
}
_ALIGN = 64  # parts of a chunk start on cache-line boundaries: ranks write disjoint lines
#: Elements per torch op where the process has intra-op threads: below torch's grain size
#: (32768) its kernels run in this thread only. Intra-op threads would spin in OpenMP while the
#: other ranks need the cores (measured: 60x slower at 1 MiB with 2 threads per rank, 2 ranks on
#: 2 cores). With one thread (torchrun's default, the demo's), one op per part: each op costs
#: about 2 us of dispatch, 4 % of a 64 MiB all_reduce in 128 KiB pieces.
_SERIAL = 32768 - 64
#: Tensors up to this size (and the slot's) are all-reduced with one barrier: every rank folds
#: every slot (the same order everywhere, so the same bits), instead of each reducing a part and
#: a second barrier. Measured at 2 and 4 ranks on 2 cores, side by side: one barrier was faster
#: at every size up to the 1 MiB slot (1 MiB: 354 vs 601 us at 2 ranks, 1529 vs 2134 us at 4).
SMALL_BYTES = 1 << 20
_JOIN_S = 2.0  # how long close() waits for the async thread to finish the ops queued
_memmove = ctypes.memmove  # a plain memcpy that releases the GIL and starts no threads


def _move(dst: int, src: int, nbytes: int) -> None:
    if nbytes > 0:
        _memmove(dst, src, nbytes)


def _grain(count: int) -> int:
    """Return how many elements one reducing torch op takes (see ``_SERIAL``)."""
    return count if torch.get_num_threads() == 1 else _SERIAL


_per_thread: bool | None = None


def _threads_per_thread() -> bool:
    """Return whether torch's intra-op thread count is per thread (its OpenMP backend).

    With OpenMP, ``torch.set_num_threads`` sets the calling thread's count only (OpenMP's
    nthreads-var is per thread), so an op can run its folds serially in whole chunks and give
    the caller's count back after; the Linux x86-64 wheels use OpenMP. Elsewhere the folds go
    in ``_SERIAL`` pieces instead (``_grain``).
    """
    global _per_thread
    if _per_thread is None:
        _per_thread = "parallel backend: OpenMP" in torch.__config__.parallel_info()
    return _per_thread


def _serial() -> int:
    """Make this thread's torch ops single-threaded; return the count to give back (0: none).

    Measured (2 ranks on 2 cores, 64 MiB all_reduce): 20.4 ms with one thread, 34.7 ms with two
    threads and ``_SERIAL`` pieces (each piece's Python runs with cold caches).
    """
    threads = torch.get_num_threads()
    if threads == 1 or not _threads_per_thread():
        return 0
    torch.set_num_threads(1)
    return threads


def _give_back(threads: int) -> None:
    """Undo :func:`_serial`."""
    if threads:
        torch.set_num_threads(threads)


@dataclass(frozen=True, slots=True)
class _Small:
    """What a small all_reduce of one dtype, shape and op uses: kept per engine."""

    signature: int
    views: list[list[torch.Tensor]]  # [buffer][rank]: the slots' first elements, as the shape
    fold: _Reducer


#: Small all_reduce set-ups an engine keeps (dtype, shape and op each); then it starts over.
_SMALL_KEYS = 64


def _fold_into(fold: _Reducer, terms: list[torch.Tensor], out: torch.Tensor) -> None:
    """Fold ``terms`` into ``out`` in rank order (in ``_SERIAL`` pieces with intra-op threads)."""
    count = out.numel()
    if count <= _SERIAL or torch.get_num_threads() == 1:
        fold(terms[0], terms[1], out=out)
        for term in terms[2:]:
            fold(out, term, out=out)
        return
    flat, pieces = out.view(-1), [term.view(-1) for term in terms]
    for a in range(0, count, _SERIAL):
        b = min(count, a + _SERIAL)
        _fold_into(fold, [piece[a:b] for piece in pieces], flat[a:b])


def _fold(small: _Small, terms: list[torch.Tensor], out: torch.Tensor) -> Steps:
    """Fold a small all_reduce's slots into ``out``: its one step after the barrier."""
    _fold_into(small.fold, terms, out)
    yield from ()


def _until(wait: timedelta) -> float | None:
    """Return when a wait of ``wait`` from now ends (``time.monotonic()``); None for zero."""
    return time.monotonic() + wait.total_seconds() if wait else None


def _part(count: int, world: int, rank: int, itemsize: int) -> tuple[int, int]:
    """Return rank's [lo, hi) element range of a ``count``-element chunk (cache-line aligned)."""
    align = max(1, _ALIGN // itemsize)
    lo = count * rank // world // align * align
    hi = count if rank == world - 1 else count * (rank + 1) // world // align * align
    return lo, hi


class Engine:
    """A group's segment, barrier and async thread, and the ops that run through them."""

    def __init__(self, segment: Segment, barrier: Barrier, *, rank: int, world: int) -> None:
        self.segment = segment
        self.barrier = barrier
        self.rank = rank
        self.world = world
        self.broken = ""  # why the path can no longer be used on this group ('' while it can)
        self.calls = 0  # ops run on the path (tests and benchmarks read it)
        self._chunks = 0  # chunks moved so far: the same on every rank; picks the buffer
        self._queue: queue.SimpleQueue[ShmWork | None] = queue.SimpleQueue()
        self._pending = 0
        self._idle = threading.Condition()
        self._thread: threading.Thread | None = None
        self._open: ShmWork | None = None  # the last op run in a waiting thread
        self._smalls: dict[tuple[Any, ...], _Small] = {}  # see all_reduce_now
        self._small_bytes = min(SMALL_BYTES, segment.slot_bytes)

    # -- running ops in issue order ------------------------------------------------------------

    def work(self, op: str, call: Call) -> ShmWork:
        """Return ``call``'s work, not started.

        It runs when waited on, or on the group's thread once its future is asked for.
        """
        self.calls += 1
        return ShmWork(self, op, call)

    def idle(self) -> bool:
        """Return whether no op of the group is queued or unfinished, and the path still works."""
        open_work = self._open
        return not (
            self._pending or self.broken or (open_work is not None and not open_work.is_completed())
        )

    def run_now(self, op: str, call: Call, wait: timedelta) -> ShmWork | None:
        """Run ``call`` here, synchronously: None once done, else its work to wait for.

        While the group is :meth:`idle`, without the work's machinery (an event, a future, the
        driving loop): the handed-back work is then one whose wait ran past ``wait`` (a
        watchdog's first slice; zero means no limit, as for ``Work.wait``), going on from the
        barrier it waits at, or one that failed (its ``wait()`` raises). Otherwise the work is
        one not started, run by its ``wait()``.
        """
        if not self.idle():
            return self.work(op, call)
        self.calls += 1
        barrier = self.barrier
        barrier.start(op, call.signature)
        until = _until(wait)
        threads = _serial()
        try:
            for _ in call.steps:
                target = barrier.arrive()
                if not barrier.wait_for(target, until):
                    return self._unfinished(op, call, target)
        except CollectiveError as exc:
            return self._failed(op, call, exc)
        finally:
            _give_back(threads)
        return None

    def _unfinished(self, op: str, call: Call, target: int) -> ShmWork:
        """Return the work of an op run in place whose wait at barrier ``target`` ran out.

        Its ``wait()`` goes on from that barrier with the op's remaining steps; until it ends the
        group is not :meth:`idle`, so the next call waits for it first.
        """
        work = self._open = ShmWork(self, op, call)
        work.target = target
        return work

    def _failed(self, op: str, call: Call, error: CollectiveError) -> ShmWork:
        """Mark the path broken and return a settled work whose ``wait()`` raises ``error``."""
        self.broken = self.broken or str(error)
        work = ShmWork(self, op, call)
        work.settle(error)
        return work

    def run(self, op: str, call: Call, async_op: bool) -> ShmWork | None:
        """Run ``call`` to the end here (sync), or return its work (async: see :meth:`work`)."""
        work = self.work(op, call)
        if async_op:
            return work
        self.drive_here(work, None)
        work.wait()  # raises the op's error
        return None

    def drive_here(self, work: ShmWork, until: float | None) -> None:
        """Run ``work`` in this thread, after the ops queued before it, until done or ``until``.

        An op left unfinished by an earlier wait that gave up (a watchdog's ``HangError``) runs
        to its end first: every rank runs the ops in the same order.
        """
        with self._idle:
            while self._pending:
                left = None if until is None else until - time.monotonic()
                if left is not None and left <= 0:
                    return
                self._idle.wait(left)
        open_work = self._open
        if open_work is not None and open_work is not work and not open_work.is_completed():
            self._step(open_work, until)
            if not open_work.is_completed():
                return
        self._open = work
        self._step(work, until)

    def _step(self, work: ShmWork, until: float | None) -> None:
        """Advance ``work`` barrier by barrier until it ends (settled) or ``until`` passes.

        The op's torch ops run on one thread (:func:`_serial`); the count is given back before
        the work settles, so its future's callbacks run with the thread's own.
        """
        threads = _serial()
        try:
            if not self._advance(work, until):
                return  # a slice ended: a later wait goes on from here
            error: BaseException | None = None
        except CollectiveError as exc:
            self.broken = self.broken or str(exc)
            error = exc
        except BaseException as exc:  # handed to the waiter, never lost in the group's thread
            error = exc
        finally:
            _give_back(threads)
        work.settle(error)

    def _advance(self, work: ShmWork, until: float | None) -> bool:
        """Run ``work``'s steps; True once they ended, False when ``until`` passed first."""
        barrier = self.barrier
        if work.target is None and not self.broken:
            barrier.start(work.op, work.signature)
        elif self.broken:
            raise CollectiveError(
                f"{work.op}: the shared-memory path of this group failed before: {self.broken}",
                op=work.op,
                peer=None,
            )
        while True:
            if work.target is not None:
                if not barrier.wait_for(work.target, until):
                    return False
                work.target = None
            try:
                next(work.steps)
            except StopIteration:
                return True
            work.target = barrier.arrive()

    def submit(self, work: ShmWork) -> None:
        """Queue ``work`` for the group's thread (ops run in the order they were queued)."""
        with self._idle:
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._serve, name="distcompat-shm", daemon=True
                )
                self._thread.start()
        self._queue.put(work)

    def _serve(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                return
            self._step(work, None)
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()
            del work

    def close(self) -> None:
        """End the async thread after the ops queued (the group is gone, or the process exits).

        The thread is joined (briefly): a daemon thread still alive when the interpreter
        finalizes is ended inside whatever native frame it is in, and unwinding through torch's
        ``noexcept`` frames ends the process in ``std::terminate``.
        """
        self.broken = self.broken or "the group was destroyed"
        self._queue.put(None)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(_JOIN_S)

    # -- the ops (tensors are contiguous and 1-d; the same call on every rank) -----------------

    def _next_buffer(self) -> int:
        self._chunks += 1
        return self._chunks & 1

    def all_reduce(self, flat: torch.Tensor, op: Any) -> Call:
        """Return the op (see ``_all_reduce``)."""
        return Call(
            signature("all_reduce", str(flat.dtype), flat.numel(), str(op)),
            self._all_reduce(flat, op),
        )

    def _small(self, tensor: torch.Tensor, op: Any) -> _Small:
        """Return (and keep) what a small all_reduce of ``tensor``'s dtype, shape and op uses."""
        if len(self._smalls) >= _SMALL_KEYS:
            self._smalls.clear()
        dtype, shape, count = tensor.dtype, tensor.shape, tensor.numel()
        slots = self.segment.slots(dtype)
        found = self._smalls[dtype, shape, op] = _Small(
            signature("all_reduce", str(dtype), count, str(op)),
            [[slot[:count].view(shape) for slot in slots[b]] for b in (0, 1)],
            REDUCERS[R.SUM if op == R.AVG else op],
        )
        return found

    def all_reduce_now(self, tensor: torch.Tensor, op: Any, wait: timedelta) -> ShmWork | None:
        """All-reduce a small contiguous ``tensor`` here and now: None once done, else its work.

        The synchronous small all_reduce (up to ``SMALL_BYTES``, nothing else of the group in
        flight, ``op`` one of SUM, MIN and MAX) without an op object, a generator or a future:
        the same steps, barrier and signature as ``_all_reduce``'s one-barrier case, so peers
        may run either. The work handed back is one still to wait for (``wait``, a
        watchdog's first slice, passed first: its wait goes on from the barrier), one that failed
        (its ``wait()`` raises), or, off that case, one not started.
        """
        nbytes = tensor.nbytes
        if nbytes > self._small_bytes or not self.idle():
            flat = tensor if tensor.dim() == 1 else tensor.view(-1)
            return self.run_now("all_reduce", self.all_reduce(flat, op), wait)
        self.calls += 1
        small = self._smalls.get((tensor.dtype, tensor.shape, op)) or self._small(tensor, op)
        barrier = self.barrier
        barrier.start("all_reduce", small.signature)
        self._chunks += 1
        buffer = self._chunks & 1
        _move(self.segment.address(buffer, self.rank), tensor.data_ptr(), nbytes)
        target = barrier.arrive()
        try:
            done = barrier.wait_for(target, _until(wait))
        except CollectiveError as exc:
            return self._failed("all_reduce", Call(small.signature, iter(())), exc)
        terms = small.views[buffer]
        if not done:  # the wait goes on in the work: the fold is its one remaining step
            rest = Call(small.signature, _fold(small, terms, tensor))
            return self._unfinished("all_reduce", rest, target)
        threads = _serial()
        try:
            _fold_into(small.fold, terms, tensor)
        finally:
            _give_back(threads)
        return None

    def _all_reduce(self, flat: torch.Tensor, op: Any) -> Steps:
        """Reduce ``flat`` in place across the ranks, parts reduced in rank order 0..w-1.

        Rank ``r`` copies in only the parts other ranks reduce, reads its own part of its own
        input where it is, and reduces its part piece by piece: in place in ``flat`` (ranks 0
        and 1) or in its slot's part ``r``, which it left free (later ranks); each piece is
        copied to the other place at once. Then it copies the other ranks' reduced parts out of
        their slots. AVG (floating dtypes) is the sum divided by the world size, on the part.
        """
        average = op == R.AVG
        fold = REDUCERS[R.SUM if average else op]
        seg, me, world = self.segment, self.rank, self.world
        size, itemsize = flat.numel(), flat.element_size()
        base = flat.data_ptr()
        if size * itemsize <= self._small_bytes:
            # One barrier instead of two: every rank folds every slot, in the same order
            buffer = self._next_buffer()
            _move(seg.address(buffer, me), base, size * itemsize)
            yield
            small = self._smalls.get((flat.dtype, flat.shape, op)) or self._small(flat, op)
            yield from _fold(small, small.views[buffer], flat)
            if average:
                flat.div_(world)
            return
        step = seg.slot_bytes // itemsize
        grain = _grain(step)
        for start in range(0, size, step):
            count = min(step, size - start)
            buffer = self._next_buffer()
            slots = seg.slots(flat.dtype)[buffer]
            mine = seg.address(buffer, me)
            here = base + start * itemsize
            parts = [_part(count, world, r, itemsize) for r in range(world)]
            lo, hi = parts[me]
            _move(mine, here, lo * itemsize)  # the parts the other ranks reduce
            _move(mine + hi * itemsize, here + hi * itemsize, (count - hi) * itemsize)
            yield
            chunk = flat[start : start + count]
            for a in range(lo, hi, grain):
                b = min(hi, a + grain)
                own = chunk[a:b]
                terms = [own if r == me else slots[r][a:b] for r in range(world)]
                # Ranks 0 and 1 read their own term in the first fold, so they can reduce in
                # place; a later rank keeps its term intact in ``flat`` until its turn.
                acc = own if me < 2 else slots[me][a:b]
                fold(terms[0], terms[1], out=acc)
                for term in terms[2:]:
                    fold(acc, term, out=acc)
                if average:
                    acc.div_(world)
                # publish the reduced piece (or take it home) while it is still in cache
                if acc is own:
                    _move(mine + a * itemsize, here + a * itemsize, (b - a) * itemsize)
                else:
                    _move(here + a * itemsize, mine + a * itemsize, (b - a) * itemsize)
            yield
            for r, (a, b) in enumerate(parts):
                if r != me:
                    _move(
                        here + a * itemsize,
                        seg.address(buffer, r) + a * itemsize,
                        (b - a) * itemsize,
                    )

    def broadcast(self, flat: torch.Tensor, root: int) -> Call:
        """Return the op (see ``_broadcast``)."""
        return Call(
            signature("broadcast", flat.numel() * flat.element_size(), root),
            self._broadcast(flat, root),
        )

    def _broadcast(self, flat: torch.Tensor, root: int) -> Steps:
        """Copy group rank ``root``'s ``flat`` into every rank's (the whole buffer per chunk)."""
        seg, me = self.segment, self.rank
        size = flat.numel() * flat.element_size()
        step = self.world * seg.slot_bytes
        base = flat.data_ptr()
        for start in range(0, size, step):
            count = min(step, size - start)
            region = seg.address(self._next_buffer(), 0)
            if me == root:
                _move(region, base + start, count)
            yield
            if me != root:
                _move(base + start, region, count)

    def all_gather(self, out: torch.Tensor, flat: torch.Tensor) -> Call:
        """Return the op (see ``_all_gather``)."""
        return Call(
            signature("all_gather", flat.numel() * flat.element_size()),
            self._all_gather(out, flat),
        )

    def _all_gather(self, out: torch.Tensor, flat: torch.Tensor) -> Steps:
        """Gather every rank's ``flat`` into ``out`` (rank r's at ``out[r * n : (r + 1) * n]``)."""
        seg, me, world = self.segment, self.rank, self.world
        size = flat.numel() * flat.element_size()  # bytes from each rank
        source, target = flat.data_ptr(), out.data_ptr()
        for start in range(0, size, seg.slot_bytes):
            count = min(seg.slot_bytes, size - start)
            buffer = self._next_buffer()
            _move(seg.address(buffer, me), source + start, count)
            yield
            for rank in range(world):
                _move(target + rank * size + start, seg.address(buffer, rank), count)

    def reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, op: Any) -> Call:
        """Return the op (see ``_reduce_scatter``)."""
        return Call(
            signature("reduce_scatter", str(out.dtype), out.numel(), str(op)),
            self._reduce_scatter(out, flat, op),
        )

    def _reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, op: Any) -> Steps:
        """Reduce ``flat`` (w blocks of ``out.numel()``) and keep block ``rank``, in rank order.

        Each rank copies in the blocks of the other ranks' destinations; rank ``r`` folds block
        ``r`` of every rank (its own from its input) into ``out``.
        """
        average = op == R.AVG
        fold = REDUCERS[R.SUM if average else op]
        seg, me, world = self.segment, self.rank, self.world
        size, itemsize = out.numel(), out.element_size()
        blocks = flat.view(world, size)  # [destination rank, element]
        step = max(1, seg.slot_bytes // itemsize // world)
        grain = _grain(step)
        source = flat.data_ptr()
        for start in range(0, size, step):
            count = min(step, size - start)
            buffer = self._next_buffer()
            mine = seg.address(buffer, me)
            for dest in range(world):
                if dest != me:
                    _move(
                        mine + dest * count * itemsize,
                        source + (dest * size + start) * itemsize,
                        count * itemsize,
                    )
            yield
            slots = seg.slots(flat.dtype)[buffer]
            for a in range(0, count, grain):
                b = min(count, a + grain)
                target = out[start + a : start + b]
                lo, hi = me * count + a, me * count + b
                terms = [
                    blocks[me, start + a : start + b] if r == me else slots[r][lo:hi]
                    for r in range(world)
                ]
                fold(terms[0], terms[1], out=target)
                for term in terms[2:]:
                    fold(target, term, out=target)
                if average:
                    target.div_(world)
