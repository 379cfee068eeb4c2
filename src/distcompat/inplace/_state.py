"""One step's state on every survivor: the whole of the furthest, sent from its memory.

A loss can come at any point of a step, so the survivors may stand at different places: one
applied step ``k + 1`` (its gradient all-reduce had completed), another failed before its update,
a third inside an update that has collectives of its own (torn). Each says where it stands
(:class:`Position`); the source is the lowest rank among those at the furthest whole step
(:func:`choose_source`), and :func:`sync` sends its model, optimizer and other state to every
other survivor over the group. So a step commits on every survivor or on none: the state the
group goes on from is one rank's, whole. Sharded state (a ``Reshardable``: a ZeRO optimizer)
is not sent so: each share comes back from the copies ``_shards`` keeps, at a step chosen with
it (``choose_source(found, at=step)``); FSDP2's DTensor parameters cannot be re-cut in place.

Example:
    >>> choose_source([Position(3, False), Position(4, True), Position(4, False)])
    2
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from distcompat.collectives import all_gather_object, broadcast, broadcast_object_list
from distcompat.inplace._errors import InPlaceUnsupportedError, StateLostError
from distcompat.inplace._shards import named, sharded

__all__ = ["Position", "choose_source", "positions", "refuse_sharded", "sync", "zero_grads"]


@dataclass(frozen=True, slots=True)
class Position:
    """Where one survivor stands: optimizer steps applied whole, and whether it was inside one."""

    applied: int  # -1: a newcomer, which holds no state
    torn: bool


def refuse_sharded(
    model: torch.nn.Module, optimizer: Any, state: Mapping[str, Any], *, copies: bool
) -> None:
    """Raise :class:`InPlaceUnsupportedError` for sharded state that cannot be re-cut in place.

    :func:`sync` sends one rank's state to every other: a share of sharded state sent so would
    overwrite each rank's own share with the source's, silently. A ``Reshardable`` object (one
    with ``load_resharded``, the checkpoint's protocol for a per-rank share) is kept in two
    places instead (``_shards``) when ``copies`` (InPlace's ``shard_copies``) says so, and
    refused without it; FSDP2's or tensor parallel's DTensor parameters and torch's
    ``ZeroRedundancyOptimizer`` (no ``load_resharded``) cannot be, and are refused.

    Example:
        >>> refuse_sharded(torch.nn.Linear(2, 1), None, {}, copies=False)   # replicated
    """
    for name, param in model.named_parameters():
        if _is_a(param, "DTensor"):
            raise InPlaceUnsupportedError(
                f"parameter {name} is a DTensor (FSDP2 or tensor parallel): each rank holds a "
                "share of it, and a lost rank takes its share with it; InPlace keeps replicated "
                "parameters in place (a plain or DDP model, with a ZeRO optimizer that is "
                "Reshardable if you like). Without InPlace the job restarts from its last "
                "checkpoint"
            )
    for name, value in sharded(optimizer, state).items():
        if not copies:
            raise InPlaceUnsupportedError(
                f"{name} ({type(value).__name__}) holds a share that differs from rank to rank "
                "(a sharded optimizer: ZeRO), and a lost rank takes its share with it. Pass "
                "InPlace(..., shard_copies=True) to keep each share on a second rank too (one "
                "send of this rank's share a step: measured +13 % a step on the demo's GPT "
                "with ZeroAdamW, docs/resilience.md); else the job restarts from its last "
                "checkpoint"
            )
    for name, value in named(optimizer, state).items():
        if _is_a(value, "ZeroRedundancyOptimizer"):
            raise InPlaceUnsupportedError(
                f"{name} ({type(value).__name__}) holds a share that differs from rank to rank, "
                "and cannot be re-cut for another world size (it has no load_resharded); a lost "
                "rank takes its share with it. InPlace keeps a sharded optimizer that is "
                "Reshardable (distcompat.checkpoint.Reshardable: its load_resharded cuts its "
                "share from every rank's state) or a replicated one; without InPlace the job "
                "restarts from its last checkpoint"
            )


def _is_a(value: object, class_name: str) -> bool:
    """Whether ``value``'s class or a base has ``class_name`` (no import of the class's module)."""
    return any(cls.__name__ == class_name for cls in type(value).__mro__)


def positions(mine: Position) -> list[Position]:
    """Gather every rank's :class:`Position` over the (regrouped) default group."""
    found: list[Any] = [None]
    all_gather_object(found, (mine.applied, mine.torn))
    return [Position(int(applied), bool(torn)) for applied, torn in found]


def choose_source(found: list[Position], *, at: int | None = None, torn: bool = False) -> int:
    """Return the rank to copy from: the lowest rank at the furthest whole step.

    ``at``: the step to copy (sharded state goes back to the step its copies were kept at);
    ``torn``: a rank inside its update may be the source (its optimizer's state is re-cut from
    the copies, its parameters with it). A newcomer (applied -1) never is.
    Raises :class:`StateLostError` when no survivor holds such a step whole.
    """
    whole = [
        (p.applied, -rank)
        for rank, p in enumerate(found)
        if p.applied >= 0 and (torn or not p.torn) and at in (None, p.applied)
    ]
    if not whole:
        raise StateLostError(
            "every survivor was inside its optimizer's update when the peer was lost (its "
            "update has collectives of its own), so none holds a whole step: a restart resumes "
            "the job from its last checkpoint"
        )
    return -max(whole)[1]


def sync(
    source: int,
    rank: int,
    model: torch.nn.Module,
    optimizer: Any,
    state: Mapping[str, Any],
    started: Mapping[str, Any] | None = None,
) -> None:
    """Make every rank's ``model``, ``optimizer`` and ``state`` (name -> Stateful) ``source``'s.

    The model's tensors are broadcast in place; the optimizer's and the others' state dicts go as
    one object (their tensors inside it). ``started``: on the source, the Statefuls' state dicts
    at the start of the step it did not apply (a loader that fetched the step's batch is a batch
    ahead): those go, and the source takes them back too; None when it applied the step. A
    Stateful with an ``abandon()`` method (exact mode's
    :class:`~distcompat.anysize.ExactGradients`) drops the partial work of the step redone.
    """
    with torch.no_grad():
        for tensor in model.state_dict(keep_vars=True).values():
            broadcast(tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor, source)
    sent: list[Any] = [None, None]
    if rank == source:
        live = {name: value.state_dict() for name, value in state.items()}
        sent = [optimizer.state_dict() if optimizer is not None else None, started or live]
    broadcast_object_list(sent, src=source)
    if rank != source and optimizer is not None:
        optimizer.load_state_dict(sent[0])
    if rank != source or started is not None:
        for name, value in state.items():
            value.load_state_dict(sent[1][name])
    for value in state.values():
        abandon = getattr(value, "abandon", None)  # a step's partial work (exact mode's sums)
        if callable(abandon):
            abandon()


def zero_grads(model: torch.nn.Module) -> None:
    """Drop every gradient of ``model`` (the step redone starts from none)."""
    for param in model.parameters():
        param.grad = None
