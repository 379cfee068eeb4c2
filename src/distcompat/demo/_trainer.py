"""The demo's model, optimizer and loader, stepped together: :class:`Trainer` (one per run).

    trainer = Trainer.build(config, corpus, device, init_seed=config.seed)
    record = trainer.train_step()        # one optimizer step on every rank

A step is the plan's micro-batches (``--global-batch``), this rank's share of them: in float
mode the sharded :class:`~distcompat.demo._optim.ZeroAdamW` syncs during the last backward; in
exact mode a replicated AdamW is fed by :class:`~distcompat.anysize.ExactGradients`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import distcompat
import distcompat.distributed as dist
from distcompat.anysize import ExactGradients, RankShare, TrainPlan, counter_rng
from distcompat.checkpoint import training_state
from distcompat.data import TokenLoader
from distcompat.demo._config import DemoConfig
from distcompat.demo._model import GPT
from distcompat.demo._optim import ZeroAdamW
from distcompat.demo._report import StepRecord
from distcompat.runtime import compute_dtype

__all__ = ["Trainer", "lr_schedule"]

_log = distcompat.get_logger("distcompat.demo")


def lr_schedule(config: DemoConfig) -> Callable[[int], float]:
    """Linear warm-up over the first 5% of steps, then cosine decay to 10% of ``config.lr``.

    Example:
        >>> from pathlib import Path
        >>> lr = lr_schedule(DemoConfig(out=Path("o"), steps=100, lr=1.0))
        >>> round(lr(1), 2), lr(5), round(lr(100), 2)
        (0.2, 1.0, 0.1)
    """
    warmup = max(1, config.steps // 20)

    def lr_at(step: int) -> float:
        if step <= warmup:
            return config.lr * step / warmup
        progress = (step - warmup) / max(1, config.steps - warmup)
        return config.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))

    return lr_at


def _endless(loader: TokenLoader) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches across epochs: each pass over the loader is the rest of one epoch."""
    while True:
        yield from loader


def _loader(
    config: DemoConfig, corpus: Path, share: RankShare, device: torch.device
) -> TokenLoader:
    """Return the loader of this rank's ``share`` of each step (``share.samples`` windows)."""
    return TokenLoader(
        corpus, batch_size=share.samples, seq_len=config.seq_len, seed=config.seed, device=device
    )


