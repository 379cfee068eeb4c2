"""All-gathers whose ranks send different row counts: straight through shared memory, or padded.

Where every rank is on this machine, each rank's rows go through shared memory straight into
that rank's tensor. Elsewhere (gloo gathers only tensors of one shape) each rank pads its tensor
with zeros to the longest rank's rows, the padded tensors travel as one flat all-gather of the
backend (gloo, NCCL), and each rank's rows are cut back out.
The mismatch check compares every rank's row counts and names the rank whose count disagrees::

    out = [torch.empty(n, 2) for n in (3, 4)]           # rank 0 sends 3 rows, rank 1 sends 4
    all_gather(out, torch.ones(3 if rank == 0 else 4, 2))
    rows = all_gather_uneven(torch.ones(rank + 1, 2))    # counts unknown: one tiny gather first
"""

from __future__ import annotations

from typing import Any, Literal, overload

import torch
import torch.distributed as dist

from distcompat.collectives._checked import verify
from distcompat.collectives._entry import entry
from distcompat.collectives._group import group_size
from distcompat.collectives._issue import issue
from distcompat.collectives._native import all_gather_flat
from distcompat.collectives._wire import chain, stage_input, stage_output
from distcompat.collectives._work import CompatWork, done_if_async
from distcompat.collectives.shm import _path as shm

__all__ = ["all_gather_rows", "all_gather_uneven"]


def all_gather_rows(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: Any,
    async_op: bool,
    result: Any = None,
) -> CompatWork | None:
    """``all_gather`` where ``tensor_list``'s first dimensions differ (it sends those here).

    ``tensor_list[r]`` takes rank r's rows; every rank's list must say the same counts.
    ``result``: the async handle's value (default ``tensor_list``).
    """
    me, trail = dist.get_rank(group), tensor.shape[1:]
    for r, out in enumerate(tensor_list):
        if tensor.dim() == 0 or out.shape[1:] != trail or out.dim() != tensor.dim():
            raise ValueError(
                f"tensor_list[{r}] has shape {tuple(out.shape)} and tensor {tuple(tensor.shape)}: "
                "only the first dimension (the rows each rank sends) may differ"
            )
        if out.dtype != tensor.dtype:
            raise ValueError(f"tensor_list[{r}] is {out.dtype}; tensor is {tensor.dtype}")
    if tensor_list[me].shape[0] != tensor.shape[0]:
        raise ValueError(
            f"tensor_list[{me}] has {tensor_list[me].shape[0]} rows but this rank's tensor has "
            f"{tensor.shape[0]}: entry {me} (this rank's) receives this rank's tensor"
        )
    rows = [out.shape[0] for out in tensor_list]
    verify("all_gather", tensor, group, row_counts=rows)
    most, result = max(rows), tensor_list if result is None else result
    if most == 0:
        return done_if_async(result, async_op)
    padded = tensor.new_zeros(()).expand(len(rows) * most, *trail)  # what the gather moves
    engine = shm.engine_for(group, "all_gather_into_tensor", padded)  # the same on every rank
    if engine is not None:  # every rank on this machine: rank r's rows straight into its tensor
        staged = [stage_output(out) for out in tensor_list]
        wires, mine = [wire.reshape(-1) for wire, _ in staged], stage_input(tensor)
        return issue(
            "all_gather",
            lambda a: engine.run(
                "all_gather", engine.all_gather_rows(wires, mine.reshape(-1)), a, (tensor,)
            ),
            group,
            result,
            chain(*(finish for _, finish in staged)),
            async_op,
        )
    padding = tensor.new_zeros((most - rows[me], *trail))
    source = tensor if rows[me] == most else torch.cat([tensor, padding])
    gathered = tensor.new_empty(padded.shape)  # rank r's rows at r * most
    wire, copy_back = stage_output(gathered)
    flat_in, flat_out = stage_input(source).reshape(-1), wire.view(-1)

    def trim() -> None:
        copy_back()
        for r, out in enumerate(tensor_list):
            out.copy_(gathered[r * most : r * most + rows[r]])

    return issue(
        "all_gather",
        lambda a: all_gather_flat(flat_out, flat_in, group=group, async_op=a),
        group,
        result,
        trim,
        async_op,
    )


@overload
def all_gather_uneven(
    tensor: torch.Tensor, group: Any = ..., async_op: Literal[False] = ...
) -> torch.Tensor: ...


@overload
def all_gather_uneven(
    tensor: torch.Tensor, group: Any = ..., *, async_op: Literal[True]
) -> CompatWork: ...


@overload
def all_gather_uneven(
    tensor: torch.Tensor, group: Any = ..., async_op: bool = ...
) -> torch.Tensor | CompatWork: ...


@entry
def all_gather_uneven(
    tensor: torch.Tensor, group: Any = None, async_op: bool = False
) -> torch.Tensor | CompatWork:
    """Return every rank's ``tensor`` concatenated along dimension 0, in rank order.

    The row counts may differ and need not be known: one all-gather of the counts goes first
    (an int64 per rank), then :func:`all_gather`'s uneven form. The other dimensions and the
    dtype must agree. With ``async_op=True`` the handle's future holds ``[gathered]``.

    Example:
        >>> all_gather_uneven(torch.arange(3))     # one process: a copy of the tensor
        tensor([0, 1, 2])
    """
    if tensor.dim() == 0:
        raise ValueError("all_gather_uneven concatenates along dimension 0; tensor is 0-dim")
    world = group_size(group)
    if world == 1:
        alone = tensor.clone()
        return CompatWork.completed([alone]) if async_op else alone
    mine = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
    counts = mine.new_empty(world)
    verify("all_gather_into_tensor", mine, group)
    engine = shm.engine_for(group, "all_gather_into_tensor", counts)  # None: the backend
    issue(
        "all_gather_into_tensor",
        lambda a: (
            all_gather_flat(counts, mine, group=group, async_op=a)
            if engine is None
            else engine.run("all_gather_into_tensor", engine.all_gather(counts, mine), a)
        ),
        group,
        [counts],
        None,
        False,
    )
    rows = counts.tolist()
    out = tensor.new_empty((sum(rows), *tensor.shape[1:]))
    work = all_gather_rows(list(torch.split(out, rows)), tensor, group, async_op, result=[out])
    return out if work is None else work
