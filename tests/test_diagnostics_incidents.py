"""What a rank says of a report another rank printed (no processes: the desk's state is set by
hand, as ``_finish`` sets it after an incident; the 3-rank jobs in
test_diagnostics_flight_dump.py check the whole path)."""

from __future__ import annotations

from pathlib import Path

from distcompat.diagnostics import HangReport, WatchdogConfig
from distcompat.diagnostics._incidents import IncidentDesk
from distcompat.diagnostics._records import Recorder


def test_a_report_another_rank_printed_is_one_line_here() -> None:
    desk = IncidentDesk(WatchdogConfig(timeout=5), Recorder())
    report = HangReport(incident=3, written_by=0, timeout=5.0, world_size=2, trigger="t",
                        states={0: None, 1: None}, job="j")  # fmt: skip
    dump = Path("/d/j/incident-3/rank0.json")
    desk.last_report, desk.printed_by, desk.last_dump = report, 1, dump
    assert desk.pointer(report) == (
        "hang incident 3 of job j: rank 0 did not answer: it died, is stopped (SIGSTOP, a "
        "debugger), holds the GIL in native code, or runs without a watchdog; the full report "
        f"is in rank 1's output, this rank's dump is {dump}"
    )
    other = HangReport(incident=2, written_by=1, timeout=5.0, world_size=2, trigger="t",
                       states={0: None, 1: None}, job="j")  # fmt: skip
    assert desk.pointer(other) is None  # not the incident this rank handled last: in full
    desk.printed_by = 0
    assert desk.pointer(report) is None  # this rank printed it: the error carries it in full
