"""One shared-memory segment for a group's ranks on this machine, and the futex words in it.

The segment is a file in ``/dev/shm`` that group rank 0 creates and reserves (``posix_fallocate``:
a full ``/dev/shm`` fails here, with ENOSPC, not later with SIGBUS), every rank maps, and rank 0
unlinks as soon as every rank has it mapped: from then on nothing is left in ``/dev/shm``, and the
kernel frees the memory when the last rank exits, however it exits::

    segment = Segment.create(world=2, slot_bytes=1 << 20)   # rank 0; the others: Segment.attach
    segment.unlink()                                        # once every rank has it mapped

Layout: one 64-byte line per rank in the first page (that rank's arrival word, see
``_barrier``: the number of the barrier it reached, which is the futex word, and in the
upper half the signature of its call; then its *sleepers* word), then two buffers of ``world``
slots of ``slot_bytes`` each (a pipeline alternates between them). Each word is written with one
aligned 64-bit store after the data it announces; x86-64 keeps stores in order (total store
order), so the path is offered there only.

A rank about to sleep on a peer's arrival word first sets that peer's sleepers word; an arriving
rank makes the futex wake call (a syscall: about 4 us of a 30 us small all_reduce) only when
its sleepers word is set, and clears it before waking. A sleeper sleeps at most one slice of
``_barrier`` before it looks again, so even a wake missed by the arriver's load of the
sleepers word passing its arrival store (the one reordering x86-64 allows, inside a window of
nanoseconds) costs one slice, never a hang.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import secrets

import torch

from distcompat._scarcity import exhausted, ran_out
from distcompat.peers import Identity, is_alive

__all__ = [
    "MAX_WORLD",
    "MIN_SLOT_BYTES",
    "NUMBER_MASK",
    "SHM_DIR",
    "Segment",
    "SegmentError",
    "free_bytes",
    "platform_problem",
    "sweep_leftovers",
]

SHM_DIR = "/dev/shm"
_PREFIX = "distcompat-shm-"
_LINE = 64  # bytes per rank's counter: one cache line each, so arrivals do not false-share
_WORDS = _LINE // 8  # 64-bit words per line
_HEADER = 4096
MAX_WORLD = _HEADER // _LINE
_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = (
    0,
    1,
)  # shared (not PRIVATE): the word is in a mapping of several processes
_WAKE_ALL = 0x7FFFFFFF
#: The barrier number's half of a rank's arrival word.
NUMBER_MASK = 0xFFFFFFFF
#: The smallest slot a segment is made with (a smaller /dev/shm falls back to gloo).
MIN_SLOT_BYTES = 64 << 10


def _ranks_in(free: int) -> int:
    """Return how many ranks' smallest segment fits in half of ``free`` bytes."""
    return max(0, (free // 2 - _HEADER) // (2 * MIN_SLOT_BYTES))


class SegmentError(OSError):
    """The shared-memory segment could not be made or mapped (the path falls back to gloo)."""


def _why(exc: BaseException) -> str:
    """Return what ``exc`` says, as what ran out with its numbers when a resource did."""
    code = getattr(exc, "errno", None)
    return (
        ran_out(code, path=SHM_DIR)
        if exhausted(code)
        else getattr(exc, "strerror", None) or str(exc)
    )


def platform_problem() -> str:
    """Return why this machine cannot use the path ('' when it can).

    Example:
        >>> isinstance(platform_problem(), str)
        True
    """
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"needs Linux on x86-64 (futex, total store order); this is {platform.machine()}"
    if not os.path.isdir(SHM_DIR):
        return f"{SHM_DIR} does not exist"
    return ""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True) if platform.system() == "Linux" else None


def _futex(address: int, op: int, value: int, timeout_s: float | None = None) -> None:
    """``futex(address, op, value, timeout)``; errors (EAGAIN, ETIMEDOUT, EINTR) are ignored.

    Every caller looks at the word again afterwards, so no outcome needs telling apart.
    """
    assert _libc is not None
    spec = None
    if timeout_s is not None:
        whole = int(timeout_s)
        spec = ctypes.byref(_Timespec(whole, int((timeout_s - whole) * 1e9)))
    _libc.syscall(
        ctypes.c_long(_SYS_FUTEX),
        ctypes.c_void_p(address),
        ctypes.c_int(op),
        ctypes.c_uint32(value),
        spec,
        None,
        ctypes.c_int(0),
    )


def sweep_leftovers() -> tuple[str, ...]:
    """Unlink segments that a process that died before unlinking them left in ``/dev/shm``.

    A name carries its creator's pid and start time; only segments whose creator is gone are
    removed. Returns the names removed.

    Example:
        >>> isinstance(sweep_leftovers(), tuple)
        True
    """
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(SHM_DIR):
            if not name.startswith(_PREFIX):
                continue
            parts = name[len(_PREFIX) :].split("-")
            if len(parts) != 3 or not (parts[0].isdigit() and parts[1].isdigit()):
                continue
            creator = Identity("", "", int(parts[0]), int(parts[1]), ())
            if not is_alive(creator):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(SHM_DIR, name))
                    removed.append(name)
    return tuple(removed)


