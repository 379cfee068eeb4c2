"""Uneven inputs: ranks with different numbers of batches finish together, with equal replicas.

The two lines a training loop writes::

    with distcompat.join_uneven(ddp_model, optimizer):   # every rank uses all of its batches
        for batch in loader: train_step(batch)

or, when stopping at the shortest rank is fine, one tiny all-reduce per step::

    while distcompat.all_have_data(batch is not None): ...

Design. :func:`join_uneven` builds on PyTorch's public Join protocol
(``torch.distributed.algorithms.join``: ``Join``, ``Joinable``, ``JoinHook``), so DDP's own Joinable
keeps working unchanged and shadows its forward/backward collectives. Torch's Join only shadows what
a Joinable knows about; an optimizer that runs its own collectives (a ZeRO-style reduce-scatter and
all-gather, a global grad-norm all-reduce) makes the joined rank and the others disagree and hang.
So the optimizer is wrapped in a Joinable of its own that needs no knowledge of the optimizer's
collectives: a rank that has run out of data replays ``optimizer.step()`` with zero gradients once
per step the others still take, which issues the identical collective sequence with a neutral
contribution. The per-step agreement is Join's one-element all-reduce of "ranks still with data",
issued from DDP's forward or, without DDP, from a step pre-hook on the optimizer. When every rank
is done, parameters, buffers and (where replicated) optimizer state are broadcast from a rank that
ran the most steps, the rank DDP itself picks, so replicas are identical afterwards.
Replaying the step was chosen over teaching a hook each optimizer's collectives: it works for any
optimizer written against ``distcompat.distributed`` or ``torch.distributed`` without its help.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from distcompat.collectives import all_reduce, broadcast, broadcast_object_list
from distcompat.collectives._group import backend_for, global_rank, group_size
from distcompat.collectives._wait import Wait, until, work_ready

__all__ = ["all_have_data", "join_uneven"]


def _comm_device(group: Any) -> torch.device:
    """CPU unless the group moves CPU tensors with NCCL: then the current GPU."""
    if backend_for(group, torch.device("cpu")) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_have_data(flag: bool, group: Any = None) -> bool:
    """Return True on every rank when every rank's ``flag`` is True (one tiny MIN all-reduce).

    Every rank must call it once per step, with or without data; all get the same answer, so a
    loop guarded by it stops at the shortest rank and never leaves a rank waiting in a collective.
    At world size 1, or with no process group, it returns ``flag``.

    Example:
        >>> batches = iter([1, 2, 3])
        >>> seen = []
        >>> while all_have_data((batch := next(batches, None)) is not None):
        ...     seen.append(batch)
        >>> seen
        [1, 2, 3]
    """
    if group_size(group) == 1:
        return bool(flag)
    agreed = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_comm_device(group))
    all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    return bool(agreed.item())


def _source_rank(is_last_joiner: bool, group: Any, device: torch.device) -> int:
    """Agree on the highest group rank among the last joiners (DDP's rule); return it global."""
    candidate = torch.tensor(
        [dist.get_rank(group) if is_last_joiner else -1], dtype=torch.int64, device=device
    )
    all_reduce(candidate, op=dist.ReduceOp.MAX, group=group)
    return global_rank(group, int(candidate.item()))


def _sync_module(module: torch.nn.Module, src: int, group: Any) -> None:
    """Broadcast every parameter and buffer of ``module`` from global rank ``src``, in place."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            broadcast(tensor, src=src, group=group)


def _sync_optimizer(optimizer: torch.optim.Optimizer, src: int, group: Any) -> None:
    """Make every rank's optimizer state and hyperparameters equal to global rank ``src``'s.

    A skeleton (param_groups' hyperparameters; each state entry's shape and dtype, or its value for
    scalars and for tensors not on their parameter's device) travels as one object; tensors on
    their parameter's device are then broadcast in place (created first where a rank lacks them).
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    skeleton: list[Any] = [None, None]
    if dist.get_rank() == src:
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        entries: list[dict[str, tuple[str, Any]]] = []
        for p in params:
            row: dict[str, tuple[str, Any]] = {}
            for key, value in optimizer.state.get(p, {}).items():
                big = isinstance(value, torch.Tensor) and value.numel() > 1
                if big and value.device == p.device:
                    row[key] = ("tensor", (tuple(value.shape), value.dtype))
                    continue
                row[key] = ("value", value.cpu() if isinstance(value, torch.Tensor) else value)
            entries.append(row)
        skeleton = [hyper, entries]
    broadcast_object_list(skeleton, src=src, group=group)
    hyper, entries = skeleton
    for group_dict, values in zip(optimizer.param_groups, hyper, strict=True):
        group_dict.update(values)
    with torch.no_grad():
        for p, row in zip(params, entries, strict=True):
            state = optimizer.state[p]
            for key in [k for k in state if k not in row]:
                del state[key]
            for key, (kind, payload) in sorted(row.items()):
                if kind == "value":
                    mine = state.get(key)
                    if isinstance(payload, torch.Tensor) and isinstance(mine, torch.Tensor):
                        payload = payload.to(mine.device)
                    state[key] = payload
                    continue
                shape, dtype = payload
                mine = state.get(key)
                if not (
                    isinstance(mine, torch.Tensor) and mine.shape == shape and mine.dtype == dtype
                ):
                    mine = torch.empty(shape, dtype=dtype, device=p.device)
                    state[key] = mine
                broadcast(mine, src=src, group=group)


class _StepShadow(Joinable):
    """The Joinable for an optimizer (and a plain model) that torch's Join knows nothing about."""

    def __init__(
        self,
        *,
        model: torch.nn.Module | None,
        ddp: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        group: Any,
        device: torch.device,
        notify: bool,
        sync_state: bool,
        shadow_step: Callable[[], object] | None,
    ) -> None:
        super().__init__()
        self.model = model  # set only when no Joinable already syncs it (DDP does)
        self.ddp = ddp  # a Joinable model whose hook runs before ours
        self.optimizer = optimizer
        self.group = group
        self.device = device
        self.notify = notify  # this Joinable carries Join's per-step "still have data" all-reduce
        self.sync_state = sync_state
        self.shadow_step = shadow_step
        self.shadowing = False
        self.rescale = False  # set by the hook: divide_by_initial_world_size=False

    def join_hook(self, **kwargs: Any) -> JoinHook:
        self.rescale = self.notify and not kwargs.get("divide_by_initial_world_size", True)
        return _StepShadowHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> Any:
        return self.group

    def before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Step pre-hook on a rank with data: tell Join it has not joined (first Joinable only)."""
        if self.shadowing or not self.notify:
            return
        work = Join.notify_join_context(self)
        if work is None or not self.rescale:
            return  # leave the tiny all-reduce in flight; Join's loop consumes it on joined ranks
        wait = Wait(op="join notify", phase="backend wait", group=self.group)
        until(work_ready(work), wait)  # watched and named like every wait on peers
        active = int(work.result()[0].item())
        scale = dist.get_world_size(self.group) / active
        for p in self._params():
            if p.grad is not None:
                p.grad.mul_(scale)

    def _params(self) -> list[torch.Tensor]:
        assert self.optimizer is not None
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def shadow(self) -> None:
        """On a rank without data: one neutral optimizer step (same collectives, zero grads)."""
        if self.optimizer is None:
            return
        # DDP's hook (run just before) sets require_forward_param_sync to whether any rank syncs
        # gradients this iteration; a no_sync() accumulation forward is followed by no step.
        # Named fallback: a Joinable without the attribute gets a shadow step every iteration.
        if self.ddp is not None and not getattr(self.ddp, "require_forward_param_sync", True):
            return
        self.shadowing = True
        try:
            if self.shadow_step is not None:
                self.shadow_step()
                return
            for p in self._params():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        finally:
            self.shadowing = False

    def sync(self, is_last_joiner: bool) -> None:
        """Once all ranks are done: copy the model and optimizer state of a rank with most steps."""
        if self.model is None and not self.sync_state:
            return
        src = _source_rank(is_last_joiner, self.group, _comm_device(self.group))
        if self.model is not None:
            _sync_module(self.model, src, self.group)
        if self.sync_state and self.optimizer is not None:
            _sync_optimizer(self.optimizer, src, self.group)


class _StepShadowHook(JoinHook):
    def __init__(self, joinable: _StepShadow) -> None:
        self.joinable = joinable

    def main_hook(self) -> None:
        self.joinable.shadow()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.joinable.sync(is_last_joiner)


def _first_device(*sources: Any) -> torch.device:
    for source in sources:
        if isinstance(source, torch.nn.Module):
            for p in source.parameters():
                return p.device
        elif isinstance(source, torch.optim.Optimizer):
            for g in source.param_groups:
                for p in g["params"]:
                    return torch.device(p.device)
    return torch.device("cpu")


@contextmanager
def join_uneven(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    group: Any = None,
    divide_by_initial_world_size: bool = True,
    sync_optimizer_state: bool | None = None,
    shadow_step: Callable[[], object] | None = None,
    enable: bool = True,
) -> Iterator[None]:
    """Let ranks with unequal numbers of batches finish the loop without hanging.

    Inside the block each rank runs its own batches. A rank that runs out keeps answering the
    others' collectives until every rank is done: DDP's Joinable shadows DDP's forward/backward
    communication; ``optimizer.step()`` is replayed with zero gradients (or ``shadow_step()`` is
    called) once per step the others take, so the optimizer's own collectives (any written against
    ``distcompat.distributed`` or ``torch.distributed``) see the same sequence on every rank. At the
    exit, parameters and buffers (and the optimizer state where ``sync_optimizer_state``) are
    broadcast from the highest rank among those that ran the most steps.

    Averaging while some ranks are joined: with ``divide_by_initial_world_size=True`` a joined rank
    contributes zeros, so an AVG over ``W`` ranks of which ``A`` have data gives ``sum / W`` (DDP's
    default). With ``False``, DDP divides by ``A``; without DDP, the ranks with data multiply their
    gradients by ``W / A`` in place before ``step()`` (one extra wait per step), so an optimizer
    that averages gradients over the group gets ``sum / A``.

    Args:
        model: a ``DistributedDataParallel`` (or any ``Joinable``) or a plain module; a plain
            module is only synced at the exit, its forward/backward must issue no collectives.
        optimizer: a ``torch.optim.Optimizer`` whose ``step()`` may issue collectives; a
            ``Joinable`` optimizer (``ZeroRedundancyOptimizer``) is used as it is.
        group: the process group (default: DDP's, else the default group).
        divide_by_initial_world_size: see above.
        sync_optimizer_state: broadcast the optimizer state at the exit. Default: True with DDP
            (a joined rank's optimizer never saw the reduced gradients), False without (the
            optimizer reduces gradients itself, so joined ranks keep stepping with the same reduced
            gradients; a sharded optimizer's per-rank state must not be overwritten).
        shadow_step: replaces the neutral step on a joined rank; it must issue the same collectives
            as one ``optimizer.step()`` (e.g. also step an LR scheduler there).
        enable: False makes the block a plain block (inputs known to be even).

    Raises:
        ValueError: nothing to shadow (a plain module and no optimizer), or ``group`` differs from
            the DDP model's process group.
        TypeError: ``optimizer`` is neither a ``torch.optim.Optimizer`` nor a ``Joinable``.

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with join_uneven(model, opt):   # no process group: a plain block
        ...     model(torch.ones(1, 2)).sum().backward()
        ...     opt.step()
    """
    model_joins = isinstance(model, Joinable)
    if optimizer is None and not model_joins:
        raise ValueError(
            f"join_uneven got a plain {type(model).__name__} and no optimizer: nothing issues "
            "collectives to shadow; pass the DDP-wrapped model or the optimizer"
        )
    opt_joins = isinstance(optimizer, Joinable)
    if optimizer is not None and not opt_joins and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer is a {type(optimizer).__name__}; join_uneven needs a "
            "torch.optim.Optimizer (for its step pre-hook) or a Joinable"
        )
    if model_joins:
        own_group = model.join_process_group
        if group is not None and group is not own_group:
            raise ValueError("group= differs from the DDP model's process group")
        group = own_group
    if not enable or group_size(group) == 1:
        yield
        return
    joinables: list[Any] = [j for j in (model, optimizer) if isinstance(j, Joinable)]
    shadow_opt = optimizer if optimizer is not None and not opt_joins else None
    sync_model = None if model_joins else model
    if sync_optimizer_state is None:
        sync_optimizer_state = model_joins
    handles = []
    if shadow_opt is not None or sync_model is not None:
        shadow = _StepShadow(
            model=sync_model,
            ddp=model if model_joins else None,
            optimizer=shadow_opt,
            group=group,
            device=_first_device(model, optimizer),
            notify=not joinables,
            sync_state=sync_optimizer_state and shadow_opt is not None,
            shadow_step=shadow_step,
        )
        if shadow_opt is not None:
            handles.append(shadow_opt.register_step_pre_hook(shadow.before_step))
        joinables.append(shadow)
    join = Join(joinables, divide_by_initial_world_size=divide_by_initial_world_size)
    try:
        yield  # an exception here propagates at once: no shadowing, peers are left waiting
        with warnings.catch_warnings():  # Join.__exit__ calls warnings.simplefilter("once")
            join.__exit__(None, None, None)
    finally:
        for handle in handles:
            handle.remove()
