"""A small training run for the any-size tests: one function per rank, importable by the ranks.

``train`` runs ``steps`` optimizer steps of an MLP with dropout and LayerNorm on a fixed synthetic
dataset, with a :class:`TrainPlan` (global batch 24, micro-batch 2: 12 micro-batches, which split
over 1, 2, 3, 4, 6 and 12 ranks), counter RNG for dropout, and either exact mode (plain model or
DDP with the exact comm hook) or the default float all-reduce. It can start from and stop at a
checkpoint, so a run can be cut and resumed on another world size. It returns the SHA-256 of the
parameters' bytes, the logged losses and how many steps were redone.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import distcompat
import distcompat.distributed as dist
from distcompat.anysize import ExactGradients, TrainPlan, counter_rng
from distcompat.checkpoint import resume, save_checkpoint, training_state

GLOBAL_BATCH, MICRO_BATCH, FEATURES = 24, 2, 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FEATURES, 32), nn.LayerNorm(32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 1)
    )


def _data(steps: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(steps * GLOBAL_BATCH, FEATURES, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True).sin() * 3
    return inputs, targets


def params_sha256(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for _, param in sorted(model.state_dict().items()):
        digest.update(param.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def train(
    steps: int,
    *,
    mode: str = "exact",
    seed: int = 5,
    headroom_bits: int = 16,
    checkpoint: str | None = None,
    stop_after: int | None = None,
    grow: float = 1.0,
) -> dict[str, Any]:
    """Train until ``steps`` (or save and stop after ``stop_after``); ``mode``: exact, ddp, float.

    ``grow`` multiplies the loss by ``grow ** step``, so gradients grow each step (with a small
    ``headroom_bits``, steps overflow their bounds and are redone).
    """
    torch.set_num_threads(1)  # the same kernels' thread split at every world size
    plan = TrainPlan(global_batch=GLOBAL_BATCH, micro_batch=MICRO_BATCH, seed=seed)
    share = plan.share()
    model = _model()
    module: nn.Module = model
    if mode == "ddp":
        module = DistributedDataParallel(model)
    exact = None
    if mode in ("exact", "ddp"):
        exact = ExactGradients(model, micro_batches=plan.micro_batches, headroom_bits=headroom_bits)
        if mode == "ddp":
            assert isinstance(module, DistributedDataParallel)
            module.register_comm_hook(None, exact.ddp_comm_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs, targets = _data(steps, seed)
    if checkpoint is not None:
        resumed = resume(checkpoint, model=model, optimizer=optimizer)
        if not resumed.fresh:
            plan.load_state_dict(resumed.extra["plan"])
            if exact is not None:
                exact.load_state_dict(resumed.extra["exact"])
    losses: list[float] = []
    redone = 0
    last = share.micro_batches[-1]
    while plan.step < steps:
        base = plan.samples_consumed
        while True:
            local = torch.zeros(1, dtype=torch.float64)
            for micro in share.micro_batches:
                rows = slice(base + micro * MICRO_BATCH, base + (micro + 1) * MICRO_BATCH)
                sync = mode == "ddp" and micro != last
                with module.no_sync() if sync else contextlib.nullcontext():  # type: ignore[operator]
                    with counter_rng(seed, plan.step, micro):
                        out = module(inputs[rows])
                    loss = nn.functional.mse_loss(out, targets[rows]) * grow**plan.step
                    if exact is not None:
                        exact.add_loss(loss)
                    else:
                        local += loss.detach().double()
                    (loss if exact is not None else loss / share.accum_steps).backward()  # type: ignore[no-untyped-call]
            if exact is None:
                for param in model.parameters():
                    assert param.grad is not None
                    dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
                dist.all_reduce(local)
                losses.append(float(local.item()) / plan.micro_batches)
                break
            result = exact.reduce()
            if result.ok:
                assert result.loss is not None
                losses.append(result.loss)
                break
            optimizer.zero_grad()
            redone += 1
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        plan.advance()
        if checkpoint is not None and plan.step == stop_after:
            extra: dict[str, Any] = {"plan": plan.state_dict()}
            if exact is not None:
                extra["exact"] = exact.state_dict()
            state = training_state(model=model, optimizer=optimizer, rng=False, extra=extra)
            save_checkpoint(checkpoint, plan.step, state)
            break
    if exact is not None:
        exact.close()
    return {
        "sha256": params_sha256(model),
        "losses": losses,
        "redone": redone,
        "world_size": distcompat.get_world_size(),
        "step": plan.step,
    }


def dropout_masks(seed: int = 3) -> dict[int, list[bool]]:
    """Each sample's dropout mask, keyed by its global index, for the micro-batches of this rank.

    A step of :data:`GLOBAL_BATCH` samples of width :data:`FEATURES` goes through ``nn.Dropout``
    under :func:`counter_rng` per global micro-batch; the merged dicts of every rank are the
    same at every world size.
    """
    plan = TrainPlan(global_batch=GLOBAL_BATCH, micro_batch=MICRO_BATCH, seed=seed)
    dropout = nn.Dropout(0.5)
    masks: dict[int, list[bool]] = {}
    for micro in plan.share().micro_batches:
        with counter_rng(plan.seed, plan.step, micro):
            out = dropout(torch.ones(MICRO_BATCH, FEATURES))
        for row in range(MICRO_BATCH):
            masks[micro * MICRO_BATCH + row] = (out[row] != 0).tolist()
    return masks
