"""The demo's end-of-run measurements: replicas byte-equal across ranks, all-reduce latency.

The two lines the demo writes (every rank calls both: each runs collectives)::

    replicas = check_replicas(model)                    # ReplicaCheck(equal=True, ...)
    latency = time_allreduce(numel=param_count, reps=20)  # p50/p95 in ms on rank 0

Both are identities at world size 1 (a single rank is trivially its own replica).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import torch
from torch import nn

import distcompat
import distcompat.distributed as dist

__all__ = [
    "AllReduceTiming",
    "ReplicaCheck",
    "check_replicas",
    "flat_parameters",
    "params_sha256",
    "percentile",
    "time_allreduce",
]

#: The replica check is bitwise (tolerance 0), and why that is the right bar for this optimizer.
REPLICA_TOLERANCE_REASON = (
    "bitwise (tolerance 0): every parameter element is computed by the one rank that owns its "
    "shard and copied to the others by all_gather, so replicas cannot drift by rounding"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaCheck:
    """Whether every rank holds the same parameter bytes as rank 0.

    ``differing_elements`` is summed over ranks; ``max_abs_diff`` is the largest difference of a
    parameter value from rank 0's, over all ranks (0.0 when equal).
    """

    equal: bool
    differing_elements: int
    max_abs_diff: float
    tolerance: str = REPLICA_TOLERANCE_REASON


@dataclass(frozen=True, slots=True, kw_only=True)
class AllReduceTiming:
    """Wall time of synchronous all-reduces of one float32 tensor, as rank 0 saw them."""

    numel: int
    reps: int
    p50_ms: float
    p95_ms: float
    what: str


def flat_parameters(model: nn.Module) -> torch.Tensor:
    """Return every parameter, flattened and concatenated (a copy), in registration order.

    Example:
        >>> flat_parameters(torch.nn.Linear(2, 3)).shape
        torch.Size([9])
    """
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def params_sha256(model: nn.Module) -> str:
    """Return the SHA-256 of every parameter's bytes, parameters in name order.

    Equal on two runs exactly when every parameter is bit for bit equal (same dtypes and shapes).

    Example:
        >>> a, b = torch.nn.Linear(2, 3), torch.nn.Linear(2, 3)
        >>> _ = b.load_state_dict(a.state_dict())
        >>> params_sha256(a) == params_sha256(b), len(params_sha256(a))
        (True, 64)
    """
    digest = hashlib.sha256()
    for _, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        raw = param.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        digest.update(bytes(raw.tolist()))  # no NumPy here: the CPU wheel may lack it
    return digest.hexdigest()


def percentile(values: list[float], q: float) -> float:
    """Return the ``q``-quantile (0..1) of ``values`` by linear interpolation.

    Example:
        >>> percentile([1.0, 2.0, 3.0, 4.0], 0.5)
        2.5
    """
    if not values:
        raise ValueError("percentile of an empty list")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def check_replicas(model: nn.Module) -> ReplicaCheck:
    """Compare this rank's parameters with rank 0's, bit for bit; every rank must call it.

    Rank 0's parameters are broadcast and compared as raw bytes (so -0.0 vs 0.0 or two NaN
    payloads count as different); the verdict is all-reduced, so every rank returns the same.

    Example:
        >>> check_replicas(torch.nn.Linear(2, 2)).equal    # one process: trivially equal
        True
    """
    mine = flat_parameters(model)
    reference = mine.clone()
    distcompat.broadcast(reference, src=0)
    rows = (mine.numel(), -1)  # (elements, bytes per element)
    differ = mine.view(torch.uint8).view(rows).ne(reference.view(torch.uint8).view(rows))
    stats = torch.tensor(  # on the run device: NCCL moves no CPU tensors
        [float(differ.any(dim=1).sum().item()), (mine - reference).abs().max().item()],
        dtype=torch.float64,
        device=mine.device,
    )
    count = stats[:1].clone()
    distcompat.all_reduce(count, op=dist.ReduceOp.SUM)
    worst = stats[1:].clone()
    distcompat.all_reduce(worst, op=dist.ReduceOp.MAX)
    differing = int(count.item())
    return ReplicaCheck(
        equal=differing == 0, differing_elements=differing, max_abs_diff=float(worst.item())
    )


def time_allreduce(
    *, numel: int, reps: int, warmup: int = 3, device: str | torch.device = "cpu"
) -> AllReduceTiming:
    """Time ``reps`` synchronous float32 all-reduces of ``numel`` elements; every rank calls it.

    A barrier precedes each timed call, so a rank's time is the op itself, not waiting for a
    late peer. Rank 0's times are reported (every rank returns them). ``device`` is the run
    device (a CUDA tensor is synchronized before the clock stops).

    Example:
        >>> time_allreduce(numel=8, reps=3).reps
        3
    """
    tensor = torch.ones(numel, dtype=torch.float32, device=device)
    times: list[float] = []
    for i in range(warmup + reps):
        distcompat.barrier()
        start = time.perf_counter()
        distcompat.all_reduce(tensor, op=dist.ReduceOp.SUM)
        if tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
        tensor.fill_(1.0)  # keep the values bounded
    shared = torch.tensor(times, dtype=torch.float64, device=device)
    distcompat.broadcast(shared, src=0)
    ranked = shared.tolist()
    world = distcompat.get_world_size()
    return AllReduceTiming(
        numel=numel,
        reps=reps,
        p50_ms=percentile(ranked, 0.5),
        p95_ms=percentile(ranked, 0.95),
        what=(
            f"synchronous all_reduce(SUM) of one float32 tensor of {numel} elements "
            f"({numel * 4 / 1e6:.2f} MB: the whole gradient, what plain DDP all-reduces each step) "
            f"across {world} rank(s); {reps} calls after {warmup} warm-up calls, a barrier before "
            "each, rank 0's wall time"
        ),
    )
