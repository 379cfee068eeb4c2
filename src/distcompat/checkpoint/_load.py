"""Find the newest intact checkpoint and load this rank's state from it, checksums verified.

Loading runs no collective: every rank reads its own file, so a rank may load alone (for
evaluation, or to inspect a checkpoint in a notebook).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from distcompat._ranks import get_rank, get_world_size
from distcompat.checkpoint._errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    WorldSizeMismatchError,
)
from distcompat.checkpoint._manifest import (
    check_file,
    committed_steps,
    read_manifest,
    step_path,
    verify_checkpoint,
)

__all__ = ["latest_checkpoint", "load_checkpoint"]

_log = logging.getLogger("distcompat.checkpoint")


def latest_checkpoint(directory: str | os.PathLike[str], *, checksums: bool = False) -> int | None:
    """Return the newest committed step that verifies, or ``None`` if there is none.

    Temp directories of saves in progress or killed mid-way are never considered. A committed
    step that fails verification (missing file, wrong size; with ``checksums=True`` also a wrong
    checksum, which reads every file) is skipped with a logged warning, and the next older one is
    tried.

    Example:
        >>> import tempfile
        >>> from distcompat.checkpoint import save_checkpoint
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     _ = save_checkpoint(tmp, 1, {"x": 1})
        ...     _ = save_checkpoint(tmp, 2, {"x": 2})
        ...     latest_checkpoint(tmp)
        2
    """
    root = Path(directory)
    for step in reversed(committed_steps(root)):
        try:
            verify_checkpoint(root, step, checksums=checksums)
        except (CheckpointCorruptError, CheckpointNotFoundError) as exc:
            _log.warning("skipping checkpoint step %d in %s: %s", step, root, exc)
            continue
        return step
    return None


def load_checkpoint(
    directory: str | os.PathLike[str],
    step: int | None = None,
    *,
    verify: bool = True,
    weights_only: bool = True,
    map_location: str | torch.device | None = None,
    rank: int | None = None,
) -> dict[str, Any]:
    """Load this rank's state from committed ``step`` (the newest intact one if ``None``).

    Args:
        directory: the checkpoint root given to :func:`save_checkpoint`.
        step: the step to load; ``None`` means :func:`latest_checkpoint`.
        verify: check the file's SHA-256 against the manifest before unpickling (one extra read,
            usually from the page cache); ``False`` checks the size only.
        weights_only: passed to ``torch.load``; keep it True unless you trust the files.
        map_location: passed to ``torch.load``.
        rank: load the file saved by this rank instead of the caller's own, at any world size
            (for re-sharding by hand).

    Raises:
        CheckpointNotFoundError: no committed step (or not ``step``).
        CheckpointCorruptError: the file is missing, truncated, or fails its checksum.
        WorldSizeMismatchError: saved by a different world size, not ``replicated``, no ``rank``.

    Example:
        >>> import tempfile, torch
        >>> from distcompat.checkpoint import save_checkpoint
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     _ = save_checkpoint(tmp, 7, {"w": torch.arange(3)})
        ...     load_checkpoint(tmp)["w"]
        tensor([0, 1, 2])
    """
    root = Path(directory)
    if step is None:
        step = latest_checkpoint(root)
        if step is None:
            raise CheckpointNotFoundError(f"no committed checkpoint in {root}")
    step_dir = step_path(root, step)
    manifest = read_manifest(step_dir)
    if manifest.replicated:
        source = 0
    elif rank is not None:
        if not 0 <= rank < manifest.world_size:
            raise ValueError(f"rank={rank} is outside step {step}'s {manifest.world_size} ranks")
        source = rank
    else:
        world_size = get_world_size()
        if world_size != manifest.world_size:
            raise WorldSizeMismatchError(
                f"step {step} in {root} holds per-rank state of {manifest.world_size} ranks but "
                f"this job has {world_size}; save with replicated=True if every rank holds the "
                "same state, or pass rank= to read a given rank's file and re-shard it yourself"
            )
        source = get_rank()
    entry = manifest.file_for_rank(source)
    check_file(step_dir, entry, checksum=verify)
    state = torch.load(step_dir / entry.name, weights_only=weights_only, map_location=map_location)
    if not isinstance(state, dict):
        raise CheckpointCorruptError(f"{step_dir / entry.name} holds a {type(state).__name__}")
    return state
