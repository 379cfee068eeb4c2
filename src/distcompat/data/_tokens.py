"""Sharded, resumable (inputs, targets) batches from flat token files, without loading them.

The two lines a training script writes::

    loader = TokenLoader(["train_000.bin", "train_001.bin"], batch_size=8, seq_len=1024)
    for inputs, targets in loader: ...     # int64 (B, T) each; targets = inputs shifted by one

A token file is a flat little-endian array of uint16 or uint32 token ids (:func:`write_tokens`
writes one). A *sample* is a window of ``seq_len + 1`` tokens; file ``f`` with ``L`` tokens holds
``(L - 1) // seq_len`` windows starting at ``0, T, 2T, ...`` (neighbours share one token, as input
and target), and windows never cross files. Samples are numbered across files; each epoch has one
global order of them (a seeded permutation, or file order without shuffling), consumed in rounds of
``world_size * batch_size``: rank ``r`` takes the ``r``-th block of ``batch_size`` in every round,
and the tail shorter than a round is dropped, so every rank yields the same number of batches.

Memory: files are never read whole. Each batch's windows are copied straight from the files into
one ``(B, T+1)`` buffer (see ``_tokenfile`` for the two readers), so the resident set does not grow
with the dataset. The one O(dataset) structure is the epoch's permutation: 8 bytes per window.
"""

from __future__ import annotations

import os
from bisect import bisect_right
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch

from distcompat._ranks import get_rank, get_world_size
from distcompat.data._shard import EmptyShardError, check_world
from distcompat.data._state import EpochCursor
from distcompat.data._tokenfile import (
    BIG_ENDIAN,
    TokenFile,
    batch_buffer,
    choose_reader,
    resolve_dtype,
    swap_bytes,
)

__all__ = ["TokenLoader"]


