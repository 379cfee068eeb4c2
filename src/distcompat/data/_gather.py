"""``gather_for_metrics``: every rank's evaluation results, each sample once, in sampler order.

A sharded evaluation scores each rank's shard; a metric needs the whole set, once. Samplers that
pad (``ShardedSampler`` mode ``"pad"``, torch's ``DistributedSampler``) repeat samples so every
rank gets as many; mode ``"strided"`` gives each sample once but unequal counts. Pass the sampler
and every rank gets the whole evaluation back, padding dropped, in the sampler's order::

    preds = torch.cat([model(x).argmax(-1) for x, _ in loader])     # this rank's samples
    labels = torch.cat([y for _, y in loader])
    everything = distcompat.gather_for_metrics({"pred": preds, "label": labels}, sampler)
    accuracy = (everything["pred"] == everything["label"]).float().mean()   # as on one process

How: rank r's k-th sample sits at position ``r + k * W`` of the pass (both samplers deal the
epoch's order round-robin); positions past the pass's samples are padding. One all-gather of a
small header per call (each rank's count, a code of the value's structure, the sampler's pass)
checks the ranks agree, on every rank at once; then one uneven all-gather per tensor.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from distcompat.collectives import CompatWork, all_gather, all_gather_into_tensor
from distcompat.data._sampler import ShardedSampler

__all__ = ["gather_for_metrics"]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Pass:
    """A sampler's pass: rank r holds positions r, r + world, ... below ``positions``."""

    world: int
    positions: int
    samples: int  # positions at or past this are padding

    def count(self, rank: int) -> int:
        return len(range(rank, self.positions, self.world))


def _pass_of(sampler: Any) -> _Pass | None:
    """Read how ``sampler`` deals its pass (None: no sampler, concatenate in rank order)."""
    if sampler is None:
        return None
    if isinstance(sampler, ShardedSampler):
        positions, samples = sampler._span()
    elif isinstance(sampler, DistributedSampler):
        positions = sampler.total_size
        samples = min(positions, len(sampler.dataset))  # type: ignore[arg-type]
    else:
        raise TypeError(
            f"sampler is a {type(sampler).__name__}; gather_for_metrics knows "
            "distcompat.ShardedSampler and torch's DistributedSampler (or None: rank order)"
        )
    return _Pass(world=sampler.num_replicas, positions=positions, samples=samples)


def _leaves(value: Any, path: str, found: list[tuple[str, torch.Tensor]]) -> None:
    """Append ``value``'s tensors to ``found`` with their paths, depth first."""
    if isinstance(value, torch.Tensor):
        found.append((path, value))
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _leaves(item, f"{path}[{key!r}]", found)
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _leaves(item, f"{path}[{index}]", found)
    else:
        raise TypeError(
            f"{path} is a {type(value).__name__}: gather_for_metrics takes tensors (first "
            "dimension: samples) in dicts, lists and tuples"
        )


def _rebuild(value: Any, tensors: Any) -> Any:
    """Return ``value`` with its tensors replaced, in :func:`_leaves`' order, from ``tensors``."""
    if isinstance(value, torch.Tensor):
        return next(tensors)
    if isinstance(value, Mapping):
        return {key: _rebuild(item, tensors) for key, item in value.items()}
    items = [_rebuild(item, tensors) for item in value]
    if isinstance(value, tuple):
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return items


def _describe(value: Any) -> tuple[list[torch.Tensor], int, str]:
    """Return ``value``'s tensors, this rank's sample count, and what every rank must agree on."""
    found: list[tuple[str, torch.Tensor]] = []
    _leaves(value, "value", found)
    if not found:
        raise ValueError("value holds no tensor")
    counts = {t.shape[0] if t.dim() else -1 for _, t in found}
    if len(counts) != 1 or -1 in counts:
        shapes = ", ".join(f"{path}: {tuple(t.shape)}" for path, t in found)
        raise ValueError(f"every tensor's first dimension must be its samples, alike: {shapes}")
    text = "; ".join(f"{path}: {t.dtype} x {list(t.shape[1:])}" for path, t in found)
    return [t for _, t in found], counts.pop(), text


def _header(rows: int, text: str, dealt: _Pass | None, world: int, rank: int) -> list[int]:
    """Return what this rank tells the others: [count, structure code, positions, samples]."""
    if dealt is not None and dealt.world != world:
        raise ValueError(f"the sampler has num_replicas={dealt.world}; the group has {world}")
    if dealt is not None and rows != dealt.count(rank):
        raise ValueError(
            f"rank {rank} passed {rows} samples; its sampler dealt it {dealt.count(rank)} in this "
            "pass: pass all of them (each batch's results concatenated), once, after the loop"
        )
    spans = [-1, -1] if dealt is None else [dealt.positions, dealt.samples]
    return [rows, zlib.crc32(text.encode()), *spans]


