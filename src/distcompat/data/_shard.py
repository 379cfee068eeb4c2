"""Which indices of ``range(n)`` a rank owns, in four documented modes.

The two lines a user writes::

    mine = shard_indices(len(dataset), rank, world_size, mode="pad")   # same count on every rank
    for i in mine: ...

Modes, for ``n`` items over ``world_size`` ranks:

* ``"strided"``: rank ``r`` gets ``r, r + W, r + 2W, ...`` (``index % world_size == rank``);
  every index exactly once; counts differ by at most one.
* ``"contiguous"``: rank ``r`` gets one block; the first ``n % W`` ranks get one extra item; every
  index exactly once; counts differ by at most one.
* ``"pad"``: strided over ``ceil(n / W) * W`` positions; position ``p >= n`` repeats index
  ``p % n``; every index at least once; every rank gets the same count
  (``DistributedSampler(drop_last=False)``).
* ``"drop"``: strided over the first ``floor(n / W) * W`` indices; the tail is dropped; every rank
  gets the same count (``DistributedSampler(drop_last=True)``).

A shard that would be empty raises :class:`EmptyShardError` on EVERY rank (each rank can compute
every other rank's count), so no rank walks on into a collective that the empty rank never joins.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Literal, get_args

__all__ = ["MODES", "EmptyShardError", "ShardMode", "shard_indices", "shard_sizes"]

ShardMode = Literal["strided", "contiguous", "pad", "drop"]
MODES: tuple[str, ...] = get_args(ShardMode)


class EmptyShardError(ValueError):
    """A rank would get no data, so it would leave the others waiting in their next collective."""


def _as_int(value: object, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got the bool {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None


def check_world(rank: object, world_size: object) -> tuple[int, int]:
    """Validate ``(rank, world_size)``; return them as ints (errors name the value and the rule)."""
    world = _as_int(world_size, "world_size")
    if world < 1:
        raise ValueError(f"world_size must be >= 1, got {world}")
    r = _as_int(rank, "rank")
    if not 0 <= r < world:
        raise ValueError(f"rank must be in [0, world_size={world}), got {r}")
    return r, world


def check_mode(mode: object) -> ShardMode:
    """Return ``mode`` if it is one of :data:`MODES`, else raise ValueError naming it."""
    if mode not in MODES:
        raise ValueError(f"unknown shard mode {mode!r}; expected one of {', '.join(MODES)}")
    return mode  # type: ignore[return-value]


def positions_limit(n: int, world_size: int, mode: ShardMode) -> int:
    """Return how many strided positions a mode walks: padded up, cut down, or ``n`` itself."""
    if mode == "pad":
        return -(-n // world_size) * world_size
    if mode == "drop":
        return n // world_size * world_size
    return n


def shard_sizes(n: int, world_size: int, *, mode: ShardMode = "strided") -> list[int]:
    """How many items each rank gets: ``shard_sizes(n, W, mode=m)[r] == len(shard_indices(...))``.

    Example:
        >>> shard_sizes(10, 3), shard_sizes(10, 3, mode="pad"), shard_sizes(10, 3, mode="drop")
        ([4, 3, 3], [4, 4, 4], [3, 3, 3])
    """
    n = _as_int(n, "n")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    _, world = check_world(0, world_size)
    mode = check_mode(mode)
    if mode in ("pad", "drop"):
        return [positions_limit(n, world, mode) // world] * world
    base, extra = divmod(n, world)
    return [base + (1 if r < extra else 0) for r in range(world)]


def _check_nonempty(sizes: list[int], n: int, mode: str) -> None:
    empty = [r for r, size in enumerate(sizes) if size == 0]
    if not empty:
        return
    shown = ", ".join(map(str, empty[:8])) + (", ..." if len(empty) > 8 else "")
    raise EmptyShardError(
        f"{n} item(s) over world_size={len(sizes)} in mode {mode!r} leave rank(s) {shown} with no "
        "data; such a rank would leave the others waiting in their next collective. Use fewer "
        "ranks, more data (or smaller units: row groups, windows), mode='pad', or pass "
        "allow_empty=True if that rank really has nothing to do"
    )


def shard_indices(
    n: int,
    rank: int,
    world_size: int,
    *,
    mode: ShardMode = "strided",
    allow_empty: bool = False,
) -> Sequence[int]:
    """Return the indices of ``range(n)`` that ``rank`` owns (see the module docstring for modes).

    The result is a ``range`` for every mode but ``"pad"`` with wrapping (a list then), so
    sharding a billion indices costs nothing. Who gets what for ``n=10, world_size=3``::

        strided     r0: 0 3 6 9   r1: 1 4 7     r2: 2 5 8
        contiguous  r0: 0 1 2 3   r1: 4 5 6     r2: 7 8 9
        pad         r0: 0 3 6 9   r1: 1 4 7 0   r2: 2 5 8 1
        drop        r0: 0 3 6     r1: 1 4 7     r2: 2 5 8

    Args:
        n: number of items (``len(dataset)``, number of files, row groups...).
        rank: this rank, in ``[0, world_size)``.
        world_size: number of ranks, ``>= 1``.
        mode: ``"strided"``, ``"contiguous"``, ``"pad"`` or ``"drop"``.
        allow_empty: return an empty shard instead of raising when some rank gets nothing.

    Raises:
        EmptyShardError: some rank (not necessarily this one) would get no item; raised on every
            rank alike so that none goes on to wait for the empty one.
        ValueError: ``n < 0``, ``world_size < 1``, ``rank`` out of range or an unknown mode.

    Example:
        >>> list(shard_indices(10, 1, 3, mode="pad"))
        [1, 4, 7, 0]
        >>> shard_indices(2, 0, 3)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        distcompat.data._shard.EmptyShardError: 2 item(s) over world_size=3 in mode 'strided' ...
    """
    n = _as_int(n, "n")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rank, world = check_world(rank, world_size)
    mode = check_mode(mode)
    sizes = shard_sizes(n, world, mode=mode)
    if not allow_empty:
        _check_nonempty(sizes, n, mode)
    if mode == "contiguous":
        start = sum(sizes[:rank])
        return range(start, start + sizes[rank])
    limit = positions_limit(n, world, mode)
    if limit <= n:
        return range(rank, limit, world)
    return [p % n for p in range(rank, limit, world)]
