"""Batched point-to-point ops through the drop-in module, on real gloo groups of 2 and 3 ranks."""

from __future__ import annotations

import pytest
import torch

import distcompat.distributed as dist
from distcompat.collectives import CompatWork
from distcompat.testing import run_on_ranks


def _ring(use_torch_ops: bool, transposed: bool) -> list[float]:
    """Send this rank's values to the next rank and receive the previous rank's, batched."""
    rank, world = dist.get_rank(), dist.get_world_size()
    source = torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * rank
    send = source.t() if transposed else source  # a non-contiguous view when transposed
    base = torch.full((2, 3), -1.0)
    recv = base.t() if transposed else base
    isend, irecv = (
        (torch.distributed.isend, torch.distributed.irecv)
        if use_torch_ops
        else (
            dist.isend,
            dist.irecv,
        )
    )
    ops = [dist.P2POp(isend, send, (rank + 1) % world), dist.P2POp(irecv, recv, (rank - 1) % world)]
    assert all(op.op in (torch.distributed.isend, torch.distributed.irecv) for op in ops)
    works = dist.batch_isend_irecv(ops)
    assert all(isinstance(work, CompatWork) for work in works)
    torch.futures.wait_all([work.get_future() for work in works])
    for work in works:
        work.wait()  # a second wait is safe
    expected = torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * ((rank - 1) % world)
    if transposed:
        expected = expected.t()
    assert torch.equal(recv, expected), (recv, expected)
    return recv.flatten().tolist()


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("use_torch_ops", [False, True])
@pytest.mark.parametrize("transposed", [False, True])
def test_batch_isend_irecv_ring(world_size: int, use_torch_ops: bool, transposed: bool) -> None:
    results = run_on_ranks(_ring, world_size, args=(use_torch_ops, transposed))
    assert len(results) == world_size


def _bad_inputs() -> list[str]:
    messages = []
    for bad in ([], [object()]):
        try:
            dist.batch_isend_irecv(bad)
        except (ValueError, TypeError) as exc:
            messages.append(f"{type(exc).__name__}: {exc}")
    try:
        dist.P2POp(dist.all_reduce, torch.zeros(1), 1)
    except ValueError as exc:
        messages.append(f"{type(exc).__name__}: {exc}")
    return messages


def test_batch_isend_irecv_bad_input_is_named() -> None:
    messages = run_on_ranks(_bad_inputs, 2)[0]
    assert messages[0].startswith("ValueError: batch_isend_irecv needs at least one")
    assert messages[1].startswith("TypeError: batch_isend_irecv takes P2POp objects, got object")
    assert messages[2].startswith("ValueError")
    assert "isend" in messages[2]


def _cuda_p2p_through_gloo() -> list[list[float]]:
    """Every point-to-point form with CUDA tensors on a gloo group (both ranks on cuda:0)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = (rank + 1) % world
    device = torch.device("cuda", 0)
    mine = torch.arange(4, dtype=torch.float32, device=device) + 10 * rank
    got = []
    for form in ("blocking", "async", "batch"):
        into = torch.full((2, 2), -1.0, device=device).t()  # non-contiguous too
        view = mine.view(2, 2)
        if form == "blocking":
            if rank == 0:
                dist.send(view, peer)
                dist.recv(into, peer)
            else:
                dist.recv(into, peer)
                dist.send(view, peer)
        elif form == "async":
            works = [dist.isend(view, peer), dist.irecv(into, peer)]
            torch.futures.wait_all([w.get_future() for w in works])
        else:
            ops = [dist.P2POp(dist.isend, view, peer), dist.P2POp(dist.irecv, into, peer)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        assert into.device == device
        got.append(into.flatten().tolist())
    return got


@pytest.mark.cuda
def test_cuda_tensors_point_to_point_through_gloo() -> None:
    """Real GPU: raw gloo send/recv of CUDA memory kills the process; distcompat's go via host."""
    zero, one = run_on_ranks(_cuda_p2p_through_gloo, 2)
    assert zero == [[10.0, 11.0, 12.0, 13.0]] * 3
    assert one == [[0.0, 1.0, 2.0, 3.0]] * 3