class Segment:
    """A mapped segment: the rank counters, and ``data``, the slots as one uint8 tensor."""

    def __init__(self, path: str, fd: int, world: int, slot_bytes: int, size: int) -> None:
        self.path = path
        self.world = world
        self.slot_bytes = slot_bytes
        self.size = size
        try:
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._words = (ctypes.c_uint64 * (_HEADER // 8)).from_buffer(self._map)
        self._base = ctypes.addressof(self._words)
        self.data = torch.frombuffer(self._map, dtype=torch.uint8, offset=_HEADER)
        self._data_address = self.data.data_ptr()
        self._slots: dict[torch.dtype, list[list[torch.Tensor]]] = {}

    @staticmethod
    def size_for(world: int, slot_bytes: int) -> int:
        """Return the bytes a segment for ``world`` ranks with ``slot_bytes`` slots takes."""
        return _HEADER + 2 * world * slot_bytes

    @classmethod
    def fit(cls, world: int, wanted: int) -> int:
        """Return the slot size to use: ``wanted``, halved until the segment fits.

        The segment may take at most half of what ``/dev/shm`` has free; below
        ``MIN_SLOT_BYTES`` there is no room, and :class:`SegmentError` says so.
        """
        free = _free_bytes()
        slot = wanted
        while cls.size_for(world, slot) > free // 2 and slot > MIN_SLOT_BYTES:
            slot //= 2
        if cls.size_for(world, slot) > free // 2:
            need = cls.size_for(world, slot) * 2 / 2**20
            raise SegmentError(
                None,
                f"{SHM_DIR} has {free / 2**20:.1f} MiB free; the path wants twice its "
                f"{need / 2:.1f} MiB segment there (a container's default 64 MiB is enough for "
                f"{_ranks_in(64 << 20)} ranks)",
            )
        return slot

    @classmethod
    def create(cls, world: int, slot_bytes: int) -> Segment:
        """Create, reserve and map a new segment (group rank 0); raise :class:`SegmentError`."""
        me = Identity.here()
        name = f"{_PREFIX}{me.pid}-{me.start}-{secrets.token_hex(6)}"
        path = os.path.join(SHM_DIR, name)
        size = cls.size_for(world, slot_bytes)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise SegmentError(exc.errno, f"cannot create {path}: {_why(exc)}") from exc
        try:
            os.posix_fallocate(fd, 0, size)  # ENOSPC now rather than SIGBUS mid-collective
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            free = _free_bytes() / 2**20
            raise SegmentError(
                exc.errno,
                f"cannot reserve {size / 2**20:.1f} MiB in {SHM_DIR} ({free:.1f} MiB free): "
                f"{exc.strerror}",
            ) from exc
        try:
            return cls(path, fd, world, slot_bytes, size)
        except (OSError, ValueError) as exc:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise SegmentError(
                getattr(exc, "errno", None), f"cannot map {path}: {_why(exc)}"
            ) from exc

    @classmethod
    def attach(cls, path: str, world: int, slot_bytes: int) -> Segment:
        """Map the segment rank 0 created; raise :class:`SegmentError`."""
        size = cls.size_for(world, slot_bytes)
        try:
            fd = os.open(path, os.O_RDWR)
            if os.fstat(fd).st_size != size:
                os.close(fd)
                raise SegmentError(None, f"{path} is not {size} bytes long")
            return cls(path, fd, world, slot_bytes, size)
        except (OSError, ValueError) as exc:
            if isinstance(exc, SegmentError):
                raise
            raise SegmentError(
                getattr(exc, "errno", None), f"cannot map {path}: {_why(exc)}"
            ) from exc

    def unlink(self) -> None:
        """Remove the name from ``/dev/shm`` (the mappings stay valid); safe to repeat."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def slots(self, dtype: torch.dtype) -> list[list[torch.Tensor]]:
        """Return every slot as a ``dtype`` tensor: ``slots(dtype)[buffer][rank]`` (cached)."""
        found = self._slots.get(dtype)
        if found is None:
            count = self.slot_bytes // dtype.itemsize
            found = self._slots[dtype] = [
                [
                    self.slot_at(b, r)[: count * dtype.itemsize].view(dtype)
                    for r in range(self.world)
                ]
                for b in (0, 1)
            ]
        return found

    def slot_at(self, buffer: int, rank: int) -> torch.Tensor:
        """Return ``rank``'s slot in ``buffer`` as bytes."""
        start = (buffer * self.world + rank) * self.slot_bytes
        return self.data[start : start + self.slot_bytes]

    def address(self, buffer: int, rank: int) -> int:
        """Return the address of ``rank``'s slot in ``buffer`` (slots of a buffer are adjacent)."""
        return self._data_address + (buffer * self.world + rank) * self.slot_bytes

    def counter(self, rank: int) -> int:
        """Return ``rank``'s arrival word: its op's signature << 32 | its barrier number."""
        return int(self._words[rank * _WORDS])

    def arrive(self, rank: int, number: int, signature: int) -> None:
        """Store ``rank``'s arrival (one 64-bit store, after its data writes), wake sleepers.

        The wake is made only when a peer marked that it sleeps on the word (see module doc).
        """
        words, at = self._words, rank * _WORDS
        words[at] = (signature << 32) | (number & NUMBER_MASK)
        if words[at + 1]:
            words[at + 1] = 0
            _futex(self._base + rank * _LINE, _FUTEX_WAKE, _WAKE_ALL)

    def sleep_on(self, rank: int, seen: int, timeout_s: float) -> None:
        """Sleep until ``rank``'s barrier number is not ``seen``, a wake, or ``timeout_s``."""
        self._words[rank * _WORDS + 1] = 1  # the sleepers word: arrive() wakes us
        _futex(
            self._base + rank * _LINE, _FUTEX_WAIT, seen & NUMBER_MASK, timeout_s
        )  # the low half

    def close(self) -> None:
        """Unmap (the views into it must be gone); safe to repeat."""
        self.data = torch.empty(0, dtype=torch.uint8)
        self._slots.clear()
        words, self._words = self._words, None  # type: ignore[assignment]
        del words
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()


def free_bytes() -> int:
    """Return the bytes free in ``/dev/shm`` (0 when it cannot be read)."""
    return _free_bytes()


def _free_bytes() -> int:
    try:
        stat = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return stat.f_bavail * stat.f_frsize
