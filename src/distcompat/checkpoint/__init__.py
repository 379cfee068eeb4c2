"""Crash-consistent checkpoints: a killed save never costs the last good one.

The lines a training script writes (every rank calls both, each with its own state)::

    step = distcompat.latest_checkpoint("ckpt")          # newest committed, intact step or None
    state = distcompat.load_checkpoint("ckpt", step) if step is not None else None
    ...
    distcompat.save_checkpoint("ckpt", step, {"model": model.state_dict()}, keep_last=3)

:class:`AsyncCheckpointer` does the same from a background thread, after copying the state.

A run that must survive a lost rank writes one line at the top instead, the same on the first
start and on every restart (``_resume``)::

    resumed = resume("ckpt", model=model, optimizer=optimizer, loader=loader)   # step 0: fresh
    ... save_checkpoint("ckpt", step, training_state(model=model, optimizer=optimizer,
                                                      loader=loader), keep_last=3)

It also resumes on another world size: replicated state checked equal on every saving rank, a
:class:`Reshardable` object re-split, per-rank state that cannot follow refused by name
(:class:`PerRankStateError`).

Single files: :func:`atomic_save` is ``torch.save`` that never leaves a torn file, and
:func:`atomic_write_bytes` / :func:`atomic_write_json` do the same for bytes and JSON.

The commit protocol, what it guarantees under which failure, and what it costs are described in
``docs/checkpoints.md``. Modules: ``_atomic`` (durable single-file writes), ``_manifest`` (layout
and verification), ``_sync`` (the save's collectives), ``_save``, ``_load``, ``_async``,
``_state`` (what a resumable state holds: ``training_state``, the protocols), ``_resume`` (resume a
run: agree on a step, load every object), ``_world`` (a checkpoint of another world size).
"""

from distcompat._files import (
    CHECKSUM_ALGORITHM,
    atomic_save,
    atomic_write_bytes,
    atomic_write_json,
)
from distcompat.checkpoint._async import AsyncCheckpointer
from distcompat.checkpoint._errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointSyncError,
    CheckpointWriteError,
    PerRankStateError,
    ResumeStateError,
    RngStateWarning,
    WorldSizeMismatchError,
)
from distcompat.checkpoint._load import latest_checkpoint, load_checkpoint
from distcompat.checkpoint._manifest import (
    Manifest,
    ManifestFile,
    committed_steps,
    verify_checkpoint,
)
from distcompat.checkpoint._resume import Resumed, resume
from distcompat.checkpoint._save import save_checkpoint
from distcompat.checkpoint._state import RESUME_FORMAT, Reshardable, Stateful, training_state
from distcompat.checkpoint._sync import DEFAULT_SYNC_TIMEOUT_S

__all__ = [
    "CHECKSUM_ALGORITHM",
    "DEFAULT_SYNC_TIMEOUT_S",
    "RESUME_FORMAT",
    "AsyncCheckpointer",
    "CheckpointCorruptError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointSyncError",
    "CheckpointWriteError",
    "Manifest",
    "ManifestFile",
    "PerRankStateError",
    "Reshardable",
    "ResumeStateError",
    "Resumed",
    "RngStateWarning",
    "Stateful",
    "WorldSizeMismatchError",
    "atomic_save",
    "atomic_write_bytes",
    "atomic_write_json",
    "committed_steps",
    "latest_checkpoint",
    "load_checkpoint",
    "resume",
    "save_checkpoint",
    "training_state",
    "verify_checkpoint",
]
