"""``CompatWork``: an async handle whose wait, is_completed and get_future work everywhere.

torch's ``Work`` objects differ by backend and op. On gloo, ``get_future()`` raises for
``reduce_scatter*`` and every point-to-point op, ``is_completed()`` never turns True before
``wait()``, and a second ``wait()`` on an any-source ``irecv`` blocks until the timeout. This handle
hides that::

    work = distcompat.all_reduce(t, async_op=True)
    work.get_future().then(lambda f: f.value()[0] * 2)   # a real torch.futures.Future

How a handle completes (``CompatWork.strategy`` names it):

* ``"native"``: the backend's own future; distcompat's post-processing (copy back a staged
  non-contiguous output, divide for AVG, ...) runs as a ``then`` callback, so it overlaps compute.
* ``"worker"``: the backend has no future for this op. One long-lived thread per process group
  calls ``work.wait()`` for each such op in issue order and completes the future, so communication
  still overlaps compute; the cost is a queue hand-off per op, not a thread per op.
* ``"done"``: nothing was sent (world size 1, or a local identity): completed at once.

Errors of the op always reach the future (and ``wait()``); post-processing never runs on a
failed op. ``wait()`` may be called any number of times: the backend's ``wait()`` runs once.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from distcompat.collectives import _checked
from distcompat.collectives._errors import translate

__all__ = [
    "CompatFuture",
    "CompatWork",
    "Strategy",
    "done_if_async",
    "finish_now",
    "future_for",
    "holds_inference",
    "joined",
]

Strategy = Literal["native", "worker", "done"]
Finish = Callable[[], Any]
_Item = tuple[Any, "torch.futures.Future[Any]", Any, "Finish | None", str, Any]


class CompatFuture(torch.futures.Future[Any]):
    """A ``torch.futures.Future`` whose ``then`` callbacks cannot swallow the op's error.

    torch runs a ``then`` callback even when the op failed; a callback that never calls
    ``f.value()`` turns the failure into success (measured: a failed gather "succeeded" with
    garbage). Here the error is raised into the derived future before the callback runs.
    """

    def then(self, callback: Callable[[Any], Any]) -> torch.futures.Future[Any]:
        """Chain ``callback``; it runs only if this future succeeded."""

        def checked(done: torch.futures.Future[Any]) -> Any:
            done.wait()  # re-raise the op's error into the derived future
            return callback(done)

        return super().then(checked)


def future_for(result: Any) -> CompatFuture:
    """Return an empty :class:`CompatFuture` for ``result``, stream-aware for CUDA tensors.

    Without the devices, completing the future with CUDA tensors would tell nobody which streams
    produced them, and a caller's next kernel could read an output that gloo was still copying
    back (measured on an H200: right after ``wait()``, an async reduce_scatter_tensor's output was
    stale in 2 of 10 rounds). With them, torch records events when the value is set and makes the
    waiting caller's current stream (or a ``then`` callback's stream) wait for them: the same
    guarantee as torch's own ``wait()``.

    Example:
        >>> future_for([torch.ones(1)]).done()   # CPU tensors: a plain future, not yet set
        False
    """
    # No CUDA tensor can exist before CUDA is initialized: skip the scan (1.3 us per call).
    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return CompatFuture()
    tensors: list[Any] = []
    for item in result if isinstance(result, list | tuple) else [result]:
        tensors += item if isinstance(item, list | tuple) else [item]  # all_gather: [[...]]
    names = {str(t.device) for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda}
    devices: list[int | str | torch.device] = [*sorted(names)]
    return CompatFuture(devices=devices) if devices else CompatFuture()


class CompatWork:
    """The handle distcompat's async collectives return, the same on every backend.

    ``wait()`` blocks until the op and its post-processing are done and returns True;
    ``is_completed()`` never blocks; ``get_future()`` returns a ``torch.futures.Future`` whose value
    is the op's result (the output tensors, or the list of them), failing with the op's error.

    Example:
        >>> import torch
        >>> from distcompat.collectives import all_reduce
        >>> work = all_reduce(torch.ones(2), async_op=True)   # no group: completes at once
        >>> work.wait(), work.is_completed(), work.get_future().value()
        (True, True, [tensor([1., 1.])])
    """

    __slots__ = ("_done", "_future", "_lock", "_work", "group", "op", "strategy")

    def __init__(
        self,
        future: torch.futures.Future[Any],
        strategy: Strategy,
        work: Any,
        group: Any = None,
        op: str = "collective",
    ) -> None:
        self._future = future
        self._work = work  # kept alive until completion; never waited on from here twice
        self.group = group  # whose lost peers end a wait (None: the default group's)
        self.op = op
        self._done = threading.Event()
        self._lock = threading.Lock()
        self.strategy: Strategy = strategy
        future.add_done_callback(lambda _: self._done.set())

    @classmethod
    def completed(cls, value: Any) -> CompatWork:
        """Return a handle that is already done with ``value`` (nothing was sent)."""
        future: torch.futures.Future[Any] = CompatFuture()
        future.set_result(value)
        return cls(future, "done", None)

    @classmethod
    def from_work(
        cls, work: Any, group: Any, result: Any, finish: Finish | None, *, op: str = "collective"
    ) -> CompatWork:
        """Wrap a backend ``Work``: use its future if it has one, else the group's worker."""
        future: torch.futures.Future[Any] = future_for(result)
        try:
            native = work.get_future()
        except RuntimeError:  # "Work::getFuture not implemented" (gloo reduce_scatter*, p2p)
            _worker_for(group).submit((work, future, result, finish, op, group))
            return cls(future, "worker", work, group, op)

        def complete(done: torch.futures.Future[Any]) -> None:
            # done.wait() raises the op's error; a callback that skipped it would lose it
            _settle(done.wait, finish, future, result, op, group)

        native.add_done_callback(complete)
        return cls(future, "native", work, group, op)

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Block until done (and post-processed); raise the op's error. Safe to call repeatedly.

        With ``timeout`` (seconds or a timedelta), raise ``TimeoutError`` if the op is not done by
        then; the op keeps running and the group stays usable.
        """
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        watcher = _checked.watch  # distcompat.diagnostics' watchdog bounds an unbounded wait
        if seconds is None and watcher is not None and not self._done.is_set():
            watcher.wait_event(self._done, self)
        elif not self._done.wait(seconds):
            raise TimeoutError(
                f"collective not complete after {seconds}s (strategy {self.strategy!r}); it keeps "
                "running and a later wait() can still collect it"
            )
        self._future.wait()  # re-raises the op's error
        return True

    def is_completed(self) -> bool:
        """Return True once the op and its post-processing are done (successfully or not)."""
        return self._done.is_set()

    def get_future(self) -> torch.futures.Future[Any]:
        """Return this op's ``torch.futures.Future`` (works with ``then`` and ``collect_all``)."""
        return self._future

    def exception(self) -> BaseException | None:
        """Return the op's error once it is done, else None."""
        if not self._done.is_set():
            return None
        try:
            self._future.wait()
        except BaseException as exc:
            return exc
        return None


