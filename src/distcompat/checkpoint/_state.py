"""What a resumable checkpoint holds: the objects' states, the RNG states, and their protocols.

The line a training script writes at a save (every rank, each with its own objects)::

    save_checkpoint("ckpt", step, training_state(model=model, optimizer=optimizer,
                                                 loader=loader, plan=plan), keep_last=3)

An object is :class:`Stateful` (``state_dict`` / ``load_state_dict``); one whose state is split
across the ranks and can be re-split for another world size is also :class:`Reshardable`
(``load_resharded``). :func:`~distcompat.checkpoint.resume` reads this layout back.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "FORMAT_KEY",
    "OBJECTS",
    "RESUME_FORMAT",
    "Reshardable",
    "Stateful",
    "set_rng_state",
    "training_state",
]

#: The key and version :func:`training_state` writes; :func:`resume` refuses other states.
RESUME_FORMAT = "distcompat.resume/1"
FORMAT_KEY = "format"
#: The objects a training state holds, by the key each is stored under (and restored in order).
OBJECTS = ("model", "optimizer", "loader", "plan")


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` / ``load_state_dict()``: a module, an optimizer, a loader."""

    def state_dict(self) -> Any:
        """Return the object's state."""

    def load_state_dict(self, state_dict: Any, /) -> Any:
        """Restore the object's state."""


@runtime_checkable
class Reshardable(Stateful, Protocol):
    """A :class:`Stateful` whose state is split across the ranks and can be split again.

    On a checkpoint saved by another world size, :func:`~distcompat.checkpoint.resume` calls
    ``load_resharded(states)`` instead of ``load_state_dict``: ``states`` holds the
    ``state_dict()`` that every saving rank saved for this object, in rank order, and the object
    loads its own share for the current world size (its rank and world size are its own to
    know). At the same world size each rank's own state goes to ``load_state_dict`` as usual.

    Example:
        >>> class Halves:  # each rank holds one slice of a vector of 6
        ...     def __init__(self, rank, world): self.rank, self.world, self.part = rank, world, []
        ...     def state_dict(self): return {"part": self.part}
        ...     def load_state_dict(self, state): self.part = list(state["part"])
        ...     def load_resharded(self, states):
        ...         whole = [x for s in states for x in s["part"]]
        ...         size = len(whole) // self.world
        ...         self.part = whole[self.rank * size:(self.rank + 1) * size]
        >>> mine = Halves(rank=1, world=3)
        >>> mine.load_resharded([{"part": [0, 1, 2]}, {"part": [3, 4, 5]}])  # saved by 2 ranks
        >>> isinstance(mine, Reshardable), mine.part
        (True, [2, 3])
    """

    def load_resharded(self, states: Sequence[Any], /) -> None:
        """Load this rank's share from every saving rank's ``state_dict()``, in rank order."""


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore the RNG states :func:`training_state` saved (torch CPU, CUDA, Python)."""
    # .cpu(): the generators take CPU byte tensors, whatever map_location the load used
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(_as_random_state(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def _as_random_state(value: Any) -> tuple[Any, ...]:
    """``random.setstate`` wants tuples; a loaded state may hold lists."""
    version, internal, gauss = value
    return (version, tuple(internal), gauss)


def training_state(
    *,
    model: Stateful | None = None,
    optimizer: Stateful | None = None,
    loader: Stateful | None = None,
    plan: Stateful | None = None,
    rng: bool = True,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Return this rank's state for :func:`save_checkpoint`, in the layout :func:`resume` reads.

    Holds each given object's ``state_dict()`` (``plan``: the training plan, replicated state
    like the loader's), this rank's RNG states (torch CPU, CUDA when in use, Python's
    ``random``; NumPy's is not kept) and ``extra``: plain values (numbers, strings, lists,
    dicts, tensors) a ``weights_only`` load accepts. The RNG states are per rank: a resume on
    another world size cannot restore them and says so (``rng=False`` saves none, for a run
    whose randomness does not live in per-rank generators).

    Example:
        >>> import torch
        >>> state = training_state(model=torch.nn.Linear(2, 1), extra={"losses": [2.5]})
        >>> sorted(state)
        ['extra', 'format', 'model', 'rng']
    """
    state: dict[str, Any] = {FORMAT_KEY: RESUME_FORMAT}
    for name, obj in zip(OBJECTS, (model, optimizer, loader, plan), strict=True):
        if obj is not None:
            state[name] = obj.state_dict()
    if rng:
        state["rng"] = _rng_state()
    if extra:
        state["extra"] = dict(extra)
    return state
