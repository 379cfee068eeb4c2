"""Rank-side bodies for the shared-memory collective tests (imported by the rank processes).

Every body first puts its rank on the path under test with :func:`configure`: ``DISTCOMPAT_SHM``
set as asked and a slot size small enough that the test's odd sizes go through several chunks
(the pipeline) of both buffers. Results are compared with raw gloo (``torch.distributed``) on the
same inputs, and every rank's result bytes with every other's.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist

from distcompat.collectives import (
    all_gather_into_tensor,
    all_reduce,
    broadcast,
    reduce_scatter_tensor,
)
from distcompat.collectives._entry import entry
from distcompat.collectives.shm import Engine
from distcompat.collectives.shm import _path as shm

R = tdist.ReduceOp
#: Slot bytes in the tests: a few hundred elements per chunk, so sizes up to ~3000 pipeline.
TEST_SLOT_BYTES = 1024
DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "bfloat16", "float16", "float64", "int32", "int64", "int8", "uint8")
}
OPS = ("SUM", "AVG", "MAX", "MIN", "PRODUCT")
LAYOUTS = ("contiguous", "transposed", "strided")


@dataclass(frozen=True)
class ShmCase:
    """One call: the collective, dtype, ReduceOp, element count per rank, layout, seed."""

    collective: str
    dtype: str
    op: str
    numel: int
    layout: str
    seed: int


def configure(mode: str = "on", slot_bytes: int = TEST_SLOT_BYTES) -> None:
    """Set this rank's ``DISTCOMPAT_SHM`` and slot size; set the path up again when they change."""
    if os.environ.get("DISTCOMPAT_SHM") == mode and slot_bytes == shm.SLOT_BYTES:
        return
    os.environ["DISTCOMPAT_SHM"] = mode
    shm.SLOT_BYTES = slot_bytes
    shm.reset()
    all_reduce(torch.zeros(1))  # every rank: decide the path (and set it up) now


@contextlib.contextmanager
def configured(mode: str, slot_bytes: int = TEST_SLOT_BYTES) -> Iterator[None]:
    """:func:`configure` for the block, then this rank's earlier setting again (pool ranks serve
    later tests too)."""
    before, slot_before = os.environ.get("DISTCOMPAT_SHM"), shm.SLOT_BYTES
    configure(mode, slot_bytes)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("DISTCOMPAT_SHM", None)
        else:
            os.environ["DISTCOMPAT_SHM"] = before
        shm.SLOT_BYTES = slot_before
        shm.reset()


def calls_on_path(group: Any = None) -> int:
    """Return how many ops the group's shared-memory engine ran (-1: it has none)."""
    found = shm._groups.get(group if group is not None else tdist.group.WORLD)
    return found.calls if isinstance(found, Engine) else -1


def inputs(case: ShmCase, rank: int, rows: int) -> torch.Tensor:
    """Rank's logical input: floats with fractions (so summation order shows), or small ints."""
    gen = torch.Generator().manual_seed(case.seed * 131 + rank)
    dtype = DTYPES[case.dtype]
    if dtype.is_floating_point:
        values = torch.randn(rows, case.numel, generator=gen, dtype=torch.float64)
        if case.op == "PRODUCT":
            values = 1 + values / 8  # near one: products stay in range
        return values.to(dtype)
    high = 3 if case.op == "PRODUCT" else 50
    return torch.randint(
        -high if dtype != torch.uint8 else 0, high, (rows, case.numel), generator=gen
    ).to(dtype)


