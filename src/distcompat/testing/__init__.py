"""Run a function on every rank of a real process group, from a test or a notebook.

The two lines a test writes::

    from distcompat.testing import run_on_ranks
    assert run_on_ranks(my_rank_fn, world_size=2) == [value_on_rank0, value_on_rank1]

``my_rank_fn`` must be importable by the rank processes (a module-level function). Inside it the
default group already exists, created by :func:`distcompat.init_distributed` from a torchrun-style
environment, so ``distcompat.get_rank()`` and every ``torch.distributed`` call work as under
torchrun. The ranks stay warm between calls with the same world size and backend.

For pytest, enable the plugin (``pytest_plugins = ["distcompat.testing.pytest_plugin"]`` in a
``conftest.py``, or ``-p distcompat.testing.pytest_plugin``) to get the ``run_on_ranks`` fixture.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from distcompat.testing._pool import RankFailedError, RankTimeoutError, get_pool, shutdown_pools

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "RankFailedError",
    "RankTimeoutError",
    "run_on_ranks",
    "shutdown_pools",
]

T = TypeVar("T")

#: Seconds a call may take before its ranks are killed (and the process-group timeout inside).
DEFAULT_TIMEOUT_S = 120.0


def run_on_ranks(
    fn: Callable[..., T],
    world_size: int = 2,
    *,
    backend: str = "gloo",
    timeout: float = DEFAULT_TIMEOUT_S,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
) -> list[T]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return each rank's value, in order.

    A rank that raises makes this raise :class:`RankFailedError` naming the rank, with its remote
    traceback; ranks still running ``timeout`` seconds after the call began are made to dump their
    stacks, killed with the rest of the pool, and reported in :class:`RankTimeoutError`.

    Example:
        >>> import distcompat
        >>> run_on_ranks(distcompat.get_rank, world_size=2)
        [0, 1]
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    if timeout <= 0:
        raise ValueError(f"timeout={timeout} must be positive")
    pool = get_pool(world_size, backend, group_timeout_s=DEFAULT_TIMEOUT_S)
    return pool.run(fn, args, kwargs or {}, timeout)
