"""The signals a cluster sends before it stops a job, caught as a note: which one, and when.

Slurm (SIGTERM, or ``--signal=USR1@SECONDS`` before the time limit), Kubernetes (SIGTERM, then
SIGKILL after the pod's grace period) and torchrun's agent (which forwards SIGTERM) all warn a
job before they end it. A rank that dies at that signal loses everything since its last
checkpoint, so the handler only notes the signal; the training loop acts on it between steps::

    catcher = Catcher((signal.SIGTERM, signal.SIGUSR1))
    ...
    catcher.first           # Caught(signum=15, wall=...) once one came, else None
    catcher.close()         # the handlers that were there before are back

Python runs signal handlers on the main thread, between two bytecodes: a rank waiting in a
distcompat collective (a bounded wait in Python) notes the signal within one poll.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import FrameType
from typing import Any

__all__ = ["Catcher", "Caught", "PreemptionError"]

_log = logging.getLogger("distcompat.preemption")


class PreemptionError(RuntimeError):
    """A stop could not be set up or carried out as asked (the message says why)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Caught:
    """The first stop signal this rank caught: its number and when (``time.time()``)."""

    signum: int
    wall: float

    @property
    def name(self) -> str:
        """The signal's name, e.g. ``SIGTERM``."""
        return signal.Signals(self.signum).name


class Catcher:
    """Handlers for ``signals`` that note the first one caught (and count the later ones).

    ``on_first`` runs once, in the handler, with the first signal (the deadline starts there).
    Must be made on the main thread, the only one Python lets install handlers.
    """

    def __init__(
        self, signals: Iterable[int], on_first: Callable[[Caught], None] | None = None
    ) -> None:
        chosen = tuple(dict.fromkeys(int(s) for s in signals))
        if not chosen:
            raise PreemptionError("signals=() catches nothing: name at least one, e.g. SIGTERM")
        for signum in chosen:
            if signum in (signal.SIGKILL, signal.SIGSTOP):
                raise PreemptionError(f"{signal.Signals(signum).name} cannot be caught")
        if threading.current_thread() is not threading.main_thread():
            raise PreemptionError(
                "make the Preemption on the main thread: Python runs signal handlers there only"
            )
        self.signals = chosen
        self.first: Caught | None = None
        self.later = 0
        self._on_first = on_first
        self._previous: dict[int, Any] = {}
        for signum in chosen:
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.first is not None:
            self.later += 1
            return
        self.first = Caught(signum=signum, wall=time.time())
        _log.warning(
            "distcompat: caught %s: the ranks agree on a step to stop at, save it and exit",
            self.first.name,
        )
        if self._on_first is not None:
            self._on_first(self.first)

    def close(self) -> None:
        """Put back the handlers found at creation (where ours is still the one installed)."""
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, previous)
        self._previous.clear()
