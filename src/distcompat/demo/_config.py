"""The demo's settings: one frozen :class:`DemoConfig`, validated once, turned back into flags.

The two lines the launcher writes::

    config = DemoConfig(out=Path("demo-out"), steps=40, nproc=2)
    argv = config.to_argv()          # the same settings for every rank process

The ranks it starts get the settings as command-line flags, so a rank started by ``distcompat
demo`` and one started by torchrun or srun parse exactly the same thing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path

from distcompat.anysize import BatchSplitError, TrainPlan
from distcompat.demo._model import GPTConfig

__all__ = ["DemoConfig", "DemoConfigError"]


class DemoConfigError(ValueError):
    """A demo setting is out of range; the message names the flag, its value and the rule."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoConfig:
    """Everything one demo run needs; the defaults take a minute or two on two CPU cores.

    ``nproc`` is the number of ranks the demo starts itself (None: 2, or the launcher's world
    size when torchrun or srun started this process). ``checkpoint_at`` None means half way.
    ``checkpoint_every`` None means an eighth of the run. ``kill="RANK@STEP"`` makes rank RANK
    SIGKILL itself at step STEP of the first attempt; ``preempt="RANK@STEP"`` sends it SIGTERM
    instead (every rank saves the agreed step and exits); ``max_restarts`` None means 1 with
    either, else 0 (restarts the demo's own supervisor allows; under torchrun its flag rules).
    ``global_batch`` (sequences per step, all ranks together) and ``micro_batch`` (sequences per
    forward; default ``batch_size``) fix the step at every world size; without them
    ``batch_size`` is per rank, as before. ``exact`` sums gradients as integers (the same bits at
    any world size; needs ``global_batch``). ``resize="OLD:NEW@STEP"`` starts OLD ranks, stops
    them together after STEP and finishes on NEW ranks. ``in_place``: a lost rank costs a regroup,
    not a restart (``distcompat.inplace``): the others go on at the new size, ZeroAdamW's shards
    re-cut from the copies in place (exact mode's replicated AdamW sent whole), the global batch
    kept (``batch_size`` times the starting ranks without ``global_batch``).

    Example:
        >>> config = DemoConfig(out=Path("x"), steps=10)
        >>> config.checkpoint_step, config.resume_compare_steps
        (5, 3)
    """

    out: Path
    steps: int = 160
    nproc: int | None = None
    sweep: bool = False
    seed: int = 35000
    batch_size: int = 8
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    lr: float = 3e-3
    checkpoint_at: int | None = None
    resume_steps: int = 3
    allreduce_reps: int = 20
    corpus_bytes: int = 1 << 20
    device: str = "cpu"
    backend: str | None = None
    log_every: int | None = None
    timeout_s: float = 300.0
    checkpoint_every: int | None = None
    kill: str | None = None
    max_restarts: int | None = None
    preempt: str | None = None
    global_batch: int | None = None
    micro_batch: int | None = None
    exact: bool = False
    resize: str | None = None
    in_place: bool = False

    def __post_init__(self) -> None:
        positive = (
            "steps", "batch_size", "seq_len", "n_layer", "n_head", "n_embd", "resume_steps",
            "allreduce_reps", "corpus_bytes",
        )  # fmt: skip
        for name in positive:
            if getattr(self, name) < 1:
                raise DemoConfigError(f"--{_flag(name)}={getattr(self, name)} must be at least 1")
        if self.steps < 2:
            raise DemoConfigError(
                f"--steps={self.steps} must be at least 2 (a checkpoint mid-run, then more steps)"
            )
        if self.nproc is not None and self.nproc < 1:
            raise DemoConfigError(f"--nproc={self.nproc} must be at least 1")
        if self.checkpoint_at is not None and not 1 <= self.checkpoint_at < self.steps:
            raise DemoConfigError(
                f"--checkpoint-at={self.checkpoint_at} must be in [1, --steps={self.steps}): "
                "the resume check re-runs the steps after it"
            )
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise DemoConfigError(f"--lr={self.lr} must be a positive number")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise DemoConfigError(f"--checkpoint-every={self.checkpoint_every} must be at least 1")
        if self.max_restarts is not None and self.max_restarts < 0:
            raise DemoConfigError(f"--max-restarts={self.max_restarts} must be at least 0")
        if self.kill is not None:
            self.kill_target  # noqa: B018 (validates the flag)
        if self.preempt is not None:
            self.preempt_target  # noqa: B018 (validates the flag)
            if self.kill is not None:
                raise DemoConfigError("--kill and --preempt: give one of them")
        self._check_sizes()
        if self.timeout_s <= 0:
            raise DemoConfigError(f"--timeout-s={self.timeout_s} must be positive")
        try:
            self.model_config()
        except ValueError as exc:
            raise DemoConfigError(f"model sizes (--n-embd, --n-head): {exc}") from exc

    def _check_sizes(self) -> None:
        """Check the global batch, micro-batch, exact mode and resize flags together."""
        for name in ("global_batch", "micro_batch"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise DemoConfigError(f"--{_flag(name)}={value} must be at least 1")
        if self.micro_batch is not None and self.global_batch is None:
            raise DemoConfigError("--micro-batch needs --global-batch (the step's sequences)")
        if self.in_place and self.resize is not None:
            raise DemoConfigError("--in-place and --resize: give one of them")
        if self.exact and self.plan is None:
            raise DemoConfigError(
                "--exact needs --global-batch N: the same bits at every world size need a "
                "step of the same sequences, whatever the number of ranks"
            )
        try:
            plan = self.plan
        except BatchSplitError as exc:
            raise DemoConfigError(f"--global-batch/--micro-batch: {exc}") from exc
        if self.resize is None:
            return
        target = self.resize_target
        assert target is not None  # resize is set
        old, new, step = target
        if self.kill is not None or self.preempt is not None:
            raise DemoConfigError("--resize stops the ranks itself: leave out --kill and --preempt")
        if plan is not None:
            for size in (old, new):
                try:
                    plan.share(world_size=size, rank=0)
                except BatchSplitError as exc:
                    raise DemoConfigError(f"--resize={self.resize}: {exc}") from exc
        first, last = self.checkpoint_step, self.checkpoint_step + self.resume_compare_steps
        if first <= step < last:
            raise DemoConfigError(
                f"--resize={self.resize}: STEP falls inside the resume check (steps {first + 1}-"
                f"{last} re-run from step {first}); pick another STEP or --checkpoint-at"
            )

    @property
    def plan(self) -> TrainPlan | None:
        """The run's :class:`TrainPlan` (None without ``global_batch``: per-rank batches).

        Example:
            >>> DemoConfig(out=Path("x"), global_batch=16, micro_batch=4).plan.micro_batches
            4
        """
        if self.global_batch is None and not self.in_place:
            return None
        micro = self.batch_size if self.micro_batch is None else self.micro_batch
        steady = self.batch_size * self.world_size  # in place: the starting ranks' batch
        size = steady if self.global_batch is None else self.global_batch
        return TrainPlan(global_batch=size, micro_batch=micro, seed=self.seed)

    @property
    def resize_target(self) -> tuple[int, int, int] | None:
        """``(old, new, step)`` of ``--resize OLD:NEW@STEP``, or None.

        Example:
            >>> DemoConfig(out=Path("x"), steps=100, resize="2:3@40").resize_target
            (2, 3, 40)
        """
        if self.resize is None:
            return None
        sizes, at, step = self.resize.partition("@")
        old, colon, new = sizes.partition(":")
        if not (at and colon and old.isdigit() and new.isdigit() and step.isdigit()):
            raise DemoConfigError(f"--resize={self.resize} must read OLD:NEW@STEP, e.g. 2:3@60")
        if min(int(old), int(new)) < 1:
            raise DemoConfigError(f"--resize={self.resize}: world sizes must be at least 1")
        if not 1 <= int(step) < self.steps:
            raise DemoConfigError(
                f"--resize={self.resize}: STEP must be in [1, --steps={self.steps})"
            )
        return int(old), int(new), int(step)

    @property
    def world_size(self) -> int:
        """Ranks the demo starts itself when no launcher started it (a resize: OLD)."""
        if self.resize_target is not None:
            return self.resize_target[0]
        return 2 if self.nproc is None else self.nproc

    def world_size_at(self, attempt: int) -> int:
        """Ranks the demo's supervisor starts for ``attempt`` (a resize: NEW after the stop)."""
        target = self.resize_target
        if target is not None and attempt > 0:
            return target[1]
        return self.world_size

    @property
    def micro_size(self) -> int:
        """Sequences per forward pass: ``micro_batch``, else ``batch_size``."""
        return self.micro_batch if self.micro_batch is not None else self.batch_size

    @property
    def checkpoint_step(self) -> int:
        """The step after which the mid-run checkpoint is saved."""
        return self.checkpoint_at if self.checkpoint_at is not None else self.steps // 2

    @property
    def save_every(self) -> int:
        """Steps between two checkpoints a restart can resume from."""
        return self.checkpoint_every or max(1, self.steps // 8)

    def saves_at(self, step: int) -> bool:
        """Whether a checkpoint is saved after ``step``."""
        return step % self.save_every == 0 or step == self.checkpoint_step

    @property
    def keep_last(self) -> int:
        """Checkpoints kept: the resume check's one must live until the check runs."""
        return 2 + self.resume_compare_steps // self.save_every

    @property
    def kill_target(self) -> tuple[int, int] | None:
        """``(rank, step)`` of ``--kill RANK@STEP``, or None.

        Example:
            >>> DemoConfig(out=Path("x"), steps=100, kill="1@60").kill_target
            (1, 60)
        """
        return None if self.kill is None else self._rank_at_step("kill", self.kill)

    @property
    def preempt_target(self) -> tuple[int, int] | None:
        """``(rank, step)`` of ``--preempt RANK@STEP``, or None.

        Example:
            >>> DemoConfig(out=Path("x"), steps=100, preempt="1@60").preempt_target
            (1, 60)
        """
        if self.resize_target is not None:  # the resize's stop: rank 0 is told at STEP
            return 0, self.resize_target[2]
        return None if self.preempt is None else self._rank_at_step("preempt", self.preempt)

    def _rank_at_step(self, name: str, value: str) -> tuple[int, int]:
        rank, at, step = value.partition("@")
        if not (at and rank.isdigit() and step.isdigit()):
            raise DemoConfigError(f"--{name}={value} must read RANK@STEP, e.g. 1@60")
        if not 1 <= int(step) <= self.steps:
            raise DemoConfigError(f"--{name}={value}: STEP must be in [1, --steps={self.steps}]")
        return int(rank), int(step)

    @property
    def restarts_allowed(self) -> int:
        """Restarts the demo's own supervisor allows (1 with ``--kill`` or ``--preempt``)."""
        if self.max_restarts is not None:
            return self.max_restarts
        planned = (None if self.in_place else self.kill, self.preempt, self.resize)
        return 1 if any(value is not None for value in planned) else 0

    @property
    def resume_compare_steps(self) -> int:
        """How many steps after the checkpoint the resume check re-runs and compares."""
        return min(self.resume_steps, self.steps - self.checkpoint_step)

    @property
    def log_interval(self) -> int:
        """Steps between two loss lines (about ten lines a run unless ``log_every`` is set)."""
        return self.log_every if self.log_every is not None else max(1, self.steps // 10)

    def model_config(self) -> GPTConfig:
        """Return the model sizes of this run."""
        return GPTConfig(
            seq_len=self.seq_len, n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd
        )

    def to_argv(self) -> list[str]:
        """Return the ``distcompat demo`` flags that reproduce this config (None: flag left out).

        Example:
            >>> DemoConfig(out=Path("o"), steps=4, sweep=True).to_argv()[:5]
            ['--out', 'o', '--steps', '4', '--sweep']
        """
        argv: list[str] = []
        for item in fields(self):
            value = getattr(self, item.name)
            if value is None or value is False:
                continue
            flag = f"--{_flag(item.name)}"
            argv += [flag] if value is True else [flag, str(value)]
        return argv


def _flag(name: str) -> str:
    return name.replace("_", "-")
