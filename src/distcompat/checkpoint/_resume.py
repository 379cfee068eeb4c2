"""Resume a training run in one call: the newest checkpoint every rank has, loaded everywhere.

The lines a training script writes (every rank, the same code on the first start and on every
restart)::

    resumed = resume("ckpt", model=model, optimizer=optimizer, loader=loader)
    for step in range(resumed.step + 1, total_steps + 1):
        train_step()
        if step % 100 == 0:
            save_checkpoint("ckpt", step, training_state(model=model, optimizer=optimizer,
                                                         loader=loader), keep_last=3)

How the ranks agree (one object all-gather, over the same group a save uses): each rank lists
the committed steps it sees whose manifest and file sizes check out, and the ranks take the
newest step in *every* list. So a rank whose view of a shared file system lags (it does not see
the newest folder yet) holds the others back to a step all of them see, instead of each rank
loading a different step. Every rank then loads its own file (checksum verified) and the ranks
gather the outcomes; a step whose file fails on any rank is dropped on all of them and the next
common step is tried, so the ranks always leave together, on the same step, or raise together.

A world size that changed since the save (an elastic restart on fewer nodes) loads rank 0's file
on every rank: right for replicated state (DDP's model and optimizer) and for distcompat's
loaders, whose state is the global position and re-shards by itself. Per-rank state (a ZeRO
optimizer shard) cannot be re-sharded this way; pass ``world_change="error"`` to refuse instead.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from distcompat.checkpoint._errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointSyncError,
    WorldSizeMismatchError,
)
from distcompat.checkpoint._load import load_checkpoint
from distcompat.checkpoint._manifest import TMP_RE, committed_steps, verify_checkpoint
from distcompat.checkpoint._sync import DEFAULT_SYNC_TIMEOUT_S, save_group

__all__ = ["RESUME_FORMAT", "ResumeStateError", "Resumed", "Stateful", "resume", "training_state"]

#: The key and version :func:`training_state` writes; :func:`resume` refuses other states.
RESUME_FORMAT = "distcompat.resume/1"
_FORMAT_KEY = "format"

_log = logging.getLogger("distcompat.checkpoint")


class ResumeStateError(ValueError):
    """A committed checkpoint does not hold what :func:`resume` was asked to restore."""


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` / ``load_state_dict()``: a module, an optimizer, a loader."""

    def state_dict(self) -> Any:
        """Return the object's state."""

    def load_state_dict(self, state_dict: Any, /) -> Any:
        """Restore the object's state."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Resumed:
    """Where a run continues, and how resume got there.

    ``step`` is the step of the loaded checkpoint: the steps already done, so the loop runs
    ``range(step + 1, total + 1)``; 0 when there was none (a fresh start, nothing loaded).
    ``skipped`` names each newer folder passed over and why (torn, failed verification, not
    seen by every rank). ``world_size`` is the saving run's, ``extra`` what it passed as
    ``extra=`` to :func:`training_state`, ``seconds`` how long the call took on this rank.
    """

    step: int
    directory: Path | None
    world_size: int | None
    skipped: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def fresh(self) -> bool:
        """True when no checkpoint was found and nothing was loaded."""
        return self.directory is None


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    # .cpu(): the generators take CPU byte tensors, whatever map_location the load used
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(_as_random_state(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def _as_random_state(value: Any) -> tuple[Any, ...]:
    """``random.setstate`` wants tuples; a loaded state may hold lists."""
    version, internal, gauss = value
    return (version, tuple(internal), gauss)


def training_state(
    *,
    model: Stateful | None = None,
    optimizer: Stateful | None = None,
    loader: Stateful | None = None,
    rng: bool = True,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Return this rank's state for :func:`save_checkpoint`, in the layout :func:`resume` reads.

    Holds each given object's ``state_dict()``, the RNG states (torch CPU, CUDA when in use,
    Python's ``random``; NumPy's is not kept) and ``extra``: plain values (numbers, strings,
    lists, dicts, tensors) a ``weights_only`` load accepts.

    Example:
        >>> import torch
        >>> state = training_state(model=torch.nn.Linear(2, 1), extra={"losses": [2.5]})
        >>> sorted(state)
        ['extra', 'format', 'model', 'rng']
    """
    state: dict[str, Any] = {_FORMAT_KEY: RESUME_FORMAT}
    for name, obj in (("model", model), ("optimizer", optimizer), ("loader", loader)):
        if obj is not None:
            state[name] = obj.state_dict()
    if rng:
        state["rng"] = _rng_state()
    if extra:
        state["extra"] = dict(extra)
    return state


