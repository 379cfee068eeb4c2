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

A world size that changed since the save (an elastic restart on fewer nodes, a job moved to more
GPUs) is followed (``_world``): replicated state (DDP's model and optimizer, distcompat's loaders
and training plan, whose state is a global position) comes from rank 0's file once every saving
rank's copy is checked equal; a :class:`Reshardable` object (a ZeRO optimizer shard) gets every
saving rank's state and takes its share; state that differs per rank and cannot be re-split
raises :class:`PerRankStateError` on every rank, naming its keys. Per-rank RNG states cannot
follow: a warning (:class:`RngStateWarning`) or, with ``rng_change="error"``, the same error.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from distcompat.checkpoint._errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointSyncError,
    PerRankStateError,
    ResumeStateError,
    RngStateWarning,
    WorldSizeMismatchError,
)
from distcompat.checkpoint._load import load_checkpoint
from distcompat.checkpoint._manifest import TMP_RE, committed_steps, verify_checkpoint
from distcompat.checkpoint._state import (
    FORMAT_KEY,
    OBJECTS,
    RESUME_FORMAT,
    Reshardable,
    Stateful,
    set_rng_state,
)
from distcompat.checkpoint._sync import DEFAULT_SYNC_TIMEOUT_S, save_group
from distcompat.checkpoint._world import Prints, check_replicated, read_saving_ranks, rng_message

__all__ = ["Resumed", "resume"]

_log = logging.getLogger("distcompat.checkpoint")
_WORLD_CHANGES = ("follow", "rank0", "error")
_RNG_CHANGES = ("warn", "error")


@dataclass(frozen=True, slots=True, kw_only=True)
class Resumed:
    """Where a run continues, and how resume got there.

    ``step`` is the step of the loaded checkpoint: the steps already done, so the loop runs
    ``range(step + 1, total + 1)``; 0 when there was none (a fresh start, nothing loaded).
    ``skipped`` names each newer folder passed over and why (torn, failed verification, not
    seen by every rank). ``world_size`` is the saving run's, ``resized`` whether it differs from
    this run's, ``extra`` what it passed as ``extra=`` to :func:`training_state` (rank 0's on
    another world size), ``seconds`` how long the call took on this rank.
    """

    step: int
    directory: Path | None
    world_size: int | None
    resized: bool = False
    skipped: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def fresh(self) -> bool:
        """True when no checkpoint was found and nothing was loaded."""
        return self.directory is None


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
    """One rank's load of a step, as gathered: ``error`` None, a failure, or a refusal.

    ``prints``: on another world size, the fingerprints of the saving ranks' files this rank
    read for the check (merged across ranks, they cover every saving rank).
    """

    error: str | None
    refusal: str | None = None  # the class name of an error that holds for every step
    prints: Prints = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Own:
    """The state a rank loaded for a step, and what it needs to know about the save.

    ``other``: per-rank files of another world size (``state`` is then saving rank 0's);
    ``checked``: the objects whose copies must be equal on every saving rank; ``resharded``:
    each Reshardable object's state from every saving rank.
    """

    state: dict[str, Any]
    world_size: int
    other: bool
    checked: tuple[str, ...] = ()
    resharded: dict[str, list[Any]] = field(default_factory=dict)


