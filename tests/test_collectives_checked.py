"""Checked mode on real gloo groups: mismatched collectives raise on every rank, naming both."""

from __future__ import annotations

import pytest
import torch

import distcompat.distributed as dist
from distcompat.collectives import CollectiveMismatchError, checked
from distcompat.testing import RankFailedError, run_on_ranks


def _agreeing() -> list[float]:
    world = dist.get_world_size()
    with checked():
        value = torch.ones(3)
        dist.all_reduce(value)
        dist.broadcast(value, src=0)
        out = torch.empty(world * 3)
        dist.all_gather_into_tensor(out, value)
        got = torch.empty(world)
        dist.all_to_all_single(got, torch.arange(world, dtype=torch.float32))
        dist.barrier()
    return [value.sum().item(), out.sum().item(), got.sum().item()]


@pytest.mark.parametrize("world_size", [2, 3])
def test_agreeing_calls_pass_and_stay_correct(world_size: int) -> None:
    w = float(world_size)
    for rank, (reduced, gathered, exchanged) in enumerate(run_on_ranks(_agreeing, world_size)):
        assert reduced == 3 * w  # three elements, each summed over w ranks
        assert gathered == 3 * w * w  # w copies of that
        assert exchanged == rank * w  # every rank sends the value r to rank r


def _mismatch(kind: str) -> str:
    rank = dist.get_rank()
    with checked(timeout=10):
        try:
            if kind == "dtype":
                dist.all_reduce(torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64))
            elif kind == "op":
                if rank == 0:
                    dist.all_reduce(torch.ones(4))
                else:
                    dist.broadcast(torch.ones(4), src=0)
            elif kind == "reduce_op":
                op = dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX
                dist.all_reduce(torch.ones(4), op=op)
            elif kind == "root":
                dist.broadcast(torch.ones(4), src=rank)
            elif kind == "shape":
                dist.all_reduce(torch.ones(4 if rank == 0 else 5))
            elif kind == "splits":
                world = dist.get_world_size()
                sizes = [1] * world
                out_sizes = [2 if rank == 0 else 1] * world  # rank 0 expects too much
                dist.all_to_all_single(
                    torch.empty(sum(out_sizes)), torch.ones(world), out_sizes, sizes
                )
        except CollectiveMismatchError as exc:
            return str(exc)
    return "no error"


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("dtype", ["dtype=torch.float32", "dtype=torch.float64"]),
        ("op", ["op=all_reduce", "op=broadcast"]),
        ("reduce_op", ["ranks disagree"]),
        ("root", ["root=0", "root=1"]),
        ("shape", ["numel=4", "numel=5"]),
        ("splits", ["expects 2"]),
    ],
)
def test_mismatch_raises_on_every_rank(kind: str, words: list[str]) -> None:
    for message in run_on_ranks(_mismatch, 2, args=(kind,)):
        assert "call #" in message
        for word in words:
            assert word in message, message


def _only_rank_zero_calls() -> None:
    with checked(timeout=2):
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(1))  # the classic `if rank == 0:` collective


def test_rank_conditional_collective_is_caught() -> None:
    with pytest.raises(RankFailedError, match="not every rank reached it within 2s") as info:
        run_on_ranks(_only_rank_zero_calls, 2, timeout=60)
    assert info.value.rank == 0
    assert isinstance(info.value.exception, CollectiveMismatchError)
