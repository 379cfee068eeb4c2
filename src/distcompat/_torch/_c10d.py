"""torch's private c10d names: the default group's store and record, Work from a future, ...

Each function says what it reaches and on which releases (:data:`~distcompat._torch.INTERNALS`
holds the table docs/torch_versions.md shows). The same names serve torch 2.9 through 2.15;
where a later release renames one, the function here is what changes.

Example:
    >>> default_group() is None   # no default group in this process
    True
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d_ext
from torch.distributed import c10d_logger as _c10d_logger
from torch.distributed import distributed_c10d as _c10d
from torch.distributed.algorithms import join as _join

__all__ = [
    "AllgatherOptions",
    "backend_timeout_s",
    "caller_files",
    "create_work_from_future",
    "default_group",
    "default_store",
    "end_coalescing",
    "premul_sum",
    "register_cpu_backend",
    "start_coalescing",
]

#: The options object gloo's allgather takes (public in C++, not re-exported by torch.distributed).
AllgatherOptions = _c10d_ext.AllgatherOptions


class _ViaProperty:
    """Stands in for torch's ``_world`` where that has no ``_default_pg``: the public property."""

    @property
    def _default_pg(self) -> Any:
        return dist.GroupMember.WORLD


_RECORD: Any = (
    _c10d._world if hasattr(getattr(_c10d, "_world", None), "_default_pg") else _ViaProperty()
)

#: The default group or None, read from torch's own record without the two property calls of
#: ``GroupMember.WORLD`` (1.5-3 us of a tiny call right after a wait, benchmarks/README.md): a
#: C-level ``getattr``, no Python frame. tests/test_torch.py checks both name the same group.
default_group: Any = functools.partial(getattr, _RECORD, "_default_pg")


def default_store() -> dist.Store:
    """Return the default group's rendezvous store (torch keeps it privately).

    Raises torch's ``ValueError``/``RuntimeError`` when there is no default group.

    Example:
        >>> default_store()  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Default process group has not been initialized...
    """
    store: dist.Store = _c10d._get_default_store()
    return store


def create_work_from_future(future: torch.futures.Future[Any]) -> dist.Work:
    """Return a native ``Work`` over ``future`` (one C++ code can hold after Python lets go).

    Example:
        >>> future = torch.futures.Future()
        >>> future.set_result([torch.ones(1)])
        >>> create_work_from_future(future).wait()
        True
    """
    extension: Any = _c10d_ext  # the stubs of some releases omit the name
    work: dist.Work = extension._create_work_from_future(future)
    return work


def register_cpu_backend(group: dist.ProcessGroup, backend: Any) -> None:
    """Make gloo ``backend`` ``group``'s CPU backend and its default one (C++ calls reach it).

    Example:
        >>> from datetime import timedelta
        >>> store = dist.HashStore()
        >>> gloo = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=5))
        >>> group = dist.ProcessGroup(0, 1)
        >>> register_cpu_backend(group, gloo)
        >>> backend_timeout_s(group)
        5.0
    """
    kind = dist.ProcessGroup.BackendType.GLOO
    group._register_backend(torch.device("cpu"), kind, backend)
    group._set_default_backend(kind)


def start_coalescing(backend: Any) -> None:
    """Start coalescing on ``backend`` (torch 2.14+'s trampoline asks a Python group for it).

    gloo raises torch's own "does not implement startCoalescing", as torch's group does.

    Example:
        >>> from datetime import timedelta
        >>> gloo = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=5))
        >>> start_coalescing(gloo)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        RuntimeError: Backend gloo does not implement startCoalescing...
    """
    backend._start_coalescing()


def end_coalescing(backend: Any) -> Any:
    """End coalescing on ``backend``; return its Work (gloo: torch's "does not implement").

    Example:
        >>> callable(end_coalescing)
        True
    """
    return backend._end_coalescing()


def backend_timeout_s(group: Any) -> float | None:
    """Return ``group``'s own timeout in seconds (its CPU backend's options), or None.

    torch keeps it privately (``options._timeout``): None where this torch does not say.

    Example:
        >>> backend_timeout_s(None) is None
        True
    """
    try:
        options = group._get_backend(torch.device("cpu")).options
        return float(options._timeout.total_seconds())
    except (AttributeError, RuntimeError, ValueError):
        return None


def premul_sum(factor: Any) -> dist.ReduceOp:
    """Return ``ReduceOp.PREMUL_SUM`` with ``factor`` (callable in torch 2.13+; the maker before).

    Example:
        >>> premul_sum(2.0).op == dist.ReduceOp.PREMUL_SUM
        True
    """
    kind: Any = dist.ReduceOp.PREMUL_SUM  # callable with a factor from 2.13 (stubs differ)
    try:
        op: dist.ReduceOp = kind(factor)
    except TypeError:
        op = dist._make_nccl_premul_sum(factor)
    return op


@functools.cache
def caller_files() -> tuple[str, str, str]:
    """Return the files of torch's Python collectives, its logging wrapper, and its Join.

    The protected group tells by them who called it: ``torch.distributed``'s functions (then a
    handle goes back to Python), their logging wrapper (skipped), and Join, which hands the Work
    on to DDP's C++ reducer.

    Example:
        >>> caller_files()[0].endswith("distributed_c10d.py")
        True
    """
    return (str(_c10d.__file__), str(_c10d_logger.__file__), str(_join.__file__))
