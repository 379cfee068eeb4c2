"""What one rank says about itself when a hang is declared: its state, its stacks, its dump file.

The two lines the watchdog writes::

    mine = rank_state(recorder, rank=0, reason="all_reduce #57 not complete after 60s")
    path = write_dump(directory, rank=0, world_size=2, history=history, report=report)

Dumps are ``rank<R>.json`` files (format ``distcompat-hang/1``) written atomically, so
``distcompat diagnose DIR`` never reads half a file even if the job is killed while writing.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from distcompat._files import atomic_write_json
from distcompat.diagnostics._records import CollectiveRecord, Recorder, group_label
from distcompat.diagnostics._report import HangReport, RankState

__all__ = ["DUMP_FORMAT", "current_stacks", "rank_state", "write_dump"]

DUMP_FORMAT = "distcompat-hang/1"
_RECENT = 8  # history records each rank publishes with its account


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
    )


def write_dump(
    directory: Path, *, rank: int, world_size: int, history: list[Any], report: HangReport
) -> Path:
    """Write ``rank<R>.json`` under ``directory`` atomically and return its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank{rank}.json"
    data = {
        "format": DUMP_FORMAT,
        "rank": rank,
        "world_size": world_size,
        "written": time.time(),
        "history": history,
        "report": report.to_json(),
        "text": report.describe(),
    }
    atomic_write_json(path, data, indent=1)
    return path
