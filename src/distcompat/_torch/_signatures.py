"""Which parameters the installed torch's functions take, and a clear error where one is missing.

torch adds parameters from release to release (``init_process_group(enable_reconfigure=)`` in
2.14, ``weights_only=`` on the object collectives in 2.14, ``_ranks=`` in 2.10). distcompat's
drop-ins take the newest torch's; a value torch here does not take fails as
:class:`TorchReleaseError`, naming the release, as torch's own ``TypeError`` would::

    require_takes("init_process_group", "enable_reconfigure", True)

Example:
    >>> takes("init_process_group", "backend")
    True
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from torch.distributed import distributed_c10d as _c10d

from distcompat._torch._release import release_text

__all__ = ["TorchReleaseError", "parameters", "require_takes", "takes"]


class TorchReleaseError(TypeError):
    """A torch feature or parameter that the installed release does not have."""


def parameters(function: str) -> Mapping[str, inspect.Parameter]:
    """Return the parameters of torch's ``torch.distributed.<function>`` on this release.

    A function ``distcompat run`` replaced is read through ``__wrapped__`` (torch's own).

    Example:
        >>> "group" in parameters("all_reduce")
        True
    """
    found = getattr(_c10d, function, None)
    if found is None:
        raise TorchReleaseError(
            f"torch.distributed.{function} does not exist in torch {release_text()}"
        )
    return inspect.signature(found).parameters


def takes(function: str, parameter: str) -> bool:
    """Return whether torch's ``torch.distributed.<function>`` takes ``parameter`` here.

    Example:
        >>> takes("all_reduce", "no_such_parameter")
        False
    """
    try:
        return parameter in parameters(function)
    except TorchReleaseError:
        return False


def require_takes(function: str, parameter: str, value: Any) -> None:
    """Raise :class:`TorchReleaseError` where torch here does not take ``parameter``.

    Example:
        >>> require_takes("init_process_group", "backend", "gloo")
    """
    if not takes(function, parameter):
        raise TorchReleaseError(
            f"{function}({parameter}={value!r}): torch {release_text()}'s {function} has no "
            f"{parameter!r} parameter (a newer torch release added it)"
        )
