"""shard_indices modes and the stream/file/row-group sharders: coverage, even counts, no empty rank.

Properties are checked against a rule written independently here (who gets index i), for random n,
world sizes 1-8 and every mode.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distcompat.data import (
    EmptyShardError,
    RowGroup,
    ShardMode,
    shard_files,
    shard_indices,
    shard_iterable,
    shard_row_groups,
    shard_sizes,
)

sizes = st.integers(0, 200)
worlds = st.integers(1, 8)
MODE_LIST: list[ShardMode] = ["strided", "contiguous", "pad", "drop"]
modes = st.sampled_from(MODE_LIST)


def _all_shards(n: int, world: int, mode: ShardMode) -> list[list[int]]:
    return [list(shard_indices(n, r, world, mode=mode, allow_empty=True)) for r in range(world)]


@given(sizes, worlds, modes)
def test_union_covers_every_index_and_counts_match_shard_sizes(
    n: int, world: int, mode: ShardMode
) -> None:
    shards = _all_shards(n, world, mode)
    seen = Counter(i for shard in shards for i in shard)
    assert [len(s) for s in shards] == shard_sizes(n, world, mode=mode)
    assert all(0 <= i < n for i in seen)
    if mode in ("strided", "contiguous"):  # exactly once
        assert seen == Counter(range(n))
    elif mode == "pad":  # at least once; only whole rounds' worth of extras
        assert set(seen) == set(range(n))
        assert sum(seen.values()) == -(-n // world) * world
    else:  # drop: at most once, exactly the first floor(n/W)*W
        assert seen == Counter(range(n // world * world))


@given(sizes, worlds, modes)
def test_counts_are_equal_where_promised(n: int, world: int, mode: ShardMode) -> None:
    counts = [len(s) for s in _all_shards(n, world, mode)]
    if mode in ("pad", "drop"):
        assert len(set(counts)) == 1
    else:
        assert max(counts) - min(counts) <= 1


@given(sizes, worlds)
def test_strided_is_index_mod_world(n: int, world: int) -> None:
    for r, shard in enumerate(_all_shards(n, world, "strided")):
        assert list(shard) == [i for i in range(n) if i % world == r]


@given(sizes, worlds)
def test_contiguous_blocks_are_in_order(n: int, world: int) -> None:
    flat = [i for shard in _all_shards(n, world, "contiguous") for i in shard]
    assert flat == list(range(n))


@given(sizes, worlds, modes)
def test_empty_rank_raises_on_every_rank_alike(n: int, world: int, mode: ShardMode) -> None:
    empty = min(shard_sizes(n, world, mode=mode)) == 0
    for r in range(world):
        if empty:
            with pytest.raises(EmptyShardError, match=f"world_size={world}"):
                shard_indices(n, r, world, mode=mode)
        else:
            shard_indices(n, r, world, mode=mode)


def test_picture_in_docs_n10_w3() -> None:
    expected: dict[ShardMode, list[list[int]]] = {
        "strided": [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]],
        "contiguous": [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]],
        "pad": [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]],
        "drop": [[0, 3, 6], [1, 4, 7], [2, 5, 8]],
    }
    for mode, shards in expected.items():
        assert _all_shards(10, 3, mode) == shards


def test_pad_wraps_more_than_once_when_n_is_below_world() -> None:
    assert _all_shards(2, 5, "pad") == [[0], [1], [0], [1], [0]]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"n": -1, "rank": 0, "world_size": 1}, ValueError, "n must be >= 0, got -1"),
        ({"n": 4, "rank": 0, "world_size": 0}, ValueError, "world_size must be >= 1, got 0"),
        ({"n": 4, "rank": 3, "world_size": 3}, ValueError, r"rank must be in \[0, world_size=3\)"),
        ({"n": 4, "rank": -1, "world_size": 3}, ValueError, "got -1"),
        ({"n": 4, "rank": 0, "world_size": 1, "mode": "zigzag"}, ValueError, "'zigzag'"),
        ({"n": 4.0, "rank": 0, "world_size": 1}, TypeError, "n must be an int"),
        ({"n": 4, "rank": True, "world_size": 2}, TypeError, "rank must be an int"),
    ],
)
def test_invalid_inputs_name_the_value(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        shard_indices(**kwargs)


def test_allow_empty_returns_an_empty_shard() -> None:
    assert list(shard_indices(1, 1, 2, allow_empty=True)) == []


def test_large_n_is_lazy() -> None:
    shard = shard_indices(10**12, 3, 8)
    assert isinstance(shard, range)
    assert len(shard) == 10**12 // 8


# --- files and row groups --------------------------------------------------------------------


def test_file_list_with_fewer_row_groups_than_ranks_raises_clearly() -> None:
    # nanochat's case: 2 parquet files of 1 row group each, 4 ranks -> ranks 2, 3 would spin
    for rank in range(4):
        with pytest.raises(EmptyShardError, match=r"2 file\(s\) hold 2 row group\(s\)"):
            shard_row_groups([1, 1], rank, 4)


@given(st.lists(st.integers(0, 6), min_size=1, max_size=6), worlds, modes)
def test_row_groups_cover_every_group(counts: list[int], world: int, mode: ShardMode) -> None:
    total = sum(counts)
    if min(shard_sizes(total, world, mode=mode)) == 0:
        with pytest.raises(EmptyShardError):
            shard_row_groups(counts, 0, world, mode=mode)
        return
    every = [RowGroup(file=f, row_group=g) for f, c in enumerate(counts) for g in range(c)]
    for rank in range(world):
        mine = shard_row_groups(counts, rank, world, mode=mode)
        assert mine == [every[i] for i in shard_indices(total, rank, world, mode=mode)]


def test_row_group_counts_are_validated() -> None:
    with pytest.raises(ValueError, match=r"row_group_counts\[1\] must be an int >= 0, got -2"):
        shard_row_groups([3, -2], 0, 1)


def test_shard_files_keeps_the_items() -> None:
    assert shard_files(["a", "b", "c"], 0, 2, mode="contiguous") == ["a", "b"]
    with pytest.raises(EmptyShardError):
        shard_files([], 0, 1)


def test_parquet_counts_read_the_footer(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow", reason="optional: the ImportError path is tested below")
    pq = pytest.importorskip("pyarrow.parquet")
    from distcompat.data import parquet_row_group_counts

    path = tmp_path / "three.parquet"
    pq.write_table(pa.table({"x": list(range(30))}), path, row_group_size=10)
    assert parquet_row_group_counts([path]) == [3]


def test_parquet_counts_without_pyarrow_raise_a_clear_import_error() -> None:
    if importlib.util.find_spec("pyarrow") is not None:
        pytest.skip("pyarrow is installed")
    from distcompat.data import parquet_row_group_counts

    with pytest.raises(ImportError, match="pass the row-group counts as ints"):
        parquet_row_group_counts(["x.parquet"])


# --- streams ---------------------------------------------------------------------------------


@given(sizes, worlds, st.sampled_from(MODE_LIST).filter(lambda m: m != "contiguous"))
def test_stream_shards_equal_index_shards(n: int, world: int, mode: ShardMode) -> None:
    items = [f"x{i}" for i in range(n)]
    empty = min(shard_sizes(n, world, mode=mode)) == 0
    for rank in range(world):
        stream = shard_iterable(iter(items), rank, world, mode=mode)
        if empty:
            with pytest.raises(EmptyShardError, match=f"held {n} item"):
                list(stream)
            continue
        expected = [items[i] for i in shard_indices(n, rank, world, mode=mode)]
        assert list(stream) == expected


def test_stream_is_lazy() -> None:
    def endless() -> Iterator[int]:
        i = 0
        while True:
            yield i
            i += 1

    stream = shard_iterable(endless(), 1, 3, mode="drop")
    assert [next(stream) for _ in range(3)] == [1, 4, 7]


def test_stream_refuses_contiguous() -> None:
    with pytest.raises(ValueError, match="length is unknown"):
        shard_iterable([1, 2], 0, 1, mode="contiguous")


@settings(max_examples=20)
@given(worlds)
def test_stream_with_fewer_items_than_ranks_raises_on_every_rank(world: int) -> None:
    n = world - 1
    for rank in range(world):
        with pytest.raises(EmptyShardError):
            list(shard_iterable(range(n), rank, world))