@dataclass(frozen=True, slots=True)
class _View:
    """What one rank sees in the checkpoint root: steps that verify, and why others did not."""

    steps: tuple[int, ...]
    skipped: tuple[str, ...]


def _local_view(root: Path) -> _View:
    steps, skipped = [], []
    for step in committed_steps(root):
        try:
            verify_checkpoint(root, step, checksums=False)  # sizes here; the load hashes
        except (CheckpointCorruptError, CheckpointNotFoundError) as exc:
            skipped.append(f"step-{step}: {exc}")
            continue
        steps.append(step)
    if root.is_dir():
        for entry in root.iterdir():
            match = TMP_RE.fullmatch(entry.name)
            if match and (not steps or int(match.group(1)) > steps[-1]):
                skipped.append(f"{entry.name}: never committed (a save killed or still running)")
    return _View(tuple(steps), tuple(skipped))


@dataclass(frozen=True, slots=True)
class _Loaded:
    """One rank's load of a step, as gathered: ``error`` None, a failure, or a refusal."""

    error: str | None
    refusal: str | None = None  # the class name of an error that holds for every step


@dataclass(frozen=True, slots=True)
class _Own:
    """The state a rank loaded for a step, and what it needs to know about the save."""

    state: dict[str, Any]
    world_size: int
    from_other_rank: bool


def resume(
    directory: str | os.PathLike[str],
    *,
    model: Stateful | None = None,
    optimizer: Stateful | None = None,
    loader: Stateful | None = None,
    rng: bool = True,
    world_change: Literal["rank0", "error"] = "rank0",
    map_location: str | torch.device | None = "cpu",
    timeout: float = DEFAULT_SYNC_TIMEOUT_S,
) -> Resumed:
    """Load the newest checkpoint every rank sees into the given objects; every rank calls it.

    Finds the committed steps under ``directory`` (temp folders of killed saves and steps that
    fail verification are skipped, and rank 0 logs each skip on the ``distcompat.checkpoint``
    logger), agrees with the other ranks on the newest step all of them see, loads this rank's
    file of it (SHA-256 verified) and restores ``model``, ``optimizer``, ``loader`` and the RNG
    states from it. With no checkpoint it changes nothing and returns step 0.

    Args:
        directory: the checkpoint root given to :func:`save_checkpoint`.
        model: the module to restore (it must have been in :func:`training_state`).
        optimizer: the optimizer to restore (likewise).
        loader: the data loader or sampler to restore (likewise): ``ShardedSampler`` and
            ``TokenLoader`` continue at the saved global position, re-sharded over this world.
        rng: restore the RNG states (skipped, with a note in the log, on a new world size).
        world_change: a checkpoint of another world size: ``"rank0"`` loads rank 0's file on
            every rank (replicated state, global loader positions); ``"error"`` raises
            :class:`WorldSizeMismatchError`.
        map_location: passed to ``torch.load`` (CPU by default; ``load_state_dict`` copies to
            the model's device).
        timeout: seconds to wait for every rank to call it (as for a save).

    Raises:
        CheckpointSyncError: the ranks see committed steps but none in common (a directory that
            is not shared), or a peer failed.
        ResumeStateError: the checkpoint was not saved with :func:`training_state`, or lacks an
            object asked for.
        WorldSizeMismatchError: another world size and ``world_change="error"``.

    Example:
        >>> import tempfile, torch
        >>> from distcompat.checkpoint import save_checkpoint
        >>> model = torch.nn.Linear(2, 1)
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     resume(tmp, model=model).step           # nothing saved yet: start at 0
        ...     _ = save_checkpoint(tmp, 40, training_state(model=model))
        ...     resume(tmp, model=model).step
        0
        40
    """
    started = time.perf_counter()
    root = Path(directory)
    if world_change not in ("rank0", "error"):
        raise ValueError(f"world_change={world_change!r} must be 'rank0' or 'error'")
    what = f"resume({str(root)!r})"
    group = save_group(what, timeout)
    group.arrive(what, timeout)
    views: list[_View] = group.gather(_local_view(root))
    skipped = list(views[0].skipped)
    candidates = set(views[0].steps).intersection(*(set(v.steps) for v in views[1:]))
    everywhere = set().union(*(set(v.steps) for v in views))
    if everywhere and not candidates:
        seen = "; ".join(f"rank {r}: {list(v.steps) or 'none'}" for r, v in enumerate(views))
        raise CheckpointSyncError(
            f"{what}: the ranks see committed steps but none in common ({seen}); is "
            f"{root} on a file system every rank sees, and up to date on each?"
        )
    for step in sorted(everywhere - candidates, reverse=True):
        if candidates and step > max(candidates):
            missing = [r for r, v in enumerate(views) if step not in v.steps]
            skipped.append(f"step-{step}: not seen by rank(s) {missing} yet")
    for step in sorted(candidates, reverse=True):
        own, outcome = _load_own(root, step, group.world_size, world_change, map_location)
        outcomes: list[_Loaded] = group.gather(outcome)
        refusals = [(r, o) for r, o in enumerate(outcomes) if o.refusal]
        if refusals:  # a wrong format or world size holds for every older step too
            rank, first = refusals[0]
            error = _REFUSALS[str(first.refusal)]
            raise error(f"{what} on rank {rank}: {first.error}")
        failed = [f"rank {r}: {o.error}" for r, o in enumerate(outcomes) if o.error is not None]
        if failed:
            skipped.append(f"step-{step}: {'; '.join(failed)}")
            continue
        assert own is not None
        _restore(own, model=model, optimizer=optimizer, loader=loader, rng=rng)
        _report(root, skipped, step, group.rank)
        return Resumed(
            step=step,
            directory=root / f"step-{step}",
            world_size=own.world_size,
            skipped=tuple(skipped),
            extra=dict(own.state.get("extra", {})),
            seconds=time.perf_counter() - started,
        )
    _report(root, skipped, None, group.rank)
    return Resumed(
        step=0,
        directory=None,
        world_size=None,
        skipped=tuple(skipped),
        seconds=time.perf_counter() - started,
    )


