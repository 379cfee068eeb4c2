"""A training plan free of the world size: the global batch, the micro-batch, and who does what.

The lines a training script writes (every rank)::

    plan = TrainPlan(global_batch=32, micro_batch=4, seed=0)   # fails here if 32 % 4 != 0
    share = plan.share()             # this rank's micro-batches; BatchSplitError before training
    loader = TokenLoader(path, batch_size=share.samples, seq_len=T, seed=plan.seed)
    ...
    plan.advance()                   # after each optimizer step: step and samples consumed

The step's ``global_batch`` samples form ``global_batch // micro_batch`` *global micro-batches*,
numbered in the order of the global sample order. Rank ``r`` of ``W`` computes the contiguous
block ``[r * A, (r + 1) * A)`` of them (``A = micro_batches // W`` accumulation steps), which is
exactly the block a distcompat loader with ``batch_size = A * micro_batch`` hands that rank. So
a micro-batch holds the same samples, and has the same shape, at every world size: the unit of
work that makes exact mode (:mod:`distcompat.anysize._exact`) and counter RNG possible.

The plan is a Stateful: pass it to ``training_state(plan=...)`` and ``resume(plan=...)``. Its
state (step, samples consumed, seed, global batch, micro-batch) is the same on every rank, so it
follows any world size; a resume with another global batch, micro-batch or seed raises
:class:`PlanMismatchError`, since that would be another run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from distcompat.collectives._group import group_size, rank_in

__all__ = ["BatchSplitError", "PlanMismatchError", "RankShare", "TrainPlan"]

#: The key and version of :meth:`TrainPlan.state_dict`.
PLAN_FORMAT = "distcompat.plan/1"


class BatchSplitError(ValueError):
    """The global batch does not split into whole micro-batches over this world size."""


class PlanMismatchError(ValueError):
    """A saved plan describes another run (global batch, micro-batch or seed differ)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankShare:
    """One rank's part of a step: which global micro-batches it computes, and how many samples.

    ``micro_batches`` is the range of global micro-batch indices of this rank (contiguous);
    ``samples`` the samples it loads per step (``accum_steps * micro_batch``), ``first_sample``
    the offset of its first sample inside the step's global batch.
    """

    world_size: int
    rank: int
    micro_batch: int
    accum_steps: int
    micro_batches: range

    @property
    def samples(self) -> int:
        """Samples this rank loads per step (its loader's batch size)."""
        return self.accum_steps * self.micro_batch

    @property
    def first_sample(self) -> int:
        """Offset of this rank's first sample in the step's global batch."""
        return self.micro_batches.start * self.micro_batch


