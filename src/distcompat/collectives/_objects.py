"""Object collectives that work without NumPy: pickle to bytes, move uint8 tensors, unpickle.

torch's own ``all_gather_object`` and friends decode with ``tensor.numpy()``, so on a torch
install without NumPy they fail with "Numpy is not available" (seen on this project's CPU
machines). These move the same pickled bytes with plain tensor collectives::

    losses = [None] * world_size
    all_gather_object(losses, {"rank": rank, "loss": loss})

``gather_object`` and ``scatter_object_list`` are built on all-gather and broadcast (every rank
receives every payload): simple and correct, meant for the small objects they are used for.
Like torch's, they unpickle what peers send: use them only inside a job you trust, or pass
``weights_only=True`` (torch 2.14's parameter, here on every release): ``torch.save`` bytes,
read back by ``torch.load(weights_only=True)``, which refuses anything but tensors, containers
and plain values. Every rank must pass the same value.
"""

from __future__ import annotations

import ctypes
import io
import pickle
from typing import Any

import torch
import torch.distributed as dist

from distcompat.collectives._checked import verify
from distcompat.collectives._entry import entry
from distcompat.collectives._group import backend_for, global_rank, group_size, is_root, rank_in
from distcompat.collectives._issue import issue
from distcompat.collectives._native import all_gather_flat

__all__ = ["all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list"]


def _device(group: Any) -> torch.device:
    """CPU unless the group's backend cannot move CPU tensors (NCCL): then the current GPU."""
    if backend_for(group, torch.device("cpu")) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(obj: Any, device: torch.device, weights_only: bool) -> torch.Tensor:
    if weights_only:
        saved = io.BytesIO()
        torch.save(obj, saved)
        data = bytearray(saved.getvalue())
    else:
        data = bytearray(pickle.dumps(obj))
    return torch.frombuffer(data, dtype=torch.uint8).to(device)


def _decode(payload: torch.Tensor, size: int, weights_only: bool) -> Any:
    host = payload[:size].cpu().contiguous()
    data = ctypes.string_at(host.data_ptr(), size)  # no NumPy needed
    if weights_only:
        return torch.load(io.BytesIO(data), weights_only=True)
    return pickle.loads(data)


def _wait_on(op: str, group: Any, call: Any) -> None:
    """Run one step of an object collective as every collective waits (``issue``): watched."""
    issue(op, call, group, None, None, False)


def _gather_payloads(obj: Any, group: Any, op: str, weights_only: bool) -> list[Any]:
    world = group_size(group)
    device = _device(group)
    mine = _encode(obj, device, weights_only)
    sizes = torch.empty(world, dtype=torch.int64, device=device)
    size = torch.tensor([mine.numel()], device=device)
    _wait_on(op, group, lambda a: all_gather_flat(sizes, size, group=group, async_op=a))
    longest = int(sizes.max())
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: mine.numel()] = mine
    everything = torch.empty(world * longest, dtype=torch.uint8, device=device)
    _wait_on(op, group, lambda a: all_gather_flat(everything, padded, group=group, async_op=a))
    rows = everything.view(world, longest)
    return [_decode(rows[r], int(sizes[r]), weights_only) for r in range(world)]


def _global(group: Any, src: int | None, group_src: int | None) -> int:
    if group_src is None:
        if src is None:
            raise ValueError("name the source rank: src= (global) or group_src= (in the group)")
        return src
    return global_rank(group, group_src)


@entry
def all_gather_object(
    object_list: list[Any], obj: Any, group: Any = None, weights_only: bool = False
) -> None:
    """Gather picklable ``obj`` from every rank into ``object_list`` (in rank order).

    ``weights_only=True``: only what ``torch.load(weights_only=True)`` reads (module docstring).

    Example:
        >>> out = [None]
        >>> all_gather_object(out, {"loss": 1.5})
        >>> out
        [{'loss': 1.5}]
    """
    if group_size(group) == 1:
        object_list[0] = obj
        return
    verify("all_gather_object", None, group)
    object_list[:] = _gather_payloads(obj, group, "all_gather_object", weights_only)


@entry
def broadcast_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: Any = None,
    device: torch.device | None = None,
    group_src: int | None = None,
    weights_only: bool = False,
) -> None:
    """Replace ``object_list``'s items with the source rank's, on every rank.

    Example:
        >>> objs = ["config"]
        >>> broadcast_object_list(objs, src=0)
        >>> objs
        ['config']
    """
    if group_size(group) == 1:
        return
    root = _global(group, src, group_src)
    verify("broadcast_object_list", None, group, root=root)
    where = device or _device(group)
    is_root = dist.get_rank() == root
    payload = _encode(list(object_list), where, weights_only) if is_root else None
    size = torch.tensor([payload.numel() if payload is not None else 0], device=where)
    op = "broadcast_object_list"
    _wait_on(op, group, lambda a: dist.broadcast(size, root, group, async_op=a))
    buffer = (
        payload if payload is not None else torch.empty(int(size), dtype=torch.uint8, device=where)
    )
    _wait_on(op, group, lambda a: dist.broadcast(buffer, root, group, async_op=a))
    object_list[:] = _decode(buffer, int(size), weights_only)


@entry
def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: Any = None,
    group_dst: int | None = None,
    weights_only: bool = False,
) -> None:
    """Gather picklable objects into ``object_gather_list`` on the destination rank.

    Example:
        >>> out = [None]
        >>> gather_object(3, out, dst=0)
        >>> out
        [3]
    """
    if group_size(group) == 1:
        if object_gather_list is not None:
            object_gather_list[0] = obj
        return
    verify("gather_object", None, group, root=dst if dst is not None else group_dst)
    everything = _gather_payloads(obj, group, "gather_object", weights_only)
    if is_root(group, dst, group_dst):
        if object_gather_list is None:
            raise ValueError("the destination rank needs an object_gather_list")
        object_gather_list[:] = everything


@entry
def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int | None = None,
    group: Any = None,
    group_src: int | None = None,
    weights_only: bool = False,
) -> None:
    """Send item r of the source's ``scatter_object_input_list`` to rank r (into output[0]).

    Example:
        >>> out = [None]
        >>> scatter_object_list(out, ["mine"], src=0)
        >>> out
        ['mine']
    """
    if group_size(group) == 1:
        if scatter_object_input_list is not None:
            scatter_object_output_list[0] = scatter_object_input_list[0]
        return
    items = list(scatter_object_input_list or [])
    broadcast_object_list(
        items, src=src, group=group, group_src=group_src, weights_only=weights_only
    )
    scatter_object_output_list[0] = items[rank_in(group)]
