"""Optional dependencies: a clear error naming the pip extra that brings a missing one.

The demo's ``--sweep`` plot and ``distcompat bench --plot`` draw with matplotlib, which is an
extra; both check before any rank starts::

    require("matplotlib", extra="demo", feature="--sweep draws scaling.png", without="--sweep")
"""

from __future__ import annotations

import importlib.util

__all__ = ["MissingExtraError", "require"]


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


def require(module: str, *, extra: str, feature: str, without: str) -> None:
    """Raise :class:`MissingExtraError` unless ``module`` can be imported.

    Example:
        >>> require("json", extra="demo", feature="--sweep draws scaling.png", without="--sweep")
    """
    if importlib.util.find_spec(module) is None:
        raise MissingExtraError(
            f"{feature} with {module}, which is not installed: "
            f"pip install 'distcompat[{extra}]' (or run without {without})"
        )
