"""Which ReduceOp the backend is asked for, and the named shim around it when it lacks the real one.

Measured on gloo 2.13 (backend_matrix.md): bool SUM adds bytes and wraps at 256 (a True flag
all-reduced 8 times on 2 ranks becomes False); PREMUL_SUM raises; AVG works for floats only;
NCCL has no bitwise ops. :func:`plan_reduction` turns the caller's op into one the backend does
correctly plus local steps, each with a name a user can print::

    plan = plan_reduction(dist.ReduceOp.AVG, torch.float32, world_size=2, backend="gloo")
    plan.shim   # 'avg-as-sum-then-divide'

A plan is a decision only: ``_wire`` takes its steps on the tensors (``stage_reduction``).
:func:`plan_call` plans a call (with the group's probe cells where it was probed), and
:func:`by_gathering` is the transport of a plan whose op the backend lacks.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from distcompat.collectives._group import backend_for, group_size
from distcompat.collectives._native import all_gather_flat
from distcompat.collectives._probed import probed_for
from distcompat.collectives._wire import (
    REDUCE_NATIVE,
    REINTERPRET,
    Finish,
    Transport,
    UnsupportedCollectiveError,
)

__all__ = [
    "PROBED_COLLECTIVES",
    "ReducePlan",
    "by_gathering",
    "local_reduce",
    "plan_call",
    "plan_fast",
    "plan_reduction",
    "upcast_dtype",
]

R = dist.ReduceOp
_UPCAST: dict[torch.dtype, torch.dtype] = {
    torch.int16: torch.int32,
    torch.uint16: torch.int32,
    torch.uint32: torch.int64,
}
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
    upcast: torch.dtype | None = None  # converted to this dtype to be reduced (int16, fp8, ...)
    shim: str = ""
    source: str = ""  # why: the probe cell this plan follows, '' for the plan that holds everywhere


def _kind(op: Any) -> tuple[Any, Any]:
    """Split an op into (RedOpType, PREMUL_SUM factor or None)."""
    kind = getattr(op, "op", op)  # ReduceOp.PREMUL_SUM(factor) carries .op and .factor
    return kind, getattr(op, "factor", None)


_PLAIN = {kind: ReducePlan(kind) for kind in (R.SUM, R.MIN, R.MAX, R.PRODUCT)}


def plan_fast(op: Any, dtype: torch.dtype) -> ReducePlan | None:
    """Return the plan when it cannot depend on the backend (the common case), else None."""
    return _PLAIN.get(op) if dtype in REDUCE_NATIVE else None


def upcast_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """Return the dtype a reduction of ``dtype`` runs in, or None when it runs natively.

    Example:
        >>> upcast_dtype(torch.int16)
        torch.int32
    """
    if dtype in REDUCE_NATIVE or dtype.is_complex or dtype == torch.bool:
        return None
    if dtype in _UPCAST:
        return _UPCAST[dtype]
    if dtype in REINTERPRET:
        return REINTERPRET[dtype]
    if dtype.is_floating_point and dtype.itemsize == 1:  # the fp8 family
        return torch.float32
    raise UnsupportedCollectiveError(
        f"reductions of {dtype} are not supported: no backend reduces it and distcompat has no "
        "exact emulation (it can still be moved: broadcast, gather, send, ...)"
    )


def plan_call(
    op: Any, tensor: torch.Tensor, group: Any, world_size: int, collective: str
) -> ReducePlan:
    """Plan the reduction of ``collective``; the capability probe's cells apply where it ran it.

    Example:
        >>> plan_call(dist.ReduceOp.SUM, torch.ones(2), None, 1, "all_reduce").op
        <RedOpType.SUM: 0>
    """
    probed = probed_for(group) if collective in PROBED_COLLECTIVES and world_size > 1 else None
    key = None
    if probed is not None and probed.device_type == tensor.device.type:
        # A PREMUL_SUM factor may be a tensor, so those plans are made afresh every call.
        kind = getattr(op, "op", op)
        key = None if kind == R.PREMUL_SUM else (kind, tensor.dtype, world_size, collective)
        cached: ReducePlan | None = probed.plans.get(key) if key is not None else None
        if cached is not None:
            return cached
    else:
        probed = None
        fast = plan_fast(op, tensor.dtype)
        if fast is not None:
            return fast
    plan = plan_reduction(
        op,
        tensor.dtype,
        world_size=world_size,
        backend=backend_for(group, tensor.device) if world_size > 1 else "none",
        probed=probed.cells if probed is not None else None,
        collective=collective,
    )
    if probed is not None and key is not None:
        probed.plans[key] = plan
    return plan


def _op_name(op: Any) -> str:
    return str(_kind(op)[0]).rsplit(".", 1)[-1].upper()


def plan_reduction(
    op: Any,
    dtype: torch.dtype,
    *,
    world_size: int,
    backend: str,
    probed: Mapping[tuple[str, str, str], str] | None = None,
    collective: str = "all_reduce",
) -> ReducePlan:
    """Plan a reduction of ``dtype`` with ``op`` on ``backend``.

    ``probed`` holds the group's agreed capability-probe cells, if it was probed. The op sent is
    then checked against the cell for the dtype the backend sees (bool as uint8 bytes, complex as
    its real view, int16 as int32, ...): a native AVG or PREMUL_SUM the probe saw give the right
    answer is used as it is, and an op it saw fail is done by all-gather and a local reduction.
    The probe covers ``all_reduce`` and ``reduce``; the reduce-scatters keep the plan that is
    correct everywhere.

    Example:
        >>> plan_reduction(dist.ReduceOp.SUM, torch.bool, world_size=2, backend="gloo").shim
        'bool-sum-as-max'
        >>> cells = {("all_reduce", "float32", "AVG"): "ok"}
        >>> plan = plan_reduction(dist.ReduceOp.AVG, torch.float32, world_size=2,
        ...                       backend="gloo", probed=cells)
        >>> plan.op == dist.ReduceOp.AVG, plan.source
        (True, 'probe: all_reduce float32 AVG ok')
    """
    fast = plan_fast(op, dtype)
    if fast is not None:
        return _settle(fast, probed, collective, dtype)
    kind, factor = _kind(op)
    name = _op_name(kind).lower()
    if dtype == torch.bool:
        if kind not in _BOOL_AS:
            raise UnsupportedCollectiveError(f"ReduceOp.{name.upper()} is undefined for bool")
        target = _BOOL_AS[kind]
        as_name = _op_name(target).lower()
        shim = "bool-bxor-as-sum-parity" if kind == R.BXOR else f"bool-{name}-as-{as_name}"
        plan = ReducePlan(target, parity=kind == R.BXOR, shim=shim)
        return _settle(plan, probed, collective, torch.uint8)  # canonical 0/1 bytes
    compute = upcast_dtype(dtype) or dtype
    upcast = compute if compute != dtype and dtype not in REINTERPRET else None
    wire = _REAL.get(compute, compute)  # complex is sent as its real view
    floating = compute.is_floating_point or compute.is_complex
    if compute.is_complex and kind not in (R.SUM, R.AVG, R.PREMUL_SUM):
        raise UnsupportedCollectiveError(
            f"ReduceOp.{name.upper()} is undefined for complex {dtype}: use SUM, AVG or PREMUL_SUM"
        )
    if kind in _BITWISE and floating:
        raise UnsupportedCollectiveError(
            f"ReduceOp.{name.upper()} needs an integer or bool dtype, not {dtype}"
        )
    cell = _cell(probed, collective, wire, kind)
    if kind in _BITWISE and backend == "nccl" and cell is None:  # NCCL has no bitwise ops
        return ReducePlan(
            kind, gather=True, shim="bitwise-as-all-gather-then-local-reduce", upcast=upcast
        )
    # Without a probe only NCCL's AVG and PREMUL_SUM are known to be native and right.
    native = cell == "ok" or (cell is None and backend == "nccl" and compute == dtype)
    if kind == R.AVG:
        if not floating:
            raise UnsupportedCollectiveError(
                f"ReduceOp.AVG of integer {dtype} would need a rounding rule; all_reduce with "
                "SUM and divide the way you want"
            )
        if native:
            return _settle(ReducePlan(R.AVG, upcast=upcast), probed, collective, wire)
        plan = ReducePlan(R.SUM, divide_by=world_size, shim="avg-as-sum-then-divide", upcast=upcast)
        return _settle(plan, probed, collective, wire)
    if kind == R.PREMUL_SUM:
        if not floating:
            raise UnsupportedCollectiveError(
                f"ReduceOp.PREMUL_SUM needs a floating dtype, not {dtype}"
            )
        if native and not compute.is_complex:
            return _settle(ReducePlan(op, upcast=upcast), probed, collective, wire)
        if factor is None:
            raise UnsupportedCollectiveError(
                "this torch's PREMUL_SUM op does not expose its factor (torch < 2.13 hides it), "
                "so it can only run natively on NCCL: multiply by the factor yourself and use SUM"
            )
        plan = ReducePlan(
            R.SUM, factor=factor, shim="premul-sum-as-scaled-copy-then-sum", upcast=upcast
        )
        return _settle(plan, probed, collective, wire)
    flip = dtype == torch.uint64 and kind in (R.MIN, R.MAX)
    if flip:
        shim = "uint64-minmax-as-int64-sign-flipped"
    elif dtype == torch.uint64:
        shim = "uint64-as-int64-bits"
    else:
        shim = f"{dtype}-reduced-as-{compute}".replace("torch.", "") if compute != dtype else ""
    plan = ReducePlan(kind, flip_sign=flip, shim=shim, upcast=upcast)
    return _settle(plan, probed, collective, wire)


_REAL = {torch.complex64: torch.float32, torch.complex128: torch.float64}
#: the collectives the capability probe runs (reduce-scatter is done as all-to-all off NCCL)
PROBED_COLLECTIVES = ("all_reduce", "reduce")


def _cell(
    probed: Mapping[tuple[str, str, str], str] | None,
    collective: str,
    dtype: torch.dtype,
    kind: Any,
) -> str | None:
    """Return the probe's result for this reduction, or None where it has none to give."""
    if probed is None or collective not in PROBED_COLLECTIVES:
        return None
    return probed.get((collective, str(dtype).removeprefix("torch."), _op_name(kind)))


