"""The framework session's table: each test adds its cell, the end of the run prints the table."""

from __future__ import annotations

import pytest

#: program -> column -> what the run showed (filled by test_frameworks.py).
TABLE: dict[str, dict[str, str]] = {}
COLUMNS = ["bits plain vs run", "stall named after", "then a mismatch", "killed rank"]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not TABLE:
        return
    write = terminalreporter.write_line
    write("")
    write("| program | " + " | ".join(COLUMNS) + " |")
    write("|---" * (len(COLUMNS) + 1) + "|")
    for program, cells in TABLE.items():
        write(f"| {program} | " + " | ".join(cells.get(c, "-") for c in COLUMNS) + " |")
