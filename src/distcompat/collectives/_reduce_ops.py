"""Which ReduceOp the backend is asked for, and the named shim around it when it lacks the real one.

Measured on gloo 2.13 (backend_matrix.md): bool SUM adds bytes and wraps at 256 (a True flag
all-reduced 8 times on 2 ranks becomes False); PREMUL_SUM raises; AVG works for floats only;
NCCL has no bitwise ops. :func:`plan_reduction` turns the caller's op into one the backend does
correctly plus local steps, each with a name a user can print::

    plan = plan_reduction(dist.ReduceOp.AVG, torch.float32, world_size=2, backend="gloo")
    plan.shim   # 'avg-as-sum-then-divide'
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from distcompat.collectives._wire import UnsupportedCollectiveError, upcast_dtype

__all__ = ["ReducePlan", "local_reduce", "plan_fast", "plan_reduction"]

R = dist.ReduceOp
_SIGN_BIT = -(2**63)  # int64's top bit
_BITWISE = (R.BAND, R.BOR, R.BXOR)
#: bool reductions by their logical meaning, on canonical 0/1 bytes.
_BOOL_AS: dict[Any, Any] = {
    R.SUM: R.MAX,  # logical or, as NCCL remaps it
    R.MAX: R.MAX,
    R.BOR: R.MAX,
    R.PRODUCT: R.MIN,  # logical and
    R.MIN: R.MIN,
    R.BAND: R.MIN,
    R.BXOR: R.SUM,  # parity survives gloo's mod-256 byte add
}


@dataclass(frozen=True, slots=True)
class ReducePlan:
    """The op sent to the backend and the local steps around it; ``shim`` names them ('' = none)."""

    op: Any
    factor: Any = None  # PREMUL_SUM: multiply a temporary input by this first
    divide_by: int | None = None  # AVG emulation: divide the result by the world size
    parity: bool = False  # bool BXOR: keep the low bit of the byte sum
    flip_sign: bool = False  # uint64 MIN/MAX: flip the top bit so signed order = unsigned order
    gather: bool = False  # the backend lacks the op: all-gather every rank's input, reduce here
    shim: str = ""

    @property
    def has_finish(self) -> bool:
        """Whether :meth:`finish` has anything to do."""
        return self.divide_by is not None or self.parity or self.flip_sign

    def prepared(self, wire: torch.Tensor) -> torch.Tensor:
        """Return the input to send: a *copy* when it must be scaled or flipped, else ``wire``."""
        if self.factor is None and not self.flip_sign:
            return wire
        out = wire.clone()
        self.prepare_in_place(out)
        return out

    def prepare_in_place(self, wire: torch.Tensor) -> None:
        """Scale or flip an in-place op's buffer (it is overwritten with the result anyway)."""
        self.scale_in_place(wire)
        if self.flip_sign:
            wire.bitwise_xor_(_SIGN_BIT)

    def scale_in_place(self, wire: torch.Tensor) -> None:
        """Premultiply by the PREMUL_SUM factor: all a reduction over one rank does."""
        if self.factor is None:
            return
        try:
            wire.mul_(self.factor)
        except NotImplementedError:  # fp8 (and older torch's uint16/32) have no mul kernel
            wide = torch.complex128 if wire.is_complex() else torch.float64
            wire.copy_(wire.to(wide) * self.factor)

    def finish(self, wire: torch.Tensor) -> None:
        """Apply the steps that follow the backend's op to the wire result, in place."""
        if self.flip_sign:
            wire.bitwise_xor_(_SIGN_BIT)
        if self.divide_by is not None:
            wire.div_(self.divide_by)
        if self.parity:
            wire.bitwise_and_(1)


def _kind(op: Any) -> tuple[Any, Any]:
    """Split an op into (RedOpType, PREMUL_SUM factor or None)."""
    kind = getattr(op, "op", op)  # ReduceOp.PREMUL_SUM(factor) carries .op and .factor
    return kind, getattr(op, "factor", None)


_PLAIN = {kind: ReducePlan(kind) for kind in (R.SUM, R.MIN, R.MAX, R.PRODUCT)}
_NATIVE_DTYPES = frozenset(
    {torch.float16, torch.bfloat16, torch.float32, torch.float64}
    | {torch.int8, torch.uint8, torch.int32, torch.int64}
)


