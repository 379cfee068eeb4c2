"""A failed op's error for a caller in C++ (DDP's reducer): raised once the call is back in Python.

torch 2.13's DDP reducer crashes the process (SIGSEGV) when the future of a bucket's all-reduce
failed with an error set from Python, as every error of a Python process group is. So the
protected group hands a C++ caller a future that never fails (:func:`shielded`): on failure it
completes with the op's outputs, the C++ call (``loss.backward()``) finishes, and the op's typed
error (:class:`~distcompat.PeerLostError` naming the rank) is raised in the caller's thread
once that call has returned::

    caller = Caller(threading.get_ident(), sys._getframe(2))   # the frame C++ was entered from
    future = shielded(handle.get_future(), outputs, caller)

The error is raised with ``PyThreadState_SetAsyncExc`` once a watcher thread sees that the
frame the C++ call was made from has returned (``_engine_run_backward`` for DDP): Python that
C++ runs meanwhile (callbacks, torch extracting a future's tensors) is left alone, since C++
would turn the error into a RuntimeError with its text or drop it. It lands within a few
bytecodes of ``loss.backward()`` returning, in the thread that called it.
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

__all__ = ["Caller", "shielded"]

#: How long the watcher follows a caller still inside its C++ call before raising anyway (s).
_FOLLOW_S = 600.0
_POLL_S = 0.0005


@dataclass(frozen=True, slots=True)
class Caller:
    """The thread that called into C++, and the Python frame it called from."""

    thread: int
    frame: FrameType

    def inside_call(self) -> bool:
        """Whether :attr:`frame` is still on the thread's stack.

        The C++ call made from it, and any Python that C++ runs meanwhile (callbacks, torch
        extracting a future's tensors), is no place to raise: C++ would turn the error into its
        text or drop it.
        """
        top = sys._current_frames().get(self.thread)
        while top is not None and top is not self.frame:
            top = top.f_back
        return top is not None


class _Pending(BaseException):
    """What :func:`_raise_in` raises: CPython makes one, and gets the error it stands for."""

    error: BaseException

    def __new__(cls, *args: Any) -> Any:  # the error it stands for, not a _Pending
        return cls.error


def _raise_in(thread: int, error: BaseException) -> None:
    """Raise ``error`` in ``thread`` at the next Python instruction it runs."""
    pending = type(type(error).__name__, (_Pending,), {"error": error})
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(pending))


def _raise_when_back(caller: Caller, error: BaseException) -> None:
    """Wait (on this thread) until ``caller`` is past its C++ call, then raise ``error`` there."""
    deadline = time.monotonic() + _FOLLOW_S
    while caller.inside_call() and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    if caller.thread in sys._current_frames():
        _raise_in(caller.thread, error)


def shielded(
    future: torch.futures.Future[Any], outputs: Any, caller: Caller
) -> torch.futures.Future[Any]:
    """Return a future with ``future``'s value that never fails; an error goes to ``caller``.

    An op that already failed is handled the same way: raised here, inside the C++ call, its
    type would be lost (C++ passes it on as a RuntimeError with its text).

    Example:
        >>> done = torch.futures.Future()
        >>> done.set_result([torch.ones(1)])
        >>> shielded(done, None, Caller(threading.get_ident(), sys._getframe())).value()
        [tensor([1.])]
    """
    out: torch.futures.Future[Any] = torch.futures.Future()

    def settle(done: torch.futures.Future[Any]) -> None:
        try:
            value = done.value()
        except BaseException as exc:
            threading.Thread(target=_raise_when_back, args=(caller, exc), daemon=True).start()
            value = outputs  # the caller finishes its C++ call, then meets the error
        out.set_result(value)

    future.add_done_callback(settle)
    return out
