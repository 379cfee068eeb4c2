"""Single-rank regions: code only one rank runs, where a collective would hang the others.

The two lines a script writes::

    with distcompat.single_rank_region("saving on rank 0"):   # or @distcompat.rank_zero_only
        save(model)           # an all_reduce in here raises SingleRankCollectiveError at once

Inside a region any distcompat collective, and any ``torch.distributed`` collective called as
``dist.<name>(...)``, raises :class:`SingleRankCollectiveError` naming the call site instead of
waiting forever for ranks that never come. For torch.distributed the module's collective
attributes are swapped for checking wrappers while any thread is in a region (restored when the
last one leaves); the wrappers pass through for threads outside a region. Limit: a name bound
before the region (``from torch.distributed import all_reduce``) is the original function and is
not checked. At world size 1, or without a group, nothing can hang and nothing is refused.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from distcompat.diagnostics import _hooks

__all__ = ["COLLECTIVE_NAMES", "in_single_rank_region", "single_rank_region"]

#: The torch.distributed functions checked inside a region (those that exist in this torch).
COLLECTIVE_NAMES = (
    "all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
)  # fmt: skip

_originals: dict[str, Callable[..., Any]] = {}
_wrappers: dict[str, Callable[..., Any]] = {}


def _needs_check() -> bool:
    """Return True when a collective could hang: a group of more than one rank exists."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _wrapper(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def checked(*args: Any, **kwargs: Any) -> Any:
        if getattr(_hooks.local, "regions", None) and _needs_check():
            _hooks.region_check(f"torch.distributed.{name}")
        return original(*args, **kwargs)

    return checked


def _swap_in() -> None:
    for name in COLLECTIVE_NAMES:
        current = dist.__dict__.get(name)
        if current is None or current is _wrappers.get(name):
            continue
        _originals[name] = current
        _wrappers[name] = _wrapper(name, current)
        setattr(dist, name, _wrappers[name])


def _swap_out() -> None:
    for name, original in list(_originals.items()):
        if dist.__dict__.get(name) is _wrappers.get(name):  # leave anyone else's patch alone
            setattr(dist, name, original)
        del _originals[name]


def in_single_rank_region() -> bool:
    """Return whether this thread is inside a single-rank region.

    Example:
        >>> with single_rank_region():
        ...     in_single_rank_region()
        True
        >>> in_single_rank_region()
        False
    """
    return bool(getattr(_hooks.local, "regions", None))


@contextlib.contextmanager
def single_rank_region(label: str = "single_rank_region()") -> Iterator[None]:
    """Mark the block as run by one rank only: any collective in it raises at once.

    ``label`` appears in the error (what made the code single-rank). Regions nest and are per
    thread; other threads' collectives are unaffected.

    Example:
        >>> with single_rank_region("saving on rank 0"):
        ...     pass   # a collective here would raise SingleRankCollectiveError
    """
    regions: list[str] | None = getattr(_hooks.local, "regions", None)
    if regions is None:
        regions = _hooks.local.regions = []
    first_here = not regions
    regions.append(label)
    if first_here:
        with _hooks.state.lock:
            _hooks.state.region_threads += 1
            if _hooks.state.region_threads == 1:
                _swap_in()
                _hooks.refresh()
    try:
        yield
    finally:
        regions.pop()
        if first_here:
            with _hooks.state.lock:
                _hooks.state.region_threads -= 1
                if _hooks.state.region_threads == 0:
                    _swap_out()
                    _hooks.refresh()
