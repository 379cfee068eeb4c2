"""``distcompat diagnose``: read a hang's evidence, distcompat's dumps and PyTorch's, and say it.

The lines a user types::

    distcompat diagnose                          # distcompat's default dump folder
    distcompat diagnose ~/.cache/torch           # torch's Flight Recorder dumps (NCCL, gloo)

Under ``DIR`` it reads one incident of distcompat's watchdog dumps (``<job>/incident-<N>/rank<R>
.json``) and the newest set of Flight Recorder dumps written by torch (``<prefix><rank>``: an
NCCL job's dumps on timeout or through the debug pipe, gloo's own); either may be absent. The
Flight Recorder files distcompat writes beside its JSON dumps say the same as those, so they are
read only where no JSON dump is found.
"""

from __future__ import annotations

from dataclasses import dataclass

from distcompat.diagnostics import DumpReadError, read_dumps
from distcompat.diagnostics._flight_read import FlightReadError, read_flight_dumps

__all__ = ["Diagnosis", "diagnose"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Diagnosis:
    """What ``diagnose`` prints (``text``) or, when nothing was found, why (``error``).

    Example:
        >>> diagnose("/nonexistent").error.startswith("cannot read /nonexistent")
        True
    """

    text: str = ""
    error: str = ""

    @property
    def exit_code(self) -> int:
        """0 when a report was read, 2 when there was none."""
        return 2 if self.error else 0


def diagnose(directory: str, *, job: str | None = None, incident: int | None = None) -> Diagnosis:
    """Read what ``directory`` holds: distcompat's dumps, torch's Flight Recorder dumps, or both.

    ``job`` / ``incident`` pick among distcompat's incidents; asked for, a missing one is an
    error even where Flight Recorder dumps are found (which name no job).

    Example:
        >>> diagnose("/nonexistent").exit_code
        2
    """
    parts: list[str] = []
    problems: list[str] = []
    have_json = False
    try:
        parts.append(read_dumps(directory, job=job, incident=incident).describe())
        have_json = True
    except DumpReadError as exc:
        if job is not None or incident is not None:
            return Diagnosis(error=str(exc))
        problems.append(str(exc))
    try:
        flight = read_flight_dumps(directory, include_distcompat=not have_json)
    except FlightReadError as exc:
        if not have_json:
            problems.append(str(exc))
    else:
        if have_json:
            parts.append("=== PyTorch Flight Recorder dumps in the same folder ===")
        parts.append(flight.describe())
    if not parts:
        return Diagnosis(error="; ".join(problems))
    return Diagnosis(text="\n".join(parts))
