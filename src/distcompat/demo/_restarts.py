"""The demo's restarts: which attempt this is, the planned kill, and what a restart cost.

The lines a rank writes::

    attempt = attempt_number()                # 0, then 1 after a restart (torchrun's count)
    kill_if_planned(config, rank, step, attempt)   # --kill RANK@STEP: SIGKILL, first attempt only
    timings = restart_timings(out, ...)       # on rank 0 of a restarted attempt, for the report

Files in ``--out`` (each written atomically): ``kill.json`` by the rank that kills itself, just
before the signal (its rank, step and wall time); ``restarts.json`` by the demo's own supervisor
after each failed attempt (when it saw the failure, when every rank had stopped, when it
started the next attempt). Under torchrun there is no supervisor file: its agent restarts the
ranks, and the report gives detection and restart as one figure.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from distcompat.checkpoint import atomic_write_json
from distcompat.demo._config import DemoConfig, DemoConfigError

__all__ = [
    "KILL_FILE",
    "MAX_RESTARTS_VAR",
    "PREEMPTIONS_FILE",
    "RESTARTS_FILE",
    "RESTART_COUNT_VAR",
    "attempt_number",
    "check_launcher_restarts",
    "in_place_timings",
    "kill_if_planned",
    "preempt_if_planned",
    "preemptions",
    "record_preemption",
    "record_restart",
    "restart_timings",
]

#: torchrun's count of restarts so far; the demo's own supervisor sets it the same way.
RESTART_COUNT_VAR = "TORCHELASTIC_RESTART_COUNT"
#: torchrun's ``--max-restarts``, as its agent tells the workers.
MAX_RESTARTS_VAR = "TORCHELASTIC_MAX_RESTARTS"
KILL_FILE = "kill.json"
PREEMPTIONS_FILE = "preemptions.json"
RESTARTS_FILE = "restarts.json"


def attempt_number(environ: Mapping[str, str] | None = None) -> int:
    """Return this attempt's number: 0 on the first start, N after the N-th restart.

    Example:
        >>> attempt_number({}), attempt_number({"TORCHELASTIC_RESTART_COUNT": "1"})
        (0, 1)
    """
    value = (os.environ if environ is None else environ).get(RESTART_COUNT_VAR, "0")
    if not value.isdigit():
        raise DemoConfigError(f"{RESTART_COUNT_VAR}={value!r} must be a whole number >= 0")
    return int(value)


def check_launcher_restarts(config: DemoConfig, environ: Mapping[str, str] | None = None) -> None:
    """Refuse ``--kill`` under a launcher that will not restart the ranks (torchrun's flag 0).

    Example:
        >>> cfg = DemoConfig(out=Path("o"), steps=4, kill="1@2")
        >>> check_launcher_restarts(cfg, {"TORCHELASTIC_MAX_RESTARTS": "1"})
        >>> check_launcher_restarts(cfg, {"TORCHELASTIC_MAX_RESTARTS": "0"})
        Traceback (most recent call last):
        ...
        distcompat.demo._config.DemoConfigError: --kill=1@2 under torchrun --max-restarts=0: ...
    """
    value = (os.environ if environ is None else environ).get(MAX_RESTARTS_VAR)
    for name, flag in (("kill", config.kill), ("preempt", config.preempt)):
        if flag is not None and value == "0":
            raise DemoConfigError(
                f"--{name}={flag} under torchrun --max-restarts=0: the stopped ranks would end "
                "the job; start torchrun with --max-restarts=1 (or run the demo without a "
                "launcher)"
            )


def kill_if_planned(config: DemoConfig, rank: int, step: int, attempt: int) -> None:
    """SIGKILL this process if ``--kill`` names this rank and step (first attempt only).

    Writes ``kill.json`` first, so the restarted run can say how long the restart took.

    Example:
        >>> kill_if_planned(DemoConfig(out=Path("o"), steps=4), rank=0, step=1, attempt=0)
    """
    if attempt != 0 or config.kill_target != (rank, step):
        return
    atomic_write_json(config.out / KILL_FILE, {"rank": rank, "step": step, "at": time.time()})
    os.kill(os.getpid(), signal.SIGKILL)


def preempt_if_planned(config: DemoConfig, rank: int, step: int, attempt: int) -> None:
    """Send this process SIGTERM if ``--preempt`` names this rank and step (first attempt only).

    The rank's :class:`~distcompat.preemption.Preemption` notes it; the ranks agree on a step,
    save it and exit, as a cluster's warning before a preemption makes them do.

    Example:
        >>> preempt_if_planned(DemoConfig(out=Path("o"), steps=4), rank=0, step=1, attempt=0)
    """
    if attempt == 0 and config.preempt_target == (rank, step):
        os.kill(os.getpid(), signal.SIGTERM)


def record_preemption(out: Path, entry: Mapping[str, Any]) -> None:
    """Append one stop's report to ``preemptions.json`` (rank 0 of the stopped attempt).

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> record_preemption(folder, {"step": 3})
        >>> preemptions(folder)
        [{'step': 3}]
    """
    _append(out / PREEMPTIONS_FILE, entry)


def preemptions(out: Path) -> list[dict[str, Any]]:
    """Return the stops recorded in ``out`` (none: an empty list)."""
    return _entries(out / PREEMPTIONS_FILE)


def record_restart(out: Path, entry: Mapping[str, Any]) -> None:
    """Append one failed attempt's times to ``restarts.json`` (the demo's supervisor calls it).

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> record_restart(folder, {"attempt": 0})
        >>> json.loads((folder / RESTARTS_FILE).read_text())
        [{'attempt': 0}]
    """
    _append(out / RESTARTS_FILE, entry)


def _entries(path: Path) -> list[dict[str, Any]]:
    """Return the list in JSON file ``path`` (missing, unreadable or not a list: empty)."""
    found = _read(path)
    return list(found) if isinstance(found, list) else []


def _append(path: Path, entry: Mapping[str, Any]) -> None:
    """Add ``entry`` to the list in ``path``, written atomically."""
    atomic_write_json(path, [*_entries(path), dict(entry)])


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def restart_timings(
    out: Path,
    *,
    attempt: int,
    group_ready: float,
    resumed_step: int,
    resume_s: float,
    resumed_at: float,
    caught_up: float | None,
) -> dict[str, Any] | None:
    """Return where the time of the last restart went, from the files and this attempt's times.

    ``detect_s``: kill to the supervisor seeing the first rank fail; ``peers_stopped_s``: kill to
    every rank of the attempt gone (peers fail fast on the lost peer); ``restart_s``: from then
    (from the kill under torchrun, whose agent leaves no times) to the new group being ready
    (process start, imports, rendezvous); ``setup_s``: corpus and
    model set-up before resuming; ``resume_s``: the ``resume`` call; ``redo_s``: re-running the
    steps after the checkpoint up to the killed one;
    ``lost_s``: kill to back at the killed step. None on a first attempt.

    Example:
        >>> restart_timings(Path("o"), attempt=0, group_ready=0.0,
        ...     resumed_step=0, resume_s=0.0, resumed_at=0.0, caught_up=None) is None
        True
    """
    if attempt == 0:
        return None
    kill = _read(out / KILL_FILE) or {}
    supervisor = (_read(out / RESTARTS_FILE) or [{}])[-1]
    kill_at = kill.get("at")
    timings: dict[str, Any] = {
        "killed_rank": kill.get("rank"),
        "killed_at_step": kill.get("step"),
        "resumed_after_step": resumed_step,
        "steps_redone": None if kill.get("step") is None else kill["step"] - 1 - resumed_step,
        "resume_s": resume_s,
        "setup_s": resumed_at - group_ready - resume_s,
        "redo_s": _since(resumed_at, caught_up),
        "supervisor": "distcompat demo" if supervisor else "the launcher (torchrun)",
    }
    if kill_at is not None:
        stopped = supervisor.get("stopped_at")
        timings["detect_s"] = _since(kill_at, supervisor.get("failure_seen_at"))
        timings["peers_stopped_s"] = _since(kill_at, stopped)
        timings["restart_s"] = group_ready - (stopped if stopped is not None else kill_at)
        timings["lost_s"] = _since(kill_at, caught_up)
    return timings


def in_place_timings(
    out: Path, recoveries: Sequence[Any], committed: float | None
) -> dict[str, Any] | None:
    """Return where the time of an in-place recovery went (``--in-place``); None without one.

    ``lost_s``: the kill to the killed step committed by the ranks that went on (the same key
    a restart's account has); ``regroup_s``: their agreement, new group and state copy.

    Example:
        >>> in_place_timings(Path("o"), [], None) is None
        True
    """
    if not recoveries:
        return None
    kill = _read(out / KILL_FILE) or {}
    first = recoveries[0]
    kill_at = kill.get("at")
    return {
        "killed_rank": kill.get("rank"),
        "killed_at_step": kill.get("step"),
        "in_place": True,
        "went_on_from_step": first.step,
        "world_size_after": len(first.members),
        "how": first.how,
        "regroup_s": first.seconds,
        "steps_redone": None if kill.get("step") is None else kill["step"] - 1 - first.step,
        "supervisor": "distcompat demo (the others kept running)",
        "lost_s": None if kill_at is None else _since(kill_at, committed),
    }


def _since(start: float, end: float | None) -> float | None:
    return None if end is None else end - start
