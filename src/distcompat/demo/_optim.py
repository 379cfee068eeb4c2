"""ZeRO-2 style AdamW whose gradient sync overlaps backward through async collective futures.

The two lines a training loop writes (one backward per step, every rank)::

    opt = ZeroAdamW(model.parameters(), lr=lambda step: 1e-3)
    loss.backward(); opt.step(); opt.zero_grad()

Each rank keeps AdamW state and an fp32 master copy for a 1/world_size shard of every parameter.
The sync is nanochat's ``DistAdamW`` pattern, the one that raises "Work::getFuture not
implemented" on plain gloo (seed 000) and works here through ``distcompat.distributed``:

1. During ``backward``, a post-accumulate-grad hook marks each gradient ready; ready gradients
   are launched, in one fixed parameter order on every rank, as
   ``dist.reduce_scatter_tensor(shard, grad, op=AVG, async_op=True)``. So communication overlaps
   the rest of the backward pass.
2. ``work.get_future().then(adamw)`` updates this rank's shard as soon as its averaged gradient
   lands, on the thread that completes the future, still overlapping backward.
3. ``step()`` waits for each update in order and launches
   ``dist.all_gather_into_tensor(param, master_shard, async_op=True)``, then waits for all of them:
   each gather overlaps the remaining updates. Every rank ends with the same bytes in every
   parameter, because each one was copied from the single rank that owns it.

Collectives are issued by the training thread only and in the same order on every rank; the
future callbacks do local arithmetic only.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import distcompat.distributed as dist

__all__ = ["OptimizerStateError", "ZeroAdamW"]


class OptimizerStateError(ValueError):
    """An optimizer state dict does not fit this optimizer (other world size, rank or shapes)."""


@dataclass(slots=True, eq=False)
class _Slot:
    """One parameter: its shard geometry, sync buffers and this rank's AdamW state."""

    param: nn.Parameter
    shard: int  # elements per rank (the parameter padded to a multiple of the world size)
    grad_shard: torch.Tensor  # (shard,) the averaged gradient of this rank's shard
    master: torch.Tensor  # (shard,) fp32 master weights of this rank's shard
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    staging: torch.Tensor | None  # (shard * W,) padded flat buffer, or None when no padding
    update: torch.futures.Future[Any] | None = field(default=None)


def _lr_schedule(lr: float | Callable[[int], float]) -> Callable[[int], float]:
    if callable(lr):
        return lr
    value = float(lr)
    return lambda _step: value