def _agreed(table: list[list[int]], mine: Exception | None, text: str) -> list[int]:
    """Return each rank's count, or raise (on every rank) where any rank failed or disagrees."""
    if mine is not None:
        raise mine
    failed = [str(r) for r, row in enumerate(table) if row[0] < 0]
    if failed:
        raise ValueError(
            f"rank {', '.join(failed)} could not take part in gather_for_metrics (its own error "
            "says why); nothing was gathered"
        )
    odd = [str(r) for r, row in enumerate(table) if row[1] != table[0][1]]
    if odd:
        raise ValueError(
            f"rank {', '.join(odd)} passed a value whose keys, dtypes or per-sample shapes differ "
            f"from rank 0's (this rank's: {text})"
        )
    odd = [str(r) for r, row in enumerate(table) if row[2:] != table[0][2:]]
    if odd:
        raise ValueError(
            f"rank {', '.join(odd)}'s sampler differs from rank 0's (another pass, dataset or "
            "mode, or no sampler on one side)"
        )
    return [row[0] for row in table]


def _order(dealt: _Pass, rows: list[int]) -> torch.Tensor:
    """Return, for each sample of the pass in order, its row in the rank-order concatenation."""
    keep = torch.empty(dealt.samples, dtype=torch.int64)
    offset = 0
    for rank, count in enumerate(rows):
        positions = torch.arange(rank, rank + count * dealt.world, dealt.world)
        real = positions < dealt.samples
        keep[positions[real]] = torch.arange(offset, offset + count)[real]
        offset += count
    return keep


@overload
def gather_for_metrics(
    value: Any, sampler: Any = ..., *, group: Any = ..., async_op: Literal[False] = ...
) -> Any: ...


@overload
def gather_for_metrics(
    value: Any, sampler: Any = ..., *, group: Any = ..., async_op: Literal[True]
) -> CompatWork: ...


def gather_for_metrics(
    value: Any, sampler: Any = None, *, group: Any = None, async_op: bool = False
) -> Any:
    """Return the whole evaluation on every rank: each sample once, in the sampler's order.

    Args:
        value: a tensor, or dicts, lists and tuples of tensors, whose first dimension is this
            rank's samples: everything it evaluated, in the order its sampler gave them.
        sampler: the evaluation's ``ShardedSampler`` (any mode) or ``DistributedSampler``; its
            padding is dropped and the samples come back in its order. None: every rank's
            samples concatenated in rank order.
        group: the process group (default: the whole job). Without one, ``value`` comes back.
        async_op: return a :class:`~distcompat.CompatWork` whose future holds the result (the
            small exchange of counts happens before it returns).

    Raises:
        ValueError, TypeError: on every rank, when any rank's value, count or sampler does not
            fit (a count unlike what the sampler dealt it, other keys or shapes); the rank at
            fault says what.

    Example:
        >>> sampler = ShardedSampler(range(5), shuffle=False)   # one process: nothing to pad
        >>> gather_for_metrics({"loss": torch.arange(5.0)}, sampler)
        {'loss': tensor([0., 1., 2., 3., 4.])}
    """
    joined = dist.is_available() and dist.is_initialized()
    world, rank = (dist.get_world_size(group), dist.get_rank(group)) if joined else (1, 0)
    tensors: list[torch.Tensor] = []
    mine: Exception | None = None
    text, header, dealt = "", [-1, 0, 0, 0], None
    try:
        tensors, rows, text = _describe(value)
        dealt = _pass_of(sampler)
        header = _header(rows, text, dealt, world, rank)
    except (TypeError, ValueError) as exc:
        if world == 1:
            raise
        mine = exc  # raised after the exchange, so that no rank is left waiting
    if world == 1:  # one rank holds every sample of the pass, in order
        return CompatWork.completed(value) if async_op else value
    device = tensors[0].device if tensors else torch.device("cpu")
    table = torch.empty(world * 4, dtype=torch.int64, device=device)
    all_gather_into_tensor(table, torch.tensor(header, device=device), group=group)
    counts = _agreed(table.view(world, 4).tolist(), mine, text)
    keep = None if dealt is None else _order(dealt, counts).to(device)
    outs = [t.new_empty((sum(counts), *t.shape[1:])) for t in tensors]
    works = [
        all_gather(list(torch.split(out, counts)), t, group=group, async_op=async_op)
        for out, t in zip(outs, tensors, strict=True)
    ]

    def arranged() -> Any:
        picked = outs if keep is None else [out.index_select(0, keep) for out in outs]
        return _rebuild(value, iter(picked))

    if not async_op:
        return arranged()
    handles = [work for work in works if work is not None]

    def settle(done: torch.futures.Future[Any]) -> Any:
        for each in done.value():
            each.value()  # raises the gather's error, if it failed
        return arranged()

    future = torch.futures.collect_all([h.get_future() for h in handles]).then(settle)
    first = handles[0]
    return CompatWork(future, first.strategy, handles, first.group, first.op)
