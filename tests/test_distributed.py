"""``distcompat.distributed`` as a drop-in for ``torch.distributed``, in a ZeRO-style step."""

from __future__ import annotations

import torch

import distcompat.distributed as dist
from distcompat.testing import run_on_ranks

SIZES = [(6, 4), (10,), (3, 3, 2)]  # parameter shapes; total is padded to the world size
LR = 0.1


def _params() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen) for shape in SIZES]


def _grads(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    return [torch.randn(shape, generator=gen) for shape in SIZES]


def _flat(tensors: list[torch.Tensor], world: int) -> torch.Tensor:
    flat = torch.cat([t.reshape(-1) for t in tensors])
    pad = (-flat.numel()) % world
    return torch.cat([flat, flat.new_zeros(pad)])


def _zero_step() -> tuple[bool, bool, bytes]:
    """nanochat's pattern: async reduce_scatter AVG -> shard update -> async all_gather."""
    rank, world = dist.get_rank(), dist.get_world_size()
    params, grads = _params(), _grads(rank)
    flat_params, flat_grads = _flat(params, world), _flat(grads, world)
    shard = flat_params.numel() // world
    grad_shard = torch.empty(shard)
    work = dist.reduce_scatter_tensor(grad_shard, flat_grads, op=dist.ReduceOp.AVG, async_op=True)
    assert work is not None
    future = work.get_future()  # torch.distributed on gloo: "Work::getFuture not implemented"
    overlapped = sum(p.square().sum() for p in params)  # compute while the grads travel
    my_params = flat_params[rank * shard : (rank + 1) * shard].clone()
    updated = future.then(lambda f: my_params.sub_(LR * f.value()[0]))
    updated.wait()
    gathered = torch.empty_like(flat_params)
    gather_work = dist.all_gather_into_tensor(gathered, my_params, async_op=True)
    assert gather_work is not None
    gather_work.wait()

    # single-process reference: the same SGD step on the average of every rank's gradients
    mean_grad = torch.stack([_flat(_grads(r), world) for r in range(world)]).sum(0) / world
    expected = flat_params - LR * mean_grad
    replicas = [torch.empty_like(gathered) for _ in range(world)]
    dist.all_gather(replicas, gathered)
    all_equal = all(torch.equal(replica, gathered) for replica in replicas)
    close = torch.allclose(gathered, expected, rtol=1e-6, atol=1e-6) and bool(overlapped > 0)
    return all_equal, close, bytes(gathered.view(torch.uint8).tolist())


def test_zero_style_step_matches_single_process() -> None:
    for world_size in (2, 3):
        results = run_on_ranks(_zero_step, world_size)
        assert all(all_equal and close for all_equal, close, _ in results)
        assert len({blob for _, _, blob in results}) == 1  # replicas byte-equal across ranks


def test_drop_in_reexports_torch_distributed() -> None:
    import torch.distributed as torch_dist

    assert dist.ReduceOp is torch_dist.ReduceOp
    assert dist.init_process_group.__module__ == "distcompat.process_group._torch_api"
    assert dist.destroy_process_group.__module__ == "distcompat.process_group._torch_api"
    assert dist.new_group is torch_dist.new_group
    assert dist._make_nccl_premul_sum is torch_dist._make_nccl_premul_sum  # via __getattr__
    assert dist.all_reduce.__module__ == "distcompat.collectives._reductions"
    assert dist.reduce_scatter_single is dist.reduce_scatter_tensor
