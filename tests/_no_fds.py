"""Run a block with every file descriptor of this process used up (``EMFILE`` on any open).

    with no_fds():
        open("/dev/null")       # OSError: [Errno 24] Too many open files

Lowers the soft ``RLIMIT_NOFILE`` to a little above what is open, fills every free number
below it with ``/dev/null``, and undoes both when the block ends. Real exhaustion, in this
process: keep the block short (pytest's own files are open around it, untouched).
"""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Iterator

__all__ = ["no_fds"]


@contextlib.contextmanager
def no_fds() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
    try:
        while True:
            try:
                held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