class ZeroAdamW:
    """AdamW with state sharded across ranks; gradients reduce-scattered while backward runs.

    Args:
        params: the model's parameters (the same order on every rank).
        lr: a learning rate, or ``lr(step)`` for step 1, 2, ... (read when a shard is updated,
            which happens during ``backward``: the schedule must be known before it runs).
        betas, eps, weight_decay: as in :class:`torch.optim.AdamW` (decoupled weight decay).

    ``sync_wait_s`` is the time the last :meth:`step` spent blocked on communication or on the
    updates still running on the future-completion thread.

    Example:
        >>> model = torch.nn.Linear(4, 2, bias=False)
        >>> opt = ZeroAdamW(model.parameters(), lr=0.1)
        >>> model(torch.ones(1, 4)).sum().backward()
        >>> before = model.weight.detach().clone()
        >>> opt.step(); opt.zero_grad()
        >>> bool((model.weight - before).abs().max() > 0.05), opt.steps_done
        (True, 1)
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        *,
        lr: float | Callable[[int], float],
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        self._lr = _lr_schedule(lr)
        self._betas, self._eps, self._weight_decay = betas, eps, weight_decay
        self._params = [p for p in params if p.requires_grad]
        if not self._params:
            raise ValueError("ZeroAdamW got no parameter that requires grad")
        self._world, self._rank = 1, 0
        self._slots: list[_Slot] = []
        self._order: list[_Slot] = []
        self._slot_for_world()
        self._syncing = True
        self.steps_done = 0
        self.sync_wait_s = 0.0
        self._hooks = self._register_hooks()

    def _slot_for_world(self) -> None:
        """Cut the shards for the group's world size and rank now; no step in flight after."""
        self._world = dist.get_world_size() if dist.is_initialized() else 1
        self._rank = dist.get_rank() if dist.is_initialized() else 0
        self._slots = [self._make_slot(p) for p in self._params]
        # Gradients become ready roughly from the last layer back: launch in that order.
        self._order = list(reversed(self._slots))
        self._position = {id(slot.param): i for i, slot in enumerate(self._order)}
        self._ready = [False] * len(self._order)
        self._launched = 0

    def _make_slot(self, param: nn.Parameter) -> _Slot:
        numel = param.numel()
        shard = math.ceil(numel / self._world)
        padded = shard * self._world != numel
        flat = param.detach().reshape(-1)
        master = torch.zeros(shard, dtype=torch.float32, device=param.device)
        mine = flat[self._rank * shard : (self._rank + 1) * shard]
        master[: mine.numel()] = mine.float()
        return _Slot(
            param=param,
            shard=shard,
            grad_shard=torch.zeros(shard, dtype=param.dtype, device=param.device),
            master=master,
            exp_avg=torch.zeros_like(master),
            exp_avg_sq=torch.zeros_like(master),
            staging=(
                torch.zeros(shard * self._world, dtype=param.dtype, device=param.device)
                if padded
                else None
            ),
        )

    def _register_hooks(self) -> list[Any]:
        # Fallback 'sync-after-backward': torch without post-accumulate-grad hooks (added in 2.1)
        # launches every reduce-scatter from step(), so comm no longer overlaps backward.
        handles = []
        for slot in self._slots:
            register = getattr(slot.param, "register_post_accumulate_grad_hook", None)
            if register is None:
                return []
            handles.append(register(self._on_grad_ready))
        return handles

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._syncing:  # a micro-batch but the last: the gradient accumulates
            return
        self._ready[self._position[id(param)]] = True
        while self._launched < len(self._order) and self._ready[self._launched]:
            self._launch(self._order[self._launched])
            self._launched += 1

    def _launch(self, slot: _Slot) -> None:
        grad = slot.param.grad
        if grad is None:  # an unused parameter: every rank must still join the collective
            grad = torch.zeros_like(slot.param)
        flat = grad.reshape(-1)
        if slot.staging is not None:
            slot.staging[: flat.numel()].copy_(flat)
            flat = slot.staging
        work = dist.reduce_scatter_tensor(
            slot.grad_shard, flat, op=dist.ReduceOp.AVG, async_op=True
        )
        step = self.steps_done + 1

        def update(done: torch.futures.Future[Any]) -> list[torch.Tensor]:
            done.value()  # a failed reduce-scatter: its error, and no update from a stale shard
            return self._adamw(slot, step)

        slot.update = work.get_future().then(update)

    @torch.no_grad()
    def _adamw(self, slot: _Slot, step: int) -> list[torch.Tensor]:
        """Update this rank's shard from its averaged gradient (runs as a future callback).

        Returns the tensors it wrote: on CUDA the callback runs on a stream of its own, and
        waiting on the derived future orders the caller's stream after the writes to these
        tensors only (torch's rule for CUDA futures, NCCL's and now gloo's alike). Returning
        nothing let ``step()`` read the master shard before the update had run (measured: the
        demo's resume check differed on 2 gloo ranks sharing an H100).
        """
        beta1, beta2 = self._betas
        lr = self._lr(step)
        grad = slot.grad_shard.float()
        slot.exp_avg.lerp_(grad, 1.0 - beta1)
        slot.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        denom = (slot.exp_avg_sq / (1.0 - beta2**step)).sqrt_().add_(self._eps)
        if self._weight_decay:
            slot.master.mul_(1.0 - lr * self._weight_decay)
        slot.master.addcdiv_(slot.exp_avg, denom, value=-lr / (1.0 - beta1**step))
        return [slot.master, slot.exp_avg, slot.exp_avg_sq]

    @torch.no_grad()
    def step(self) -> None:
        """Finish the gradient sync, update every shard and gather the new parameters."""
        waited = 0.0
        while self._launched < len(self._order):  # gradients no hook announced
            self._launch(self._order[self._launched])
            self._launched += 1
        gathers = []
        for slot in self._order:
            assert slot.update is not None
            start = time.perf_counter()
            slot.update.wait()  # raises the reduce-scatter's (typed) error, if any
            waited += time.perf_counter() - start
            target = slot.staging if slot.staging is not None else slot.param.data.view(-1)
            source = slot.master.to(slot.param.dtype)
            gathers.append(dist.all_gather_into_tensor(target, source, async_op=True))
        start = time.perf_counter()
        for slot, work in zip(self._order, gathers, strict=True):
            work.wait()
            if slot.staging is not None:
                slot.param.data.view(-1).copy_(slot.staging[: slot.param.numel()])
            slot.update = None
        self.sync_wait_s = waited + time.perf_counter() - start
        self._ready = [False] * len(self._order)
        self._launched = 0
        self.steps_done += 1

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes inside launch no reduce-scatter.

        Run every micro-batch of a step but the last inside it (as with DDP's ``no_sync``).

        Example:
            >>> model = torch.nn.Linear(2, 1, bias=False)
            >>> opt = ZeroAdamW(model.parameters(), lr=0.1)
            >>> with opt.no_sync():
            ...     model(torch.ones(1, 2)).sum().backward()
            >>> model(torch.ones(1, 2)).sum().backward(); opt.step()
            >>> model.weight.grad.tolist()
            [[2.0, 2.0]]
        """
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def zero_grad(self) -> None:
        """Drop the gradients (set them to None), as ``torch.optim`` does by default."""
        for slot in self._slots:
            slot.param.grad = None

    def close(self) -> None:
        """Remove the gradient hooks (the optimizer is no longer used with this model)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def state_dict(self) -> dict[str, Any]:
        """Return this rank's shard state (it differs per rank: save it per rank).

        Example:
            >>> opt = ZeroAdamW(torch.nn.Linear(2, 2).parameters(), lr=0.1)
            >>> sorted(opt.state_dict())
            ['rank', 'shards', 'steps_done', 'world_size']
        """
        return {
            "rank": self._rank,
            "world_size": self._world,
            "steps_done": self.steps_done,
            "shards": [
                {"master": s.master, "exp_avg": s.exp_avg, "exp_avg_sq": s.exp_avg_sq}
                for s in self._slots
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state saved by the same rank of the same world size, with the same params.

        Example:
            >>> opt = ZeroAdamW(torch.nn.Linear(2, 2).parameters(), lr=0.1)
            >>> opt.load_state_dict(opt.state_dict())
        """
        where = (state.get("rank"), state.get("world_size"))
        if where != (self._rank, self._world):
            raise OptimizerStateError(
                f"optimizer state of (rank, world_size)={where} cannot load into rank "
                f"{self._rank} of {self._world}: ZeroAdamW state is sharded per rank"
            )
        shards = state["shards"]
        if len(shards) != len(self._slots):
            raise OptimizerStateError(
                f"optimizer state has {len(shards)} parameters, this optimizer {len(self._slots)}"
            )
        for slot, saved in zip(self._slots, shards, strict=True):
            for name in ("master", "exp_avg", "exp_avg_sq"):
                mine: torch.Tensor = getattr(slot, name)
                if saved[name].shape != mine.shape:
                    raise OptimizerStateError(
                        f"optimizer state {name} has shape {tuple(saved[name].shape)}, "
                        f"expected {tuple(mine.shape)}"
                    )
                mine.copy_(saved[name])
        self.steps_done = int(state["steps_done"])

    def load_resharded(self, states: Sequence[dict[str, Any]], /) -> None:
        """Load the states every rank of another world size saved, re-cut for this world size.

        ``states`` are the saving ranks' :meth:`state_dict` in rank order: each parameter's
        shards are joined into the whole (padding dropped) and this rank's shard is cut from it,
        so the run continues on any number of ranks with the same master weights and moments.
        The world size is the group's now (one that changed since this optimizer was made, in
        place, re-cuts its shards), and every parameter becomes its whole master weights in its
        own dtype, as a step's gather leaves it: a step broken off midway is undone.

        Example:
            >>> opt = ZeroAdamW(torch.nn.Linear(3, 1).parameters(), lr=0.1)
            >>> opt.load_resharded([opt.state_dict()])
        """
        ranks = [state.get("rank") for state in states]
        sizes = {state.get("world_size") for state in states}
        if sizes != {len(states)} or ranks != list(range(len(states))):
            raise OptimizerStateError(
                f"load_resharded needs every saving rank's state in rank order; got ranks "
                f"{ranks} of world sizes {sorted(map(str, sizes))}"
            )
        steps = {int(state["steps_done"]) for state in states}
        if len(steps) != 1:
            raise OptimizerStateError(f"the saving ranks were at different steps: {sorted(steps)}")
        counts = {len(state["shards"]) for state in states}
        if counts != {len(self._params)}:
            raise OptimizerStateError(
                f"optimizer states hold {sorted(counts)} parameters, this optimizer "
                f"{len(self._params)}"
            )
        wholes = [self._wholes(index, states) for index in range(len(self._params))]
        self._slot_for_world()
        with torch.no_grad():
            for slot, whole in zip(self._slots, wholes, strict=True):
                start = self._rank * slot.shard
                for name, tensor in whole.items():
                    mine: torch.Tensor = getattr(slot, name)
                    part = tensor[start : start + slot.shard]
                    mine.zero_()
                    mine[: part.numel()].copy_(part)
                slot.param.data.view(-1).copy_(whole["master"].to(slot.param.dtype))
        self.steps_done = steps.pop()

    def _wholes(self, index: int, states: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Join parameter ``index``'s shards of ``states`` into whole tensors (padding dropped)."""
        numel = self._params[index].numel()
        wholes = {}
        for name in ("master", "exp_avg", "exp_avg_sq"):
            whole = torch.cat([state["shards"][index][name] for state in states])[:numel]
            if whole.numel() != numel:
                raise OptimizerStateError(
                    f"optimizer state {name} of parameter {index} holds {whole.numel()} "
                    f"elements, the parameter {numel}"
                )
            wholes[name] = whole
        return wholes
