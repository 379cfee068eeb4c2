"""Any world size, the same run: a plan free of the world size, counter RNG, exact mode.

The lines a training script writes (every rank)::

    from distcompat.anysize import ExactGradients, TrainPlan, counter_rng

    plan = TrainPlan(global_batch=32, micro_batch=4, seed=0)
    share = plan.share()                      # BatchSplitError here, before any training
    exact = ExactGradients(model, micro_batches=plan.micro_batches)   # opt-in: the same bits
    resumed = resume("ckpt", model=model, optimizer=opt, loader=loader, plan=plan)

Modules: ``_plan`` (the global batch, the micro-batch, each rank's share, the resumable step),
``_rng`` (generators seeded from the work's counters, not the rank), ``_fixed`` (fixed-point
numbers whose sums do not depend on order), ``_exact`` (exact mode: integer gradient sums).
The contract and its limits: ``docs/any_size.md``.
"""

from distcompat.anysize._exact import (
    ExactGradients,
    ExactModeError,
    ExactStep,
    NonFiniteGradientError,
)
from distcompat.anysize._plan import BatchSplitError, PlanMismatchError, RankShare, TrainPlan
from distcompat.anysize._rng import (
    counter_rng,
    counter_seed,
    micro_batch_generator,
    sample_generator,
)

__all__ = [
    "BatchSplitError",
    "ExactGradients",
    "ExactModeError",
    "ExactStep",
    "NonFiniteGradientError",
    "PlanMismatchError",
    "RankShare",
    "TrainPlan",
    "counter_rng",
    "counter_seed",
    "micro_batch_generator",
    "sample_generator",
]