class TokenLoader:
    """Sharded, resumable (inputs, targets) batches from flat token files, never read whole.

    Every rank yields ``len(loader)`` batches per epoch (the tail shorter than one round of
    ``world_size * batch_size`` windows is dropped), so no rank runs out first and hangs the others.
    Iterating runs the rest of the current epoch; the next iteration starts the next epoch (with a
    new order when shuffling) whether or not :meth:`set_epoch` is called. ``state_dict()`` at a step
    boundary is the same on every rank; ``load_state_dict`` resumes exactly, also with another world
    size or batch size (the remaining windows of the epoch are then re-sharded, each seen once).

    Args:
        files: a path or a sequence of paths to flat token files.
        batch_size: windows per batch on each rank (B).
        seq_len: tokens per row of ``inputs`` (T); a window holds ``T + 1`` tokens.
        dtype: storage dtype of the files: ``torch.uint16`` or ``torch.uint32`` (or their names).
        rank: this rank; default ``distcompat.get_rank()`` (0 without a group).
        world_size: number of ranks; default ``distcompat.get_world_size()`` (1 without a group).
        seed: seed of the per-epoch order (mixed with the epoch number).
        shuffle: draw a new window order each epoch; False keeps file order.
        device: where batches are delivered (pinned host memory and a non-blocking copy for CUDA).
        reader: ``"auto"`` (positioned reads where ``os.preadv`` exists, else mmap), ``"pread"``
            or ``"mmap"``; ``loader.reader`` says which one runs and why.

    Raises:
        EmptyShardError: the files hold fewer than ``world_size * batch_size`` windows, so some rank
            would get no batch (a ValueError; raised on every rank alike).
        TokenFileError: a file's size is not a whole number of tokens of ``dtype``.

    Example:
        >>> import tempfile, os, torch
        >>> from distcompat.data import write_tokens
        >>> path = write_tokens(os.path.join(tempfile.mkdtemp(), "t.bin"), torch.arange(100))
        >>> loader = TokenLoader(path, batch_size=2, seq_len=8, shuffle=False)
        >>> len(loader), loader.num_windows
        (6, 12)
        >>> inputs, targets = next(iter(loader))
        >>> inputs[0].tolist(), targets[0].tolist()
        ([0, 1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8])
        >>> loader.state_dict()["consumed"]
        2
    """

    def __init__(
        self,
        files: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        batch_size: int,
        seq_len: int,
        dtype: torch.dtype | str = torch.uint16,
        rank: int | None = None,
        world_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        device: str | torch.device = "cpu",
        reader: str = "auto",
    ) -> None:
        paths = [Path(files)] if isinstance(files, (str, os.PathLike)) else [Path(f) for f in files]
        if not paths:
            raise ValueError("TokenLoader needs at least one token file, got an empty sequence")
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if rank is None or world_size is None:
            rank = get_rank() if rank is None else rank
            world_size = get_world_size() if world_size is None else world_size
        self.rank, self.world_size = check_world(rank, world_size)
        self.batch_size, self.seq_len = batch_size, seq_len
        self.dtype = resolve_dtype(dtype)
        self.device = torch.device(device)
        self.reader = choose_reader(reader)
        self._files = [TokenFile(p, self.dtype, self.reader.reader) for p in paths]
        counts = [max(f.length - 1, 0) // seq_len for f in self._files]
        self._starts = [0]
        for count in counts:
            self._starts.append(self._starts[-1] + count)
        self.num_windows = self._starts[-1]
        per_round = self.world_size * batch_size
        if self.num_windows < per_round:
            raise EmptyShardError(
                f"{len(paths)} token file(s) hold {self.num_windows} window(s) of seq_len+1="
                f"{seq_len + 1} tokens, fewer than world_size*batch_size={per_round}: some rank "
                "would get no batch. Use more data, a smaller batch_size or seq_len, or fewer ranks"
            )
        self._cursor = EpochCursor(num_samples=self.num_windows, seed=seed, shuffle=shuffle)

    def __len__(self) -> int:
        """Batches every rank yields in a full epoch at this world size."""
        return self.num_windows // (self.world_size * self.batch_size)

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from (a completed epoch reads as the next one)."""
        return self._cursor.position()[0]

    def set_epoch(self, epoch: int) -> None:
        """Jump to ``epoch`` (optional: epochs advance by themselves after each full pass).

        Calling it with the current epoch keeps a resumed mid-epoch position, so the usual
        ``for epoch in range(start, n): loader.set_epoch(epoch)`` loop works after a resume.

        Example:
            >>> import tempfile, os, torch
            >>> from distcompat.data import write_tokens
            >>> path = write_tokens(os.path.join(tempfile.mkdtemp(), "t.bin"), torch.arange(50))
            >>> loader = TokenLoader(path, batch_size=1, seq_len=4)
            >>> loader.set_epoch(3)
            >>> loader.epoch
            3
        """
        self._cursor.set_epoch(epoch, owner="TokenLoader")

    def state_dict(self) -> dict[str, int | bool | str]:
        """Return the global position: epoch, seed, windows all ranks consumed, and checks.

        Example:
            >>> import tempfile, os, torch
            >>> from distcompat.data import write_tokens
            >>> path = write_tokens(os.path.join(tempfile.mkdtemp(), "t.bin"), torch.arange(50))
            >>> state = TokenLoader(path, batch_size=1, seq_len=4).state_dict()
            >>> state["epoch"], state["consumed"]
            (0, 0)
        """
        return self._cursor.state(
            "TokenLoader",
            seq_len=self.seq_len,
            world_size=self.world_size,
            batch_size=self.batch_size,
        )

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Resume from :meth:`state_dict` of any rank of any world size over the same files.

        The saved seed replaces this loader's. Raises :class:`LoaderStateError` (a ValueError) when
        the state describes other data (window count, ``seq_len`` or ``shuffle`` differ).

        Example:
            >>> import tempfile, os, torch
            >>> from distcompat.data import write_tokens
            >>> path = write_tokens(os.path.join(tempfile.mkdtemp(), "t.bin"), torch.arange(50))
            >>> a = TokenLoader(path, batch_size=2, seq_len=4, world_size=2, rank=0)
            >>> _ = next(iter(a))
            >>> b = TokenLoader(path, batch_size=2, seq_len=4, world_size=1, rank=0)
            >>> b.load_state_dict(a.state_dict())
            >>> b.state_dict()["consumed"]
            4
        """
        self._cursor.load(state, "TokenLoader", seq_len=self.seq_len)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield the rest of the current epoch as ``(inputs, targets)`` int64 (B, T) pairs."""
        cursor = self._cursor
        per_round, mine = self.world_size * self.batch_size, self.rank * self.batch_size
        order, _ = cursor.begin_pass(done=lambda consumed: consumed + per_round > self.num_windows)
        while cursor.consumed + per_round <= self.num_windows:
            first = cursor.consumed + mine
            batch = self._read(order[first : first + self.batch_size].tolist())
            cursor.consumed += per_round
            yield batch
        cursor.finished = True

    def _read(self, windows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.seq_len
        raw, raw_bytes = batch_buffer(len(windows), T + 1, self.dtype)  # (B, T+1) file tokens
        row_bytes = len(raw_bytes) // len(windows)
        for row, window in enumerate(windows):
            f = bisect_right(self._starts, window) - 1
            start = (window - self._starts[f]) * T
            span = raw_bytes[row * row_bytes : (row + 1) * row_bytes]
            self._files[f].read(raw[row], span, start)
        if self.reader.reader == "mmap":
            for token_file in self._files:
                token_file.release()
        if BIG_ENDIAN:
            raw = swap_bytes(raw)
        inputs = torch.empty((len(windows), T), dtype=torch.int64).copy_(raw[:, :-1])
        targets = torch.empty((len(windows), T), dtype=torch.int64).copy_(raw[:, 1:])
        if self.device.type == "cuda":
            return (
                inputs.pin_memory().to(self.device, non_blocking=True),
                targets.pin_memory().to(self.device, non_blocking=True),
            )
        if self.device.type != "cpu":
            return inputs.to(self.device), targets.to(self.device)
        return inputs, targets
