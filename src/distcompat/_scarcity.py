"""What ran out: an OS error about a used-up resource, said as that resource, with its numbers.

``OSError: [Errno 24] Too many open files`` names no limit, and torch's own writer says
``unexpected pos 768 vs 662`` when a disk fills. Where distcompat meets such an error it says
what ran out, how much there was, and where, as a database does ("could not extend file ...:
No space left on device")::

    try:
        os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot open {path}: {ran_out(exc.errno) or exc.strerror}")
    ran_out(errno.ENOSPC, path="/ckpt", needed=2 << 20)
    # 'no space left on device at /ckpt: needed 2.0 MiB, 0 B free of 16.0 MiB'

Reading the numbers costs no file descriptor where one may have run out: the open-file count
is read only when the error is not EMFILE (at EMFILE it is the limit itself).
"""

from __future__ import annotations

import errno
import os
import resource

__all__ = ["exhausted", "free_bytes", "open_file_limit", "open_files", "ran_out", "size"]

#: The errors that mean a resource ran out, not that something is wrong with the request.
_EXHAUSTION = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOSPC, errno.EDQUOT, errno.ENOMEM})


def exhausted(code: int | None) -> bool:
    """Return whether ``code`` (an errno) says that a resource ran out.

    Example:
        >>> exhausted(errno.EMFILE), exhausted(errno.ENOENT), exhausted(None)
        (True, False, False)
    """
    return code in _EXHAUSTION


def size(count: float) -> str:
    """Return a byte count for people: ``768 B``, ``1.5 MiB``.

    Example:
        >>> size(768), size(3 << 19), size(5 << 30)
        ('768 B', '1.5 MiB', '5.0 GiB')
    """
    if count < 1024:
        return f"{int(count)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        count /= 1024
        if count < 1024 or unit == "TiB":
            break
    return f"{count:.1f} {unit}"


def open_file_limit() -> int:
    """Return this process's open-file limit (the soft ``RLIMIT_NOFILE``; -1: unlimited).

    Example:
        >>> open_file_limit() > 0
        True
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return -1 if soft == resource.RLIM_INFINITY else int(soft)


def open_files() -> int | None:
    """Return how many files this process holds open (None when ``/proc`` cannot be read).

    Example:
        >>> (open_files() or 1) > 0
        True
    """
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the listing's own descriptor
    except OSError:
        return None


def _statvfs(path: str | os.PathLike[str]) -> os.statvfs_result | None:
    """Return the statvfs of ``path``'s nearest existing parent (None when none can be read)."""
    where = os.path.abspath(os.fspath(path))
    while True:
        try:
            return os.statvfs(where)
        except FileNotFoundError:
            parent = os.path.dirname(where)
            if parent == where:
                return None
            where = parent
        except OSError:
            return None


def free_bytes(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """Return (bytes free to this user, total bytes) of the file system holding ``path``.

    ``path`` need not exist: its nearest existing parent is asked. None when none can be.

    Example:
        >>> free, total = free_bytes("/")
        >>> 0 <= free <= total
        True
    """
    stat = _statvfs(path)
    return None if stat is None else (stat.f_bavail * stat.f_frsize, stat.f_blocks * stat.f_frsize)


def _no_inodes(path: str | os.PathLike[str]) -> int | None:
    """Return the file system's inode count when none is free to this user, else None."""
    stat = _statvfs(path)
    return stat.f_files if stat is not None and stat.f_files and stat.f_favail == 0 else None


def _file_table() -> str:
    try:
        with open("/proc/sys/fs/file-nr") as handle:
            used, _, most = handle.read().split()[:3]
    except (OSError, ValueError):
        return ""
    return f" ({used} of fs.file-max {most} in use)"


def ran_out(
    code: int | None,
    *,
    path: str | os.PathLike[str] | None = None,
    needed: int | None = None,
) -> str:
    """Say what ran out for the errno ``code``, with numbers; "" when it is not an exhaustion.

    ``path``: where a file was being written (disk full); ``needed``: the bytes it needed.

    Example:
        >>> ran_out(errno.ENOENT)
        ''
        >>> ran_out(errno.EMFILE).startswith("too many open files")
        True
    """
    if code == errno.EMFILE:
        limit = open_file_limit()
        held = "as many as it may" if limit < 0 else f"all {limit} its limit (RLIMIT_NOFILE) allows"
        return (
            f"too many open files: this process holds {held}; raise it "
            f"with `ulimit -n`, or see what holds them in /proc/{os.getpid()}/fd"
        )
    if code == errno.ENFILE:
        return f"the system's open-file table is full{_file_table()}: raise fs.file-max"
    if code in (errno.ENOSPC, errno.EDQUOT):
        what = "no space left on device" if code == errno.ENOSPC else "disk quota exceeded"
        if path is None:
            return what
        inodes = _no_inodes(path)
        if inodes is not None:
            return f"{what} at {os.fspath(path)}: no inode free of {inodes} (too many files)"
        room = free_bytes(path)
        free = f"{size(room[0])} free of {size(room[1])}" if room else "free space unknown"
        want = f"needed {size(needed)}, " if needed is not None else ""
        return f"{what} at {os.fspath(path)}: {want}{free}"
    if code == errno.ENOMEM:
        return "out of memory (the kernel refused an allocation)"
    return ""
