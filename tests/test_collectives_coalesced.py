"""Coalesced collectives equal the per-tensor ops, on real gloo groups of 2 and 3 ranks."""

from __future__ import annotations

import pytest
import torch

import distcompat.distributed as dist
from distcompat.collectives import (
    all_reduce,
    all_reduce_coalesced,
    reduce_scatter_coalesced,
    reduce_scatter_tensor,
)
from distcompat.testing import run_on_ranks

R = dist.ReduceOp


def _mixed(rank: int, count: int = 12) -> list[torch.Tensor]:
    """Small-integer tensors of mixed dtypes, shapes and layouts (exact in every dtype)."""
    gen = torch.Generator().manual_seed(rank)
    out = []
    for i in range(count):
        base = torch.randint(0, 4, (3, 4), generator=gen)
        kind = i % 4
        if kind == 0:
            out.append(base.float())
        elif kind == 1:
            out.append(base.t().to(torch.int64))  # transposed view
        elif kind == 2:
            out.append(base > 1)  # bool
        else:
            out.append(base.double()[0])  # a row view with an offset
    return out


def _compare(op_name: str, async_op: bool) -> bool:
    op = getattr(R, op_name)
    rank = dist.get_rank()
    coalesced, single = _mixed(rank), _mixed(rank)
    if op_name == "AVG":  # AVG is defined for floats only
        coalesced = [t for t in coalesced if t.is_floating_point()]
        single = [t for t in single if t.is_floating_point()]
    work = all_reduce_coalesced(coalesced, op=op, async_op=async_op)
    if work is not None:
        assert work.get_future().wait() == coalesced
    for t in single:
        all_reduce(t, op=op)
    return all(torch.equal(a, b) for a, b in zip(coalesced, single, strict=True))


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("op_name", ["SUM", "MAX", "AVG"])
@pytest.mark.parametrize("async_op", [False, True])
def test_all_reduce_coalesced_equals_per_tensor(
    world_size: int, op_name: str, async_op: bool
) -> None:
    assert run_on_ranks(_compare, world_size, args=(op_name, async_op)) == [True] * world_size


def _compare_reduce_scatter(async_op: bool) -> bool:
    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    shapes = [(2, 3), (5,), (), (1, 1, 4)]
    inputs = [torch.randint(0, 9, (world, *s), generator=gen).float() for s in shapes]
    inputs.append(torch.randint(0, 9, (world * 3,), generator=gen))  # an int64 bucket too
    outputs = [torch.empty(s) for s in shapes] + [torch.empty(3, dtype=torch.int64)]
    work = reduce_scatter_coalesced(outputs, inputs, op=R.SUM, async_op=async_op)
    if work is not None:
        work.wait()
    expected = [torch.empty_like(o) for o in outputs]
    for out, inp in zip(expected, inputs, strict=True):
        reduce_scatter_tensor(out, inp, op=R.SUM)
    return all(torch.equal(a, b) for a, b in zip(outputs, expected, strict=True))


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("async_op", [False, True])
def test_reduce_scatter_coalesced_equals_per_tensor(world_size: int, async_op: bool) -> None:
    assert (
        run_on_ranks(_compare_reduce_scatter, world_size, args=(async_op,)) == [True] * world_size
    )


def test_mismatched_sizes_are_named() -> None:
    with pytest.raises(ValueError, match="2 outputs but 1 inputs"):
        reduce_scatter_coalesced([torch.empty(1), torch.empty(1)], [torch.empty(1)])
    with pytest.raises(ValueError, match=r"inputs\[0\] is torch.int64 but outputs\[0\] is"):
        reduce_scatter_coalesced([torch.empty(1)], [torch.ones(1, dtype=torch.int64)])
