"""Shard streams, file lists and parquet row groups over ranks, refusing to leave a rank empty.

The two lines a user writes::

    mine = shard_row_groups([f.num_row_groups for f in parquet_files], rank, world_size)
    for group in mine: table = parquet_files[group.file].read_row_group(group.row_group)

Why: a loader that hands one rank nothing leaves that rank idle (or spinning on an empty list)
while the others wait for it in the next collective, and the job hangs until the timeout. A file
list with fewer row groups than ranks is the classic case. Every function here computes every
rank's share and raises :class:`EmptyShardError` on every rank alike when one would be empty.

Row-group counts are plain ints, so this module needs no pyarrow; :func:`parquet_row_group_counts`
reads them with pyarrow when it is installed.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from distcompat.data._shard import (
    EmptyShardError,
    ShardMode,
    check_mode,
    check_world,
    shard_indices,
)

__all__ = [
    "RowGroup",
    "parquet_row_group_counts",
    "shard_files",
    "shard_iterable",
    "shard_row_groups",
]

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class RowGroup:
    """One parquet row group: the position of its file in the list, and its index in the file."""

    file: int
    row_group: int


def shard_files(
    files: Sequence[T], rank: int, world_size: int, *, mode: ShardMode = "strided"
) -> list[T]:
    """Return this rank's files (any sequence: paths, URLs, shard names) by :func:`shard_indices`.

    Raises:
        EmptyShardError: fewer files than ranks (in the chosen mode), on every rank alike.

    Example:
        >>> shard_files(["a", "b", "c", "d", "e"], 1, 2)
        ['b', 'd']
        >>> shard_files(["a"], 0, 2)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        distcompat.data._shard.EmptyShardError: 1 item(s) over world_size=2 ...
    """
    return [files[i] for i in shard_indices(len(files), rank, world_size, mode=mode)]


def shard_row_groups(
    row_group_counts: Sequence[int],
    rank: int,
    world_size: int,
    *,
    mode: ShardMode = "strided",
) -> list[RowGroup]:
    """Deal the row groups of a list of parquet files over ranks, in file order.

    The row groups of all files are numbered one after the other and sharded with
    :func:`shard_indices`, so a file with many row groups is split across ranks and a list of
    small files still gives every rank work.

    Args:
        row_group_counts: number of row groups of each file, as plain ints (pyarrow:
            ``pq.ParquetFile(path).num_row_groups``; or :func:`parquet_row_group_counts`).
        rank: this rank.
        world_size: number of ranks.
        mode: ``"strided"`` (default), ``"contiguous"``, ``"pad"`` or ``"drop"``.

    Raises:
        EmptyShardError: fewer row groups than ranks (for the mode): some rank would read nothing
            and leave the others waiting; raised on every rank alike.
        ValueError: a count is negative, or rank / world size / mode is invalid.

    Example:
        >>> shard_row_groups([2, 1], 1, 2)
        [RowGroup(file=0, row_group=1)]
        >>> shard_row_groups([1, 1], 2, 3)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        distcompat.data._shard.EmptyShardError: 2 file(s) hold 2 row group(s) in total, ...
    """
    counts = list(row_group_counts)
    for i, count in enumerate(counts):
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"row_group_counts[{i}] must be an int >= 0, got {count!r}")
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    total = starts[-1]
    try:
        mine = shard_indices(total, rank, world_size, mode=mode)
    except EmptyShardError as error:
        raise EmptyShardError(
            f"{len(counts)} file(s) hold {total} row group(s) in total, too few for "
            f"world_size={world_size} in mode {mode!r}: some rank would read nothing while the "
            f"others wait for it in their next collective ({error})"
        ) from None
    out: list[RowGroup] = []
    f = 0
    for g in mine:  # ascending except for pad wrap-arounds, which restart the walk
        if g < starts[f]:
            f = 0
        while starts[f + 1] <= g:
            f += 1
        out.append(RowGroup(file=f, row_group=g - starts[f]))
    return out


def shard_iterable(
    iterable: Iterable[T], rank: int, world_size: int, *, mode: ShardMode = "strided"
) -> Iterator[T]:
    """Yield this rank's items of a stream that every rank reads in full.

    Item ``i`` of the stream is dealt to rank ``i % world_size``.
    Modes: ``"strided"`` (every item once), ``"drop"`` (only whole rounds of ``world_size`` items:
    every rank yields the same count), ``"pad"`` (the last round is completed with items from the
    start of the stream: same count, everything at least once). ``"contiguous"`` needs the length
    up front: use :func:`shard_indices` on a sequence instead.

    Every rank reads the whole stream and keeps its slice, so this suits cheap streams; for large
    data shard the files or row groups instead.

    Raises:
        EmptyShardError: at the end of the stream, when some rank got no item (the stream had
            fewer items than ranks); raised on every rank alike, instead of a silent empty shard.

    Example:
        >>> list(shard_iterable(iter("abcde"), 0, 2)), list(shard_iterable(iter("abcde"), 1, 2))
        (['a', 'c', 'e'], ['b', 'd'])
        >>> list(shard_iterable(iter("abcde"), 1, 2, mode="pad"))
        ['b', 'd', 'a']
    """
    rank, world = check_world(rank, world_size)
    mode = check_mode(mode)
    if mode == "contiguous":
        raise ValueError(
            "shard_iterable cannot deal contiguous blocks: a stream's length is unknown until it "
            "ends; use shard_indices(len(seq), ...) on a sequence, or mode='strided'"
        )
    return _deal(iter(iterable), rank, world, mode)


def _deal(items: Iterator[T], rank: int, world: int, mode: ShardMode) -> Iterator[T]:
    head: list[T] = []  # the first `world` items: what "pad" completes the last round with
    held: list[T] = []  # this rank's item of the current round, until the round is whole
    n = 0
    for item in items:
        if n < world:
            head.append(item)
        if n % world == rank:
            if mode == "strided":
                yield item
            else:
                held.append(item)
        n += 1
        if held and n % world == 0:
            yield held.pop()
    tail = n % world
    if mode == "pad" and tail:  # position g = n - tail + rank wraps to g % n when g >= n
        yield held.pop() if held else head[(n - tail + rank) % n]
    if (n == 0) if mode == "pad" else (n < world):
        raise EmptyShardError(
            f"the stream held {n} item(s), too few for world_size={world} in mode {mode!r}: some "
            "rank got no item; raised on every rank alike so that none waits for an empty one"
        )


def parquet_row_group_counts(paths: Sequence[str | os.PathLike[str]]) -> list[int]:
    """Read each parquet file's row-group count from its footer (needs pyarrow).

    Raises:
        ImportError: pyarrow is not installed (distcompat does not depend on it; pass counts as
            ints to :func:`shard_row_groups` instead).

    Example:
        >>> parquet_row_group_counts(["shard_000.parquet"])  # doctest: +SKIP
        [12]
    """
    try:
        pq = importlib.import_module("pyarrow.parquet")
    except ImportError as error:
        raise ImportError(
            "parquet_row_group_counts needs pyarrow (pip install 'distcompat[parquet]'); "
            "without it, pass the row-group counts as ints to shard_row_groups"
        ) from error
    return [int(pq.ParquetFile(os.fspath(p)).metadata.num_row_groups) for p in paths]