def laid_out(logical: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values in non-contiguous memory (or a fresh contiguous copy)."""
    if layout == "transposed":
        return logical.t().contiguous().t()
    if layout == "strided":
        base = torch.zeros(logical.shape[0], 2 * logical.shape[1], dtype=logical.dtype)
        view = base[:, ::2]
        view.copy_(logical)
        return view
    return logical.clone()


def _gloo(fn: Any, *tensors: torch.Tensor, **kwargs: Any) -> None:
    """Run raw ``torch.distributed`` ``fn`` on gloo itself: the reference path.

    Inside an entry, the protected default group hands the call straight to its gloo backend.
    """
    entry(fn)(*tensors, **kwargs)


def _same_everywhere(result: torch.Tensor) -> bool:
    """Whether every rank holds exactly these bytes."""
    world = tdist.get_world_size()
    mine = result.contiguous().view(-1).view(torch.uint8)
    every = torch.empty(world * mine.numel(), dtype=torch.uint8)
    entry(tdist.all_gather_into_tensor)(every, mine)  # gloo's, not counted on the path
    return all(torch.equal(row, mine) for row in every.view(world, -1))


def _close(actual: torch.Tensor, expected: torch.Tensor, case: ShmCase) -> bool:
    """Equal for ints, MAX and MIN; within reassociation of ``world`` terms for float sums."""
    if actual.shape != expected.shape:
        return False
    if not actual.dtype.is_floating_point or case.op in ("MAX", "MIN"):
        return torch.equal(actual, expected)
    eps = torch.finfo(actual.dtype).eps
    scale = 4 * tdist.get_world_size() * eps
    return bool(torch.allclose(actual.double(), expected.double(), rtol=scale, atol=scale))


def run_shm_case(case: ShmCase, slot_bytes: int = TEST_SLOT_BYTES, threads: int = 0) -> str:
    """Run ``case`` on the shared-memory path; return 'ok' or what went wrong.

    ``threads``: torch's intra-op threads in this rank for the call (0: as the rank is); the
    rank's own setting is restored after, since the pool's ranks serve later tests too.
    """
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _run_case(case, slot_bytes)
    finally:
        torch.set_num_threads(before)


def _run_case(case: ShmCase, slot_bytes: int) -> str:
    configure(slot_bytes=slot_bytes)
    rank, world = tdist.get_rank(), tdist.get_world_size()
    if not shm.status(None).engaged:
        return f"not on shared memory: {shm.status(None).reason}"
    dtype = DTYPES[case.dtype]
    calls = calls_on_path()
    if case.collective == "all_reduce":
        logical = inputs(case, rank, 2)
        tensor = laid_out(logical, case.layout)
        expected = logical.clone()
        if case.op == "AVG":
            _gloo(tdist.all_reduce, expected.view(-1), op=R.SUM)
            expected = (expected.double() / world).to(dtype)
        else:
            _gloo(tdist.all_reduce, expected.view(-1), op=getattr(R, case.op))
        all_reduce(tensor, op=getattr(R, case.op))
        result = tensor
    elif case.collective == "broadcast":
        root = case.seed % world
        tensor = laid_out(inputs(case, rank, 2), case.layout)
        expected = inputs(case, root, 2)
        broadcast(tensor, src=root)
        result = tensor
    elif case.collective == "all_gather_into_tensor":
        mine = inputs(case, rank, 1).view(-1)
        source = laid_out(mine.view(1, -1), case.layout)[0]  # 1-d; every other element if strided
        result = torch.empty(world * case.numel, dtype=dtype)
        expected = torch.cat([inputs(case, r, 1).view(-1) for r in range(world)])
        all_gather_into_tensor(result, source)
    else:  # reduce_scatter_tensor
        logical = inputs(case, rank, world)  # [destination rank, element]
        source = laid_out(logical, case.layout)
        stack = torch.stack([inputs(case, r, world)[rank] for r in range(world)])
        expected = _fold(stack, case.op, dtype)
        result = torch.empty(case.numel, dtype=dtype)
        reduce_scatter_tensor(result, source, op=getattr(R, case.op))
    if calls_on_path() != calls + 1:
        return f"rank {rank}: {case.collective} did not go through shared memory"
    if not _close(result, expected, case):
        diff = (result.double() - expected.double()).abs().max().item()
        return f"rank {rank}: differs from the reference by up to {diff}"
    if case.collective != "reduce_scatter_tensor" and not _same_everywhere(result):
        return f"rank {rank}: result bytes differ between ranks"
    return "ok"


def _fold(stack: torch.Tensor, op: str, dtype: torch.dtype) -> torch.Tensor:
    """Reduce rows in rank order in ``dtype`` (gloo has no reduce_scatter_tensor)."""
    fns: dict[str, Any] = {"SUM": torch.add, "AVG": torch.add, "MAX": torch.maximum}
    fn = fns.get(op, torch.minimum if op == "MIN" else torch.mul)
    out: torch.Tensor = functools.reduce(fn, stack.unbind(0))
    return (out.double() / stack.shape[0]).to(dtype) if op == "AVG" else out
