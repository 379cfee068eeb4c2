"""A failed op's error for a caller in C++ (DDP's reducer): raised once the call is back in Python.

torch 2.13's DDP reducer crashes the process (SIGSEGV) when the future of a bucket's all-reduce
failed with an error set from Python, as every error of a Python process group is. So the
protected group hands a C++ caller a future that never fails (:func:`shielded`): on failure it
completes with the op's outputs, the C++ call (``loss.backward()``) finishes, and the op's typed
error (:class:`~distcompat.PeerLostError` naming the rank) is raised in the caller's thread
once that call has returned::

    caller = Caller(threading.get_ident(), sys._getframe(2))   # the frame C++ was entered from
    future = shielded(handle.get_future(), outputs, caller)

The error is owed to the caller's thread until it is raised there, once: by a watcher thread
with ``PyThreadState_SetAsyncExc`` as soon as it sees that the frame the C++ call was made from
has returned (``_engine_run_backward`` for DDP), by the thread's next optimizer step
(:func:`refuse_step`, a global ``torch.optim`` step pre-hook), or by its next distcompat
collective (:func:`raise_owed`, which every entry calls), whichever comes first. Python that
C++ runs meanwhile (callbacks, torch extracting a future's tensors, the reducer's next buckets)
is left alone, since C++ would turn the error into a RuntimeError with its text or drop it. It
usually lands within a few bytecodes of ``loss.backward()`` returning; on a loaded machine the
watcher may come later, but never after the thread's next step or collective: an error
delivered by the watcher while that collective already waited in native code would wait with
it (a dead peer's sockets held open by a child it forked, a DataLoader worker, kept gloo
waiting 4 s past the kill here).

An asynchronous raise lands wherever the thread is, and code there may swallow it: a
:class:`PeerLostError` is a ``ConnectionError``, and importlib's path scans catch ``OSError``
(Accelerate's ``optimizer.step()`` looks for a package on each step: 4 of 8 kills here). So the
failure stays on record (:data:`FAILED`) after it is raised, and every optimizer step raises it
again until the thread's next C++ call hands over an op (the next backward): no step applies
gradients the reducer did not finish. An in-place regroup (``distcompat.inplace``) drops the
record (:func:`forget`).
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from distcompat.collectives._errors import gone_error
from distcompat.peers import Lost, gone_peers, listeners

__all__ = ["FAILED", "OWED", "Caller", "forget", "raise_owed", "refuse_step", "shielded"]

#: How long the watcher follows a caller still inside its C++ call before raising anyway (s).
_FOLLOW_S = 600.0
_POLL_S = 0.0005


@dataclass(frozen=True, slots=True)
class Caller:
    """The thread that called into C++, and the Python frame it called from."""

    thread: int
    frame: FrameType

    def inside_call(self) -> bool:
        """Whether :attr:`frame` is still on the thread's stack (it has not returned).

        The C++ call made from it, and any Python that C++ runs meanwhile (callbacks, torch
        extracting a future's tensors), is no place to raise: C++ would turn the error into its
        text or drop it. Asked of the frame in one call: ``frame.clear()`` refuses a frame that
        is on a stack, and drops a returned one's locals (Python 3.10-3.13). Walking the
        thread's stack from another thread raced with it: on Python 3.11 a frame that returned
        meanwhile gave a garbage ``f_back`` (a ``str``, once in 12 runs of the tests here).
        """
        try:
            self.frame.clear()
        except RuntimeError:  # "cannot clear an executing frame"
            return True
        return False


class _Pending(BaseException):
    """What :func:`_raise_in` raises: CPython makes one, and gets the error it stands for."""

    error: BaseException

    def __new__(cls, *args: Any) -> Any:  # the error it stands for, not a _Pending
        return cls.error


def _raise_in(thread: int, error: BaseException) -> None:
    """Raise ``error`` in ``thread`` at the next Python instruction it runs."""
    pending = type(type(error).__name__, (_Pending,), {"error": error})
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(pending))


def _cancel_pending(thread: int) -> None:
    """Cancel an asynchronous raise in ``thread`` that has not landed yet (none: no effect)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), None)


@dataclass(frozen=True, slots=True, eq=False)
class _Owed:
    """An error owed to the thread of ``caller``: raised there once, by whoever claims it."""

    caller: Caller
    error: BaseException


#: thread ident -> the error owed to it (one at a time: a later failure of the same C++ call,
#: another bucket's, adds nothing). Read without the lock by :func:`raise_owed`'s callers.
OWED: dict[int, _Owed] = {}
#: thread ident -> the failure of its last C++ call whose op failed (a backward whose bucket
#: did): the gradients it left are not the reduced ones. Raised by every optimizer step until
#: the thread's next C++ call hands over an op (:func:`shielded`), claimed or not.
FAILED: dict[int, _Owed] = {}
_claims = threading.Lock()


def _take(owed: _Owed) -> bool:
    """Take ``owed`` off :data:`OWED` if it is still there (``_claims`` held): True once."""
    if OWED.get(owed.caller.thread) is not owed:
        return False
    del OWED[owed.caller.thread]
    return True


def _claim(owed: _Owed) -> bool:
    """Take ``owed`` off :data:`OWED` if it is still there: True for exactly one claimant."""
    with _claims:
        return _take(owed)


def _owe(caller: Caller, error: BaseException) -> None:
    """Owe ``error`` to ``caller``'s thread, unless an error is owed there already."""
    owed = _Owed(caller, error)
    with _claims:
        if caller.thread in OWED:
            return
        OWED[caller.thread] = FAILED[caller.thread] = owed
    _watch(owed)


