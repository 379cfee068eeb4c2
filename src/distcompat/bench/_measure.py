"""Time each collective on this rank's group, through distcompat's collectives (the user's path).

Every rank calls :func:`measure` with the same config; the rows are the same on every rank::

    info = distcompat.init_distributed()
    rows = measure(BenchConfig(sizes=[1024, 1 << 20]), device=info.device)

Per op and size: warm-up calls, a barrier, then timed calls one by one (the clock stops after the
call returns and, on an accelerator, after the device synchronised). Each iteration counts as
long as its slowest rank took (one MAX all-reduce of the times at the end), so the percentiles
describe the collective, not one rank's view of it.

With ``compare_shm`` (CPU tensors), each iteration times the call once through shared memory and
once through gloo (``DISTCOMPAT_SHM=on`` / ``off`` for that call, the order alternating), so the
two rows of an op and size saw the same moments of the machine.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from distcompat import collectives
from distcompat._ranks import get_rank, get_world_size
from distcompat.bench._stats import OPS, BenchRow
from distcompat.collectives.shm import _path as shm_path
from distcompat.process_group import barrier

__all__ = ["PATHS", "BenchConfig", "measure"]


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """What to measure: ops, buffer sizes in bytes, iterations, element type."""

    ops: tuple[str, ...] = OPS
    sizes: list[int] = field(default_factory=lambda: [1 << 10, 1 << 20])
    iterations: int = 20
    warmup: int = 5
    dtype: torch.dtype = torch.float32
    compare_shm: bool = False  # time each call through shared memory and through gloo


#: The paths ``compare_shm`` measures, and the setting that sends a call down each.
PATHS: dict[str, Literal["on", "off"]] = {"shared memory": "on", "gloo": "off"}


def _through(path: str) -> contextlib.AbstractContextManager[None]:
    """Send the calls in the block down ``path`` ('' leaves the user's setting)."""
    return shm_path.forced(PATHS[path]) if path else contextlib.nullcontext()


def _call(
    op: str, nbytes: int, world: int, dtype: torch.dtype, device: torch.device
) -> tuple[Callable[[], object], int, int]:
    """Return the call for ``op`` at about ``nbytes``, its buffer's bytes and elements."""
    item = torch.empty((), dtype=dtype).element_size()
    per_rank = max(1, nbytes // (item * world))  # the gathers and scatters split by rank
    total = per_rank * world

    def zeros(count: int) -> torch.Tensor:  # zeros: sums never overflow, whatever the count
        return torch.zeros(count, dtype=dtype, device=device)

    if op in ("all_reduce", "broadcast"):
        count = max(1, nbytes // item)
        tensor = zeros(count)
        if op == "all_reduce":
            return (lambda: collectives.all_reduce(tensor)), count * item, count
        return (lambda: collectives.broadcast(tensor, src=0)), count * item, count
    if op == "all_gather_into_tensor":
        piece, whole = zeros(per_rank), zeros(total)
        return (lambda: collectives.all_gather_into_tensor(whole, piece)), total * item, total
    if op == "all_gather_uneven":  # the same output, but rank 0 sends half, the last 1.5x
        rows = [per_rank] * world
        rows[0], rows[-1] = per_rank - per_rank // 2, per_rank + per_rank // 2
        mine = zeros(rows[get_rank()] if world > 1 else per_rank)
        return (lambda: collectives.all_gather_uneven(mine)), total * item, total
    if op == "reduce_scatter_tensor":
        whole, piece = zeros(total), zeros(per_rank)
        return (lambda: collectives.reduce_scatter_tensor(piece, whole)), total * item, total
    if op == "all_to_all_single":
        source, target = zeros(total), zeros(total)
        return (lambda: collectives.all_to_all_single(target, source)), total * item, total
    raise ValueError(f"op={op!r} is not one of {', '.join(OPS)}")


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    if device.type == "xpu":
        return lambda: torch.xpu.synchronize(device)
    return lambda: None


def _slowest_rank(times: list[float], device: torch.device) -> list[float]:
    """Each iteration's time on the rank that took longest (one MAX all-reduce)."""
    gathered = torch.tensor(times, dtype=torch.float64, device=device)
    collectives.all_reduce(gathered, op=dist.ReduceOp.MAX)
    return [float(t) for t in gathered.cpu()]


def measure(config: BenchConfig, *, device: torch.device) -> list[BenchRow]:
    """Run every op at every size on the current group (or alone); return one row per pair.

    Every rank must call it with the same ``config``.

    Example:
        >>> rows = measure(BenchConfig(ops=("all_reduce",), sizes=[64], iterations=3, warmup=1),
        ...     device=torch.device("cpu"))   # one process: the collectives are the identity
        >>> rows[0].op, rows[0].nbytes, rows[0].iterations
        ('all_reduce', 64, 3)
    """
    if config.compare_shm and device.type != "cpu":
        raise ValueError(f"compare_shm compares CPU collectives; the run device is {device}")
    world = get_world_size()
    sync = _synchronizer(device)
    paths = tuple(PATHS) if config.compare_shm else ("",)
    rows = []
    for op in config.ops:
        for size in config.sizes:
            call, nbytes, count = _call(op, size, world, config.dtype, device)
            for path in paths:
                with _through(path):
                    for _ in range(config.warmup):
                        call()
            sync()
            barrier()
            times: dict[str, list[float]] = {path: [] for path in paths}
            for index in range(config.iterations):
                for path in paths if index % 2 == 0 else paths[::-1]:
                    with _through(path):
                        start = time.perf_counter()
                        call()
                        sync()
                        times[path].append(time.perf_counter() - start)
            rows += [
                BenchRow.from_times(
                    op,
                    nbytes=nbytes,
                    count=count,
                    world_size=world,
                    times_s=_slowest_rank(times[path], device),
                    path=path,
                )
                for path in paths
            ]
    return rows