def resume(
    directory: str | os.PathLike[str],
    *,
    model: Stateful | None = None,
    optimizer: Stateful | None = None,
    loader: Stateful | None = None,
    plan: Stateful | None = None,
    rng: bool = True,
    world_change: Literal["follow", "rank0", "error"] = "follow",
    rng_change: Literal["warn", "error"] = "warn",
    map_location: str | torch.device | None = "cpu",
    timeout: float = DEFAULT_SYNC_TIMEOUT_S,
) -> Resumed:
    """Load the newest checkpoint every rank sees into the given objects; every rank calls it.

    Finds the committed steps under ``directory`` (temp folders of killed saves and steps that
    fail verification are skipped, and rank 0 logs each skip on the ``distcompat.checkpoint``
    logger), agrees with the other ranks on the newest step all of them see, loads this rank's
    file of it (SHA-256 verified) and restores ``model``, ``optimizer``, ``loader``, ``plan``
    and the RNG states from it. With no checkpoint it changes nothing and returns step 0.

    Args:
        directory: the checkpoint root given to :func:`save_checkpoint`.
        model: the module to restore (it must have been in :func:`training_state`).
        optimizer: the optimizer to restore (likewise).
        loader: the data loader or sampler to restore (likewise): ``ShardedSampler`` and
            ``TokenLoader`` continue at the saved global position, re-sharded over this world.
        plan: the training plan to restore (likewise; replicated state, like the loader's).
        rng: restore this rank's RNG states (not possible on another world size: see
            ``rng_change``).
        world_change: a checkpoint saved by another world size. ``"follow"``: a
            :class:`Reshardable` object gets every saving rank's state (each rank reads every
            saving rank's file); every other object is loaded from rank 0's file once its state
            is found equal on every saving rank (a SHA-256 per key, each saving rank's file
            read by one rank), else :class:`PerRankStateError` on every rank, before anything
            is restored. ``"rank0"``: every object, Reshardable too, loads rank 0's file, not
            checked (for state known to be replicated). ``"error"``: raise
            :class:`WorldSizeMismatchError`.
        rng_change: per-rank RNG states saved by another world size cannot be restored:
            ``"warn"`` continues without them with a :class:`RngStateWarning` on every rank
            (and a warning logged on rank 0); ``"error"`` raises :class:`PerRankStateError`.
        map_location: passed to ``torch.load`` (CPU by default; ``load_state_dict`` copies to
            the model's device).
        timeout: seconds to wait for every rank to call it (as for a save).

    Raises:
        CheckpointSyncError: the ranks see committed steps but none in common (a directory that
            is not shared), or a peer failed.
        ResumeStateError: the checkpoint was not saved with :func:`training_state`, or lacks an
            object asked for.
        WorldSizeMismatchError: another world size and ``world_change="error"``.
        PerRankStateError: another world size and state that differs per rank (see above).

    Example:
        >>> import tempfile, torch
        >>> from distcompat.checkpoint import save_checkpoint, training_state
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
    if world_change not in _WORLD_CHANGES:
        raise ValueError(f"world_change={world_change!r} must be one of {_WORLD_CHANGES}")
    if rng_change not in _RNG_CHANGES:
        raise ValueError(f"rng_change={rng_change!r} must be one of {_RNG_CHANGES}")
    given = (model, optimizer, loader, plan)
    objects = {name: obj for name, obj in zip(OBJECTS, given, strict=True) if obj is not None}
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
        own, outcome = _load_step(
            root, step, group.rank, group.world_size, objects, world_change, map_location
        )
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
        restore_rng = _check_world_change(
            own,
            outcomes,
            where=f"{what}: step {step}",
            rank=group.rank,
            world_size=group.world_size,
            world_change=world_change,
            rng=rng,
            rng_change=rng_change,
        )
        _restore(own, objects)
        if restore_rng:
            set_rng_state(own.state["rng"])
        _report(root, skipped, step, group.rank)
        return Resumed(
            step=step,
            directory=root / f"step-{step}",
            world_size=own.world_size,
            resized=own.world_size != group.world_size,
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


def _check_world_change(
    own: _Own,
    outcomes: list[_Loaded],
    *,
    where: str,
    rank: int,
    world_size: int,
    world_change: str,
    rng: bool,
    rng_change: str,
) -> bool:
    """Check, on every rank alike, what a step saved by another world size may restore.

    Raises :class:`PerRankStateError` for state that differs across the saving ranks (from the
    gathered fingerprints: every rank reaches the same verdict) and, with ``rng_change="error"``,
    for per-rank RNG states; warns for those otherwise. Returns whether to restore the RNG.
    """
    if own.other and world_change == "follow":
        prints: Prints = {}
        for gathered in outcomes:
            prints.update(gathered.prints)
        check_replicated(
            prints, own.checked, saved_world=own.world_size, world_size=world_size, where=where
        )
    if not (rng and "rng" in own.state):
        return False
    if not own.other:
        return True
    message = rng_message(own.world_size, world_size)
    if rng_change == "error":
        raise PerRankStateError(
            f"{where}: {message} (rng_change='error'; 'warn' continues without them)"
        )
    warnings.warn(f"{where}: {message}", RngStateWarning, stacklevel=3)  # resume's caller
    if rank == 0:
        _log.warning("resume: %s", message)
    return False


def _load_step(
    root: Path,
    step: int,
    rank: int,
    world_size: int,
    objects: dict[str, Stateful],
    world_change: str,
    map_location: str | torch.device | None,
) -> tuple[_Own | None, _Loaded]:
    """Load what this rank needs of ``step``; an error becomes the gathered outcome.

    The same world size (or a replicated save): this rank's own file. Another: saving rank 0's
    file, and with ``world_change="follow"`` the saving ranks' files the check and the
    Reshardable objects need (``_world.read_saving_ranks``).
    """
    try:
        manifest = verify_checkpoint(root, step, checksums=False)
        other = not manifest.replicated and manifest.world_size != world_size
        if other and world_change == "error":
            raise WorldSizeMismatchError(
                f"step {step} was saved by {manifest.world_size} rank(s), this run has "
                f"{world_size} (world_change='follow' checks and re-splits the state)"
            )
        state = load_checkpoint(root, step, map_location=map_location, rank=0 if other else None)
        if state.get(FORMAT_KEY) != RESUME_FORMAT:
            raise ResumeStateError(
                f"step {step} in {root} was not saved with training_state() (its keys: "
                f"{sorted(state)[:8]}); save with save_checkpoint(dir, step, training_state(...))"
            )
        for name in objects:
            if name not in state:
                raise ResumeStateError(
                    f"resume(..., {name}=...) but the checkpoint holds no {name} state; pass "
                    f"{name}= to training_state() when saving"
                )
        if not (other and world_change == "follow"):
            return _Own(state, manifest.world_size, other), _Loaded(None)
        resharded = [n for n, obj in objects.items() if isinstance(obj, Reshardable)]
        checked = tuple(n for n in objects if n not in resharded)
        prints, states = read_saving_ranks(
            root,
            step,
            saved_world=manifest.world_size,
            rank=rank,
            world_size=world_size,
            first=state,
            checked=checked,
            resharded=resharded,
            map_location=map_location,
        )
    except (WorldSizeMismatchError, ResumeStateError) as exc:
        return None, _Loaded(f"{type(exc).__name__}: {exc}", refusal=type(exc).__name__)
    except (CheckpointCorruptError, CheckpointNotFoundError, OSError, RuntimeError) as exc:
        return None, _Loaded(f"{type(exc).__name__}: {exc}")
    own = _Own(state, manifest.world_size, other, checked=checked, resharded=states)
    return own, _Loaded(None, prints=prints)


_REFUSALS: dict[str, type[ValueError]] = {
    cls.__name__: cls for cls in (WorldSizeMismatchError, ResumeStateError)
}


def _restore(own: _Own, objects: dict[str, Stateful]) -> None:
    """Load each object: its resharded states, or its state in the file loaded."""
    for name, obj in objects.items():
        if name in own.resharded:
            assert isinstance(obj, Reshardable)
            obj.load_resharded(own.resharded[name])
        else:
            obj.load_state_dict(own.state[name])


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
