"""How a watchdog behaves: its timeout, what it does on a hang, where dumps go, how often it polls.

The two lines a user writes (or lets :func:`distcompat.watchdog` write)::

    config = WatchdogConfig(timeout=60, action="report", dump_dir=Path("hangs"))
    Watchdog(config).start()
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = ["Action", "WatchdogConfig", "default_dump_dir"]

Action = Literal["raise", "report"]


@dataclass(frozen=True, slots=True, kw_only=True)
class WatchdogConfig:
    """How a :class:`Watchdog` behaves.

    ``timeout``: seconds a collective may take before a hang is declared. ``action``: ``"raise"``
    (HangError on the stuck rank, and at the next collective on the others) or ``"report"``
    (report, then keep waiting). ``dump_dir``: where ``<job>/incident-<N>/rank<R>.json`` goes
    (default ``<tmp>/distcompat-hangs``; every job writes under its own folder there). ``grace``:
    seconds to wait for the other ranks' accounts (default ``max(2, 3 * poll)``). ``poll``:
    seconds between two alarm checks (default ``timeout / 4`` within 0.25-2 s). ``history``:
    collectives kept per rank.

    Example:
        >>> WatchdogConfig(timeout=8).poll_s, WatchdogConfig(timeout=8).grace_s
        (2.0, 6.0)
    """

    timeout: float
    action: Action = "raise"
    dump_dir: Path | None = None
    grace: float | None = None
    poll: float | None = None
    history: int = 64

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError(f"watchdog timeout={self.timeout!r} must be a positive number")
        if self.action not in ("raise", "report"):
            raise ValueError(f"watchdog action={self.action!r} must be 'raise' or 'report'")

    @property
    def poll_s(self) -> float:
        """Seconds between alarm checks."""
        return self.poll if self.poll is not None else min(2.0, max(0.25, self.timeout / 4))

    @property
    def grace_s(self) -> float:
        """Seconds to wait for the other ranks' accounts."""
        return self.grace if self.grace is not None else max(2.0, 3 * self.poll_s)

    @property
    def directory(self) -> Path:
        """Where dumps are written."""
        return self.dump_dir or default_dump_dir()


def default_dump_dir() -> Path:
    """Where watchdogs write their dumps by default (one folder per job inside).

    Example:
        >>> default_dump_dir().name
        'distcompat-hangs'
    """
    return Path(tempfile.gettempdir()) / "distcompat-hangs"