@dataclass(slots=True, kw_only=True)
class TrainPlan:
    """The global batch and micro-batch of a run, its seed, and how far it got.

    ``step`` counts optimizer steps done; :meth:`advance` adds one. Every value here is the
    same on every rank and at every world size.

    Example:
        >>> plan = TrainPlan(global_batch=12, micro_batch=2, seed=7)
        >>> plan.micro_batches, plan.share(world_size=3, rank=1).micro_batches
        (6, range(2, 4))
        >>> plan.valid_world_sizes()
        (1, 2, 3, 6)
        >>> plan.advance(); plan.samples_consumed
        12
    """

    global_batch: int
    micro_batch: int
    seed: int = 0
    step: int = field(default=0)

    def __post_init__(self) -> None:
        for name in ("global_batch", "micro_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BatchSplitError(f"{name}={value!r} must be a positive integer")
        if self.global_batch % self.micro_batch:
            raise BatchSplitError(
                f"global_batch={self.global_batch} is not a multiple of micro_batch="
                f"{self.micro_batch}; multiples near it: "
                f"{_near_multiples(self.global_batch, self.micro_batch)}"
            )
        if self.step < 0:
            raise ValueError(f"step={self.step} must be at least 0")

    @property
    def micro_batches(self) -> int:
        """Global micro-batches per step (the same at every world size)."""
        return self.global_batch // self.micro_batch

    @property
    def samples_consumed(self) -> int:
        """Samples every rank together has trained on (``step * global_batch``)."""
        return self.step * self.global_batch

    def valid_world_sizes(self) -> tuple[int, ...]:
        """Return the world sizes this plan splits over: the divisors of :attr:`micro_batches`."""
        count = self.micro_batches
        return tuple(w for w in range(1, count + 1) if count % w == 0)

    def share(self, world_size: int | None = None, rank: int | None = None) -> RankShare:
        """Return this rank's share of a step; raise :class:`BatchSplitError` if it does not split.

        ``world_size`` and ``rank`` default to the current group's (1 and 0 without one).

        Example:
            >>> TrainPlan(global_batch=8, micro_batch=2).share(world_size=3, rank=0)
            Traceback (most recent call last):
            ...
            distcompat.anysize._plan.BatchSplitError: global_batch=8 with micro_batch=2 is 4 \
micro-batches, which do not split over 3 ranks; world sizes that work: 1, 2, 4 (or a global \
batch of 6 or 12 for 3 ranks)
        """
        world = group_size(None) if world_size is None else world_size
        me = rank_in(None) if rank is None else rank
        if world < 1 or not 0 <= me < world:
            raise ValueError(f"rank={me} of world_size={world} is not a rank of that world")
        if self.micro_batches % world:
            sizes = ", ".join(str(w) for w in self.valid_world_sizes())
            raise BatchSplitError(
                f"global_batch={self.global_batch} with micro_batch={self.micro_batch} is "
                f"{self.micro_batches} micro-batches, which do not split over {world} ranks; "
                f"world sizes that work: {sizes} (or a global batch of "
                f"{_near_multiples(self.global_batch, world * self.micro_batch)} for {world} ranks)"
            )
        accum = self.micro_batches // world
        return RankShare(
            world_size=world,
            rank=me,
            micro_batch=self.micro_batch,
            accum_steps=accum,
            micro_batches=range(me * accum, (me + 1) * accum),
        )

    def advance(self) -> None:
        """Count one optimizer step done (call it after the step, on every rank)."""
        self.step += 1

    def state_dict(self) -> dict[str, Any]:
        """Return the plan's state: the same on every rank and at every world size.

        Example:
            >>> sorted(TrainPlan(global_batch=4, micro_batch=2).state_dict())
            ['format', 'global_batch', 'micro_batch', 'samples_consumed', 'seed', 'step']
        """
        return {
            "format": PLAN_FORMAT,
            "step": self.step,
            "samples_consumed": self.samples_consumed,
            "seed": self.seed,
            "global_batch": self.global_batch,
            "micro_batch": self.micro_batch,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue a saved plan; raise :class:`PlanMismatchError` if it describes another run.

        Example:
            >>> saved = TrainPlan(global_batch=4, micro_batch=2, step=3).state_dict()
            >>> plan = TrainPlan(global_batch=4, micro_batch=2)
            >>> plan.load_state_dict(saved); plan.step
            3
        """
        if state.get("format") != PLAN_FORMAT:
            raise PlanMismatchError(f"not a saved TrainPlan (format {state.get('format')!r})")
        differ = [
            f"{name}: saved {state[name]}, now {getattr(self, name)}"
            for name in ("global_batch", "micro_batch", "seed")
            if state[name] != getattr(self, name)
        ]
        if differ:
            raise PlanMismatchError(
                f"the checkpoint was trained with another plan ({'; '.join(differ)}); the same "
                "run continues only with the same global batch, micro-batch and seed"
            )
        self.step = int(state["step"])


def _near_multiples(value: int, unit: int) -> str:
    """Return the positive multiples of ``unit`` just below and above ``value``, as text."""
    lower = value // unit * unit
    return " or ".join(str(b) for b in (lower, lower + unit) if b > 0)