def done_if_async(result: Any, async_op: bool) -> CompatWork | None:
    """Return a completed handle for an op that sent nothing, or None for a sync call."""
    return CompatWork.completed(result) if async_op else None


def joined(handles: list[CompatWork], finish: Finish | None, result: Any) -> CompatWork:
    """One handle that completes once every handle in ``handles`` has, then runs ``finish``.

    Its error is the first failed handle's; ``finish`` runs only when all succeeded.

    Example:
        >>> parts = [CompatWork.completed([torch.ones(1)]), CompatWork.completed([torch.zeros(1)])]
        >>> joined(parts, None, "both").get_future().value()
        'both'
    """
    future = future_for(result)

    def complete(done: torch.futures.Future[Any]) -> None:
        try:
            for part in done.wait():
                part.wait()  # raises the first handle's error
            if finish is not None:
                _post_process(finish, result)
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)

    torch.futures.collect_all([h.get_future() for h in handles]).add_done_callback(complete)
    strategy = "native" if all(h.strategy == "native" for h in handles) else handles[0].strategy
    if not handles:
        return CompatWork(future, strategy, handles)
    return CompatWork(future, strategy, handles, handles[0].group, handles[0].op)


def holds_inference(result: Any) -> bool:
    """Return whether ``result`` holds an inference tensor (one made under inference mode).

    ``result``: a tensor, a list of them, or all_gather's list of lists.

    torch refuses an in-place update to such a tensor outside inference mode, and inference mode
    is per thread: a post-processing step that writes into one (copy back, AVG's divide, a
    shared-memory fold) must enter it itself, wherever it runs. gloo writes its results from C++,
    past that check, so on plain torch a SUM into an inference tensor works in any thread.

    Example:
        >>> with torch.inference_mode():
        ...     made = torch.ones(2)
        >>> holds_inference([torch.ones(2), made]), holds_inference([[torch.ones(2)]])
        (True, False)
    """
    # isinstance with tuples, tensors first: half the time of ``list | tuple`` (measured 0.24 us
    # for a one-tensor list), as this runs on every synchronous call with a finishing step
    for item in result if isinstance(result, (list, tuple)) else (result,):
        if isinstance(item, torch.Tensor):
            if item.is_inference():
                return True
        elif isinstance(item, (list, tuple)) and holds_inference(item):
            return True
    return False