def plan_fast(op: Any, dtype: torch.dtype) -> ReducePlan | None:
    """Return the plan when it cannot depend on the backend (the common case), else None."""
    return _PLAIN.get(op) if dtype in _NATIVE_DTYPES else None


def plan_reduction(op: Any, dtype: torch.dtype, *, world_size: int, backend: str) -> ReducePlan:
    """Plan a reduction of ``dtype`` with ``op`` on ``backend``.

    Example:
        >>> plan_reduction(dist.ReduceOp.SUM, torch.bool, world_size=2, backend="gloo").shim
        'bool-sum-as-max'
    """
    fast = plan_fast(op, dtype)
    if fast is not None:
        return fast
    kind, factor = _kind(op)
    name = str(kind).rsplit(".", 1)[-1].lower()
    if dtype == torch.bool:
        if kind not in _BOOL_AS:
            raise UnsupportedCollectiveError(f"ReduceOp.{name.upper()} is undefined for bool")
        target = _BOOL_AS[kind]
        as_name = str(target).rsplit(".", 1)[-1].lower()
        shim = "bool-bxor-as-sum-parity" if kind == R.BXOR else f"bool-{name}-as-{as_name}"
        return ReducePlan(target, parity=kind == R.BXOR, shim=shim)
    compute = upcast_dtype(dtype) or dtype
    floating = compute.is_floating_point or compute.is_complex
    if compute.is_complex and kind not in (R.SUM, R.AVG, R.PREMUL_SUM):
        raise UnsupportedCollectiveError(
            f"ReduceOp.{name.upper()} is undefined for complex {dtype}: use SUM, AVG or PREMUL_SUM"
        )
    if kind in _BITWISE:
        if floating:
            raise UnsupportedCollectiveError(
                f"ReduceOp.{name.upper()} needs an integer or bool dtype, not {dtype}"
            )
        if backend == "nccl":  # NCCL has no bitwise reductions
            return ReducePlan(kind, gather=True, shim="bitwise-as-all-gather-then-local-reduce")
    if kind == R.AVG:
        if not floating:
            raise UnsupportedCollectiveError(
                f"ReduceOp.AVG of integer {dtype} would need a rounding rule; all_reduce with "
                "SUM and divide the way you want"
            )
        if backend == "nccl" and compute == dtype:
            return ReducePlan(R.AVG)
        return ReducePlan(R.SUM, divide_by=world_size, shim="avg-as-sum-then-divide")
    if kind == R.PREMUL_SUM:
        if not floating:
            raise UnsupportedCollectiveError(
                f"ReduceOp.PREMUL_SUM needs a floating dtype, not {dtype}"
            )
        if backend == "nccl" and compute == dtype and not compute.is_complex:
            return ReducePlan(op)
        if factor is None:
            raise UnsupportedCollectiveError(
                "this torch's PREMUL_SUM op does not expose its factor (torch < 2.13 hides it), "
                "so it can only run natively on NCCL: multiply by the factor yourself and use SUM"
            )
        return ReducePlan(R.SUM, factor=factor, shim="premul-sum-as-scaled-copy-then-sum")
    if dtype == torch.uint64:
        if kind in (R.MIN, R.MAX):
            return ReducePlan(kind, flip_sign=True, shim="uint64-minmax-as-int64-sign-flipped")
        return ReducePlan(kind, shim="uint64-as-int64-bits")
    shim = f"{dtype}-reduced-as-{compute}".replace("torch.", "") if compute != dtype else ""
    return ReducePlan(kind, shim=shim)


def local_reduce(stacked: torch.Tensor, op: Any) -> torch.Tensor:
    """Reduce ``stacked`` (world_size, n) over its first dimension with a backend op.

    Used where a reduce-scatter is done as an all-to-all plus a local reduction.

    Example:
        >>> local_reduce(torch.tensor([[1, 5], [3, 2]]), dist.ReduceOp.MAX)
        tensor([3, 5])
    """
    if op == R.SUM:
        return stacked.sum(0)
    if op == R.MAX:
        return stacked.amax(0)
    if op == R.MIN:
        return stacked.amin(0)
    if op == R.PRODUCT:
        return stacked.prod(0)
    bitwise = {R.BAND: torch.bitwise_and, R.BOR: torch.bitwise_or, R.BXOR: torch.bitwise_xor}
    if op in bitwise:
        return functools.reduce(bitwise[op], stacked.unbind(0))
    raise UnsupportedCollectiveError(f"no local reduction for {op}")
