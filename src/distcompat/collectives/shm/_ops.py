"""The shared-memory ops of one group, as steps: all_reduce, broadcast, all-gathers, reduce_scatter.

Each op moves a tensor through the segment in chunks of at most one slot per rank, alternating
between the segment's two buffers (the details are in ``_engine``'s module docstring). An op is a
generator that yields at each barrier; :class:`Ops` makes them from the engine's segment and
barrier, and the engine (``_engine.Engine``, which inherits them) runs them::

    engine.run("all_reduce", engine.all_reduce(flat, dist.ReduceOp.SUM), async_op=False)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from distcompat.collectives.shm._barrier import Barrier
from distcompat.collectives.shm._folds import (
    _SMALL_KEYS,
    REDUCERS,
    _fold,
    _grain,
    _move,
    _part,
    _Small,
    writing_into,
)
from distcompat.collectives.shm._segment import Segment
from distcompat.collectives.shm._work import Call, Steps, signature

__all__ = ["Ops"]

R = dist.ReduceOp


class Ops:
    """The ops an engine runs (tensors are contiguous and 1-d; the same call on every rank)."""

    segment: Segment
    barrier: Barrier
    rank: int
    world: int
    _chunks: int
    _smalls: dict[tuple[Any, ...], _Small]
    _small_bytes: int

    def _next_buffer(self) -> int:
        self._chunks += 1
        return self._chunks & 1

    def all_reduce(self, flat: torch.Tensor, op: Any) -> Call:
        """Return the op (see ``_all_reduce``)."""
        return Call(
            signature("all_reduce", str(flat.dtype), flat.numel(), str(op)),
            writing_into(flat, self._all_reduce(flat, op)),
        )

    def _small(self, tensor: torch.Tensor, op: Any) -> _Small:
        """Return (and keep) what a small all_reduce of ``tensor``'s dtype, shape and op uses."""
        if len(self._smalls) >= _SMALL_KEYS:
            self._smalls.clear()
        dtype, shape, count = tensor.dtype, tensor.shape, tensor.numel()
        slots = self.segment.slots(dtype)
        found = self._smalls[dtype, shape, op] = _Small(
            signature("all_reduce", str(dtype), count, str(op)),
            [[slot[:count].view(shape) for slot in slots[b]] for b in (0, 1)],
            REDUCERS[R.SUM if op == R.AVG else op],
        )
        return found

    def _all_reduce(self, flat: torch.Tensor, op: Any) -> Steps:
        """Reduce ``flat`` in place across the ranks, parts reduced in rank order 0..w-1.

        Rank ``r`` copies in only the parts other ranks reduce, reads its own part of its own
        input where it is, and reduces its part piece by piece: in place in ``flat`` (ranks 0
        and 1) or in its slot's part ``r``, which it left free (later ranks); each piece is
        copied to the other place at once. Then it copies the other ranks' reduced parts out of
        their slots. AVG (floating dtypes) is the sum divided by the world size, on the part.
        """
        average = op == R.AVG
        fold = REDUCERS[R.SUM if average else op]
        seg, me, world = self.segment, self.rank, self.world
        size, itemsize = flat.numel(), flat.element_size()
        base = flat.data_ptr()
        if size * itemsize <= self._small_bytes:
            # One barrier instead of two: every rank folds every slot, in the same order
            buffer = self._next_buffer()
            _move(seg.address(buffer, me), base, size * itemsize)
            yield
            small = self._smalls.get((flat.dtype, flat.shape, op)) or self._small(flat, op)
            yield from _fold(small, small.views[buffer], flat)
            if average:
                flat.div_(world)
            return
        step = seg.slot_bytes // itemsize
        grain = _grain(step)
        for start in range(0, size, step):
            count = min(step, size - start)
            buffer = self._next_buffer()
            slots = seg.slots(flat.dtype)[buffer]
            mine = seg.address(buffer, me)
            here = base + start * itemsize
            parts = [_part(count, world, r, itemsize) for r in range(world)]
            lo, hi = parts[me]
            _move(mine, here, lo * itemsize)  # the parts the other ranks reduce
            _move(mine + hi * itemsize, here + hi * itemsize, (count - hi) * itemsize)
            yield
            chunk = flat[start : start + count]
            for a in range(lo, hi, grain):
                b = min(hi, a + grain)
                own = chunk[a:b]
                terms = [own if r == me else slots[r][a:b] for r in range(world)]
                # Ranks 0 and 1 read their own term in the first fold, so they can reduce in
                # place; a later rank keeps its term intact in ``flat`` until its turn.
                acc = own if me < 2 else slots[me][a:b]
                fold(terms[0], terms[1], out=acc)
                for term in terms[2:]:
                    fold(acc, term, out=acc)
                if average:
                    acc.div_(world)
                # publish the reduced piece (or take it home) while it is still in cache
                if acc is own:
                    _move(mine + a * itemsize, here + a * itemsize, (b - a) * itemsize)
                else:
                    _move(here + a * itemsize, mine + a * itemsize, (b - a) * itemsize)
            yield
            for r, (a, b) in enumerate(parts):
                if r != me:
                    _move(
                        here + a * itemsize,
                        seg.address(buffer, r) + a * itemsize,
                        (b - a) * itemsize,
                    )

    def broadcast(self, flat: torch.Tensor, root: int) -> Call:
        """Return the op (see ``_broadcast``)."""
        return Call(
            signature("broadcast", flat.numel() * flat.element_size(), root),
            self._broadcast(flat, root),
        )

    def _broadcast(self, flat: torch.Tensor, root: int) -> Steps:
        """Copy group rank ``root``'s ``flat`` into every rank's (the whole buffer per chunk)."""
        seg, me = self.segment, self.rank
        size = flat.numel() * flat.element_size()
        step = self.world * seg.slot_bytes
        base = flat.data_ptr()
        for start in range(0, size, step):
            count = min(step, size - start)
            region = seg.address(self._next_buffer(), 0)
            if me == root:
                _move(region, base + start, count)
            yield
            if me != root:
                _move(base + start, region, count)

    def all_gather(self, out: torch.Tensor, flat: torch.Tensor) -> Call:
        """Return the op (see ``_all_gather``)."""
        return Call(
            signature("all_gather", flat.numel() * flat.element_size()),
            self._all_gather(out, flat),
        )

    def _all_gather(self, out: torch.Tensor, flat: torch.Tensor) -> Steps:
        """Gather every rank's ``flat`` into ``out`` (rank r's at ``out[r * n : (r + 1) * n]``)."""
        seg, me, world = self.segment, self.rank, self.world
        size = flat.numel() * flat.element_size()  # bytes from each rank
        source, target = flat.data_ptr(), out.data_ptr()
        for start in range(0, size, seg.slot_bytes):
            count = min(seg.slot_bytes, size - start)
            buffer = self._next_buffer()
            _move(seg.address(buffer, me), source + start, count)
            yield
            for rank in range(world):
                _move(target + rank * size + start, seg.address(buffer, rank), count)

    def all_gather_rows(self, outs: list[torch.Tensor], flat: torch.Tensor) -> Call:
        """Return the op (see ``_all_gather_rows``)."""
        sizes = [out.numel() * out.element_size() for out in outs]
        return Call(signature("all_gather_rows", *sizes), self._all_gather_rows(outs, flat, sizes))

    def _all_gather_rows(
        self, outs: list[torch.Tensor], flat: torch.Tensor, sizes: list[int]
    ) -> Steps:
        """Gather rank r's ``flat`` (``sizes[r]`` bytes: they may differ) into ``outs[r]``."""
        seg, me = self.segment, self.rank
        source, targets = flat.data_ptr(), [out.data_ptr() for out in outs]
        for start in range(0, max(sizes), seg.slot_bytes):
            buffer = self._next_buffer()
            _move(seg.address(buffer, me), source + start, min(seg.slot_bytes, sizes[me] - start))
            yield
            for rank, size in enumerate(sizes):
                _move(
                    targets[rank] + start,
                    seg.address(buffer, rank),
                    min(seg.slot_bytes, size - start),
                )

    def reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, op: Any) -> Call:
        """Return the op (see ``_reduce_scatter``)."""
        return Call(
            signature("reduce_scatter", str(out.dtype), out.numel(), str(op)),
            writing_into(out, self._reduce_scatter(out, flat, op)),
        )

    def _reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, op: Any) -> Steps:
        """Reduce ``flat`` (w blocks of ``out.numel()``) and keep block ``rank``, in rank order.

        Each rank copies in the blocks of the other ranks' destinations; rank ``r`` folds block
        ``r`` of every rank (its own from its input) into ``out``.
        """
        average = op == R.AVG
        fold = REDUCERS[R.SUM if average else op]
        seg, me, world = self.segment, self.rank, self.world
        size, itemsize = out.numel(), out.element_size()
        blocks = flat.view(world, size)  # [destination rank, element]
        step = max(1, seg.slot_bytes // itemsize // world)
        grain = _grain(step)
        source = flat.data_ptr()
        for start in range(0, size, step):
            count = min(step, size - start)
            buffer = self._next_buffer()
            mine = seg.address(buffer, me)
            for dest in range(world):
                if dest != me:
                    _move(
                        mine + dest * count * itemsize,
                        source + (dest * size + start) * itemsize,
                        count * itemsize,
                    )
            yield
            slots = seg.slots(flat.dtype)[buffer]
            for a in range(0, count, grain):
                b = min(count, a + grain)
                target = out[start + a : start + b]
                lo, hi = me * count + a, me * count + b
                terms = [
                    blocks[me, start + a : start + b] if r == me else slots[r][lo:hi]
                    for r in range(world)
                ]
                fold(terms[0], terms[1], out=target)
                for term in terms[2:]:
                    fold(target, term, out=target)
                if average:
                    target.div_(world)
