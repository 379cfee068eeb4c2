"""Flat token files: write them atomically, read windows of them without loading them.

The two lines a user writes::

    write_tokens("train_000.bin", token_ids, dtype=torch.uint16)    # flat little-endian ids
    loader = TokenLoader("train_000.bin", batch_size=8, seq_len=1024)

Two readers fill a batch of windows, both numpy-free and both leaving the resident set flat in the
dataset size (only the batch being built is in process memory):

* ``"pread"`` (the default where ``os.preadv`` exists: Linux, macOS, BSDs): one positioned read per
  window straight into the batch buffer. Nothing is mapped, so nothing stays resident.
* ``"mmap"`` (the named fallback elsewhere, e.g. Windows; or on request): the file is mapped and
  viewed with ``torch.frombuffer``; after each batch the pages it touched are handed back with
  ``madvise(MADV_DONTNEED)`` where the platform has it. Measured on Linux 6.18 / ext4, one random
  window fault maps up to about 1 MiB (large page-cache folios), so without that release a shuffled
  epoch leaves the whole file resident.

Both read the same bytes; the reader is a speed and portability choice, never a semantic one.
"""

from __future__ import annotations

import mmap
import os
import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from distcompat._files import atomic_path

__all__ = [
    "BIG_ENDIAN",
    "Reader",
    "ReaderChoice",
    "TokenFileError",
    "TokenRangeError",
    "choose_reader",
    "resolve_dtype",
    "write_tokens",
]

Reader = Literal["pread", "mmap"]
_DTYPES: dict[str, torch.dtype] = {"uint16": torch.uint16, "uint32": torch.uint32}
_WIDTH = {torch.uint16: 2, torch.uint32: 4}
_CAN_PREAD = hasattr(os, "preadv")
_CAN_RELEASE = hasattr(mmap.mmap, "madvise") and hasattr(mmap, "MADV_DONTNEED")
# Named fallback: token files are little-endian; on a big-endian host bytes are swapped in a copy.
BIG_ENDIAN = sys.byteorder == "big"


class TokenFileError(ValueError):
    """A token file cannot be read as flat tokens of the given dtype (size, truncation)."""


class TokenRangeError(ValueError):
    """A token does not fit the storage dtype (negative, or above its maximum)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReaderChoice:
    """Which reader a :class:`TokenLoader` uses, and why."""

    reader: Reader
    reason: str


def choose_reader(requested: str = "auto") -> ReaderChoice:
    """Pick the window reader: ``"auto"`` prefers ``"pread"`` and falls back to ``"mmap"``.

    Example:
        >>> choose_reader("mmap").reader
        'mmap'
    """
    if requested == "mmap":
        return ReaderChoice(reader="mmap", reason="mmap requested")
    if requested not in ("auto", "pread"):
        raise ValueError(f"reader must be 'auto', 'pread' or 'mmap', got {requested!r}")
    if _CAN_PREAD:
        return ReaderChoice(reader="pread", reason="os.preadv: one positioned read per window")
    if requested == "pread":
        raise ValueError("reader='pread' needs os.preadv, which this platform lacks; use 'mmap'")
    release = "pages released after each batch" if _CAN_RELEASE else "no madvise: pages stay mapped"
    return ReaderChoice(reader="mmap", reason=f"fallback: no os.preadv here; mmap ({release})")


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Return ``torch.uint16`` or ``torch.uint32`` for a dtype or its name, else raise ValueError.

    Example:
        >>> resolve_dtype("uint32")
        torch.uint32
    """
    resolved = _DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if resolved not in _WIDTH:
        raise ValueError(
            "token dtype must be torch.uint16 or torch.uint32 (or 'uint16'/'uint32'), got "
            f"{dtype!r}"
        )
    assert resolved is not None
    return resolved


def swap_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """Return a copy of ``tensor`` with each element's bytes reversed (endianness)."""
    width = tensor.element_size()
    flipped = tensor.contiguous().view(torch.uint8).view(-1, width).flip(1)
    return flipped.reshape(-1).view(tensor.dtype).view(tensor.shape)


