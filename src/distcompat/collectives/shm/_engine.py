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

import queue
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from distcompat.collectives._errors import CollectiveError, PeerLostError
from distcompat.collectives._profiled import begin, recording
from distcompat.collectives.shm._barrier import Barrier
from distcompat.collectives.shm._folds import (
    SMALL_BYTES,
    _fold,
    _fold_into,
    _give_back,
    _move,
    _serial,
    _Small,
)
from distcompat.collectives.shm._ops import Ops
from distcompat.collectives.shm._segment import Segment
from distcompat.collectives.shm._work import Call, ShmWork

__all__ = ["Engine"]

_JOIN_S = 2.0  # how long close() waits for the async thread to finish the ops queued


def _until(wait: timedelta) -> float | None:
    """Return when a wait of ``wait`` from now ends (``time.monotonic()``); None for zero."""
    return time.monotonic() + wait.total_seconds() if wait else None


class Engine(Ops):
    """A group's segment, barrier and async thread, and the ops that run through them."""

    def __init__(self, segment: Segment, barrier: Barrier, *, rank: int, world: int) -> None:
        self.segment = segment
        self.barrier = barrier
        self.rank = rank
        self.world = world
        self.broken = ""  # why the path can no longer be used on this group ('' while it can)
        self._lost: tuple[int, ...] = ()  # the lost peers that broke it, if a loss did
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

    def work(self, op: str, call: Call, shown: Sequence[torch.Tensor] = ()) -> ShmWork:
        """Return ``call``'s work, not started.

        It runs when waited on, or on the group's thread once its future is asked for. While
        torch's profiler records on this thread, the op of a caller's collective (``shown``: its
        tensors) is queued for the group's thread at once, inside the event gloo would record
        (``_profiled``); distcompat's own ops (no ``shown``) record none, as on the backend.
        """
        self.calls += 1
        work = ShmWork(self, op, call)
        if shown and recording():
            work.record = begin(op, shown)
            open_work = self._open
            if open_work is None or open_work.is_completed():  # else its wait() runs it after
                work.get_future()  # queued: the group's thread runs it and ends the event
        return work

    def idle(self) -> bool:
        """Return whether no op of the group is queued or unfinished, and the path still works."""
        open_work = self._open
        return not (
            self._pending or self.broken or (open_work is not None and not open_work.is_completed())
        )

    def run_now(
        self, op: str, call: Call, wait: timedelta, shown: Sequence[torch.Tensor] = ()
    ) -> ShmWork | None:
        """Run ``call`` here, synchronously: None once done, else its work to wait for.

        While the group is :meth:`idle`, without the work's machinery (an event, a future, the
        driving loop): the handed-back work is then one whose wait ran past ``wait`` (a
        watchdog's first slice; zero means no limit, as for ``Work.wait``), going on from the
        barrier it waits at, or one that failed (its ``wait()`` raises). Otherwise the work is
        one not started, run by its ``wait()`` (or queued, while a profiler records: see
        :meth:`work`).
        """
        if not self.idle() or (shown and recording()):
            return self.work(op, call, shown)
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
        self._break(error)
        work = ShmWork(self, op, call)
        work.settle(error)
        return work

    def run(
        self, op: str, call: Call, async_op: bool, shown: Sequence[torch.Tensor] = ()
    ) -> ShmWork | None:
        """Run ``call`` to the end here (sync), or return its work (async: see :meth:`work`)."""
        work = self.work(op, call, shown)
        if async_op:
            return work
        work.wait()  # runs it here (or waits for the group's thread); raises the op's error
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
            self._break(exc)
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
            raise self._failed_before(work.op)
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

    def _break(self, error: CollectiveError) -> None:
        """Mark the path unusable on this group because an op failed with ``error`` (the first)."""
        if not self.broken:  # the peers, not the error: its traceback holds the op's tensors
            self.broken = str(error)
            self._lost = error.peers if isinstance(error, PeerLostError) else ()

    def _failed_before(self, op: str) -> CollectiveError:
        """Return the error of ``op``, issued before the path broke and run after it broke.

        A lost peer stays a :class:`PeerLostError` naming the rank: an op queued behind the one
        that saw the peer go (DDP's next bucket, a metric all-reduce issued while the peer
        watch had already ended the caller's backward) fails for the same reason.
        """
        message = f"{op}: the shared-memory path of this group failed before: {self.broken}"
        if self._lost:
            return PeerLostError(message, op=op, peer=self._lost[0], peers=self._lost)
        return CollectiveError(message, op=op, peer=None)

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
        torch.set_grad_enabled(False)  # this thread's ops move bytes: no autograd (as in torch)
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

    def all_reduce_now(self, tensor: torch.Tensor, op: Any, wait: timedelta) -> ShmWork | None:
        """All-reduce a small contiguous ``tensor`` here and now: None once done, else its work.

        The synchronous small all_reduce (up to ``SMALL_BYTES``, nothing else of the group in
        flight, ``op`` one of SUM, MIN and MAX, not an inference tensor: see ``writing_into``)
        without an op object, a generator or a future:
        the same steps, barrier and signature as ``_all_reduce``'s one-barrier case, so peers
        may run either. The work handed back is one still to wait for (``wait``, a
        watchdog's first slice, passed first: its wait goes on from the barrier), one that failed
        (its ``wait()`` raises), or, off that case, one not started.
        """
        nbytes = tensor.nbytes
        if nbytes > self._small_bytes or not self.idle() or recording() or tensor.is_inference():
            flat = tensor if tensor.dim() == 1 else tensor.view(-1)
            return self.run_now("all_reduce", self.all_reduce(flat, op), wait, (tensor,))
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
