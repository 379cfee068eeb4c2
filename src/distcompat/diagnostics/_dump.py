"""What one rank says about itself when a hang is declared: its state, its stacks, its dump file.

The two lines the watchdog writes::

    mine = rank_state(recorder, rank=0, reason="all_reduce #57 not complete after 60s")
    path = write_dump(directory, rank=0, world_size=2, history=history, report=report)

Dumps are ``<dir>/<job>/incident-<N>/rank<R>.json`` files (format ``distcompat-hang/2``, which
also names the job and the incident inside), written atomically, so ``distcompat diagnose DIR``
never reads half a file even if the job is killed while writing, and never mistakes one job's
dump for another's: every job keeps its own folder under the shared default directory.
"""

from __future__ import annotations

import faulthandler
import os
import re
import socket
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from distcompat._files import atomic_write_json
from distcompat.collectives._wait import current as current_wait
from distcompat.diagnostics._records import (
    TORCH_DIR,
    CollectiveRecord,
    Recorder,
    group_label,
)
from distcompat.diagnostics._report import HangReport, RankState

__all__ = ["DUMP_FORMAT", "current_stacks", "dump_path", "main_frames", "rank_state", "write_dump"]

DUMP_FORMAT = "distcompat-hang/2"
_RECENT = 8  # history records each rank publishes with its account
_MAIN_FRAMES = 3  # user frames of the main thread shown in a report
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STDLIB = tuple({os.path.abspath(sysconfig.get_paths()[key]) for key in ("stdlib", "platstdlib")})


def _is_user_file(filename: str) -> bool:
    """Not distcompat, torch, the standard library or frozen import machinery."""
    if filename.startswith(("<frozen", _PACKAGE_DIR, TORCH_DIR)):
        return False
    if filename.startswith(_STDLIB):
        return "-packages" in filename  # site-packages below the stdlib folder: third party
    return True


def main_frames(limit: int = _MAIN_FRAMES) -> tuple[str, ...]:
    """Return the innermost frames of the main thread that are the user's code, innermost first.

    Each is ``file:line in function``; frames of distcompat, torch and the standard library are
    skipped, so a rank spinning in its data loader shows the loader's line, not ``threading``.

    Example:
        >>> main_frames()[0].endswith("in <module>")
        True
    """
    frame: FrameType | None = sys._current_frames().get(threading.main_thread().ident or -1)
    found: list[str] = []
    while frame is not None and len(found) < limit:
        code = frame.f_code
        if _is_user_file(code.co_filename):
            found.append(f"{code.co_filename}:{frame.f_lineno} in {code.co_name}")
        frame = frame.f_back
    return tuple(found)


def current_stacks() -> str:
    """Return all threads' Python stacks as faulthandler prints them (works during a C++ wait).

    Example:
        >>> "current_stacks" in current_stacks()
        True
    """
    with tempfile.TemporaryFile(mode="w+") as scratch:
        faulthandler.dump_traceback(file=scratch, all_threads=True)
        scratch.seek(0)
        return scratch.read()


def rank_state(recorder: Recorder, *, rank: int, reason: str) -> RankState:
    """Return this rank's account: collectives started, completed, in flight, recent, stacks."""
    snapshot = recorder.snapshot()
    return RankState(
        rank=rank,
        host=socket.gethostname(),
        pid=os.getpid(),
        reason=reason,
        world_group=group_label(None),
        started=snapshot["started"],
        completed=snapshot["completed"],
        in_flight=tuple(CollectiveRecord.from_json(r) for r in snapshot["in_flight"]),
        recent=tuple(CollectiveRecord.from_json(r) for r in snapshot["history"][-_RECENT:]),
        published=time.time(),
        stacks=current_stacks(),
        main_frames=main_frames(),
        phase=_phase(),
    )


def _phase() -> str:
    """Say which wait on peers the main thread is in ('' if none outlasted its first slice)."""
    wait = current_wait()
    return "" if wait is None else wait.describe()


def dump_path(directory: Path, *, job: str, incident: int, rank: int) -> Path:
    """Where rank ``rank`` writes its dump of ``incident`` of ``job``: one folder per job.

    Example:
        >>> dump_path(Path("/tmp/d"), job="20260101-120000-h-7", incident=2, rank=1).as_posix()
        '/tmp/d/20260101-120000-h-7/incident-2/rank1.json'
    """
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", job) or "job"
    return directory / safe / f"incident-{incident}" / f"rank{rank}.json"


def write_dump(
    directory: Path, *, rank: int, world_size: int, history: list[Any], report: HangReport
) -> Path:
    """Write this rank's dump of ``report`` (its job, its incident) atomically; return the path."""
    path = dump_path(directory, job=report.job, incident=report.incident, rank=rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "format": DUMP_FORMAT,
        "job": report.job,
        "incident": report.incident,
        "rank": rank,
        "world_size": world_size,
        "written": time.time(),
        "history": history,
        "report": report.to_json(),
        "text": report.describe(),
    }
    atomic_write_json(path, data, indent=1)
    return path
