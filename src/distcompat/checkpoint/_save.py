"""The distributed save: write into a temp directory, agree, write the manifest, commit by rename.

Steps, on every rank unless said otherwise (collectives are the ``group.*`` calls, all here):

1. ``group.arrive``: bounded check that every rank called the save (names the missing ranks).
2. ``group.gather`` the plan: same step everywhere, the step not yet committed, rank 0's temp id.
3. Write this rank's state to ``step-N.tmp-<id>/rank-R.pt``, fsync it and the directory.
4. ``group.gather`` the outcomes; if any rank failed, nothing is committed and every rank raises.
5. Rank 0: write ``manifest.json`` (temp, fsync, rename), rename the directory to ``step-N``,
   fsync the root, then apply retention. ``group.gather`` its result so every rank returns or
   raises together.

A committed directory is never written again: ``rename`` refuses a non-empty target, so a second
save of the same step (another job, a retried call) fails with :class:`CheckpointExistsError`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distcompat._files import atomic_write_json, fsync_dir, write_durable
from distcompat._scarcity import exhausted, free_bytes, ran_out
from distcompat.checkpoint._errors import (
    CheckpointExistsError,
    CheckpointSyncError,
    CheckpointWriteError,
)
from distcompat.checkpoint._manifest import (
    DELETING_RE,
    MANIFEST_NAME,
    STEP_RE,
    TMP_RE,
    Manifest,
    ManifestFile,
    rank_file_name,
    step_path,
)
from distcompat.checkpoint._sync import DEFAULT_SYNC_TIMEOUT_S, SaveGroup, save_group

__all__ = ["check_save_args", "save_checkpoint", "save_with_group"]

_log = logging.getLogger("distcompat.checkpoint")


@dataclass(frozen=True, slots=True)
class _Plan:
    step: int
    attempt: str
    committed: bool


@dataclass(frozen=True, slots=True)
class _Outcome:
    entry: ManifestFile | None
    error: str | None
    code: int | None = None  # the failure's errno (ENOSPC, EMFILE), when it has one


def check_save_args(step: int, keep_last: int | None, metadata: Mapping[str, Any] | None) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r} must be a non-negative int")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last={keep_last!r} must be None or an int >= 1")
    try:
        json.dumps(dict(metadata or {}))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"metadata must be JSON-serialisable: {exc}") from exc


def save_checkpoint(
    directory: str | os.PathLike[str],
    step: int,
    state: Mapping[str, Any],
    *,
    keep_last: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    replicated: bool = False,
    timeout: float = DEFAULT_SYNC_TIMEOUT_S,
) -> Path:
    """Save this rank's ``state`` as part of checkpoint ``step``, committed atomically by rank 0.

    Every rank calls it at the same step, each with its own state (model or optimizer shards, RNG
    state, data-loader position). The checkpoint appears as ``directory/step-<step>`` only once
    every rank's file is on disk and the manifest is written; a crash at any point leaves the
    previous committed steps untouched and nothing that :func:`latest_checkpoint` would pick.

    Args:
        directory: the checkpoint root, on a filesystem every rank sees.
        step: the training step; a step already committed raises :class:`CheckpointExistsError`.
        state: this rank's state; saved with ``torch.save``, so load it back with
            ``weights_only=True`` unless it holds more than tensors and plain containers.
        keep_last: after committing, keep this many newest committed steps and delete the rest.
        metadata: JSON-serialisable dict stored in the manifest (rank 0's is kept).
        replicated: every rank holds the same state (plain DDP): only rank 0's is written, and
            any world size can load it.
        timeout: seconds to wait for every rank to reach the save before raising
            :class:`CheckpointSyncError` (a save called from one rank only).

    Returns:
        The committed step directory.

    Example:
        >>> import tempfile, torch
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     path = save_checkpoint(tmp, 10, {"w": torch.zeros(2)}, keep_last=2)
        ...     path.name, sorted(p.name for p in path.iterdir())
        ('step-10', ['manifest.json', 'rank-00000.pt'])
    """
    what = f"save_checkpoint(step={step})"
    check_save_args(step, keep_last, metadata)
    group = save_group(what, timeout)
    return save_with_group(
        group,
        Path(directory),
        step,
        state,
        keep_last=keep_last,
        metadata=metadata,
        replicated=replicated,
        timeout=timeout,
        what=what,
    )


def save_with_group(
    group: SaveGroup,
    root: Path,
    step: int,
    state: Mapping[str, Any],
    *,
    keep_last: int | None,
    metadata: Mapping[str, Any] | None,
    replicated: bool,
    timeout: float,
    what: str,
) -> Path:
    """Run the protocol of :func:`save_checkpoint` over ``group`` (arguments already checked)."""
    group.arrive(what, timeout)

    final = step_path(root, step)
    plans: list[_Plan] = group.gather(_Plan(step, uuid.uuid4().hex[:16], final.exists()))
    steps = {plan.step for plan in plans}
    if len(steps) > 1:
        by_rank = ", ".join(f"rank {r}: {p.step}" for r, p in enumerate(plans))
        raise CheckpointSyncError(f"{what}: the ranks are saving different steps ({by_rank})")
    if plans[0].committed:
        raise CheckpointExistsError(
            f"{final} is already committed; a committed checkpoint is never overwritten "
            "(save under a new step, or delete it yourself)"
        )
    tmp = root / f"step-{step}.tmp-{plans[0].attempt}"

    own_error: BaseException | None = None
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        entry = None
        if group.rank == 0 or not replicated:
            name = rank_file_name(group.rank)
            entry = _write_rank_file(tmp / name, group.rank, state)
            fsync_dir(tmp)
        outcome = _Outcome(entry, None)
    except Exception as exc:
        own_error = exc
        said, code = _failure(exc, tmp / rank_file_name(group.rank), _needed_bytes(state))
        outcome = _Outcome(None, f"rank {group.rank} could not write {said}", code)
    outcomes: list[_Outcome] = group.gather(outcome)
    failed = {r: o for r, o in enumerate(outcomes) if o.error is not None}
    if failed:
        if group.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise _not_committed(what, group, root, failed) from own_error

    commit_error: BaseException | None = None
    commit: _Outcome = _Outcome(None, None)
    if group.rank == 0:
        manifest = Manifest(
            step=step,
            world_size=group.world_size,
            replicated=replicated,
            files=tuple(o.entry for o in outcomes if o.entry is not None),
            metadata=dict(metadata or {}),
        )
        try:
            _commit(root, tmp, final, manifest)
        except CheckpointExistsError as exc:  # another save committed the step: said as such
            commit_error = exc
            commit = _Outcome(None, f"CheckpointExistsError: {exc}")
        except Exception as exc:
            commit_error = exc
            said, code = _failure(exc, tmp / MANIFEST_NAME, None)
            commit = _Outcome(None, f"rank 0 could not write the manifest {said}", code)
        else:
            if keep_last is not None:
                _apply_retention(root, keep_last)
    results: list[_Outcome] = group.gather(commit)
    if isinstance(commit_error, CheckpointExistsError):
        raise commit_error
    error = results[0].error
    if error is not None and error.startswith("CheckpointExistsError: "):
        raise CheckpointExistsError(f"{what}: {error.removeprefix('CheckpointExistsError: ')}")
    if error is not None:
        raise _not_committed(what, group, root, {0: results[0]}) from commit_error
    return final


def _write_rank_file(path: Path, rank: int, state: Mapping[str, Any]) -> ManifestFile:
    """Write this rank's ``state`` to ``path`` and fsync it; refuse at once a file that cannot fit.

    A state larger than the free space would fill the file system and fail anyway (torch's
    writer then says only "unexpected pos"): ENOSPC, with the numbers, before a byte is written.
    """
    needed = _needed_bytes(state)
    room = free_bytes(path.parent)
    if room is not None and needed > room[0]:
        raise OSError(errno.ENOSPC, ran_out(errno.ENOSPC, path=path, needed=needed))
    digest = write_durable(path, lambda target: torch.save(dict(state), target))
    return ManifestFile(name=path.name, rank=rank, size=digest.size, checksum=digest.checksum)


def _needed_bytes(state: object) -> int:
    """Return the bytes of the tensors in ``state``, each storage once: what a save needs."""
    seen: dict[int, int] = {}
    stack = [state]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            with contextlib.suppress(RuntimeError, NotImplementedError):  # sparse, nested
                storage = item.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return sum(seen.values())


def _failure(exc: BaseException, path: Path, needed: int | None) -> tuple[str, int | None]:
    """Say what went wrong writing ``path``: "<path>: <what ran out> (<what was raised>)".

    torch's writer reports a full disk without an errno ("unexpected pos 768 vs 662"): a
    RuntimeError while the file system has less free than the state needs is taken for ENOSPC.
    """
    code = next(
        (e.errno for e in _chain(exc) if isinstance(e, OSError) and e.errno is not None), None
    )
    if code is None and isinstance(exc, RuntimeError):
        room = free_bytes(path.parent)
        if room is not None and room[0] < max(needed or 0, 4096):
            code = errno.ENOSPC
    raised = f"{type(exc).__name__}: {exc}"
    if not exhausted(code):
        return f"{path}: {raised}", code
    if isinstance(exc, OSError) and exc.strerror and f" at {path}" in exc.strerror:
        return f"{path}: {exc.strerror.replace(f' at {path}', '')}", code  # said already
    what = ran_out(code, path=path, needed=needed).replace(f" at {path}", "")
    return f"{path}: {what} ({raised})", code


def _chain(exc: BaseException) -> list[BaseException]:
    found: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in found:
        found.append(current)
        current = current.__cause__ or current.__context__
    return found


def _newest(root: Path) -> int | None:
    """Return the newest committed step under ``root`` (None: none, or it cannot be read)."""
    try:
        steps = _committed_with_manifest(root)
    except OSError:
        return None
    return steps[-1] if steps else None


def _not_committed(
    what: str, group: SaveGroup, root: Path, failed: dict[int, _Outcome]
) -> CheckpointWriteError:
    """Return the error every rank raises for a save that failed on ``failed`` (rank -> why).

    A collective: every rank comes here together. Rank 0 says which step stays the newest (a
    rank out of file descriptors could not read the directory).
    """
    newest = group.gather(_newest(root) if group.rank == 0 else None)[0]
    kept = f"step {newest} stays the newest committed" if newest is not None else "none before"
    shown = "; ".join(o.error or "" for _, o in sorted(failed.items()))
    first = failed[min(failed)]
    return CheckpointWriteError(
        f"{what}: not committed ({kept}): {shown}",
        failures={r: o.error or "" for r, o in failed.items()},
        code=first.code,
    )


def _commit(root: Path, tmp: Path, final: Path, manifest: Manifest) -> None:
    """Write the manifest into ``tmp`` and rename ``tmp`` to ``final`` (rank 0 only)."""
    try:
        try:
            atomic_write_json(tmp / MANIFEST_NAME, manifest.to_json())  # also fsyncs tmp
        except OSError as exc:  # said before the temp directory goes (its inodes with it)
            if not exhausted(exc.errno):
                raise
            said = ran_out(exc.errno, path=tmp / MANIFEST_NAME)
            raise OSError(exc.errno, said) from exc
        try:
            os.rename(tmp, final)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST) or isinstance(exc, FileExistsError):
                raise CheckpointExistsError(
                    f"{final} was committed by another save while this one was writing; "
                    "a committed checkpoint is never overwritten"
                ) from exc
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(root)


def _committed_with_manifest(root: Path) -> list[int]:
    steps = []
    for entry in root.iterdir():
        match = STEP_RE.fullmatch(entry.name)
        if match and (entry / MANIFEST_NAME).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def _apply_retention(root: Path, keep_last: int) -> None:
    """Delete committed steps beyond the newest ``keep_last``, and leftovers of killed saves.

    A step leaves the committed set by one atomic rename (to ``step-N.deleting-<id>``) before its
    files are removed, so a crash mid-delete never leaves a half-deleted ``step-N`` behind.
    Failures here are logged, not raised: the new checkpoint is already committed.
    """
    committed = _committed_with_manifest(root)
    doomed, kept = committed[:-keep_last], committed[-keep_last:]
    oldest_kept = kept[0] if kept else 0
    # A temp dir can never commit once its step is committed (rename refuses a full target), and
    # one older than every kept step would be deleted by retention as soon as it committed.
    dead = set(committed)
    try:
        for step in doomed:
            target = root / f"step-{step}.deleting-{uuid.uuid4().hex[:16]}"
            with contextlib.suppress(FileNotFoundError):  # a concurrent save got there first
                os.rename(step_path(root, step), target)
        if doomed:
            fsync_dir(root)
        for entry in root.iterdir():
            tmp = TMP_RE.fullmatch(entry.name)
            stale = tmp is not None and (
                int(tmp.group(1)) < oldest_kept or int(tmp.group(1)) in dead
            )
            if DELETING_RE.fullmatch(entry.name) or stale:
                # ignore_errors: a concurrent cleanup may remove files under our feet
                shutil.rmtree(entry, ignore_errors=True)
                if entry.exists():
                    _log.warning("checkpoint retention could not remove %s", entry)
    except OSError as exc:
        _log.warning("checkpoint retention in %s stopped early: %s", root, exc)