def _load_own(
    root: Path,
    step: int,
    world_size: int,
    world_change: str,
    map_location: str | torch.device | None,
) -> tuple[_Own | None, _Loaded]:
    """Load this rank's file of ``step``; an error becomes the gathered outcome."""
    try:
        manifest = verify_checkpoint(root, step, checksums=False)
        other = not manifest.replicated and manifest.world_size != world_size
        if other and world_change == "error":
            raise WorldSizeMismatchError(
                f"step {step} was saved by {manifest.world_size} rank(s), this run has "
                f"{world_size} (world_change='rank0' loads rank 0's file on every rank)"
            )
        state = load_checkpoint(root, step, map_location=map_location, rank=0 if other else None)
        if state.get(_FORMAT_KEY) != RESUME_FORMAT:
            raise ResumeStateError(
                f"step {step} in {root} was not saved with training_state() (its keys: "
                f"{sorted(state)[:8]}); save with save_checkpoint(dir, step, training_state(...))"
            )
    except (WorldSizeMismatchError, ResumeStateError) as exc:
        return None, _Loaded(f"{type(exc).__name__}: {exc}", refusal=type(exc).__name__)
    except (CheckpointCorruptError, CheckpointNotFoundError, OSError, RuntimeError) as exc:
        return None, _Loaded(f"{type(exc).__name__}: {exc}")
    return _Own(state, manifest.world_size, other), _Loaded(None)


_REFUSALS: dict[str, type[ValueError]] = {
    cls.__name__: cls for cls in (WorldSizeMismatchError, ResumeStateError)
}


def _restore(
    own: _Own,
    *,
    model: Stateful | None,
    optimizer: Stateful | None,
    loader: Stateful | None,
    rng: bool,
) -> None:
    state = own.state
    for name, obj in (("model", model), ("optimizer", optimizer), ("loader", loader)):
        if obj is None:
            continue
        if name not in state:
            raise ResumeStateError(
                f"resume(..., {name}=...) but the checkpoint holds no {name} state; pass "
                f"{name}= to training_state() when saving"
            )
        obj.load_state_dict(state[name])
    if rng and own.from_other_rank:
        _log.info("resume: RNG states not restored (the world size changed since the save)")
    elif rng and "rng" in state:
        _set_rng_state(state["rng"])


def _report(root: Path, skipped: list[str], step: int | None, rank: int) -> None:
    """Log on rank 0 which folders were skipped and what was loaded."""
    if rank != 0:
        return
    for note in skipped:
        _log.warning("resume: skipping %s in %s", note, root)
    if step is None:
        _log.info("resume: no committed checkpoint in %s, starting at step 0", root)
    else:
        _log.info("resume: continuing after step %d from %s", step, root / f"step-{step}")
