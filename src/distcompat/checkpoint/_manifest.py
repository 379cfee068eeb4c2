"""On-disk layout of a checkpoint directory, its manifest, and how a committed step is verified.

A checkpoint root holds one directory per committed step and, transiently, work in progress::

    ckpt/
      step-200/                    committed: renamed into place after its manifest was written
        manifest.json              step, world size, files with size and SHA-256, user metadata
        rank-00000.pt  rank-00001.pt
      step-300.tmp-1f0c9a.../      a save in progress, or one killed mid-way: never read
      step-100.deleting-93be.../   retention in progress: already out of the committed set

Only names matching ``step-<N>`` count as committed; every reader ignores the rest.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distcompat._files import CHECKSUM_ALGORITHM, hash_file
from distcompat.checkpoint._errors import CheckpointCorruptError, CheckpointNotFoundError

__all__ = [
    "MANIFEST_NAME",
    "Manifest",
    "ManifestFile",
    "committed_steps",
    "rank_file_name",
    "read_manifest",
    "step_path",
    "verify_checkpoint",
]

MANIFEST_NAME = "manifest.json"
_FORMAT = "distcompat-checkpoint"
_FORMAT_VERSION = 1
STEP_RE = re.compile(r"step-(\d+)")
TMP_RE = re.compile(r"step-(\d+)\.tmp-[0-9a-f]+")
DELETING_RE = re.compile(r"step-(\d+)\.deleting-[0-9a-f]+")


def step_path(directory: Path, step: int) -> Path:
    """Return the committed directory name of ``step`` under ``directory``."""
    return directory / f"step-{step}"


def rank_file_name(rank: int) -> str:
    """Return the file name holding ``rank``'s state inside a step directory."""
    return f"rank-{rank:05d}.pt"