def _watch(owed: _Owed) -> None:
    """Start the thread that raises ``owed`` once its caller is back from C++."""
    threading.Thread(target=_raise_when_back, args=(owed,), daemon=True).start()


def _raise_when_back(owed: _Owed) -> None:
    """Wait (on this thread) until the caller is past its C++ call, then raise the error there."""
    caller = owed.caller
    deadline = time.monotonic() + _FOLLOW_S
    while caller.inside_call() and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    with _claims:  # claimed and raised at once: refuse_step sees it owed or on its way
        if _take(owed) and caller.thread in sys._current_frames():  # an ended thread: nothing
            _raise_in(caller.thread, owed.error)


def raise_owed() -> None:
    """Raise here the error owed to this thread, once its C++ call has returned.

    Called at each collective's entry while :data:`OWED` holds anything, so a thread never
    starts a collective with a failed one's error still on its way.

    Example:
        >>> raise_owed()   # nothing owed to this thread: returns
    """
    owed = OWED.get(threading.get_ident())
    if owed is None or owed.caller.inside_call() or not _claim(owed):
        return
    raise owed.error


def refuse_step() -> None:
    """Raise, before an optimizer step, the error of this thread's last failed C++ reduction.

    The optimizer would apply gradients DDP's reducer did not finish: on a loaded machine the
    watcher's asynchronous raise may come after the step, and code that catches ``OSError``
    may swallow it (a :class:`PeerLostError` is a ``ConnectionError``; importlib's path scans
    in Accelerate's ``optimizer.step()`` did). Raised by every ``torch.optim`` step (a global
    step pre-hook, registered with the first shielded future) until the thread's next C++
    call hands over an op; an error still owed is claimed here, so the watcher raises nothing.

    Example:
        >>> refuse_step()   # no failed reduction on this thread: returns
    """
    thread = threading.get_ident()
    failed = FAILED.get(thread)
    if failed is None or failed.caller.inside_call():
        return
    with _claims:
        if not _take(failed):  # the watcher raised it: not landed yet, it lands here, once
            _cancel_pending(thread)
    raise failed.error.with_traceback(None)  # raised again at each step: not a growing trace


def forget() -> None:
    """Drop every error handed over so far: the group went on past them (an in-place regroup).

    An error still owed would otherwise fail the first collective or step after the regroup.

    Example:
        >>> forget()
    """
    with _claims:
        OWED.clear()
        FAILED.clear()


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Refuse a ``torch.optim`` step after a failed reduction (one dict's truth test if none)."""
    if FAILED:
        refuse_step()


@dataclass(eq=False, slots=True)
class _Shield:
    """A C++ caller's future over an op in flight: ended once, by the op or by a lost peer."""

    out: torch.futures.Future[Any]
    outputs: Any
    caller: Caller
    group: Any
    op: str
    ended: bool = False

    def end(self, value: Any, error: BaseException | None) -> None:
        """Complete :attr:`out` with ``value``, owing ``error`` to the caller; once only."""
        with _claims:
            if self.ended:
                return
            self.ended = True
            _shields.pop(id(self), None)
        if error is not None:
            _owe(self.caller, error)
        self.out.set_result(value)


#: The shields whose op is in flight, by id: a loss the peer watch records ends those of the
#: lost rank's groups (:func:`_peer_lost`), since no slice of a wait in C++ looks for one.
_shields: dict[int, _Shield] = {}
_listening = False


def _peer_lost(lost: Lost) -> None:
    """End each in-flight shield of a group ``lost.rank`` belonged to (the watch's thread).

    The backend's op may wait on for seconds more: gloo waits for the peer's sockets to close,
    and a child the peer forked (a DataLoader worker) holds them open.
    """
    for shield in list(_shields.values()):
        gone = gone_peers(shield.group)
        if lost.rank not in gone:
            continue
        where = "while a caller in C++ (DDP's reducer, a functional collective) waited for it"
        shield.end(shield.outputs, gone_error(shield.op, gone, where))


def shielded(
    future: torch.futures.Future[Any],
    outputs: Any,
    caller: Caller,
    *,
    group: Any = None,
    op: str = "collective",
) -> torch.futures.Future[Any]:
    """Return a future with ``future``'s value that never fails; an error goes to ``caller``.

    An op that already failed is handled the same way: raised here, inside the C++ call, its
    type would be lost (C++ passes it on as a RuntimeError with its text). A peer of ``group``
    (None: the default group) that the peer watch sees end fails it the same way at once,
    without waiting for the backend's own error (``op`` names it).

    Example:
        >>> done = torch.futures.Future()
        >>> done.set_result([torch.ones(1)])
        >>> shielded(done, None, Caller(threading.get_ident(), sys._getframe())).value()
        [tensor([1.])]
    """
    global _listening
    shield = _Shield(torch.futures.Future(), outputs, caller, group, op)
    if not _listening:
        listeners.append(_peer_lost)
        register_optimizer_step_pre_hook(_before_step)
        _listening = True
    failed = FAILED.get(caller.thread)
    if failed is not None and failed.caller.frame is not caller.frame:
        del FAILED[caller.thread]  # a new C++ call (the next backward): a new reduction
    _shields[id(shield)] = shield

    def settle(done: torch.futures.Future[Any]) -> None:
        try:
            value = done.value()
        except BaseException as exc:
            shield.end(outputs, exc)  # the caller finishes its C++ call, then meets the error
        else:
            shield.end(value, None)

    future.add_done_callback(settle)
    return shield.out
