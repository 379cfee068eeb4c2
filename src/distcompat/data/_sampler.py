"""``ShardedSampler``: a resumable drop-in for ``DistributedSampler`` that cannot repeat an epoch.

The two lines a training script writes::

    sampler = ShardedSampler(dataset, shuffle=True, seed=0)    # rank, world from distcompat
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)

What differs from ``torch.utils.data.DistributedSampler`` (same constructor arguments, same
``set_epoch``, same padding / dropping, plus ``mode``):

* **Forgetting set_epoch cannot repeat the order.** When an iteration runs to the end, the next one
  starts the next epoch by itself. ``set_epoch(e)`` still works (and is a no-op for the epoch it is
  in, so it keeps a resumed position); asking again for an epoch already completed warns with
  :class:`EpochRepeatWarning`, because its order would repeat exactly.
* **Resumable, elastic.** ``state_dict()`` holds epoch, seed and samples consumed by all ranks;
  ``load_state_dict`` continues exactly, also on another world size (see ``_state``).
* **Iteration is a cursor.** Breaking out of a loop and iterating again continues the epoch where
  it stopped, as a resume would.
* Indices are dealt strided: in each round rank ``r`` takes entry ``r`` of the next ``W`` entries of
  the epoch's order (``DistributedSampler`` deals ``order[r::W]``: the same sets).

Mode (default from ``drop_last`` as in ``DistributedSampler``): ``"pad"`` (repeat from the
epoch's start so every rank gets the same count), ``"drop"`` (drop the tail), or ``"strided"``
(every sample exactly once; counts may differ by one, so pair it with ``distcompat.join`` or a
per-step agreement).
``"contiguous"`` is refused here: contiguous blocks do not consume a prefix of the order.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping, Sized

import torch
from torch.utils.data import Sampler

from distcompat._ranks import get_rank, get_world_size
from distcompat.data._shard import (
    EmptyShardError,
    ShardMode,
    check_mode,
    check_world,
    positions_limit,
    shard_sizes,
)
from distcompat.data._state import EpochCursor

__all__ = ["ShardedSampler"]


class ShardedSampler(Sampler[int]):
    """Shard a map-style dataset over ranks, reshuffled each epoch, resumable on any world size.

    Args:
        dataset: anything with ``len()``; only its length is used (read once, here).
        num_replicas: world size; default ``distcompat.get_world_size()`` (1 without a group).
        rank: this rank; default ``distcompat.get_rank()`` (0 without a group).
        shuffle: draw a new order each epoch from ``(seed, epoch)``.
        seed: the same on every rank.
        drop_last: as in ``DistributedSampler``: picks ``mode="drop"`` instead of ``"pad"``.
        mode: ``"pad"``, ``"drop"`` or ``"strided"``; overrides ``drop_last`` (which must then be
            False or agree).

    Raises:
        EmptyShardError: some rank would get no sample in a full epoch (raised on every rank).
        ValueError: rank or world size out of range, unknown mode, or a mode that contradicts
            ``drop_last``.

    Example:
        >>> sampler = ShardedSampler(range(7), num_replicas=2, rank=1, shuffle=False)
        >>> list(sampler), list(sampler)   # pads by repeating index 0, like DistributedSampler
        ([1, 3, 5, 0], [1, 3, 5, 0])
        >>> s = ShardedSampler(range(7), num_replicas=2, rank=0, seed=3)
        >>> first, second = list(s), list(s)    # no set_epoch: the second pass is epoch 1
        >>> first != second, s.epoch    # two passes done: the next index comes from epoch 2
        (True, 2)
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        mode: ShardMode | None = None,
    ) -> None:
        if num_replicas is None or rank is None:
            num_replicas = get_world_size() if num_replicas is None else num_replicas
            rank = get_rank() if rank is None else rank
        self.rank, self.num_replicas = check_world(rank, num_replicas)
        if mode is None:
            mode = "drop" if drop_last else "pad"
        mode = check_mode(mode)
        if mode == "contiguous":
            raise ValueError(
                "ShardedSampler does not take mode='contiguous': contiguous blocks do not consume "
                "a prefix of the epoch's order, so the position could not be resumed on another "
                "world size. Use 'strided', 'pad' or 'drop' (or shard_indices for fixed blocks)"
            )
        if drop_last and mode != "drop":
            raise ValueError(f"drop_last=True contradicts mode={mode!r}; pass one of them")
        self.mode: ShardMode = mode
        self.shuffle, self.seed, self.drop_last = shuffle, seed, mode == "drop"
        n = operator.index(len(dataset))
        sizes = shard_sizes(n, self.num_replicas, mode=mode)
        if min(sizes) == 0:
            raise EmptyShardError(
                f"a dataset of {n} sample(s) over num_replicas={self.num_replicas} in mode "
                f"{mode!r} leaves {sizes.count(0)} rank(s) with no sample; such a rank would "
                "leave the others waiting in their next collective. Use fewer ranks or more data"
            )
        self.num_samples = sizes[self.rank]  # per rank per full epoch, as in DistributedSampler
        self.total_size = positions_limit(n, self.num_replicas, mode)
        self._cursor = EpochCursor(num_samples=n, seed=seed, shuffle=shuffle)
        self._start = 0  # consumed prefix when the current pass began
        self._yielded = 0  # indices this pass handed out

    def __len__(self) -> int:
        """Return how many indices this rank yields in a full epoch."""
        return self.num_samples

    @property
    def epoch(self) -> int:
        """The epoch the next index comes from (a completed epoch reads as the next one)."""
        return self._cursor.position()[0]

    def set_epoch(self, epoch: int) -> None:
        """Jump to ``epoch``; optional (the epoch advances by itself after each full pass).

        The current epoch keeps its (resumed) position; an epoch already completed repeats its
        order and warns with :class:`EpochRepeatWarning`.

        Example:
            >>> sampler = ShardedSampler(range(4), num_replicas=2, rank=0)
            >>> sampler.set_epoch(5)
            >>> sampler.epoch
            5
        """
        self._sync()
        self._cursor.set_epoch(epoch, owner="ShardedSampler")
        self._start, self._yielded = self._cursor.consumed, 0

    def __iter__(self) -> Iterator[int]:
        """Yield this rank's indices for the rest of the current epoch."""
        self._sync()
        n, world = self._cursor.num_samples, self.num_replicas
        order, start = self._cursor.begin_pass(
            done=lambda consumed: positions_limit(n - consumed, world, self.mode) == 0
        )
        self._start, self._yielded = start, 0
        limit = positions_limit(n - start, world, self.mode)
        positions = torch.arange(self.rank, max(limit, self.rank), world, dtype=torch.int64)
        mine = order[(positions + start) % max(n, 1)].tolist()  # pad wraps to the epoch's start
        for count, index in enumerate(mine, 1):
            self._yielded = count
            yield index
        self._sync()
        self._cursor.finished = True

    def _span(self) -> tuple[int, int]:
        """Return the current pass's ``(positions, samples)`` (for ``gather_for_metrics``).

        Rank r holds positions r, r + W, ... below ``positions``; the first ``samples`` of them
        are the pass's samples, the rest repeat the epoch's start (mode ``"pad"``).
        """
        remaining = self._cursor.num_samples - self._start
        limit = positions_limit(remaining, self.num_replicas, self.mode)
        return limit, min(limit, remaining)

    def _sync(self) -> None:
        """Fold the current pass's handed-out indices into the cursor's global position."""
        remaining = self._cursor.num_samples - self._start
        if not self._cursor.finished:
            self._cursor.consumed = self._start + min(self._yielded * self.num_replicas, remaining)

    def state_dict(self, *, local_consumed: int | None = None) -> dict[str, int | bool | str]:
        """Return the global position: epoch, seed, samples consumed by all ranks together.

        Args:
            local_consumed: indices of the current pass this rank actually used, when that is fewer
                than the sampler handed out (a ``DataLoader`` with workers prefetches ahead: pass
                ``steps_this_pass * batch_size``). Default: every index handed out.

        Example:
            >>> sampler = ShardedSampler(range(10), num_replicas=2, rank=0)
            >>> it = iter(sampler)
            >>> _ = [next(it) for _ in range(3)]
            >>> sampler.state_dict()["consumed"], sampler.state_dict(local_consumed=1)["consumed"]
            (6, 2)
        """
        self._sync()
        state = self._cursor.state("ShardedSampler", world_size=self.num_replicas)
        if local_consumed is None or local_consumed == self._yielded:
            return state
        if isinstance(local_consumed, bool) or not 0 <= local_consumed <= self._yielded:
            raise ValueError(
                f"local_consumed must be an int in [0, {self._yielded}] (the indices this pass "
                f"handed out), got {local_consumed!r}"
            )
        # fewer used than handed out: the pass is not over for this rank, whatever the iterator says
        remaining = self._cursor.num_samples - self._start
        state["epoch"] = self._cursor.epoch
        state["consumed"] = self._start + min(local_consumed * self.num_replicas, remaining)
        return state

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Resume from :meth:`state_dict` (any rank's, any world size's) over the same dataset.

        The saved seed replaces this sampler's; a dataset of another length or another ``shuffle``
        raises :class:`LoaderStateError`.

        Example:
            >>> a = ShardedSampler(range(10), num_replicas=2, rank=0, shuffle=False)
            >>> it = iter(a); _ = next(it), next(it)
            >>> b = ShardedSampler(range(10), num_replicas=3, rank=0, shuffle=False)
            >>> b.load_state_dict(a.state_dict())
            >>> list(b)     # the rest, 4..9, re-sharded over 3 ranks: rank 0 gets 4 and 7
            [4, 7]
        """
        self._cursor.load(state, "ShardedSampler")
        self._start, self._yielded = self._cursor.consumed, 0
