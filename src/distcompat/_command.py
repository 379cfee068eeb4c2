"""Is this process distcompat's own command? Then torch's NumPy warning is noise, and is hidden.

The CPU torch wheel without numpy warns "Failed to initialize NumPy" when it is imported, once per
process: ``distcompat demo`` and ``distcompat doctor`` printed it once per rank before their first
useful line. The filter must exist before torch is imported, that is before the ``distcompat``
package imports anything, so the package calls this first::

    quiet_own_command()   # a no-op unless this process is `distcompat ...` / `python -m distcompat`

It adds one narrow filter (that message, ``UserWarning``, from torch) and only in distcompat's own
command (its ranks included: the demo starts them as ``python -m distcompat``); a user's program
that imports distcompat keeps its warning filters untouched. No torch import here.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Sequence

__all__ = ["is_own_command", "quiet_own_command"]

_NUMPY_WARNING = "Failed to initialize NumPy"


def is_own_command(
    argv: Sequence[str] | None = None, orig_argv: Sequence[str] | None = None
) -> bool:
    """Return whether this process runs the ``distcompat`` command (console script or ``-m``).

    Example:
        >>> is_own_command(["/venv/bin/distcompat", "doctor"], ["python", "/venv/bin/distcompat"])
        True
        >>> is_own_command(["train.py"], ["python", "-m", "distcompat.testing", "x"])
        False
    """
    argv = sys.argv if argv is None else argv
    orig = getattr(sys, "orig_argv", []) if orig_argv is None else orig_argv
    script = os.path.basename(argv[0]) if argv else ""
    as_module = any(orig[i] == "-m" and orig[i + 1] == "distcompat" for i in range(len(orig) - 1))
    return script == "distcompat" or as_module


def quiet_own_command() -> None:
    """In distcompat's own command, ignore torch's "Failed to initialize NumPy" warning.

    Example:
        >>> quiet_own_command()   # in a user's program: nothing changes
    """
    if is_own_command():
        warnings.filterwarnings(
            "ignore", message=_NUMPY_WARNING, category=UserWarning, module=r"torch(\.|$)"
        )