def write_tokens(
    path: str | os.PathLike[str],
    tokens: torch.Tensor | Sequence[int],
    dtype: torch.dtype | str = torch.uint16,
) -> Path:
    """Write token ids as a flat little-endian token file, atomically (temp file, fsync, rename).

    Args:
        path: destination file; its directory must exist.
        tokens: a 1-D integer tensor or a sequence of ints.
        dtype: storage dtype, ``torch.uint16`` (vocabularies up to 65,536) or ``torch.uint32``.

    Returns:
        The path written, as a :class:`pathlib.Path`.

    Raises:
        TokenRangeError: a token is negative or does not fit ``dtype`` (a ValueError).
        ValueError: ``tokens`` is not 1-D integer data, or ``dtype`` is not uint16/uint32.

    Example:
        >>> import tempfile, os
        >>> folder = tempfile.mkdtemp()
        >>> write_tokens(os.path.join(folder, "t.bin"), [5, 6, 7]).stat().st_size
        6
    """
    storage = resolve_dtype(dtype)
    if isinstance(tokens, torch.Tensor):
        data = tokens
    else:
        data = torch.tensor(list(tokens), dtype=torch.int64)
    if data.dim() != 1 or data.is_floating_point() or data.is_complex() or data.dtype == torch.bool:
        raise ValueError(
            f"tokens must be a 1-D integer tensor or sequence, got dtype {data.dtype} with shape "
            f"{tuple(data.shape)}"
        )
    data = data.detach().to("cpu", torch.int64)
    top = (1 << (8 * _WIDTH[storage])) - 1
    bad = ((data < 0) | (data > top)).nonzero()
    if bad.numel():
        where = int(bad[0, 0])
        raise TokenRangeError(
            f"token {int(data[where])} at position {where} does not fit {storage} (0..{top}); "
            "use dtype=torch.uint32 for vocabularies above 65,536"
        )
    data = data.to(storage)
    if BIG_ENDIAN:
        data = swap_bytes(data)
    target = Path(path)
    nbytes = data.numel() * _WIDTH[storage]
    with atomic_path(target) as scratch, open(scratch, "xb+") as handle:
        if nbytes:
            handle.truncate(nbytes)
            with mmap.mmap(handle.fileno(), nbytes, access=mmap.ACCESS_WRITE) as mapped:
                view = torch.frombuffer(mapped, dtype=storage)
                view.copy_(data)
                del view  # release the buffer export before the mapping closes
                mapped.flush()
    return target


class TokenFile:
    """One open token file, and how to copy windows of it into a batch buffer."""

    __slots__ = ("__weakref__", "_fd", "_map", "_tokens", "dtype", "length", "path", "reader")

    def __init__(self, path: Path, dtype: torch.dtype, reader: Reader) -> None:
        self.path, self.dtype, self.reader = path, dtype, reader
        size = path.stat().st_size
        width = _WIDTH[dtype]
        if size % width:
            raise TokenFileError(
                f"{path}: {size} bytes is not a whole number of {dtype} tokens ({width} bytes "
                "each); wrong dtype, or a truncated file?"
            )
        self.length = size // width
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        weakref.finalize(self, os.close, self._fd)
        self._map: mmap.mmap | None = None
        self._tokens = torch.empty(0, dtype=dtype)
        if reader == "mmap" and self.length:  # mmap refuses empty files; they have no windows
            # ACCESS_COPY (a private mapping) is writable, so torch.frombuffer does not warn
            # about a read-only buffer; nothing is ever written, so nothing is ever copied.
            self._map = mmap.mmap(self._fd, 0, access=mmap.ACCESS_COPY)
            self._tokens = torch.frombuffer(self._map, dtype=dtype)

    def read(self, out: torch.Tensor, buffer: memoryview, start: int) -> None:
        """Copy ``out.numel()`` tokens from token ``start`` into ``out`` (a row of the batch).

        ``buffer`` is the same row as writable bytes (the pread reader fills it directly).
        """
        if self.reader == "pread":
            got = os.preadv(self._fd, [buffer], start * _WIDTH[self.dtype])
            if got != len(buffer):
                raise TokenFileError(
                    f"{self.path}: read {got} of {len(buffer)} bytes at token {start}; the file "
                    "shrank while it was open"
                )
        else:
            out.copy_(self._tokens[start : start + out.numel()])

    def release(self) -> None:
        """Hand mapped pages back to the kernel (mmap reader; a no-op otherwise)."""
        if self._map is not None and _CAN_RELEASE:
            self._map.madvise(mmap.MADV_DONTNEED)


def batch_buffer(rows: int, cols: int, dtype: torch.dtype) -> tuple[torch.Tensor, memoryview]:
    """Return a (rows, cols) tensor of ``dtype`` and the same memory as writable bytes."""
    raw = bytearray(rows * cols * _WIDTH[dtype])
    return torch.frombuffer(raw, dtype=dtype).view(rows, cols), memoryview(raw)
