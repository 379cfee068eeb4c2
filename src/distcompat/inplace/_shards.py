"""Sharded state kept in two places, so a lost rank's share is re-cut from memory.

A share of sharded state (a ZeRO optimizer's master weights and moments: each rank holds
``1/world`` of them) leaves with its rank. So after each optimizer step every rank packs the
state of its :class:`~distcompat.checkpoint.Reshardable` objects (:class:`Share`: one copy of
their tensors' bytes and a small pickle of the rest) and sends it to its holder, a rank on the
next machine (:func:`holders`; on one machine, the next rank): every share is then held by its
rank and by one other (:meth:`Shards.keep`, one point-to-point exchange a step). A *generation*
is one step's copies in one group (an epoch of the members): this rank keeps its own and those
it holds, of the last two generations, since a loss may come while the copies half moved on.

At a regroup (:meth:`Shards.choose`, then :meth:`Shards.load`) the survivors say which shares of
which generations they hold, and take the latest generation whose every share some survivor
holds and whose step a survivor's other state stands at; the shares go to every survivor, and
each object's ``load_resharded`` cuts this rank's part for the new world size (the checkpoint's
protocol for a resume at another size, in memory). The new members then keep their copies anew.
A rank and its holder lost together take a share with both copies: :class:`StateLostError` (the
job restarts as before); a machine lost alone does not, its ranks' copies being on another.

Example:
    >>> latest({(3, 1): {0, 1}, (4, 1): {0}}, world={(3, 1): 2, (4, 1): 2}, steps={3, 4})
    (3, 1)
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from distcompat.collectives import all_gather_object, irecv, isend
from distcompat.inplace._errors import StateLostError

__all__ = ["OPTIMIZER", "Generation", "Shards", "Share", "holders", "latest", "named", "sharded"]

#: Generations a rank keeps: the copies may be half way to the next one when a rank is lost.
KEPT = 2

#: The byte boundary each tensor of a packed share starts at (any dtype's size divides it).
ALIGN = 16

Key = tuple[int, int]  # (step, epoch): one step's copies in the group of one epoch of members


#: The name the optimizer goes by among the objects (a Stateful's is ``state['its key']``).
OPTIMIZER = "the optimizer"


def named(optimizer: Any, state: Mapping[str, Any]) -> dict[str, Any]:
    """Return ``optimizer`` and ``state``'s entries by the names InPlace says them by.

    Example:
        >>> list(named(None, {"plan": 1}))
        ['the optimizer', "state['plan']"]
    """
    return {OPTIMIZER: optimizer, **{f"state[{key!r}]": value for key, value in state.items()}}


def sharded(optimizer: Any, state: Mapping[str, Any]) -> dict[str, Any]:
    """Return the objects among ``optimizer`` and ``state`` whose state is split across ranks.

    Those with ``load_resharded`` (:class:`~distcompat.checkpoint.Reshardable`), by their
    :func:`named` names.

    Example:
        >>> sharded(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), {})
        {}
    """
    found = named(optimizer, state).items()
    return {n: v for n, v in found if callable(getattr(v, "load_resharded", None))}


@dataclass(slots=True)
class Generation:
    """One step's shares in one group: the world size then, and the shares held here by rank."""

    world: int
    shares: dict[int, Share]


def latest(held: Mapping[Key, set[int]], *, world: Mapping[Key, int], steps: set[int]) -> Key:
    """Return the latest generation whose every share is held somewhere, at one of ``steps``.

    ``held``: per generation, the ranks of its group whose share a survivor holds; ``steps``:
    the steps some survivor's other state (model, loader, plan) stands at.
    Raises :class:`StateLostError` when none is whole.
    """
    whole = [k for k, ranks in held.items() if k[0] in steps and ranks >= set(range(world[k]))]
    if not whole:
        raise StateLostError(
            "a share of the sharded state is gone with both ranks that held it (a rank and the "
            "rank holding its copy lost together, or lost before the first copies were kept): "
            "a restart resumes the job from its last checkpoint"
        )
    return max(whole)


