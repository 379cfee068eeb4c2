"""The multi-process harness itself, on real gloo groups."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import distcompat
from distcompat.testing import RankFailedError, RankTimeoutError, run_on_ranks

Runner = Callable[..., list[Any]]


def _identity() -> tuple[int, int, int]:
    return distcompat.get_rank(), distcompat.get_world_size(), os.getpid()


def _sum_ranks(offset: int, *, scale: int = 1) -> float:
    value = torch.tensor([float(dist.get_rank() + offset) * scale])
    dist.all_reduce(value)
    return value.item()


def _raise_on(rank: int) -> str:
    if dist.get_rank() == rank:
        raise ValueError(f"boom on rank {rank}")
    return "fine"


def _raise_while_peer_waits() -> None:
    if dist.get_rank() == 1:
        raise KeyError("rank 1 gave up")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that never comes


def _hang_on(rank: int) -> int:
    if dist.get_rank() == rank:
        time.sleep(600)
    return os.getpid()


def _exit_on(rank: int) -> None:
    if dist.get_rank() == rank:
        os._exit(3)


def _unpicklable_result() -> Any:
    return lambda: None


def _gone(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "zombie" in status


@pytest.mark.parametrize("world_size", [2, 3])
def test_values_come_back_in_rank_order(world_size: int) -> None:
    results = run_on_ranks(_identity, world_size)
    assert [r[0] for r in results] == list(range(world_size))
    assert {r[1] for r in results} == {world_size}
    pids = [r[2] for r in results]
    assert len(set(pids)) == world_size
    assert os.getpid() not in pids


def test_args_kwargs_and_collectives(run_on_ranks: Runner) -> None:
    assert run_on_ranks(_sum_ranks, 3, args=(1,), kwargs={"scale": 2}) == [12.0] * 3


def test_pool_is_reused_between_calls() -> None:
    first = [r[2] for r in run_on_ranks(_identity, 2)]
    second = [r[2] for r in run_on_ranks(_identity, 2)]
    assert first == second


def test_world_sizes_one_to_four_stay_warm_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls that alternate world sizes 1-4 keep every pool's processes. Past the limit (lowered
    here to 7 ranks, so that no larger pool is started) the least recently used pools close."""
    from distcompat.testing import _pool

    def pids() -> dict[int, list[int]]:
        return {world: [r[2] for r in run_on_ranks(_identity, world)] for world in (1, 2, 3, 4)}

    assert pids() == pids()  # used last: 4; least recently: 1
    monkeypatch.setattr(_pool, "_MAX_WARM_RANKS", 7)
    _pool._pools.pop((1, "gloo")).close()
    run_on_ranks(_identity, 1)  # 2 + 3 + 4 + 1 > 7: the pools of 2, then 3 are closed
    assert sorted(world for world, _ in _pool._pools) == [1, 4]


def test_raising_rank_names_rank_and_traceback() -> None:
    before = [r[2] for r in run_on_ranks(_identity, 2)]
    with pytest.raises(RankFailedError) as info:
        run_on_ranks(_raise_on, 2, args=(1,))
    error = info.value
    assert error.rank == 1
    assert "rank 1 raised builtins.ValueError: boom on rank 1" in str(error)
    assert "_raise_on" in error.remote_traceback
    assert isinstance(error.exception, ValueError)
    assert error.__cause__ is error.exception
    # Every rank answered, so the same processes carry on with a fresh group.
    after = [r[2] for r in run_on_ranks(_identity, 2)]
    assert after == before
    assert run_on_ranks(_sum_ranks, 2, args=(0,)) == [1.0, 1.0]


def test_raising_rank_with_a_stuck_peer_kills_the_pool() -> None:
    before = [r[2] for r in run_on_ranks(_identity, 2)]
    with pytest.raises(RankFailedError, match=r"rank 1 raised builtins\.KeyError") as info:
        run_on_ranks(_raise_while_peer_waits, 2, timeout=60)
    assert "rank 0: still running after a peer failed" in str(info.value)
    assert all(_gone(pid) for pid in before)
    assert run_on_ranks(_sum_ranks, 2, args=(0,)) == [1.0, 1.0]


def test_hanging_rank_is_named_and_killed() -> None:
    pids = [r[2] for r in run_on_ranks(_identity, 2)]
    started = time.monotonic()
    with pytest.raises(RankTimeoutError) as info:
        run_on_ranks(_hang_on, 2, args=(1,), timeout=3)
    assert time.monotonic() - started < 20
    error = info.value
    assert error.ranks == [1]
    assert "rank(s) 1 did not finish within 3s" in str(error)
    assert "_hang_on" in error.stacks[1]  # the hung rank's Python stack, from faulthandler
    assert all(_gone(pid) for pid in pids)
    assert [r[0] for r in run_on_ranks(_identity, 2)] == [0, 1]


def test_dying_rank_is_reported() -> None:
    with pytest.raises(
        RankFailedError, match=r"rank 1 raised the rank process died \(exit code 3\)"
    ):
        run_on_ranks(_exit_on, 2, args=(1,), timeout=60)
    assert [r[0] for r in run_on_ranks(_identity, 2)] == [0, 1]


def test_unpicklable_function_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="picklable function"):
        run_on_ranks(lambda: 1, 2)


def test_unpicklable_result_is_reported() -> None:
    with pytest.raises(RankFailedError, match="rank 0 raised"):
        run_on_ranks(_unpicklable_result, 2)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="world_size=0"):
        run_on_ranks(_identity, 0)
    with pytest.raises(ValueError, match="timeout=-1"):
        run_on_ranks(_identity, 2, timeout=-1)
