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


#: Parameters a drop-in takes that an older torch's function lacks: the newest torch's, which
#: the drop-in offers on every release (each raises TorchReleaseError, or works, where missing).
NEWER_PARAMETERS = {"_ranks", "enable_reconfigure", "weights_only", "timeout"}


def _replaced() -> list[str]:
    """The drop-in's functions that stand in for one of torch.distributed's of this release."""
    import inspect

    import torch.distributed as torch_dist

    names = []
    for name in dist.__all__:
        ours, theirs = getattr(dist, name), getattr(torch_dist, name, None)
        if theirs is None or ours is theirs or inspect.isclass(ours) or not callable(ours):
            continue
        names.append(name)
    return names


def test_every_drop_in_takes_every_parameter_of_torchs_function_here() -> None:
    """For the installed torch: each of torch's parameters is the drop-in's, with torch's default
    and kind; a parameter torch here lacks is a newer release's. torch's next new parameter fails
    this test, not a user's job."""
    import inspect

    import torch.distributed as torch_dist

    replaced = _replaced()
    assert {"init_process_group", "all_reduce", "all_gather_object", "barrier"} <= set(replaced)
    problems = []
    for name in replaced:
        ours = inspect.signature(getattr(dist, name)).parameters
        theirs = inspect.signature(getattr(torch_dist, name)).parameters
        for parameter in theirs.values():
            mine = ours.get(parameter.name)
            if mine is None:
                problems.append(f"{name}: no {parameter.name!r}")
            elif mine.default != parameter.default or mine.kind != parameter.kind:
                problems.append(f"{name}({parameter.name}): {mine} here, {parameter} in torch")
        extra = set(ours) - set(theirs) - NEWER_PARAMETERS
        if extra:
            problems.append(f"{name}: parameters torch has in no release: {sorted(extra)}")
    assert not problems, "\n".join(problems)


def test_the_newest_torchs_functions_are_here_on_every_release() -> None:
    """gather_single and set_timeout (torch 2.14) are distcompat's own, whatever torch is here."""
    assert dist.gather_single.__module__ == "distcompat.collectives._rooted"
    assert dist.set_timeout.__module__ == "distcompat.process_group._torch_api"


def _newest_functions() -> dict[str, object]:
    from datetime import timedelta

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.arange(3, dtype=torch.float32) + 10 * rank
    out = torch.empty(world, 3) if rank == 0 else None
    dist.gather_single(mine, out, dst=0)
    work = dist.gather_single(mine, out, group_dst=0, async_op=True)
    assert work is not None
    work.wait()
    objects: list[object] = [None] * world
    dist.all_gather_object(objects, {"rank": rank, "t": torch.ones(2) * rank}, weights_only=True)
    refused = ""
    try:
        dist.all_gather_object([None] * world, _Unsafe(), weights_only=True)
    except Exception as exc:  # torch.load's refusal, whatever its class
        refused = type(exc).__name__
    dist.set_timeout(timedelta(seconds=77))
    from distcompat.collectives._group import group_timeout_s

    return {
        "gathered": out.tolist() if out is not None else None,
        "objects": [(o["rank"], o["t"].tolist()) for o in objects],  # type: ignore[index]
        "refused": refused,
        "timeout": group_timeout_s(dist.group.WORLD),
    }


class _Unsafe:
    """A class torch.load(weights_only=True) refuses to build."""


def test_gather_single_weights_only_and_set_timeout_on_two_ranks() -> None:
    """On the protected group (every default on): gather_single fills one tensor in rank order,
    sync and async; weights_only=True moves tensors and plain values and refuses an arbitrary
    class on every rank; set_timeout reaches the bound distcompat waits by."""
    results = run_on_ranks(_newest_functions, 2, timeout=120)
    assert results[0]["gathered"] == [[0.0, 1.0, 2.0], [10.0, 11.0, 12.0]]
    assert results[1]["gathered"] is None
    for found in results:
        assert found["objects"] == [(0, [0.0, 0.0]), (1, [1.0, 1.0])]
        assert found["refused"] == "UnpicklingError"
        assert found["timeout"] == 77.0
