"""How the shared-memory ops fold and copy: reducers, serial folds, chunk parts.

The pieces every op of the path (``_ops``) uses on the tensors in the segment's slots, kept apart
from the ops' order of steps::

    threads = _serial()                    # this thread's torch ops single-threaded
    _fold_into(REDUCERS[R.SUM], terms, out)   # out = terms[0] + terms[1] + ..., in rank order
    _give_back(threads)
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from distcompat.collectives.shm._work import Steps

__all__ = ["REDUCERS", "SMALL_BYTES", "writing_into"]

R = dist.ReduceOp
_Reducer = Callable[..., torch.Tensor]
#: How a slot is folded into the running result, in place (``fn(acc, other, out=acc)``).
REDUCERS: dict[Any, _Reducer] = {
    R.SUM: torch.add,
    R.PRODUCT: torch.mul,
    R.MIN: torch.minimum,
    R.MAX: torch.maximum,
    R.BAND: torch.bitwise_and,
    R.BOR: torch.bitwise_or,
    R.BXOR: torch.bitwise_xor,
}
_ALIGN = 64  # parts of a chunk start on cache-line boundaries: ranks write disjoint lines
#: Elements per torch op where the process has intra-op threads: below torch's grain size
#: (32768) its kernels run in this thread only. Intra-op threads would spin in OpenMP while the
#: other ranks need the cores (measured: 60x slower at 1 MiB with 2 threads per rank, 2 ranks on
#: 2 cores). With one thread (torchrun's default, the demo's), one op per part: each op costs
#: about 2 us of dispatch, 4 % of a 64 MiB all_reduce in 128 KiB pieces.
_SERIAL = 32768 - 64
#: Tensors up to this size (and the slot's) are all-reduced with one barrier: every rank folds
#: every slot (the same order everywhere, so the same bits), instead of each reducing a part and
#: a second barrier. Measured at 2 and 4 ranks on 2 cores, side by side: one barrier was faster
#: at every size up to the 1 MiB slot (1 MiB: 354 vs 601 us at 2 ranks, 1529 vs 2134 us at 4).
SMALL_BYTES = 1 << 20
_memmove = ctypes.memmove  # a plain memcpy that releases the GIL and starts no threads


def _move(dst: int, src: int, nbytes: int) -> None:
    if nbytes > 0:
        _memmove(dst, src, nbytes)


def _grain(count: int) -> int:
    """Return how many elements one reducing torch op takes (see ``_SERIAL``)."""
    return count if torch.get_num_threads() == 1 else _SERIAL


_per_thread: bool | None = None


def _threads_per_thread() -> bool:
    """Return whether torch's intra-op thread count is per thread (its OpenMP backend).

    With OpenMP, ``torch.set_num_threads`` sets the calling thread's count only (OpenMP's
    nthreads-var is per thread), so an op can run its folds serially in whole chunks and give
    the caller's count back after; the Linux x86-64 wheels use OpenMP. Elsewhere the folds go
    in ``_SERIAL`` pieces instead (``_grain``).
    """
    global _per_thread
    if _per_thread is None:
        _per_thread = "parallel backend: OpenMP" in torch.__config__.parallel_info()
    return _per_thread


def _serial() -> int:
    """Make this thread's torch ops single-threaded; return the count to give back (0: none).

    Measured (2 ranks on 2 cores, 64 MiB all_reduce): 20.4 ms with one thread, 34.7 ms with two
    threads and ``_SERIAL`` pieces (each piece's Python runs with cold caches).
    """
    threads = torch.get_num_threads()
    if threads == 1 or not _threads_per_thread():
        return 0
    torch.set_num_threads(1)
    return threads


def _give_back(threads: int) -> None:
    """Undo :func:`_serial`."""
    if threads:
        torch.set_num_threads(threads)


@dataclass(frozen=True, slots=True)
class _Small:
    """What a small all_reduce of one dtype, shape and op uses: kept per engine."""

    signature: int
    views: list[list[torch.Tensor]]  # [buffer][rank]: the slots' first elements, as the shape
    fold: _Reducer


#: Small all_reduce set-ups an engine keeps (dtype, shape and op each); then it starts over.
_SMALL_KEYS = 64


def _fold_into(fold: _Reducer, terms: list[torch.Tensor], out: torch.Tensor) -> None:
    """Fold ``terms`` into ``out`` in rank order (in ``_SERIAL`` pieces with intra-op threads)."""
    count = out.numel()
    if count <= _SERIAL or torch.get_num_threads() == 1:
        fold(terms[0], terms[1], out=out)
        for term in terms[2:]:
            fold(out, term, out=out)
        return
    flat, pieces = out.view(-1), [term.view(-1) for term in terms]
    for a in range(0, count, _SERIAL):
        b = min(count, a + _SERIAL)
        _fold_into(fold, [piece[a:b] for piece in pieces], flat[a:b])


def _fold(small: _Small, terms: list[torch.Tensor], out: torch.Tensor) -> Steps:
    """Fold a small all_reduce's slots into ``out``: its one step after the barrier."""
    _fold_into(small.fold, terms, out)
    yield from ()


def writing_into(out: torch.Tensor, steps: Steps) -> Steps:
    """Return an op's ``steps``, which fold into ``out``, able to write into an inference tensor.

    torch refuses an in-place update to a tensor made under ``torch.inference_mode()`` outside
    it, and the steps run in whichever thread waits (or the group's): for such an ``out`` each
    step runs under inference mode, entered and left around it, as no thread may keep it
    across a barrier. Other tensors' steps are returned as they are, at no cost.
    """
    return _inference_steps(steps) if out.is_inference() else steps


def _inference_steps(steps: Steps) -> Steps:
    while True:
        with torch.inference_mode():
            try:
                next(steps)
            except StopIteration:
                return
        yield


def _part(count: int, world: int, rank: int, itemsize: int) -> tuple[int, int]:
    """Return rank's [lo, hi) element range of a ``count``-element chunk (cache-line aligned)."""
    align = max(1, _ALIGN // itemsize)
    lo = count * rank // world // align * align
    hi = count if rank == world - 1 else count * (rank + 1) // world // align * align
    return lo, hi
