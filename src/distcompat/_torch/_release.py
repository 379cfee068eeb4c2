"""The installed torch release, parsed once.

Example:
    >>> release() >= (2, 9)
    True
"""

from __future__ import annotations

import functools
import re

import torch

__all__ = ["release", "release_text"]


@functools.cache
def release() -> tuple[int, int]:
    """Return the installed torch's (major, minor): ``(2, 15)`` for ``2.15.0+cu132``.

    Example:
        >>> len(release())
        2
    """
    found = re.match(r"(\d+)\.(\d+)", torch.__version__)
    if found is None:  # a build that names itself otherwise: treat it as the newest
        return (99, 0)
    return int(found.group(1)), int(found.group(2))


def release_text() -> str:
    """Return torch's own version string (``"2.15.0+cu132"``), for messages.

    Example:
        >>> release_text().startswith("2.")
        True
    """
    return str(torch.__version__)
