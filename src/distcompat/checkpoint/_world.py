"""A checkpoint saved by another world size: every saving rank's state, checked or re-split.

:func:`~distcompat.checkpoint.resume` with ``world_change="follow"`` (the default) on a step
saved by S ranks, run on W != S ranks:

- every rank loads saving rank 0's file: the replicated objects (model, optimizer, loader, plan)
  are restored from it;
- each saving rank's file is *fingerprinted* by one rank (saving rank r by rank ``r % W``): a
  SHA-256 of every key's tensor bytes (dtype and shape included) or plain value, per object; the
  fingerprints travel in the gathered outcome of the load, so every rank compares the same
  fingerprints and reaches the same verdict: an object whose state differs across the saving
  ranks raises :class:`PerRankStateError` on every rank, before anything is restored;
- a :class:`~distcompat.checkpoint.Reshardable` object needs every saving rank's state, so every
  rank then reads every saving rank's file, keeping that object's part of it only.

Files are read one at a time and dropped once fingerprinted, so the memory held is rank 0's
state, the Reshardable objects' states of every saving rank, and one file.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from distcompat.checkpoint._errors import PerRankStateError, ResumeStateError
from distcompat.checkpoint._load import load_checkpoint

__all__ = ["Prints", "check_replicated", "fingerprint", "read_saving_ranks", "rng_message"]

#: Per saving rank, per object, per key: the digest of that key's value.
Prints = dict[int, dict[str, dict[str, bytes]]]

_SHOWN = 5  # keys named in an error; the count says how many more


def fingerprint(state: Any) -> dict[str, bytes]:
    """Return a digest per key of ``state`` (nested dicts and lists flattened to dotted keys).

    A tensor's digest covers its dtype, shape and bytes (no copy for a contiguous CPU tensor); a
    plain value's covers its type and ``repr``, exact for floats. Empty containers are keys too,
    so a key present on one rank only is seen.

    Example:
        >>> import torch
        >>> a = fingerprint({"state": {0: {"step": torch.tensor(3.0)}}, "lr": 0.1})
        >>> b = fingerprint({"state": {0: {"step": torch.tensor(4.0)}}, "lr": 0.1})
        >>> sorted(a), [k for k in a if a[k] != b[k]]
        (['lr', 'state.0.step'], ['state.0.step'])
    """
    return dict(_leaves(state, ""))


def _leaves(value: Any, key: str) -> Iterator[tuple[str, bytes]]:
    if isinstance(value, Mapping):
        if not value:
            yield key, _plain_digest({})
        for name, item in value.items():
            yield from _leaves(item, f"{key}.{name}" if key else str(name))
    elif isinstance(value, list | tuple) and not hasattr(value, "_fields"):  # not a namedtuple
        if not value:
            yield key, _plain_digest(value)
        for index, item in enumerate(value):
            yield from _leaves(item, f"{key}.{index}" if key else str(index))
    elif isinstance(value, torch.Tensor):
        yield key, _tensor_digest(value)
    else:
        yield key, _plain_digest(value)


def _plain_digest(value: Any) -> bytes:
    return hashlib.sha256(f"{type(value).__qualname__}:{value!r}".encode()).digest()[:16]


def _tensor_digest(tensor: torch.Tensor) -> bytes:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: its shard
    local = local.detach()
    if local.layout != torch.strided:
        local = local.to_dense()
    local = local.cpu().resolve_conj().resolve_neg().contiguous()
    digest = hashlib.sha256(f"{local.dtype}{tuple(local.shape)}".encode())
    size = local.numel() * local.element_size()
    if size:  # the bytes in place, through the buffer protocol (NumPy may be absent)
        digest.update((ctypes.c_char * size).from_address(local.data_ptr()))
    return digest.digest()[:16]


def read_saving_ranks(
    root: Path,
    step: int,
    *,
    saved_world: int,
    rank: int,
    world_size: int,
    first: Mapping[str, Any],
    checked: Sequence[str],
    resharded: Sequence[str],
    map_location: str | torch.device | None,
) -> tuple[Prints, dict[str, list[Any]]]:
    """Read the saving ranks' files this rank needs, one at a time (``first`` is rank 0's).

    Returns the fingerprints of ``checked`` objects in the files assigned to this rank (saving
    rank r to rank ``r % world_size``) and, when ``resharded`` names objects, their state in
    every saving rank's file, in rank order. A file that fails its checksum raises as a load does.
    """
    prints: Prints = {}
    states: dict[str, list[Any]] = {name: [] for name in resharded}
    for saved in range(saved_world):
        mine = saved % world_size == rank
        if mine and not checked:
            prints[saved] = {}  # nothing to compare: no need to read it for the check
            mine = False
        if not mine and not resharded:
            continue
        state = (
            first
            if saved == 0
            else load_checkpoint(root, step, map_location=map_location, rank=saved)
        )
        if mine:
            prints[saved] = {name: fingerprint(state[name]) for name in checked if name in state}
        for name in resharded:
            if name not in state:
                raise ResumeStateError(
                    f"saving rank {saved}'s file of step {step} holds no {name} state"
                )
            states[name].append(state[name])
        del state  # one file at a time: only the resharded objects' parts are kept
    return prints, states


def check_replicated(
    prints: Prints, checked: Sequence[str], *, saved_world: int, world_size: int, where: str
) -> None:
    """Raise :class:`PerRankStateError` naming each object whose state differs across ranks.

    ``prints`` must hold every saving rank (each rank's share of the gathered fingerprints,
    merged), so every rank reaches the same verdict.
    """
    assert sorted(prints) == list(range(saved_world)), sorted(prints)
    problems = []
    for name in checked:
        if name not in prints[0]:
            continue  # not in rank 0's file: the load refused it already
        first = prints[0][name]
        keys: dict[str, None] = {}  # ordered as in rank 0's state, then any others
        ranks = []
        for saved in range(1, saved_world):
            other = prints[saved].get(name, {})
            differ = [k for k in first | other if first.get(k) != other.get(k)]
            if differ:
                ranks.append(saved)
                keys.update(dict.fromkeys(differ))
        if keys:
            shown = ", ".join(list(keys)[:_SHOWN]) + (", ..." if len(keys) > _SHOWN else "")
            total = len(first.keys() | keys.keys())
            problems.append(
                f"{name}: {len(keys)} of {total} key(s) differ across the saving ranks ({shown}; "
                f"saving rank(s) {_ranges(ranks)} differ from rank 0)"
            )
    if problems:
        raise PerRankStateError(
            f"{where} was saved by {saved_world} rank(s) and this run has {world_size}, and "
            f"state that differs per rank cannot follow a new world size: {'; '.join(problems)}. "
            "Make such an object Reshardable (its load_resharded receives every saving rank's "
            f"state), resume on {saved_world} rank(s), or pass world_change='rank0' if rank 0's "
            "state is right for every rank"
        )


def _ranges(ranks: Sequence[int]) -> str:
    """``[1, 2, 3, 5]`` as ``1-3, 5``."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def rng_message(saved_world: int, world_size: int) -> str:
    """Say why per-rank RNG states are not restored on another world size, and what avoids it.

    Example:
        >>> rng_message(2, 3)[:68]
        'the RNG states (key "rng") were saved per rank by 2 rank(s) and are '
    """
    return (
        f'the RNG states (key "rng") were saved per rank by {saved_world} rank(s) and are not '
        f"restored on {world_size} rank(s): each rank would continue another rank's stream, so "
        "random draws (dropout, sampling, augmentation) from here on differ from an "
        "uninterrupted run. Counter-based RNG (generators derived from the seed, the step and "
        "the sample index, not a per-rank stream) avoids this; save with "
        "training_state(rng=False) once nothing depends on the per-rank streams"
    )
