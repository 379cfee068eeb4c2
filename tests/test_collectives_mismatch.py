"""The default mismatch check on real gloo groups: no setting, no SIGABRT, an error on every rank.

Each rank function runs on a group of its own (the pool's group carries earlier tests' calls)
and first makes agreed calls, so that a rank whose call is already agreed is inside the backend
call when its peer checks a new one (the harder case); the call after the mismatch shows the
group is still usable.
"""

from __future__ import annotations

import pytest
import torch

import distcompat.distributed as dist
from distcompat.collectives import CollectiveMismatchError, unchecked
from distcompat.collectives.agree._state import ENV_VAR, _enabled_by_env
from distcompat.testing import run_on_ranks


def _disagree(kind: str, fresh: bool) -> tuple[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(ranks=list(range(world)))
    width = 16 if fresh else 4  # 16: a shape no earlier call used, so every rank checks
    for _ in range(3):  # agreed on every rank, also as the step after itself
        dist.all_reduce(torch.ones(4), group=group)
    try:
        if kind == "shape":
            dist.all_reduce(torch.ones(width if rank == 0 else width + 1), group=group)
        elif kind == "dtype":
            dtype = torch.float32 if rank == 0 else torch.float64
            dist.all_reduce(torch.ones(width, dtype=dtype), group=group)
        elif kind == "op":
            if rank == 0:
                dist.all_reduce(torch.ones(width), group=group)
            else:
                dist.broadcast(torch.ones(width), group=group, group_src=0)
        elif kind == "reduce_op":
            op = dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX
            dist.all_reduce(torch.ones(width), op=op, group=group)
        elif kind == "root":
            dist.broadcast(torch.ones(width), group=group, group_src=0 if rank == 0 else 1)
        message = "no error"
    except CollectiveMismatchError as exc:
        message = str(exc)
    after = torch.ones(2)
    dist.all_reduce(after, group=group)  # the group still works
    dist.destroy_process_group(group)
    return message, after.sum().item() / (2 * world)


def _reordered() -> str:
    """Two signatures both agreed before, called in a different order on the two sides."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(ranks=list(range(world)))
    bucket_a, bucket_b = torch.ones(8), torch.ones(12)
    for _ in range(2):  # a training loop's steps: a then b
        dist.all_reduce(bucket_a, group=group)
        dist.all_reduce(bucket_b, group=group)
    try:
        dist.all_reduce(bucket_a if rank == 0 else bucket_b, group=group)
        message = "no error"
    except CollectiveMismatchError as exc:
        message = str(exc)
    dist.all_reduce(torch.ones(2), group=group)
    dist.destroy_process_group(group)
    return message


def test_agreed_signatures_in_a_different_order_are_caught() -> None:
    for message in run_on_ranks(_reordered, 2, timeout=60):
        assert "shape=[8]" in message, message
        assert "shape=[12]" in message, message


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("fresh", [False, True], ids=["peer-inside-agreed-call", "all-check"])
@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("shape", ["shape=[{w}]", "shape=[{w1}]"]),
        ("dtype", ["dtype=torch.float32", "dtype=torch.float64"]),
        ("op", ["all_reduce, dtype=torch.float32", "broadcast, dtype=torch.float32"]),
        ("reduce_op", ["reduce_op=SUM", "reduce_op=MAX"]),
        ("root", ["root=0", "root=1"]),
    ],
)
def test_mismatch_raises_on_every_rank_by_default(
    kind: str, words: list[str], fresh: bool, world_size: int
) -> None:
    width = 16 if fresh else 4
    results = run_on_ranks(_disagree, world_size, args=(kind, fresh), timeout=60)
    for rank, (message, usable) in enumerate(results):
        assert "ranks disagree" in message, f"rank {rank}: {message}"
        for word in words:
            assert word.format(w=width, w1=width + 1) in message, message
        assert message.count("\n  rank ") == world_size  # one line per rank
        assert usable == 1.0


def _agreeing_calls() -> list[float]:
    world = dist.get_world_size()
    t = torch.ones(3)
    dist.all_reduce(t)  # the fast path once the group is known
    dist.broadcast(t, src=0)
    handle = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
    handle.wait()
    out = torch.empty(world)
    dist.all_to_all_single(out, torch.arange(world, dtype=torch.float32))
    with unchecked():
        dist.all_reduce(t)
    return [t.sum().item(), out.sum().item()]


@pytest.mark.parametrize("world_size", [2, 3])
def test_agreeing_calls_are_unchanged(world_size: int) -> None:
    for rank, (total, exchanged) in enumerate(run_on_ranks(_agreeing_calls, world_size)):
        assert total == 3 * world_size * world_size
        assert exchanged == rank * world_size


@pytest.mark.parametrize(
    ("value", "on"), [(None, True), ("on", True), ("1", True), ("off", False), ("0", False)]
)
def test_env_switch(value: str | None, on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Env parsing only (a unit test: no processes)."""
    if value is None:
        monkeypatch.delenv(ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(ENV_VAR, value)
    assert _enabled_by_env() is on


def test_env_switch_refuses_other_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match="DISTCOMPAT_MISMATCH_CHECK='sometimes'"):
        _enabled_by_env()
