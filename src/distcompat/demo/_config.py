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
        if self.timeout_s <= 0:
            raise DemoConfigError(f"--timeout-s={self.timeout_s} must be positive")
        try:
            self.model_config()
        except ValueError as exc:
            raise DemoConfigError(f"model sizes (--n-embd, --n-head): {exc}") from exc

    @property
    def world_size(self) -> int:
        """Ranks the demo starts itself when no launcher started it."""
        return 2 if self.nproc is None else self.nproc

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
        return 1 if self.kill is not None or self.preempt is not None else 0

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
