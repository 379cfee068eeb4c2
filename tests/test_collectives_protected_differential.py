"""Differential random programs: the protected group gives plain gloo's bits, whoever calls it.

Hypothesis draws a program, a sequence of collectives, each called one of the ways a job calls
its group: a distcompat function, a raw ``torch.distributed`` call, a functional collective, an
async handle waited late (several ops later, or at the end), a DDP step, a subgroup's call, a
DTensor redistributed through every placement, a tensor-parallel (column, then row) forward. Every
rank runs it twice in one ``run_on_ranks`` call, every default on: on the protected default group
(and a protected subgroup), and with torch's own functions on a plain gloo group of the same
ranks (``new_group(backend="gloo")``). The results must be bitwise equal, and the program must
finish within the call's timeout.

Values are small integers (as floats or int64), so every sum is exact in any order; DDP steps
run only on 2 ranks, where a two-term sum is the same in either order. More examples:
``DISTCOMPAT_DIFFERENTIAL_EXAMPLES=500 pytest tests/test_collectives_protected_differential.py``.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import pytest
import torch
import torch.distributed as tdist
import torch.distributed._functional_collectives as fc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import distcompat.distributed as dc
from distcompat.testing import run_on_ranks

EXAMPLES = int(os.environ.get("DISTCOMPAT_DIFFERENTIAL_EXAMPLES", "8"))

#: What each op may be called as on the protected side (the plain side always uses torch's).
FLAVORS = {
    "all_reduce": ("distcompat", "raw", "functional", "distcompat-late", "raw-late"),
    "broadcast": ("distcompat", "raw", "functional", "distcompat-late"),
    "all_gather": ("distcompat", "raw", "functional", "distcompat-late"),
    "reduce_scatter": ("distcompat", "raw", "functional", "distcompat-late"),
    "all_to_all": ("distcompat", "raw", "functional"),
    "subgroup_all_reduce": ("distcompat", "raw"),
    "ddp_step": ("ddp",),
    "dtensor": ("redistribute",),  # Shard(0) -> Replicate -> Shard(1); Partial -> Shard, Replicate
    "tensor_parallel": ("colwise-rowwise",),
}
OPS = {"SUM": tdist.ReduceOp.SUM, "MAX": tdist.ReduceOp.MAX, "MIN": tdist.ReduceOp.MIN}


def _step_strategy(world: int) -> st.SearchStrategy[tuple[Any, ...]]:
    names = [n for n in FLAVORS if world == 2 or n != "ddp_step"]
    return st.sampled_from(names).flatmap(
        lambda name: st.tuples(
            st.just(name),
            st.sampled_from(FLAVORS[name]),
            st.integers(1, 6),  # elements per rank's chunk
            st.sampled_from(["float32", "int64"]),
            st.sampled_from(sorted(OPS) if name.endswith("all_reduce") else ["SUM"]),
            st.integers(0, world - 1),  # broadcast root
        )
    )


def _values(rank: int, index: int, count: int, dtype: str) -> torch.Tensor:
    """Small integers that differ per rank and step (exact in float32 and int64)."""
    base = torch.arange(count, dtype=torch.int64) * (rank + 2) - 3 * index + rank
    return base.to(getattr(torch, dtype))


class _Pending:
    """Async handles waited late: each after ``delay`` more ops, or at the end."""

    def __init__(self) -> None:
        self.handles: list[tuple[int, Any]] = []

    def add(self, handle: Any, delay: int) -> None:
        self.handles.append((delay, handle))

    def tick(self) -> None:
        due = [h for d, h in self.handles if d <= 0]
        self.handles = [(d - 1, h) for d, h in self.handles if d > 0]
        for handle in due:
            handle.wait()

    def finish(self) -> None:
        for _, handle in self.handles:
            handle.wait()
        self.handles = []


def _ddp_step(rank: int, index: int, group: Any) -> list[torch.Tensor]:
    """One DDP step of a 4x4 linear layer with integer weights and inputs (2 ranks)."""
    layer = torch.nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.arange(16.0).view(4, 4) - index)
    model = torch.nn.parallel.DistributedDataParallel(layer, process_group=group)
    x = torch.arange(8.0).view(2, 4) + rank
    model(x).sum().backward()  # gradient: integer column sums, averaged over 2 ranks
    assert layer.weight.grad is not None
    return [layer.weight.grad.clone()]


def _dtensor(rank: int, index: int, count: int, mesh: Any) -> list[torch.Tensor]:
    """A DTensor through every placement change (functional collectives underneath)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    world = mesh.size()
    full = torch.arange(float(world * count * 2)).view(world * count, 2) - index
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    replicated = sharded.redistribute(mesh, [Replicate()])  # all-gather
    columns = replicated.redistribute(mesh, [Shard(1)])  # local
    mine = full * (rank + 1)
    partial = DTensor.from_local(mine, mesh, [Partial()])  # a sum still to be made
    scattered = partial.redistribute(mesh, [Shard(0)])  # reduce-scatter
    summed = partial.redistribute(mesh, [Replicate()])  # all-reduce
    return [x.to_local() for x in (replicated, columns, scattered, summed)]