def _settle(
    plan: ReducePlan,
    probed: Mapping[tuple[str, str, str], str] | None,
    collective: str,
    wire: torch.dtype,
) -> ReducePlan:
    """Check the op ``plan`` sends against the probe: keep it, or gather where it failed."""
    cell = _cell(probed, collective, wire, _kind(plan.op)[0])
    if cell is None:
        return plan
    source = f"probe: {collective} {str(wire).removeprefix('torch.')} {_op_name(plan.op)} {cell}"
    if cell == "ok":
        return dataclasses.replace(plan, source=source)
    shim = f"{plan.shim}, then " if plan.shim else ""
    name = _op_name(plan.op).lower()
    return dataclasses.replace(
        plan,
        gather=True,
        shim=f"{shim}{name}-as-all-gather-then-local-reduce",
        source=source,
    )


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


def by_gathering(
    source: torch.Tensor,
    target: torch.Tensor | None,
    settle: Finish | None,
    plan: ReducePlan,
    group: Any,
) -> tuple[Transport, Finish]:
    """Transport for an op the backend lacks: all-gather every rank's ``source``, reduce here.

    ``target`` (None on ranks that keep no result) receives the reduction, then ``settle`` runs;
    world_size times the memory and bytes of the native op, which is why it is only used where
    there is none.

    Example:
        >>> plan = ReducePlan(dist.ReduceOp.BXOR, gather=True)
        >>> t = torch.tensor([5])
        >>> transport, combine = by_gathering(t, t, None, plan, None)   # issue() runs them
        >>> callable(transport) and callable(combine)
        True
    """
    world_size = group_size(group)
    flat = source.reshape(-1)
    gathered = torch.empty(world_size * flat.numel(), dtype=flat.dtype, device=flat.device)

    def combine() -> None:
        if target is None:
            return
        target.view(-1).copy_(local_reduce(gathered.view(world_size, -1), plan.op))
        if settle is not None:
            settle()

    return lambda a: all_gather_flat(gathered, flat, group=group, async_op=a), combine
