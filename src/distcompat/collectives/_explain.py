"""Say which path a collective call takes, and why: the printable reason behind every shim.

Nothing is sent; the answer is what the same call would do now on ``group``::

    >>> print(explain_collective("all_reduce", torch.zeros(4, 4).t(), op=dist.ReduceOp.AVG))
    all_reduce of float32 [4, 4] (non-contiguous), AVG, world size 1: the identity (one rank)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from distcompat.collectives._group import backend_for, group_size
from distcompat.collectives._reduce_ops import ReducePlan, plan_call
from distcompat.collectives._wire import MOVE_NATIVE, stage_input
from distcompat.collectives.shm import _path as shm

__all__ = ["CollectivePlan", "explain_collective"]

_REDUCTIONS = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor")
_MOVES = (
    "broadcast", "all_gather", "all_gather_into_tensor", "all_to_all", "all_to_all_single",
    "gather", "scatter", "send", "recv", "isend", "irecv",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class CollectivePlan:
    """What a call does: the backend it reaches, the named steps around it, and what chose them.

    ``steps`` is empty when the tensor goes to the backend as it is; ``decided_by`` is the probe
    cell the plan follows, or why no probe was consulted.
    """

    collective: str
    what: str  # dtype, shape, layout and ReduceOp of the call
    backend: str  # 'none' at world size 1
    world_size: int
    steps: tuple[str, ...]
    decided_by: str
    path: str = ""  # shared memory or the backend, and why ('' where the choice does not arise)

    def __str__(self) -> str:
        head = f"{self.collective} of {self.what}, world size {self.world_size}"
        if self.world_size == 1:
            return f"{head}: the identity (one rank)"
        steps = "; ".join(self.steps) if self.steps else "native, no shim"
        path = f" (path: {self.path})" if self.path else ""
        return f"{head}, {self.backend}: {steps} [{self.decided_by}]{path}"


def explain_collective(
    collective: str, tensor: torch.Tensor, op: Any = None, group: Any = None
) -> CollectivePlan:
    """Return the :class:`CollectivePlan` of ``collective`` on ``tensor`` (nothing is sent).

    ``op`` is the ReduceOp for reductions (SUM when omitted). Raises
    :class:`UnsupportedCollectiveError` where the call itself would, and ``ValueError`` for a
    name that is not a distcompat collective.

    Example:
        >>> plan = explain_collective("all_reduce", torch.ones(3, dtype=torch.int16))
        >>> plan.world_size, plan.steps
        (1, ())
    """
    if collective not in _REDUCTIONS + _MOVES:
        raise ValueError(
            f"{collective!r} is not a collective distcompat explains; one of: "
            + ", ".join(_REDUCTIONS + _MOVES)
        )
    reducing = collective in _REDUCTIONS
    op = dist.ReduceOp.SUM if op is None and reducing else op
    layout = "" if tensor.is_contiguous() else " (non-contiguous)"
    op_name = f", {str(getattr(op, 'op', op)).rsplit('.', 1)[-1]}" if reducing else ""
    shape = list(tensor.shape)
    what = f"{str(tensor.dtype).removeprefix('torch.')} {shape}{layout}{op_name}"
    world_size = group_size(group)
    if world_size == 1:
        return CollectivePlan(collective, what, "none", 1, (), "world size 1")
    backend = backend_for(group, tensor.device)
    steps: list[str] = []
    if layout:
        steps.append("staging: a contiguous temporary, copied back into the caller's tensor")
    decided_by = "plan correct on every backend (group not probed: distcompat.capabilities)"
    plan = plan_call(op, tensor, group, world_size, collective) if reducing else None
    if plan is not None:  # what the call itself plans
        if plan.shim:
            steps.append(plan.shim)
        if plan.source:
            decided_by = plan.source
        if collective.startswith("reduce_scatter") and backend != "nccl" and not plan.gather:
            steps.append("reduce-scatter-as-all-to-all-then-local-reduce")
    elif tensor.dtype.is_complex and collective in ("gather", "scatter"):
        steps.append("complex-as-real-view")
    elif tensor.dtype not in MOVE_NATIVE and not tensor.dtype.is_complex:
        steps.append(f"{str(tensor.dtype).removeprefix('torch.')}-moved-as-bytes")
    if collective == "all_to_all":
        steps.append("uneven-all-to-all-as-one-all-to-all-single")
    path = ""
    if collective in shm.WIRED and tensor.device.type == "cpu":
        path = _path(collective, tensor, plan, group, backend)
        if path.startswith("shared memory"):  # the group's backend is not used for this call
            steps = [step for step in steps if not step.startswith("reduce-scatter-as-all-to")]
    return CollectivePlan(collective, what, backend, world_size, tuple(steps), decided_by, path)


def _path(
    collective: str, tensor: torch.Tensor, plan: ReducePlan | None, group: Any, backend: str
) -> str:
    """Say whether the call goes through shared memory or ``backend``, and why."""
    status = shm.status(group)
    if not status.engaged:
        return f"{backend}, not shared memory: {status.reason}"
    floor = shm.floor_bytes(collective, group_size(group))
    if tensor.nbytes < floor:
        return (
            f"{backend}: {tensor.nbytes} bytes is below the {floor:.0f} bytes from which shared "
            "memory measured faster for this op (DISTCOMPAT_SHM=on sends it anyway)"
        )
    # the dtype the reduction runs in: what the call's own staging makes of an empty tensor
    if plan is not None and not shm.reduces(plan.op, stage_input(tensor.new_empty(0), plan).dtype):
        return f"{backend}: shared memory does not reduce {tensor.dtype} with this op"
    return f"shared memory: {status.reason}"