def _tensor_parallel(rank: int, index: int, mesh: Any) -> list[torch.Tensor]:
    """A column-then-row parallel MLP's forward (integer weights: exact in any order)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    world = mesh.size()
    mlp = torch.nn.Sequential(
        torch.nn.Linear(4, 2 * world, bias=False), torch.nn.Linear(2 * world, 4, bias=False)
    )
    with torch.no_grad():
        for param in mlp.parameters():
            param.copy_(torch.arange(float(param.numel())).view(param.shape) % 5 - 2 + index)
    parallel = parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    return [parallel(torch.arange(8.0).view(2, 4) + rank).detach()]


def _run(program: list[tuple[Any, ...]], protected: bool, group: Any, pair: Any) -> str:
    """Run ``program`` on ``group`` (``pair``: ranks 0 and 1); return a digest of every result."""
    from torch.distributed.device_mesh import DeviceMesh

    rank, world = tdist.get_rank(), tdist.get_world_size()
    mesh = DeviceMesh.from_group(group, "cpu")
    results: list[torch.Tensor] = []
    pending = _Pending()
    for index, (name, flavor, count, dtype, op_name, root) in enumerate(program):
        flavor = flavor if protected else "raw"
        late = flavor.endswith("-late")
        api: Any = dc if flavor.startswith("distcompat") else tdist
        op = OPS[op_name]
        mine = _values(rank, index, count, dtype)
        if name == "all_reduce":
            if flavor == "functional":
                mine = fc.wait_tensor(fc.all_reduce(mine, op_name.lower(), group))  # type: ignore[no-untyped-call]
            else:
                handle = api.all_reduce(mine, op=op, group=group, async_op=late)
                if late:
                    pending.add(handle, index % 3)
            results.append(mine)
        elif name == "broadcast":
            if flavor == "functional":
                mine = fc.wait_tensor(fc.broadcast(mine, root, group))  # type: ignore[no-untyped-call]
            else:
                handle = api.broadcast(mine, src=root, group=group, async_op=late)
                if late:
                    pending.add(handle, index % 2)
            results.append(mine)
        elif name == "all_gather":
            out = torch.empty(count * world, dtype=mine.dtype)
            if flavor == "functional":
                out = fc.wait_tensor(fc.all_gather_tensor(mine, 0, group))  # type: ignore[no-untyped-call]
            else:
                handle = api.all_gather_into_tensor(out, mine, group=group, async_op=late)
                if late:
                    pending.add(handle, index % 3)
            results.append(out)
        elif name == "reduce_scatter":
            full = _values(rank, index, count * world, dtype)
            out = torch.empty(count, dtype=full.dtype)
            if flavor == "functional":
                out = fc.wait_tensor(fc.reduce_scatter_tensor(full, "sum", 0, group))  # type: ignore[no-untyped-call]
            else:
                handle = api.reduce_scatter_tensor(out, full, group=group, async_op=late)
                if late:
                    pending.add(handle, index % 2)
            results.append(out)
        elif name == "all_to_all":
            full = _values(rank, index, count * world, dtype)
            out = torch.empty_like(full)
            if flavor == "functional":
                out = fc.wait_tensor(fc.all_to_all_single(full, None, None, group))  # type: ignore[no-untyped-call]
            else:
                api.all_to_all_single(out, full, group=group)
            results.append(out)
        elif name == "subgroup_all_reduce":
            if rank < 2:
                api.all_reduce(mine, op=op, group=pair)
            results.append(mine)
        elif name == "ddp_step":
            results += _ddp_step(rank, index, group)
        elif name == "dtensor":
            results += _dtensor(rank, index, count, mesh)
        elif name == "tensor_parallel":
            results += _tensor_parallel(rank, index, mesh)
        pending.tick()
    pending.finish()
    digest = hashlib.sha256()
    for tensor in results:
        digest.update(str(tensor.dtype).encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def _both(program: list[tuple[Any, ...]]) -> tuple[str, str, bool]:
    """Run ``program`` on the protected default group and on a plain gloo group of its ranks."""
    world = tdist.get_world_size()
    default = tdist.group.WORLD
    protected_pair = tdist.new_group([0, 1])
    plain = tdist.new_group(list(range(world)), backend="gloo")
    plain_pair = tdist.new_group([0, 1], backend="gloo")
    try:
        got = _run(program, True, default, protected_pair)
        want = _run(program, False, plain, plain_pair)
    finally:
        for made in (protected_pair, plain, plain_pair):
            tdist.destroy_process_group(made)
    is_protected = hasattr(default, "protects") and not hasattr(plain, "protects")
    return got, want, is_protected


@pytest.mark.plain_gloo
@pytest.mark.parametrize("world", [2, 3])
def test_random_programs_give_plain_gloos_bits(world: int) -> None:
    """Hypothesis programs of 1-12 ops; see the module docstring for what they mix."""

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=EXAMPLES <= 8,  # CI: the same programs every run
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(st.lists(_step_strategy(world), min_size=1, max_size=12))
    def check(program: list[tuple[Any, ...]]) -> None:
        for got, want, is_protected in run_on_ranks(_both, world, args=(program,), timeout=60):
            assert is_protected  # the default group is distcompat's, the reference torch's
            assert got == want, program

    check()