class Shards:
    """The copies of one rank's sharded objects (name -> ``Reshardable``).

    Example:
        >>> shards = Shards({})
        >>> shards.held()
        {}
    """

    def __init__(self, objects: Mapping[str, Any], node: int = 0) -> None:
        self._objects = dict(objects)
        self._node = node  # this rank's machine: the launcher's node rank
        self._machines: tuple[int, list[int]] = (-1, [])  # an epoch's holders
        self._kept: dict[Key, Generation] = {}
        self._senders: dict[int, int] = {}  # share -> the rank that sends it (choose)

    def __bool__(self) -> bool:
        return bool(self._objects)

    def __contains__(self, key: Key) -> bool:
        return key in self._kept

    def holds(self, value: object) -> bool:
        """Whether ``value`` is one of the sharded objects (kept here, not sent from a rank)."""
        return any(value is mine for mine in self._objects.values())

    def held(self) -> dict[Key, tuple[int, tuple[int, ...]]]:
        """Return, per generation kept here, its world size and the ranks whose share is here."""
        return {key: (gen.world, tuple(sorted(gen.shares))) for key, gen in self._kept.items()}

    def keep(self, step: int, epoch: int) -> None:
        """Pack this rank's shares for ``step`` and send them to the rank that holds its copy.

        Over the default group (every rank calls it): this rank's copy goes to its
        :func:`holders` rank, and it receives the shares of the ranks it holds. A peer lost
        meanwhile raises the exchange's typed error; the generation before stays whole.
        """
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = _pack({name: value.state_dict() for name, value in self._objects.items()})
        shares = {rank: mine}
        if world > 1:
            held = self._holders(epoch)
            senders = [r for r, holder in enumerate(held) if holder == rank and r != rank]
            shares.update(_swap(mine, held[rank], senders))
        self._add((step, epoch), Generation(world, shares))

    def _holders(self, epoch: int) -> list[int]:
        """Return :func:`holders` for the group of ``epoch`` (its ranks' machines asked once)."""
        if self._machines[0] != epoch:
            found: list[Any] = [None] * dist.get_world_size()
            all_gather_object(found, self._node)
            self._machines = (epoch, holders([int(node) for node in found]))
        return self._machines[1]

    def _add(self, key: Key, generation: Generation) -> None:
        self._kept[key] = generation
        for old in sorted(self._kept)[:-KEPT]:
            del self._kept[old]

    def choose(self, steps: set[int]) -> Key:
        """Agree on the generation to go back to: the latest whole one at one of ``steps``.

        Every rank of the (regrouped) default group calls it, a newcomer too (it holds none).
        ``steps``: the steps a survivor's other state (model, loader, plan) stands at.
        """
        found: list[Any] = [None] * dist.get_world_size()
        all_gather_object(found, self.held())
        held: dict[Key, set[int]] = {}
        world: dict[Key, int] = {}
        for told in found:
            for key, (size, ranks) in told.items():
                held.setdefault(key, set()).update(ranks)
                world[key] = size
        key = latest(held, world=world, steps=steps)
        self._senders = _senders(found, key)
        return key

    def load(self, key: Key) -> None:
        """Send the shares of generation ``key`` to every rank; each loads its part of them.

        Each share goes from the lowest rank that holds it; every object's ``load_resharded``
        gets the states of all the ranks of ``key``'s group, in rank order (every rank calls it,
        after :meth:`choose`).
        """
        me = dist.get_rank()
        gen = self._kept.get(key)
        mine = {r: gen.shares[r] for r, who in self._senders.items() if who == me} if gen else {}
        sent: list[Any] = [None] * dist.get_world_size()
        all_gather_object(sent, mine)
        shares = {r: blob for part in sent for r, blob in part.items()}
        world = len(self._senders)
        states = [_unpack(shares[r]) for r in range(world)]
        for name, value in self._objects.items():
            value.load_resharded([state[name] for state in states])
        # whole here now, and the only one: the steps after it were undone (copies of them
        # would mix the undone run with the one going on)
        self._kept = {key: Generation(world, shares)}


def _senders(found: list[Any], key: Key) -> dict[int, int]:
    """Return, for each share of generation ``key``, the lowest rank that told it holds it."""
    senders: dict[int, int] = {}
    for rank, told in enumerate(found):
        for share in told.get(key, (0, ()))[1]:
            senders.setdefault(share, rank)
    return senders


