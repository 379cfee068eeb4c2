"""The methods torch's C++ trampoline looks up on a Python process group, read from this torch.

torch's C++ (functional collectives, DDP's reducer, DeviceMesh) calls a Python subclass of
``ProcessGroup`` through a pybind11 trampoline, ``PyProcessGroup.hpp`` in the wheel: for each
name it asks the Python object for an override, and falls back to torch's own method where there
is none, which issues the op with the GIL held (the functional all-gather hangs of issue 40). The
protected group must define every name on this list; the list changes between releases::

    trampoline_methods()        # frozenset({'allreduce', '_allgather_base', ...})

The header lies at ``c10d/PyProcessGroup.hpp`` up to torch 2.13 and at ``c10d/py/`` from 2.14.

Example:
    >>> "allreduce" in trampoline_methods()
    True
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import torch

from distcompat._torch._release import release_text

__all__ = ["HEADERS", "TrampolineUnknownError", "trampoline_header", "trampoline_methods"]

#: Where releases put the trampoline, relative to torch's include folder (2.9-2.13, 2.14+).
HEADERS = (
    "torch/csrc/distributed/c10d/PyProcessGroup.hpp",
    "torch/csrc/distributed/c10d/py/PyProcessGroup.hpp",
)


class TrampolineUnknownError(RuntimeError):
    """The installed torch's trampoline is not where, or not as, any known release has it."""


def trampoline_header() -> Path:
    """Return the installed torch's ``PyProcessGroup.hpp``.

    Example:
        >>> trampoline_header().name
        'PyProcessGroup.hpp'
    """
    include = Path(torch.__file__).parent / "include"
    for relative in HEADERS:
        if (include / relative).is_file():
            return include / relative
    raise TrampolineUnknownError(
        f"torch {release_text()} ships no PyProcessGroup.hpp under {include} (looked at "
        f"{', '.join(HEADERS)}): find where this release keeps its Python process-group "
        "trampoline and add the path to distcompat._torch._trampoline.HEADERS"
    )


@functools.cache
def trampoline_methods() -> frozenset[str]:
    """Return the Work-returning method names the trampoline looks up on a Python group.

    Example:
        >>> "get_future" in trampoline_methods()   # the Work's, not the group's
        False
    """
    text = re.sub(r"//[^\n]*", "", trampoline_header().read_text())  # line comments
    names = set(re.findall(r"(?<!#define )WORK_OVERRIDE\(\s*\w+,\s*(?:/\*.*?\*/\s*)?(\w+)", text))
    names |= set(re.findall(r'get_override\([^;]*?"(\w+)"\)', text, re.S))
    if not names:
        raise TrampolineUnknownError(
            f"{trampoline_header()} names no method the way torch 2.9-2.15 do (WORK_OVERRIDE, "
            "get_override): read it and teach distcompat._torch._trampoline the new form"
        )
    return frozenset(names - {"get_future"})
