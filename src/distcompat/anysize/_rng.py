"""Randomness by counter, not by rank: the same draws for a sample whichever rank computes it.

The lines a training loop writes::

    with counter_rng(plan.seed, plan.step, micro_index):   # dropout of this global micro-batch
        loss = model(inputs, targets)
    gen = sample_generator(plan.seed, sample_index)          # augmentation of one sample
    crop = torch.randint(0, 8, (1,), generator=gen)

A rank's generator stream depends on which rank it is and how many draws it made before, so a
run on another world size (or resumed on one) draws other numbers for the same sample. Here a
generator is seeded from counters that name the work itself: ``(seed, step, global micro-batch
index)`` or ``(seed, sample index)``, mixed into one 64-bit seed by SplitMix64's finaliser (no
two counters collide in practice, and nearby counters give unrelated streams). Nothing per rank
remains, so no RNG state needs saving: ``training_state(rng=False)``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

__all__ = ["counter_rng", "counter_seed", "micro_batch_generator", "sample_generator"]

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
#: Domain tags, so a sample's stream never equals a micro-batch's with the same numbers.
_SAMPLE, _MICRO = 0x53414D50, 0x4D494352


def _mix(value: int) -> int:
    """SplitMix64's output function: a bijection on 64-bit integers that spreads every bit."""
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & _MASK
    return value ^ (value >> 31)


def counter_seed(seed: int, *counters: int) -> int:
    """Return a 63-bit seed derived from ``seed`` and the ``counters``, the same everywhere.

    Example:
        >>> counter_seed(0, 1, 2) == counter_seed(0, 1, 2) != counter_seed(0, 2, 1)
        True
    """
    state = _mix((seed + _GOLDEN) & _MASK)
    for counter in counters:
        if counter < 0:
            raise ValueError(f"counters must be non-negative, got {counters}")
        state = _mix((state + _GOLDEN + counter * _GOLDEN) & _MASK ^ counter)
    return state >> 1  # torch's manual_seed takes values below 2**63 on every device


def _generator(seed: int, device: str | torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def sample_generator(
    seed: int, sample_index: int, device: str | torch.device = "cpu"
) -> torch.Generator:
    """Return a generator for one sample (its global index in the data), on any rank.

    Example:
        >>> a = torch.rand(2, generator=sample_generator(0, 41))
        >>> torch.equal(a, torch.rand(2, generator=sample_generator(0, 41)))
        True
    """
    return _generator(counter_seed(seed, _SAMPLE, sample_index), device)


def micro_batch_generator(
    seed: int, step: int, micro_index: int, device: str | torch.device = "cpu"
) -> torch.Generator:
    """Return a generator for one global micro-batch of one step, on any rank.

    Example:
        >>> a = torch.rand(2, generator=micro_batch_generator(0, step=3, micro_index=5))
        >>> torch.equal(a, torch.rand(2, generator=micro_batch_generator(0, 3, 5)))
        True
    """
    return _generator(counter_seed(seed, _MICRO, step, micro_index), device)


@contextmanager
def counter_rng(
    seed: int, step: int, micro_index: int, *, devices: Sequence[torch.device | str] = ()
) -> Iterator[int]:
    """Seed torch's default generators for one global micro-batch; restore them on exit.

    Code that draws from the default generator (``nn.Dropout``, ``torch.rand`` without a
    generator) draws the same numbers for micro-batch ``micro_index`` of ``step`` at every world
    size. ``devices`` lists accelerator devices to seed too (the CPU generator always is); the
    generators' earlier states come back afterwards, so code outside is unaffected.

    Example:
        >>> with counter_rng(0, step=1, micro_index=2):
        ...     a = torch.rand(3)
        >>> with counter_rng(0, step=1, micro_index=2):
        ...     torch.equal(a, torch.rand(3))
        True
    """
    derived = counter_seed(seed, _MICRO, step, micro_index)
    accelerators = [torch.device(d) for d in devices]
    cuda = [d.index if d.index is not None else 0 for d in accelerators if d.type == "cuda"]
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        torch.default_generator.manual_seed(derived)
        for index in cuda:
            torch.cuda.default_generators[index].manual_seed(derived)
        yield derived