def finish_now(finish: Finish, result: Any) -> None:
    """Run a synchronous op's post-processing, which writes into ``result``, in this thread.

    Under inference mode when ``result`` holds an inference tensor (:func:`holds_inference`):
    a caller may make a tensor there and reduce it after leaving, as torch lets a SUM do.
    """
    if holds_inference(result):
        with torch.inference_mode():
            finish()
    else:
        finish()


def _post_process(finish: Finish, result: Any) -> None:
    """Run an async op's post-processing where it completes (gloo's or a worker's thread).

    It is arithmetic on the caller's tensors with autograd off, as inside a collective's entry:
    DDP with ``create_graph=True`` hands over tensors that require grad. Into inference tensors
    (:func:`holds_inference`) it runs under inference mode, which this thread is not in.
    """
    with torch.inference_mode() if holds_inference(result) else torch.no_grad():
        finish()


def _settle(
    wait: Callable[[], Any],
    finish: Finish | None,
    future: torch.futures.Future[Any],
    result: Any,
    op: str,
    group: Any,
) -> None:
    """Wait for the op, post-process it, and complete ``future`` with its result or typed error.

    Post-processing never runs on a failed op.
    """
    try:
        wait()
        if finish is not None:
            _post_process(finish, result)
    except BaseException as exc:
        future.set_exception(translate(exc, op, group))
    else:
        future.set_result(result)


class _GroupWorker:
    """One daemon thread that completes a group's future-less Works, in issue order."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="distcompat-work", daemon=True)
        self._thread.start()

    def submit(self, item: _Item) -> None:
        self._queue.put(item)

    def stop(self) -> None:
        """Let the thread end after the Works already queued (its group is gone)."""
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, future, result, finish, op, group = item
            _settle(work.wait, finish, future, result, op, group)
            # Hold no backend Work while idle: one still referenced from this daemon thread is
            # destroyed during interpreter teardown, which can end in C++ std::terminate.
            del item, work, future, result, finish, group


_workers: weakref.WeakKeyDictionary[Any, _GroupWorker] = weakref.WeakKeyDictionary()
_workers_lock = threading.Lock()


def _worker_for(group: Any) -> _GroupWorker:
    key = group if group is not None else dist.group.WORLD
    with _workers_lock:
        worker = _workers.get(key)
        if worker is None:
            worker = _workers[key] = _GroupWorker()
            weakref.finalize(key, worker.stop)  # the group was destroyed: end its thread
        return worker