@dataclass(slots=True)
class Trainer:
    """A model, its optimizer and its loader, stepped together (one per run or resume).

    With ``--global-batch`` a step is ``plan.micro_batches`` micro-batches, ``share`` of them on
    this rank; in exact mode (``exact`` set) the optimizer is a replicated AdamW fed by
    :class:`~distcompat.anysize.ExactGradients`; else the sharded :class:`ZeroAdamW` (in place
    too: ``distcompat.inplace`` keeps each rank's share on one other rank too).
    """

    config: DemoConfig
    model: GPT
    optimizer: ZeroAdamW | torch.optim.AdamW
    loader: TokenLoader
    autocast: Callable[[], contextlib.AbstractContextManager[Any]]
    share: RankShare
    plan: TrainPlan | None = None
    exact: ExactGradients | None = None
    redone: int = 0
    sync_wait_s: float = 0.0
    step: int = 0
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = field(default=None)
    corpus: Path | None = None

    @classmethod
    def build(
        cls, config: DemoConfig, corpus: Path, device: torch.device, *, init_seed: int
    ) -> Trainer:
        """Make a model from ``init_seed`` (rank 0's weights broadcast), optimizer and loader."""
        model = GPT(config.model_config(), seed=init_seed).to(device)
        for param in model.parameters():  # every rank starts from rank 0's weights
            distcompat.broadcast(param.data, src=0)
        dtype = compute_dtype(device).dtype

        def autocast() -> contextlib.AbstractContextManager[Any]:
            if dtype == torch.float32:
                return contextlib.nullcontext()
            return torch.autocast(device_type=device.type, dtype=dtype)

        plan = config.plan
        world, rank = distcompat.get_world_size(), distcompat.get_rank()
        if plan is None:  # per-rank batches: one micro-batch of --batch-size per rank
            plan_here = TrainPlan(
                global_batch=config.batch_size * world, micro_batch=config.batch_size
            )
            share = plan_here.share(world_size=world, rank=rank)
        else:
            share = plan.share(world_size=world, rank=rank)  # BatchSplitError: before training
        exact = None
        optimizer: ZeroAdamW | torch.optim.AdamW
        if config.exact:
            assert plan is not None  # DemoConfig: --exact needs a plan
            exact = ExactGradients(model, micro_batches=plan.micro_batches)
            optimizer = torch.optim.AdamW(
                model.parameters(), lr=config.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0
            )
        else:
            optimizer = ZeroAdamW(model.parameters(), lr=lr_schedule(config))
        return cls(
            config=config,
            model=model,
            optimizer=optimizer,
            loader=_loader(config, corpus, share, device),
            autocast=autocast,
            share=share,
            plan=plan,
            exact=exact,
            corpus=corpus,
        )

    def state(self, **extra: Any) -> dict[str, Any]:
        """Return this rank's checkpoint: weights, optimizer (shard), loader position, extra.

        No RNG state: the demo draws nothing at random while training, and what would draw
        (dropout) would take :func:`~distcompat.anysize.counter_rng`, so nothing is per rank.
        """
        if self.exact is not None:
            extra["exact"] = self.exact.state_dict()
        return training_state(
            model=self.model,
            optimizer=self.optimizer,
            loader=self.loader,
            plan=self.plan,
            rng=False,
            extra=extra,
        )

    def load(self, state: dict[str, Any], step: int) -> None:
        """Restore a :meth:`state` saved after ``step`` (by this rank, at this world size)."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.loader.load_state_dict(state["loader"])
        self.resumed(step, state.get("extra", {}))
        if self.plan is not None:
            self.plan.load_state_dict(state["plan"])

    def resumed(self, step: int, extra: dict[str, Any]) -> None:
        """Continue after ``step``: the exact-mode bounds from ``extra``, a fresh batch stream."""
        if self.exact is not None and "exact" in extra:
            self.exact.load_state_dict(extra["exact"])
        self.step = step
        self.batches = None

    def train_step(self) -> StepRecord:
        """Run one optimizer step on every rank; return its global loss and timings."""
        if self.batches is None:
            self.batches = _endless(self.loader)
        start = time.perf_counter()
        inputs, targets = next(self.batches)
        fetched = time.perf_counter()
        size = self.config.micro_size
        micro = list(zip(torch.split(inputs, size), torch.split(targets, size), strict=True))
        if self.exact is not None:
            loss_value = self._exact_step(micro, self.exact)
        else:
            loss_value = self._float_step(micro)
        end = time.perf_counter()
        self.step += 1
        if self.plan is not None:
            self.plan.advance()
        tokens = inputs.numel() * distcompat.get_world_size()
        return StepRecord(
            step=self.step,
            loss=loss_value,
            lr=lr_schedule(self.config)(self.step),
            step_ms=(end - start) * 1e3,
            data_ms=(fetched - start) * 1e3,
            sync_wait_ms=self.sync_wait_s * 1e3,
            tokens=tokens,
            tokens_per_sec=tokens / (end - start),
        )

    def _float_step(self, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Accumulate the micro-batches in float; ZeroAdamW's hooks sync during the last one.

        With a plan each micro-batch's loss counts ``1 / plan.micro_batches`` of the step (the
        ranks' shares may be uneven, after a regroup in place for one): scaled by the world
        size, since the reduce-scatter averages over the ranks.
        """
        assert isinstance(self.optimizer, ZeroAdamW)
        total = torch.zeros(1)
        world = distcompat.get_world_size()
        if self.plan is None:  # equal shares: each rank's mean, averaged
            share, op, count = float(len(micro)), dist.ReduceOp.AVG, len(micro)
        else:  # a fraction of the step each (shares may be uneven, after a regroup): summed
            count = self.plan.micro_batches
            share, op = count / world, dist.ReduceOp.SUM
        for index, (inputs, targets) in enumerate(micro):
            last = index == len(micro) - 1
            with contextlib.nullcontext() if last else self.optimizer.no_sync():
                with self.autocast():
                    loss = self.model(inputs, targets)
                total += loss.detach().float()
                if last:  # the loss's all-reduce overlaps the last backward
                    mean = total / count
                    loss_sync = dist.all_reduce(mean, op=op, async_op=True)
                (loss / share).backward()  # the last: hooks launch the reduce-scatters
        self.optimizer.step()
        self.optimizer.zero_grad()
        loss_sync.wait()
        self.sync_wait_s = self.optimizer.sync_wait_s
        return float(mean.item())

    def _replicated_update(self) -> None:
        """Step the replicated AdamW at this step's learning rate (exact mode)."""
        assert isinstance(self.optimizer, torch.optim.AdamW)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_schedule(self.config)(self.step + 1)
        self.optimizer.step()
        self.optimizer.zero_grad()

    def regrouped(self, step: int) -> None:
        """Go on at ``step`` after the group changed members in place: this rank's new share.

        The loader holds the global position a survivor sent (``distcompat.inplace``); a new one
        for the new share takes it, and re-shards the rest of the epoch.
        """
        assert self.plan is not None
        assert self.corpus is not None
        world, rank = distcompat.get_world_size(), distcompat.get_rank()
        self.share = self.plan.share(world_size=world, rank=rank)
        position = self.loader.state_dict()
        self.loader = _loader(self.config, self.corpus, self.share, self.loader.device)
        self.loader.load_state_dict(position)
        self.step, self.batches = step, None

    def _exact_step(
        self, micro: list[tuple[torch.Tensor, torch.Tensor]], exact: ExactGradients
    ) -> float:
        """Sum the micro-batches' gradients as integers; redo the step if one outgrew its bound."""
        while True:
            for index, (inputs, targets) in zip(self.share.micro_batches, micro, strict=True):
                with counter_rng(self.config.seed, self.step, index), self.autocast():
                    loss = self.model(inputs, targets)
                exact.add_loss(loss)
                loss.backward()
            reduce_start = time.perf_counter()
            result = exact.reduce()
            self.sync_wait_s = time.perf_counter() - reduce_start
            if result.ok:
                break
            self.redone += 1
            _log.info("step %d redone: %s outgrew its bound", self.step + 1, result.overflowed)
        self._replicated_update()
        assert result.loss is not None
        return result.loss

    def close(self) -> None:
        """Detach the optimizer's (or exact mode's) hooks from the model."""
        if isinstance(self.optimizer, ZeroAdamW):
            self.optimizer.close()
        if self.exact is not None:
            self.exact.close()
