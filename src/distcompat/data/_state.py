"""The global position of a sharded pass over a dataset, and how it resumes on any world size.

The two lines a user writes (on a sampler or a token loader)::

    state = loader.state_dict()         # epoch, seed, samples consumed by ALL ranks together
    loader.load_state_dict(state)       # resume exactly, with this or another world size

Why one integer is enough: every epoch has ONE global order, a permutation of ``range(n)`` seeded
by ``(seed, epoch)`` (the identity without shuffling). Ranks consume it in rounds: in a round each
of the W ranks takes its next k items from the next ``W * k`` entries of the order. After any number
of whole rounds the ranks together consumed exactly a prefix of the order, so the position is
``consumed``, the length of that prefix. A resume re-shards the rest, ``order[consumed:]``, over the
world size that is running now, so a mid-epoch resume on another world size still sees every
remaining sample exactly once (minus the tail a dropping mode drops, plus the repeats a padding
mode adds).

The order comes from ``torch.randperm`` with a CPU generator: identical on every rank and every run
of the same torch build (a resume under a different torch version may draw another order).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

__all__ = ["STATE_FORMAT", "EpochCursor", "EpochRepeatWarning", "LoaderStateError", "epoch_order"]

STATE_FORMAT = "distcompat.data/1"
_MASK64 = (1 << 64) - 1


class LoaderStateError(ValueError):
    """A state dict does not fit this loader (other data, other settings, or not a loader state)."""


class EpochRepeatWarning(UserWarning):
    """``set_epoch`` was asked for an epoch that was already completed: its order repeats."""


def _mix(seed: int, epoch: int) -> int:
    """Return a 63-bit generator seed for ``(seed, epoch)`` (splitmix64): (0, 1) != (1, 0)."""
    x = (seed * 0x9E3779B97F4A7C15 + epoch + 0x632BE59BD9B4E019) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def epoch_order(n: int, *, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """Return one epoch's global order: a seeded permutation of ``range(n)`` (int64, CPU).

    Example:
        >>> epoch_order(5, seed=0, epoch=0, shuffle=False).tolist()
        [0, 1, 2, 3, 4]
        >>> a = epoch_order(1000, seed=0, epoch=0, shuffle=True)
        >>> torch.equal(a, epoch_order(1000, seed=0, epoch=0, shuffle=True))
        True
        >>> torch.equal(a, epoch_order(1000, seed=0, epoch=1, shuffle=True))
        False
    """
    if not shuffle:
        return torch.arange(n, dtype=torch.int64)
    generator = torch.Generator().manual_seed(_mix(seed, epoch))
    return torch.randperm(n, generator=generator, dtype=torch.int64)


@dataclass(slots=True, kw_only=True)
class EpochCursor:
    """Mutable position of one loader: which epoch, how much of its order all ranks consumed.

    ``finished`` means this process walked to the end of the epoch; the position it reports is then
    the start of the next epoch, which the next pass begins automatically (so an epoch's order never
    repeats because ``set_epoch`` was forgotten).
    """

    num_samples: int
    seed: int
    shuffle: bool
    epoch: int = 0
    consumed: int = 0
    finished: bool = False
    _order: tuple[int, torch.Tensor] | None = field(default=None, repr=False)

    def begin_pass(self, *, done: Callable[[int], bool]) -> tuple[torch.Tensor, int]:
        """Start (or continue) a pass: return the epoch's order and the consumed prefix length.

        ``done(consumed)`` says whether nothing is left to deal at that position; an epoch that is
        done but was never walked to its end (a loop that stopped after ``len(loader)`` steps)
        moves on to the next epoch instead of yielding an empty pass.
        """
        if not self.finished and self.consumed and done(self.consumed):
            self.finished = True
        if self.finished:
            self.epoch, self.consumed, self.finished = self.epoch + 1, 0, False
        if self._order is None or self._order[0] != self.epoch:
            order = epoch_order(
                self.num_samples, seed=self.seed, epoch=self.epoch, shuffle=self.shuffle
            )
            self._order = (self.epoch, order)
        return self._order[1], self.consumed

    def set_epoch(self, epoch: int, *, owner: str) -> None:
        """Jump to ``epoch``; keep a mid-epoch position when it is the current (resumed) epoch."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"{owner}.set_epoch: epoch must be an int >= 0, got {epoch!r}")
        if epoch == self.epoch and not self.finished:
            return  # e.g. set_epoch(e) right after load_state_dict: continue where it stopped
        if epoch == self.epoch:
            warnings.warn(
                f"{owner}.set_epoch({epoch}): epoch {epoch} was already completed, so its order "
                "repeats exactly; pass the next epoch number (or stop calling set_epoch: the "
                "epoch advances by itself after each full pass)",
                EpochRepeatWarning,
                stacklevel=3,
            )
        self.epoch, self.consumed, self.finished = epoch, 0, False

    def position(self) -> tuple[int, int]:
        """``(epoch, consumed)`` as a resume sees it (a finished epoch reads as the next one)."""
        return (self.epoch + 1, 0) if self.finished else (self.epoch, self.consumed)

    def state(self, kind: str, **extra: int | bool | str) -> dict[str, int | bool | str]:
        """Return the plain, JSON-able state dict."""
        epoch, consumed = self.position()
        return {
            "format": STATE_FORMAT,
            "kind": kind,
            "epoch": epoch,
            "consumed": consumed,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": self.num_samples,
            **extra,
        }

    def load(self, state: Mapping[str, object], kind: str, **must_match: object) -> None:
        """Adopt ``state`` (epoch, consumed, seed) after checking it describes the same data."""
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise LoaderStateError(
                f"not a distcompat.data state dict (expected format {STATE_FORMAT!r}): "
                f"{_short(state)}"
            )
        if state.get("kind") != kind:
            raise LoaderStateError(f"state dict of a {state.get('kind')!r}, loaded into a {kind}")
        expected = {**must_match, "num_samples": self.num_samples, "shuffle": self.shuffle}
        for key, mine in expected.items():
            if state.get(key) != mine:
                raise LoaderStateError(
                    f"state dict has {key}={state.get(key)!r} but this {kind} has {key}={mine!r}: "
                    "the saved position would point into other data"
                )
        epoch, consumed, seed = (state.get(k) for k in ("epoch", "consumed", "seed"))
        for key, value in (("epoch", epoch), ("consumed", consumed), ("seed", seed)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise LoaderStateError(f"state dict {key} must be an int, got {value!r}")
        assert isinstance(epoch, int)
        assert isinstance(consumed, int)
        assert isinstance(seed, int)
        if epoch < 0 or not 0 <= consumed <= self.num_samples:
            raise LoaderStateError(
                f"state dict position epoch={epoch}, consumed={consumed} is outside "
                f"[0, num_samples={self.num_samples}]"
            )
        self.seed, self.epoch, self.consumed, self.finished = seed, epoch, consumed, False
        self._order = None


def _short(state: object) -> str:
    text = repr(state)
    return text if len(text) <= 120 else text[:117] + "..."
