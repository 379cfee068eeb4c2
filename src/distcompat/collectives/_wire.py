"""What a backend is handed: contiguous tensors of dtypes it moves and reduces correctly.

Measured on gloo (backend_matrix.md): non-contiguous views give wrong results with no error
(all_reduce even overwrites the memory between strided elements); int16, the unsigned types wider
than a byte and every fp8 type raise "Invalid scalar type"; complex is refused by some ops. So
every tensor is *staged* into a wire form, and outputs are copied back into the caller's tensor::

    wire, finish = stage_output(user_tensor, reduce=True)
    ...collective on wire...
    finish()          # copy back (and convert) into user_tensor, if wire is not user_tensor

Wire forms, chosen from the dtype alone (correct on every backend; faster native paths are for the
capability probe to unlock later):

* native dtypes: the tensor itself if contiguous, else a contiguous copy;
* complex: ``view_as_real`` of that (reductions: SUM, AVG and PREMUL_SUM only);
* bool being reduced: canonical 0/1 bytes as uint8 (the reduce op is remapped in ``_reduce_ops``);
* other dtypes, moved: raw bytes (``view(torch.uint8)``, exact, first dimension kept);
* other dtypes, reduced: upcast (int16/uint16 -> int32, uint32 -> int64, fp8 -> float32), reduced,
  cast back with the dtype's own wrap-around; uint64 is reduced as the *same bits* viewed as
  int64 (two's complement SUM, PRODUCT and bitwise ops give identical bits; MIN/MAX flip the top
  bit first, see ``_reduce_ops``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = [
    "MOVE_NATIVE",
    "REDUCE_NATIVE",
    "Finish",
    "UnsupportedCollectiveError",
    "chain",
    "stage_input",
    "stage_output",
    "upcast_dtype",
]

Finish = Callable[[], None]

#: dtypes every backend reduces natively (MPI lacks half types: the probe will say so later).
REDUCE_NATIVE: frozenset[torch.dtype] = frozenset(
    {torch.float16, torch.bfloat16, torch.float32, torch.float64}
    | {torch.int8, torch.uint8, torch.int32, torch.int64}
)
#: dtypes moved natively (bool bytes are moved as they are).
MOVE_NATIVE: frozenset[torch.dtype] = REDUCE_NATIVE | {torch.bool}

#: dtypes reduced as a same-size view (no conversion: the bits are the value).
_REINTERPRET: dict[torch.dtype, torch.dtype] = {torch.uint64: torch.int64}
_UPCAST: dict[torch.dtype, torch.dtype] = {
    torch.int16: torch.int32,
    torch.uint16: torch.int32,
    torch.uint32: torch.int64,
}


class UnsupportedCollectiveError(TypeError):
    """The op cannot be done correctly for this dtype or ReduceOp on any backend."""


def upcast_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """Return the dtype a reduction of ``dtype`` runs in, or None when it runs natively."""
    if dtype in REDUCE_NATIVE or dtype.is_complex or dtype == torch.bool:
        return None
    if dtype in _UPCAST:
        return _UPCAST[dtype]
    if dtype in _REINTERPRET:
        return _REINTERPRET[dtype]
    if dtype.is_floating_point and dtype.itemsize == 1:  # the fp8 family
        return torch.float32
    raise UnsupportedCollectiveError(
        f"reductions of {dtype} are not supported: no backend reduces it and distcompat has no "
        "exact emulation (it can still be moved: broadcast, gather, send, ...)"
    )


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Return a uint8 view of contiguous ``t``, keeping dimension 0 (row splits stay valid)."""
    rows = t.shape[0] if t.dim() else 1
    return t.reshape(rows, math.prod(t.shape[1:])).view(torch.uint8)


def _encode(dense: torch.Tensor, reduce: bool) -> torch.Tensor:
    """Return the wire form of contiguous ``dense``; a view of it where one exists."""
    dtype = dense.dtype
    if dtype.is_complex:
        return torch.view_as_real(dense)
    if dtype == torch.bool:
        return dense.view(torch.uint8).clamp(max=1) if reduce else dense
    if not reduce:
        return dense if dtype in MOVE_NATIVE else _as_bytes(dense)
    if dtype in _REINTERPRET:
        return dense.view(_REINTERPRET[dtype])
    wider = upcast_dtype(dtype)
    return dense if wider is None else dense.to(wider)


def stage_input(t: torch.Tensor, *, reduce: bool) -> torch.Tensor:
    """Return the wire form of an input; never writes to ``t``.

    Example:
        >>> stage_input(torch.ones(4, 4).t(), reduce=True).is_contiguous()
        True
    """
    if t.is_contiguous() and t.dtype in (REDUCE_NATIVE if reduce else MOVE_NATIVE):
        return t  # the common case: nothing to do
    return _encode(_dense(t), reduce)


def stage_output(
    t: torch.Tensor, *, reduce: bool, fill: bool = False
) -> tuple[torch.Tensor, Finish]:
    """Return ``(wire, finish)``: the backend writes ``wire``; ``finish()`` puts it into ``t``.

    ``fill`` starts the wire with ``t``'s values (in-place ops such as all_reduce, broadcast).

    Example:
        >>> t = torch.zeros(4, 4).t()
        >>> wire, finish = stage_output(t, reduce=False)
        >>> _ = wire.fill_(1.0); finish()
        >>> bool((t == 1).all())
        True
    """
    if t.is_contiguous():
        if t.dtype in (REDUCE_NATIVE if reduce else MOVE_NATIVE):
            return t, _nothing  # the common case: the backend writes straight into t
        dense = t
    elif fill:
        dense = t.contiguous()
    else:
        dense = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    wire = _encode(dense, reduce)
    if _aliases(wire, dense):
        if dense is t:
            return wire, _nothing
        return wire, lambda: _copy_into(t, dense)
    return wire, lambda: _copy_into(t, _decode(wire, t))


def _copy_into(t: torch.Tensor, value: torch.Tensor) -> None:
    t.copy_(value)


def _aliases(wire: torch.Tensor, dense: torch.Tensor) -> bool:
    """Return True when ``wire`` is a view over ``dense``'s memory (no conversion to read it)."""
    return wire.untyped_storage().data_ptr() == dense.untyped_storage().data_ptr()


def _decode(wire: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if like.dtype == torch.bool:
        return wire.view(like.shape) != 0
    return wire.view(like.shape) if wire.dtype == like.dtype else wire.reshape(like.shape)


def _nothing() -> None:
    return None


def chain(*steps: Finish | None) -> Finish | None:
    """Run ``steps`` in order (skipping None); None when there is nothing to run."""
    present = [step for step in steps if step is not None and step is not _nothing]
    if not present:
        return None
    if len(present) == 1:
        return present[0]

    def run() -> None:
        for step in present:
            step()

    return run
