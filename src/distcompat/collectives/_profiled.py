"""The torch profiler's events of distcompat's collectives: the caller's as gloo's, its own apart.

gloo records one event per collective: begun on the calling thread, ended on its worker thread
when the op completes (so the profiler marks it async), with the shapes of the tensors it was
given, under ``gloo:<collective>``. Profiler tables, traces, torch's own distributed tests and
users' tooling look for those names. A group whose CPU collectives take shared memory says its
backend is gloo, so its events must look the same: while torch's profiler records on the calling
thread, the engine runs each op on its group's thread instead of in place and records this
event around it (``Engine.work``)::

    record = begin("all_reduce", (tensor,))   # None while no profiler records
    ...                                      # the op runs on the group's thread
    end(record)                              # there, when the op ends

The event's keyword inputs say ``{"path": "shared memory"}``, so a trace still tells the two
paths apart. A profiler on one rank only changes nothing the others see: the ops, their order
and their barriers are the same on whichever thread they run.

distcompat's own exchanges (the mismatch check of a new call) are not the caller's
collectives: plain gloo has none, so they must not count as one. Inside :func:`internal` they
record one event named ``distcompat:<what>`` and none of gloo's.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from distcompat import _torch

__all__ = ["TITLES", "begin", "end", "internal", "recording", "showing"]

#: The event gloo records for each op the path runs (measured on torch 2.13: gloo runs a
#: reduce-scatter as one all-reduce of the whole input, and records it so).
TITLES = {
    "all_reduce": "gloo:all_reduce",
    "broadcast": "gloo:broadcast",
    "all_gather_into_tensor": "gloo:all_gather",
    "all_gather": "gloo:all_gather",
    "reduce_scatter_tensor": "gloo:all_reduce",
    "reduce_scatter": "gloo:all_reduce",
}
_PATH = {"path": "shared memory"}

#: Whether torch's profiler records on this thread (about 30 ns).
recording = _torch.profiler_enabled

_shown = threading.local()  # .tensors: what a caller that splits its call into ops was given


@contextlib.contextmanager
def showing(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Inside the block, events show ``tensors``' shapes, not those of the ops' own buffers.

    For callers that pack their tensors into one buffer (a coalesced all-reduce): gloo's event
    shows the tensors it was handed. Nothing is kept while no profiler records.

    Example:
        >>> with showing([torch.ones(2, 3), torch.ones(4)]):
        ...     pass
    """
    if not recording() or getattr(_shown, "tensors", None) is not None:
        yield  # an outer caller's tensors win
        return
    _shown.tensors = tuple(tensors)
    try:
        yield
    finally:
        _shown.tensors = None


def begin(op: str, shown: Sequence[torch.Tensor]) -> Any:
    """Begin ``op``'s event on this thread (the caller's), showing ``shown``'s shapes.

    Call only while :func:`recording`. The record ends where :func:`end` is called: on the
    group's thread, as gloo's does on its worker.

    Example:
        >>> end(begin("all_reduce", (torch.ones(2),)))
    """
    inputs = getattr(_shown, "tensors", None) or tuple(shown)
    return _torch.begin_record(TITLES.get(op, f"gloo:{op}"), inputs, _PATH)


def end(record: Any) -> None:
    """End an event :func:`begin` began (on whichever thread the op ended).

    Example:
        >>> end(begin("broadcast", ()))
    """
    _torch.end_record(record)


@contextlib.contextmanager
def internal(what: str) -> Iterator[None]:
    """Inside the block, distcompat's own collectives record one ``distcompat:<what>`` event.

    The backend's events of the ops issued inside (gloo records one per op, on the issuing
    thread) are not recorded: torch's record functions are off on this thread for the block.
    Nothing changes while no profiler records.

    Example:
        >>> with internal("mismatch check"):
        ...     pass
    """
    if not recording():
        yield
        return
    with _torch.RecordFunctionFast(f"distcompat:{what}"):
        _torch.enable_record_function(False)
        try:
            yield
        finally:
            _torch.enable_record_function(True)