def holders(nodes: list[int]) -> list[int]:
    """Return, for each rank, the rank that holds a copy of its share: on another machine.

    ``nodes``: each rank's machine. The ranks of one machine send to the next machine's ranks
    in turn (a machine lost leaves every share of its ranks on another); on one machine each
    rank sends to the next.

    Example:
        >>> holders([0, 0, 1, 1]), holders([0, 0, 0]), holders([0, 0, 0, 1])
        ([2, 3, 0, 1], [1, 2, 0], [3, 3, 3, 0])
    """
    ranks: dict[int, list[int]] = {}
    for rank, node in enumerate(nodes):
        ranks.setdefault(node, []).append(rank)
    machines = sorted(ranks)
    if len(machines) == 1:
        return [(rank + 1) % len(nodes) for rank in range(len(nodes))]
    held = [0] * len(nodes)
    for index, node in enumerate(machines):
        there = ranks[machines[(index + 1) % len(machines)]]
        for turn, rank in enumerate(ranks[node]):
            held[rank] = there[turn % len(there)]
    return held


def _swap(mine: Share, to: int, senders: list[int]) -> dict[int, Share]:
    """Send ``mine`` to rank ``to``; return what each of ``senders`` sent (sizes first)."""
    sizes = torch.tensor([mine.skeleton.numel(), mine.flat.numel()], dtype=torch.int64)
    theirs = {sender: torch.zeros(2, dtype=torch.int64) for sender in senders}
    _both(isend(sizes, to), *(irecv(size, sender) for sender, size in theirs.items()))
    got = {
        sender: Share(
            torch.empty(int(size[0]), dtype=torch.uint8),
            torch.empty(int(size[1]), dtype=torch.uint8),
        )
        for sender, size in theirs.items()
    }
    receives = [irecv(t, s) for s, share in got.items() for t in (share.skeleton, share.flat)]
    _both(isend(mine.skeleton, to), isend(mine.flat, to), *receives)
    return got


def _both(*works: Any) -> None:
    for work in works:
        work.wait()


@dataclass(frozen=True, slots=True)
class _Placed:
    """Where a tensor of a packed state lies in its share's bytes."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Share:
    """One rank's sharded state, packed: its structure pickled, its tensors' bytes in one run.

    One copy of the tensors (into ``flat``) and a small pickle, sent as two tensors: no
    serializer's pass over the bytes.
    """

    skeleton: torch.Tensor  # uint8: the pickled structure, tensors replaced by _Placed
    flat: torch.Tensor  # uint8: every tensor's bytes, one after another


def _pack(state: Any) -> Share:
    tensors: list[torch.Tensor] = []
    offset = 0

    def strip(value: Any) -> Any:
        nonlocal offset
        if isinstance(value, torch.Tensor):
            pad = -offset % ALIGN  # each tensor's bytes start where its dtype may be viewed
            if pad:
                tensors.append(torch.zeros(pad, dtype=torch.uint8))
                offset += pad
            data = value.detach().reshape(-1).contiguous().cpu()
            tensors.append(data.view(torch.uint8))
            placed = _Placed(offset, value.dtype, tuple(value.shape))
            offset += tensors[-1].numel()
            return placed
        if isinstance(value, dict):
            return {key: strip(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(strip(item) for item in value)
        return value

    skeleton = pickle.dumps(strip(state))
    flat = torch.cat(tensors) if tensors else torch.empty(0, dtype=torch.uint8)
    return Share(torch.frombuffer(bytearray(skeleton), dtype=torch.uint8), flat)


def _unpack(share: Share) -> Any:
    flat = share.flat

    def fill(value: Any) -> Any:
        if isinstance(value, _Placed):
            size = math.prod(value.shape) * value.dtype.itemsize
            part = flat[value.offset : value.offset + size]
            return part.view(value.dtype).reshape(value.shape)
        if isinstance(value, dict):
            return {key: fill(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(fill(item) for item in value)
        return value

    return fill(pickle.loads(bytes(share.skeleton.tolist())))  # no numpy: torch may lack it
