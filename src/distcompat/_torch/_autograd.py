"""torch's private autograd and profiler switches that the collectives' hot paths call.

* ``set_grad_enabled``: the C function under ``torch.set_grad_enabled`` (the context manager
  costs about 1 us per collective; the function about 40 ns);
* ``profiler_enabled``, ``RecordFunctionFast``, ``enable_record_function``: whether torch's
  profiler records on this thread, an event, and turning events off for a block.

The same names on 2.9 through 2.15 (``torch._C``, ``torch._C._profiler``, ``torch._C._autograd``).
One behaviour differs: torch 2.9's profiler drops a ``RecordFunctionFast`` event that ends on
another thread (2.13 keeps it, as an async event). :func:`begin_record` / :func:`end_record`
record an event begun here and ended on another thread on every release: on 2.13+ with the
caller's input shapes, before 2.13 through torch's future-end mechanism, which keeps the event
(async, as gloo's) but records no shapes (:data:`CROSS_THREAD_SHAPES` says which).

Example:
    >>> profiler_enabled()
    False
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch._C import _set_grad_enabled as set_grad_enabled
from torch._C import is_grad_enabled
from torch._C._autograd import _enable_record_function as enable_record_function
from torch._C._autograd import _profiler_enabled as profiler_enabled

from distcompat._torch._release import release, release_text

__all__ = [
    "CROSS_THREAD_SHAPES",
    "RecordFunctionFast",
    "begin_record",
    "enable_record_function",
    "end_record",
    "is_grad_enabled",
    "profiler_enabled",
    "set_grad_enabled",
]

#: torch's fast record function: ``RecordFunctionFast(name, inputs, kwargs)`` as a context manager.
RecordFunctionFast = torch._C._profiler._RecordFunctionFast

#: The releases whose profiler keeps an event ended on another thread, with its input shapes
#: (measured: 2.13.0 and 2.15.0 keep it; 2.9.1 drops it; 2.10-2.12 not measured, taken as 2.9).
CROSS_THREAD_SHAPES = (2, 13)

_SHAPELESS = (
    "distcompat: torch {release}'s profiler drops an event that ends on another thread, so the "
    "shared-memory collectives' gloo:<op> events are recorded through torch's future-end "
    "mechanism: named and async as gloo's, without input shapes (torch 2.13+ records them)"
)
_said: list[bool] = []


class _Record:
    """An event begun on one thread that may end on another (see the module docstring)."""

    __slots__ = ("fast", "future")

    def __init__(self, fast: Any, future: torch.futures.Future[Any] | None) -> None:
        self.fast, self.future = fast, future


def begin_record(name: str, inputs: Sequence[torch.Tensor], kwargs: Mapping[str, str]) -> Any:
    """Begin event ``name`` on this thread; :func:`end_record` ends it on any thread.

    Example:
        >>> end_record(begin_record("gloo:all_reduce", (torch.ones(2),), {}))
    """
    if release() >= CROSS_THREAD_SHAPES:
        fast = RecordFunctionFast(name, tuple(inputs), dict(kwargs))
        fast.__enter__()
        return _Record(fast, None)
    if not _said and profiler_enabled():
        _said.append(True)
        warnings.warn(_SHAPELESS.format(release=release_text()), RuntimeWarning, stacklevel=3)
    handle = torch.ops.profiler._record_function_enter_new(name, None)
    future: torch.futures.Future[Any] = torch.futures.Future()
    torch.ops.profiler._call_end_callbacks_on_jit_fut._RecordFunction(handle, future)
    return _Record(None, future)


def end_record(record: Any) -> None:
    """End an event :func:`begin_record` began (on whichever thread the op ended).

    Example:
        >>> end_record(begin_record("gloo:broadcast", (), {}))
    """
    if record.future is not None:
        record.future.set_result(None)
    else:
        record.fast.__exit__(None, None, None)