@dataclass(frozen=True, slots=True, kw_only=True)
class ManifestFile:
    """One file of a checkpoint: name in the step directory, the rank it holds, size, checksum."""

    name: str
    rank: int
    size: int
    checksum: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """What rank 0 records about a checkpoint before committing it.

    ``replicated`` means every rank held the same state and only rank 0's was written, so any
    world size may load it. ``metadata`` is the user's JSON-serialisable dict.

    Example:
        >>> m = Manifest(step=3, world_size=1, replicated=False, files=(), metadata={"lr": 0.1})
        >>> Manifest.from_json(m.to_json(), where="demo") == m
        True
    """

    step: int
    world_size: int
    replicated: bool
    files: tuple[ManifestFile, ...]
    metadata: dict[str, Any] = field(default_factory=dict)
    checksum_algorithm: str = CHECKSUM_ALGORITHM

    def to_json(self) -> dict[str, Any]:
        """Return the JSON document written as ``manifest.json``."""
        return {
            "format": _FORMAT,
            "version": _FORMAT_VERSION,
            "step": self.step,
            "world_size": self.world_size,
            "replicated": self.replicated,
            "checksum_algorithm": self.checksum_algorithm,
            "files": [
                {"name": f.name, "rank": f.rank, "size": f.size, "checksum": f.checksum}
                for f in self.files
            ],
            "metadata": self.metadata,
        }

    @classmethod
    def from_json(cls, data: Any, *, where: str) -> Manifest:
        """Parse a manifest document; anything malformed raises :class:`CheckpointCorruptError`."""
        try:
            if data["format"] != _FORMAT or data["version"] != _FORMAT_VERSION:
                raise CheckpointCorruptError(
                    f"{where}: format {data['format']!r} version {data['version']!r} is not "
                    f"{_FORMAT!r} version {_FORMAT_VERSION}"
                )
            files = tuple(
                ManifestFile(
                    name=str(f["name"]),
                    rank=int(f["rank"]),
                    size=int(f["size"]),
                    checksum=str(f["checksum"]),
                )
                for f in data["files"]
            )
            manifest = cls(
                step=int(data["step"]),
                world_size=int(data["world_size"]),
                replicated=bool(data["replicated"]),
                files=files,
                metadata=dict(data["metadata"]),
                checksum_algorithm=str(data["checksum_algorithm"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, CheckpointCorruptError):
                raise
            raise CheckpointCorruptError(f"{where}: malformed manifest ({exc!r})") from exc
        for f in files:  # a manifest may only name plain files inside its own directory
            if f.name != Path(f.name).name or f.name.startswith("."):
                raise CheckpointCorruptError(f"{where}: file name {f.name!r} is not a plain name")
        return manifest

    def file_for_rank(self, rank: int) -> ManifestFile:
        """Return the entry holding ``rank``'s state."""
        for f in self.files:
            if f.rank == rank:
                return f
        raise CheckpointCorruptError(
            f"step {self.step}: the manifest lists no file for rank {rank}"
        )


def committed_steps(directory: str | Path) -> list[int]:
    """List the step numbers whose directory is committed (by name), oldest first.

    Names only: a step listed here may still fail :func:`verify_checkpoint`. Temp directories of
    saves in progress (or killed) and directories being deleted are never listed.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     committed_steps(tmp)
        []
    """
    root = Path(directory)
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        match = STEP_RE.fullmatch(entry.name)
        if match and entry.is_dir():
            steps.append(int(match.group(1)))
    return sorted(steps)


def read_manifest(step_dir: Path) -> Manifest:
    """Read and parse ``step_dir/manifest.json``."""
    path = step_dir / MANIFEST_NAME
    if not step_dir.is_dir():
        raise CheckpointNotFoundError(f"no committed checkpoint at {step_dir}")
    try:
        text = path.read_text()
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"{step_dir} has no {MANIFEST_NAME}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointCorruptError(f"{path} is not valid JSON: {exc}") from exc
    return Manifest.from_json(data, where=str(path))


def check_file(step_dir: Path, entry: ManifestFile, *, checksum: bool) -> None:
    """Raise :class:`CheckpointCorruptError` unless the file matches its manifest entry."""
    path = step_dir / entry.name
    try:
        size = path.stat().st_size
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"{path} is listed in the manifest but missing") from exc
    if size != entry.size:
        raise CheckpointCorruptError(
            f"{path} has {size} bytes but the manifest says {entry.size}: truncated or replaced"
        )
    if checksum:
        actual = hash_file(path).checksum
        if actual != entry.checksum:
            raise CheckpointCorruptError(
                f"{path} fails its {CHECKSUM_ALGORITHM} check (manifest {entry.checksum[:16]}..., "
                f"file {actual[:16]}...): the bytes changed after the checkpoint was committed"
            )


def verify_checkpoint(directory: str | Path, step: int, *, checksums: bool = True) -> Manifest:
    """Check that committed ``step`` is whole: manifest, every file, sizes, and checksums.

    Returns the manifest; raises :class:`CheckpointNotFoundError` if the step is not committed and
    :class:`CheckpointCorruptError` naming the first problem otherwise. ``checksums=False`` checks
    sizes only (no data read).

    Example:
        >>> import tempfile, distcompat.checkpoint as ckpt
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     _ = ckpt.save_checkpoint(tmp, 5, {"x": 1}, metadata={"note": "demo"})
        ...     verify_checkpoint(tmp, 5).metadata
        {'note': 'demo'}
    """
    step_dir = step_path(Path(directory), step)
    manifest = read_manifest(step_dir)
    if manifest.step != step:
        raise CheckpointCorruptError(f"{step_dir}: the manifest is for step {manifest.step}")
    if manifest.checksum_algorithm != CHECKSUM_ALGORITHM:
        raise CheckpointCorruptError(
            f"{step_dir}: checksum algorithm {manifest.checksum_algorithm!r} is not supported "
            f"(this version writes and reads {CHECKSUM_ALGORITHM!r})"
        )
    for entry in manifest.files:
        check_file(step_dir, entry, checksum=checksums)
    return manifest
