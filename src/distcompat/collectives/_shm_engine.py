"""The shared-memory collectives of one group: chunked pipelines through the segment's slots.

Each op moves a tensor through the segment in chunks of at most one slot per rank, alternating
between the segment's two buffers, so a fixed-size segment carries tensors of any size and a
chunk's writes never meet a peer's reads of the chunk before::

    engine.run("all_reduce", lambda: engine.all_reduce(flat, dist.ReduceOp.SUM), async_op=False)

``all_reduce`` is a reduce-scatter then an all-gather inside the segment: every rank copies its
chunk into its slot; after a barrier rank ``r`` reduces part ``r`` of the chunk over the slots of
ranks 0, 1, ..., w-1 in that order (the same order for every part, on every run), into rank 0's
slot; after a second barrier every rank copies the whole reduced chunk out. The work of reducing
is shared by the ranks, and every rank copies the same bytes, so results are bit-identical on all
ranks. ``broadcast``, ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` need one barrier
per chunk.

Synchronous calls run in the caller's thread (after any async ops of the group still pending);
async calls run in issue order on one thread per group and complete a ``ShmWork``, which has the
``wait(timeout)`` / ``get_future()`` of a backend Work, so :func:`issue`, the watchdog and
:class:`CompatWork` treat it as one.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distcompat.collectives._errors import CollectiveError
from distcompat.collectives._shm_segment import Barrier, Segment

__all__ = ["REDUCERS", "Engine", "ShmWork"]

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


class ShmWork:
    """What an async shared-memory op returns: a backend Work's ``wait`` and ``get_future``."""

    __slots__ = ("_done", "_error", "_future")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._future: torch.futures.Future[Any] = torch.futures.Future()

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Block until done and raise the op's error; ``RuntimeError`` if ``timeout`` passes first.

        A zero timeout means none, as for torch's ``Work.wait``.
        """
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        if not self._done.wait(seconds or None):
            raise RuntimeError(f"shared-memory collective still running after {seconds:g}s")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """Return whether the op ended (successfully or not)."""
        return self._done.is_set()

    def get_future(self) -> torch.futures.Future[Any]:
        """Return the future the op completes (value None) or fails."""
        return self._future

    def settle(self, error: BaseException | None) -> None:
        """Record the op's outcome, wake waiters, complete the future."""
        self._error = error
        self._done.set()
        if error is None:
            self._future.set_result(None)
        else:
            self._future.set_exception(error)


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
        self._chunks = 0  # chunks moved so far: the same on every rank; picks the buffer
        self._queue: queue.SimpleQueue[tuple[str, Callable[[], None], ShmWork] | None] = (
            queue.SimpleQueue()
        )
        self._pending = 0
        self._idle = threading.Condition()
        self._thread: threading.Thread | None = None

    # -- running ops in issue order ------------------------------------------------------------

    def run(self, op: str, body: Callable[[], None], async_op: bool) -> ShmWork | None:
        """Run ``body`` now (sync, after pending async ops) or queue it and return its work."""
        if not async_op:
            with self._idle:
                while self._pending:
                    self._idle.wait()
            self._execute(op, body)
            return None
        work = ShmWork()
        with self._idle:
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._serve, name="distcompat-shm", daemon=True
                )
                self._thread.start()
        self._queue.put((op, body, work))
        return work

    def _execute(self, op: str, body: Callable[[], None]) -> None:
        if self.broken:
            raise CollectiveError(
                f"{op}: the shared-memory path of this group failed before: {self.broken}",
                op=op,
                peer=None,
            )
        self.barrier.start(op)
        try:
            body()
        except CollectiveError as exc:
            self.broken = str(exc)
            raise

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            op, body, work = item
            error: BaseException | None = None
            try:
                self._execute(op, body)
            except BaseException as exc:  # handed to the waiter, never lost in this thread
                error = exc
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()
            work.settle(error)
            del item, body, work

    def close(self) -> None:
        """End the async thread after the ops queued; unmap once no op can run any more."""
        self.broken = self.broken or "the group was destroyed"
        self._queue.put(None)

    # -- the ops (tensors are contiguous and 1-d; the same call on every rank) -----------------

    def _next_buffer(self) -> int:
        self._chunks += 1
        return self._chunks & 1

    def all_reduce(self, flat: torch.Tensor, op: Any) -> None:
        """Reduce ``flat`` in place across the ranks, parts reduced in rank order 0..w-1.

        AVG (floating dtypes) is the sum divided by the world size, on the reduced part.
        """
        average = op == R.AVG
        fold = REDUCERS[R.SUM if average else op]
        seg, me, world = self.segment, self.rank, self.world
        itemsize = flat.element_size()
        step = seg.slot_bytes // itemsize
        for start in range(0, flat.numel(), step):
            count = min(step, flat.numel() - start)
            buffer = self._next_buffer()
            seg.slot(buffer, me, count, flat.dtype).copy_(flat[start : start + count])
            self.barrier.meet()
            lo, hi = _part(count, world, me, itemsize)
            if hi > lo:
                acc = seg.slot(buffer, 0, count, flat.dtype)[lo:hi]
                for other in range(1, world):
                    fold(acc, seg.slot(buffer, other, count, flat.dtype)[lo:hi], out=acc)
                if average:
                    acc.div_(world)
            self.barrier.meet()
            flat[start : start + count].copy_(seg.slot(buffer, 0, count, flat.dtype))

    def broadcast(self, flat: torch.Tensor, root: int) -> None:
        """Copy group rank ``root``'s ``flat`` into every rank's (the whole buffer per chunk)."""
        seg, me = self.segment, self.rank
        step = self.world * seg.slot_bytes // flat.element_size()
        for start in range(0, flat.numel(), step):
            count = min(step, flat.numel() - start)
            buffer = self._next_buffer()
            if me == root:
                seg.buffer(buffer, count, flat.dtype).copy_(flat[start : start + count])
            self.barrier.meet()
            if me != root:
                flat[start : start + count].copy_(seg.buffer(buffer, count, flat.dtype))

    def all_gather(self, out: torch.Tensor, flat: torch.Tensor) -> None:
        """Gather every rank's ``flat`` into ``out`` (rank r's at ``out[r * n : (r + 1) * n]``)."""
        seg, me, world = self.segment, self.rank, self.world
        size = flat.numel()
        rows = out.view(world, size)  # [rank, element]
        step = seg.slot_bytes // flat.element_size()
        for start in range(0, size, step):
            count = min(step, size - start)
            buffer = self._next_buffer()
            seg.slot(buffer, me, count, flat.dtype).copy_(flat[start : start + count])
            self.barrier.meet()
            for rank in range(world):
                rows[rank, start : start + count].copy_(seg.slot(buffer, rank, count, flat.dtype))

    def reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, op: Any) -> None:
        """Reduce ``flat`` (w blocks of ``out.numel()``) and keep block ``rank``, in rank order."""
        fold = REDUCERS[op]
        seg, me, world = self.segment, self.rank, self.world
        size = out.numel()
        blocks = flat.view(world, size)  # [destination rank, element]
        step = max(1, seg.slot_bytes // flat.element_size() // world)
        for start in range(0, size, step):
            count = min(step, size - start)
            buffer = self._next_buffer()
            mine = seg.slot(buffer, me, world * count, flat.dtype).view(world, count)
            mine.copy_(blocks[:, start : start + count])
            self.barrier.meet()
            target = out[start : start + count]
            slot = seg.slot  # every rank's block for this rank, folded in rank order
            target.copy_(slot(buffer, 0, world * count, flat.dtype).view(world, count)[me])
            for other in range(1, world):
                block = slot(buffer, other, world * count, flat.dtype).view(world, count)[me]
                fold(target, block, out=target)
