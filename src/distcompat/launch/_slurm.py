"""Expand Slurm's compressed host lists and tasks-per-node strings.

Slurm exports node lists compressed (``SLURM_JOB_NODELIST=node[01-03,07],gpu5``) and per-node task
counts run-length encoded (``SLURM_TASKS_PER_NODE=2(x3),1``). These pure functions expand both the
way ``scontrol show hostnames`` does and raise :class:`SlurmFormatError`, which names the string,
the position and the problem, on anything else. ``_env`` adds the variable name.

Example:
    >>> expand_hostlist("node[01-02],gpu5")
    ['node01', 'node02', 'gpu5']
    >>> expand_tasks_per_node("2(x3),1")
    [2, 2, 2, 1]
"""

from __future__ import annotations

import itertools
import math
import re

__all__ = ["MAX_ENTRIES", "SlurmFormatError", "expand_hostlist", "expand_tasks_per_node"]

# A bound on how many hosts or nodes one string may expand to, so that a typo such as
# `node[0-999999999]` fails with a message instead of exhausting memory. The largest clusters
# have tens of thousands of nodes.
MAX_ENTRIES = 1_000_000

_HOST_CHARS = re.compile(r"[A-Za-z0-9._-]")
_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_TASKS = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")


class SlurmFormatError(ValueError):
    """A Slurm host list or tasks-per-node string that cannot be parsed.

    ``text`` is the whole string, ``position`` the 0-based index where parsing failed and
    ``problem`` what is wrong there.

    Example:
        >>> try:
        ...     expand_hostlist("node[3-1]")
        ... except SlurmFormatError as err:
        ...     print(err)
        reversed range '3-1' (start above end) at position 5 in 'node[3-1]'
    """

    def __init__(self, text: str, position: int, problem: str) -> None:
        self.text = text
        self.position = position
        self.problem = problem
        super().__init__(f"{problem} at position {position} in {text!r}")


def expand_hostlist(text: str) -> list[str]:
    """Expand a compressed Slurm host list into host names, in Slurm's order.

    Items are separated by commas outside brackets. A bracket group holds comma-separated numbers
    or ``lo-hi`` ranges; zero padding of ``lo`` is kept (``[08-10]`` gives ``08 09 10``). Several
    groups in one item expand as a cartesian product, the leftmost group varying slowest, as
    ``scontrol show hostnames`` does. Host names may contain letters, digits, ``.``, ``_``, ``-``.

    Example:
        >>> expand_hostlist("rack[1-2]-n[01,03]")
        ['rack1-n01', 'rack1-n03', 'rack2-n01', 'rack2-n03']
    """
    if not text:
        raise SlurmFormatError(text, 0, "empty host list")
    hosts: list[str] = []
    for start, item in _split_top_level(text):
        pieces = _parse_item(text, start, item)
        count = math.prod(len(p) for p in pieces)
        if len(hosts) + count > MAX_ENTRIES:
            raise SlurmFormatError(text, start, f"expands to more than {MAX_ENTRIES} hosts")
        hosts.extend("".join(combo) for combo in itertools.product(*pieces))
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """Expand a run-length encoded tasks-per-node string into one count per node.

    Entries are ``COUNT`` or ``COUNT(xREPEAT)``, separated by commas; ``REPEAT`` is at least 1.

    Example:
        >>> expand_tasks_per_node("1,2(x2)")
        [1, 2, 2]
    """
    counts: list[int] = []
    position = 0
    for entry in text.split(","):
        match = _TASKS.fullmatch(entry)
        if not entry:
            raise SlurmFormatError(text, position, "empty entry")
        if match is None:
            raise SlurmFormatError(
                text, position, f"entry {entry!r} is not COUNT or COUNT(xREPEAT)"
            )
        repeat = 1 if match.group(2) is None else int(match.group(2))
        if repeat < 1:
            raise SlurmFormatError(text, position, f"entry {entry!r} repeats fewer than once")
        if len(counts) + repeat > MAX_ENTRIES:
            raise SlurmFormatError(text, position, f"expands to more than {MAX_ENTRIES} nodes")
        counts.extend([int(match.group(1))] * repeat)
        position += len(entry) + 1
    return counts


def _split_top_level(text: str) -> list[tuple[int, str]]:
    """Split on commas outside brackets; return (start offset, item) pairs."""
    items: list[tuple[int, str]] = []
    start = 0
    open_at = -1  # index of the unclosed '[', or -1 outside brackets
    for i, char in enumerate(text):
        if char == "[":
            if open_at >= 0:
                raise SlurmFormatError(text, i, "nested '['")
            open_at = i
        elif char == "]":
            if open_at < 0:
                raise SlurmFormatError(text, i, "']' without a matching '['")
            open_at = -1
        elif char == "," and open_at < 0:
            items.append((start, text[start:i]))
            start = i + 1
    if open_at >= 0:
        raise SlurmFormatError(text, open_at, "'[' is never closed")
    items.append((start, text[start:]))
    return items


def _parse_item(text: str, start: int, item: str) -> list[list[str]]:
    """Turn one host item into pieces whose cartesian product is its hosts.

    Brackets are known to be balanced and not nested here.
    """
    if not item:
        raise SlurmFormatError(text, start, "empty host name")
    pieces: list[list[str]] = []
    i = 0
    while i < len(item):
        if item[i] == "[":
            close = item.index("]", i)
            pieces.append(_expand_ranges(text, start + i + 1, item[i + 1 : close]))
            i = close + 1
            continue
        if not _HOST_CHARS.fullmatch(item[i]):
            raise SlurmFormatError(text, start + i, f"character {item[i]!r} is not allowed")
        pieces.append([item[i]])
        i += 1
    return pieces


def _expand_ranges(text: str, start: int, body: str) -> list[str]:
    """Expand the inside of one bracket group, e.g. ``01-03,07``."""
    numbers: list[str] = []
    position = start
    for part in body.split(","):
        match = _RANGE.fullmatch(part)
        if not part:
            raise SlurmFormatError(text, position, "empty range in brackets")
        if match is None:
            raise SlurmFormatError(text, position, f"range {part!r} is not N or N-M")
        low_text, high_text = match.group(1), match.group(2)
        low = int(low_text)
        high = low if high_text is None else int(high_text)
        if high < low:
            raise SlurmFormatError(text, position, f"reversed range {part!r} (start above end)")
        if len(numbers) + high - low + 1 > MAX_ENTRIES:
            raise SlurmFormatError(text, position, f"expands to more than {MAX_ENTRIES} hosts")
        width = len(low_text)
        numbers.extend(f"{n:0{width}d}" for n in range(low, high + 1))
        position += len(part) + 1
    return numbers
