"""What a backend is handed: contiguous tensors of dtypes it moves and reduces correctly.

Measured on gloo (backend_matrix.md): non-contiguous views give wrong results with no error
(all_reduce even overwrites the memory between strided elements); int16, the unsigned types wider
than a byte and every fp8 type raise "Invalid scalar type"; complex is refused by some ops. So
every tensor is *staged* into a wire form, and outputs are copied back into the caller's tensor;
a reduction also takes its plan's local steps (``_reduce_ops.ReducePlan``: scale, flip, divide)::

    wire, settle = stage_reduction(user_tensor, plan, in_place=True)
    ...collective on wire...
    settle()          # the plan's steps, then copy back (and convert) into user_tensor

Wire forms, chosen from the dtype alone (correct on every backend; faster native paths are for the
capability probe to unlock later):

* native dtypes: the tensor itself if contiguous, else a contiguous copy;
* complex: ``view_as_real`` of that (reductions: SUM, AVG and PREMUL_SUM only);
* bool being reduced: canonical 0/1 bytes as uint8 (the reduce op is remapped in ``_reduce_ops``);
* other dtypes, moved: raw bytes (``view(torch.uint8)``, exact, first dimension kept);
* other dtypes, reduced: upcast to the plan's ``upcast`` dtype (int16/uint16 -> int32, uint32 ->
  int64, fp8 -> float32), reduced, cast back with the dtype's own wrap-around; uint64 is reduced
  as the *same bits* viewed as int64 (two's complement SUM, PRODUCT and bitwise ops give
  identical bits; MIN/MAX flip the top bit first).

This module applies what ``_reduce_ops`` decides and asks it nothing: a reduction's tensors go
from the caller to the wire and back here, in one place.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch

__all__ = [
    "MOVE_NATIVE",
    "REDUCE_NATIVE",
    "REINTERPRET",
    "Finish",
    "PlanSteps",
    "Transport",
    "UnsupportedCollectiveError",
    "chain",
    "scale",
    "stage_input",
    "stage_output",
    "stage_reduction",
]

Finish = Callable[[], None]
#: What a route hands ``issue()``: starts the transport (``async_op`` in), returns its Work.
Transport = Callable[[bool], Any]

#: dtypes every backend reduces natively (MPI lacks half types: the probe will say so later).
REDUCE_NATIVE: frozenset[torch.dtype] = frozenset(
    {torch.float16, torch.bfloat16, torch.float32, torch.float64}
    | {torch.int8, torch.uint8, torch.int32, torch.int64}
)
#: dtypes moved natively (bool bytes are moved as they are).
MOVE_NATIVE: frozenset[torch.dtype] = REDUCE_NATIVE | {torch.bool}

#: dtypes reduced as a same-size view (no conversion: the bits are the value).
REINTERPRET: dict[torch.dtype, torch.dtype] = {torch.uint64: torch.int64}
_SIGN_BIT = -(2**63)  # int64's top bit


class UnsupportedCollectiveError(TypeError):
    """The op cannot be done correctly for this dtype or ReduceOp on any backend."""


class PlanSteps(Protocol):
    """What this module takes from a reduction's plan (``_reduce_ops.ReducePlan``)."""

    @property
    def factor(self) -> Any: ...  # PREMUL_SUM: multiply by this before sending
    @property
    def flip_sign(self) -> bool: ...  # uint64 MIN/MAX: flip the top bit before and after
    @property
    def divide_by(self) -> int | None: ...  # AVG emulated: divide the result by this
    @property
    def parity(self) -> bool: ...  # bool BXOR: keep the low bit of the byte sum
    @property
    def upcast(self) -> torch.dtype | None: ...  # converted to this dtype to be reduced


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Return a uint8 view of contiguous ``t``, keeping dimension 0 (row splits stay valid)."""
    rows = t.shape[0] if t.dim() else 1
    return t.reshape(rows, math.prod(t.shape[1:])).view(torch.uint8)


def _encode(dense: torch.Tensor, plan: PlanSteps | None) -> torch.Tensor:
    """Return the wire form of contiguous ``dense`` (reduced by ``plan``, else moved)."""
    dtype = dense.dtype
    if dtype.is_complex:
        return torch.view_as_real(dense)
    if dtype == torch.bool:
        return dense.view(torch.uint8).clamp(max=1) if plan is not None else dense
    if plan is None:
        return dense if dtype in MOVE_NATIVE else _as_bytes(dense)
    if dtype in REINTERPRET:
        return dense.view(REINTERPRET[dtype])
    return dense if plan.upcast is None else dense.to(plan.upcast)


def stage_input(t: torch.Tensor, plan: PlanSteps | None = None) -> torch.Tensor:
    """Return the wire form of an input, to move or (``plan``) to reduce; never writes to ``t``.

    A reduction's input is also prepared (scaled, flipped): in a copy where it is ``t``'s memory.

    Example:
        >>> stage_input(torch.ones(4, 4).t()).is_contiguous()
        True
    """
    if t.is_contiguous() and t.dtype in (MOVE_NATIVE if plan is None else REDUCE_NATIVE):
        wire = t  # the common case: nothing to do
    else:
        wire = _encode(_dense(t), plan)
    if plan is None or (plan.factor is None and not plan.flip_sign):
        return wire
    if _aliases(wire, t):
        wire = wire.clone()
    _prepare(plan, wire)
    return wire


def stage_output(
    t: torch.Tensor, plan: PlanSteps | None = None, *, fill: bool = False
) -> tuple[torch.Tensor, Finish]:
    """Return ``(wire, finish)``: the backend writes ``wire``; ``finish()`` puts it into ``t``.

    ``plan``: the wire of a reduction (see :func:`stage_reduction`). ``fill`` starts the wire
    with ``t``'s values (in-place ops such as all_reduce, broadcast).

    Example:
        >>> t = torch.zeros(4, 4).t()
        >>> wire, finish = stage_output(t)
        >>> _ = wire.fill_(1.0); finish()
        >>> bool((t == 1).all())
        True
    """
    if t.is_contiguous():
        if t.dtype in (MOVE_NATIVE if plan is None else REDUCE_NATIVE):
            return t, _nothing  # the common case: the backend writes straight into t
        dense = t
    elif fill:
        dense = t.contiguous()
    else:
        dense = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    wire = _encode(dense, plan)
    if _aliases(wire, dense):
        if dense is t:
            return wire, _nothing
        return wire, lambda: _copy_into(t, dense)
    return wire, lambda: _copy_into(t, _decode(wire, t))


def stage_reduction(
    t: torch.Tensor, plan: PlanSteps, *, in_place: bool
) -> tuple[torch.Tensor, Finish | None]:
    """Return ``(wire, settle)``: a reduction's result buffer, and what settles it into ``t``.

    ``settle`` takes ``plan``'s steps after the backend's op (flip back, divide, parity), then
    copies back. ``in_place`` (all_reduce, reduce onto this rank): the wire starts as ``t``'s
    values, prepared (scaled, flipped) to be sent; else it only receives.

    Example:
        >>> import torch.distributed as dist
        >>> from distcompat.collectives._reduce_ops import plan_reduction
        >>> avg = plan_reduction(dist.ReduceOp.AVG, torch.float32, world_size=2, backend="gloo")
        >>> t = torch.tensor([3.0, 5.0])
        >>> wire, settle = stage_reduction(t, avg, in_place=True)
        >>> _ = wire.mul_(2)   # what a SUM over two equal ranks leaves in the wire
        >>> settle(); t        # AVG as SUM, then divide
        tensor([3., 5.])
    """
    wire, copy_back = stage_output(t, plan, fill=in_place)
    if in_place:
        _prepare(plan, wire)
    if plan.divide_by is None and not plan.parity and not plan.flip_sign:
        return wire, chain(copy_back)
    return wire, chain(lambda: _finish(plan, wire), copy_back)


def scale(plan: PlanSteps, wire: torch.Tensor) -> None:
    """Premultiply by ``plan``'s PREMUL_SUM factor in place: all a reduction over one rank does.

    Example:
        >>> import torch.distributed as dist
        >>> from distcompat.collectives._reduce_ops import ReducePlan
        >>> t = torch.ones(2); scale(ReducePlan(dist.ReduceOp.SUM, factor=3.0), t); t
        tensor([3., 3.])
    """
    if plan.factor is None:
        return
    try:
        wire.mul_(plan.factor)
    except NotImplementedError:  # fp8 (and older torch's uint16/32) have no mul kernel
        wide = torch.complex128 if wire.is_complex() else torch.float64
        wire.copy_(wire.to(wide) * plan.factor)


def _prepare(plan: PlanSteps, wire: torch.Tensor) -> None:
    """Scale or flip a buffer about to be sent (the wire, never the caller's tensor)."""
    scale(plan, wire)
    if plan.flip_sign:
        wire.bitwise_xor_(_SIGN_BIT)


def _finish(plan: PlanSteps, wire: torch.Tensor) -> None:
    """Take ``plan``'s steps that follow the backend's op, on the wire result, in place."""
    if plan.flip_sign:
        wire.bitwise_xor_(_SIGN_BIT)
    if plan.divide_by is not None:
        wire.div_(plan.divide_by)
    if plan.parity:
        wire.bitwise_and_(1)


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
