"""Post-mortem: read the per-rank hang dumps a watchdog wrote and say who diverged or vanished.

The line a user types (after copying every node's dump directory into one)::

    distcompat diagnose /tmp/distcompat-hangs

Each ``rank<R>.json`` holds that rank's own account (with its stacks and history) and the
cross-rank report it assembled. The newest incident wins; a rank with no file of its own is
described from the other ranks' reports.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distcompat.diagnostics._dump import DUMP_FORMAT
from distcompat.diagnostics._records import CollectiveRecord
from distcompat.diagnostics._report import HangReport, RankState

__all__ = ["DumpReadError", "PostMortem", "read_dumps"]

_FORMAT = DUMP_FORMAT
_WINDOW = 4  # calls shown side by side, ending at the newest sequence number


class DumpReadError(OSError):
    """The directory has no readable hang dump (``rank<R>.json`` written by a watchdog)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PostMortem:
    """The merged view of one incident's dumps.

    ``report`` merges every rank's account (its own file first); ``histories`` maps each rank
    with a file to its recorded collectives; ``skipped`` names files left out, with the reason.

    Example:
        >>> read_dumps("/nonexistent")  # doctest: +SKIP
    """

    directory: Path
    report: HangReport
    files: dict[int, Path]
    histories: dict[int, tuple[CollectiveRecord, ...]]
    skipped: tuple[str, ...]

    def describe(self) -> str:
        """Return the verdict, the calls side by side, then each rank's stacks, labelled."""
        ranks = sorted(self.files)
        lines = [
            f"{len(ranks)} dump(s) in {self.directory} (ranks {', '.join(map(str, ranks))}), "
            f"incident {self.report.incident}",
            *(f"skipped {why}" for why in self.skipped),
            self.report.describe(),
            *self._side_by_side(),
        ]
        for rank in range(self.report.world_size):
            state = self.report.states.get(rank)
            stacks = state.stacks if state is not None else None
            lines.append(f"=== rank {rank} stacks ===")
            lines.append(stacks.rstrip() if stacks else "(none: no dump and no report has them)")
        return "\n".join(lines)

    def _side_by_side(self) -> list[str]:
        states = [s for s in self.report.states.values() if s is not None]
        if not states or not self.histories:
            return []
        world = states[0].world_group
        calls: dict[int, dict[int, CollectiveRecord]] = {}
        for rank, history in self.histories.items():
            for record in history:
                if record.group == world:
                    calls.setdefault(record.seq, {})[rank] = record
        if not calls:
            return []
        newest = max(calls)
        lines = [f"calls on group {world}, side by side:"]
        for seq in range(max(0, newest - _WINDOW + 1), newest + 1):
            row = calls.get(seq, {})
            cells = [
                f"rank {r}: {_short(row[r]) if r in row else '-'}" for r in sorted(self.histories)
            ]
            lines.append(f"  #{seq:<4} " + "  |  ".join(cells))
        return lines


def _short(record: CollectiveRecord) -> str:
    text = record.describe()
    return text.split(" on group ", 1)[0].split(" ", 1)[1] + f" @ {os.path.basename(record.site)}"


def _load(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise ValueError(f"not a {_FORMAT} dump")
    return data


def read_dumps(directory: str | os.PathLike[str]) -> PostMortem:
    """Read ``rank<R>.json`` dumps from ``directory`` and merge the newest incident.

    Raises :class:`DumpReadError` when the directory cannot be read or holds no dump.

    Example:
        >>> read_dumps("/nonexistent/dir")
        Traceback (most recent call last):
        ...
        distcompat.diagnostics._postmortem.DumpReadError: cannot read /nonexistent/dir: ...
    """
    root = Path(directory)
    try:
        paths = sorted(root.glob("rank*.json"))
        if not root.is_dir():
            raise NotADirectoryError(f"{root} is not a directory")
    except OSError as exc:
        raise DumpReadError(f"cannot read {root}: {exc}") from exc
    loaded: dict[Path, dict[str, Any]] = {}
    skipped = []
    for path in paths:
        try:
            loaded[path] = _load(path)
        except (OSError, ValueError, KeyError) as exc:
            skipped.append(f"{path.name}: {exc}")
    if not loaded:
        extra = f" ({'; '.join(skipped)})" if skipped else ""
        raise DumpReadError(
            f"no hang dump (rank<R>.json from a distcompat watchdog) in {root}{extra}"
        )
    reports = {path: HangReport.from_json(data["report"]) for path, data in loaded.items()}
    newest = max(r.incident for r in reports.values())
    chosen = {p: d for p, d in loaded.items() if reports[p].incident == newest}
    skipped += [f"{p.name}: an older incident" for p in loaded if p not in chosen]
    first = reports[next(iter(chosen))]
    states: dict[int, RankState | None] = dict.fromkeys(range(first.world_size))
    for path in chosen:  # other ranks' view first, then each rank's own account wins
        for rank, state in reports[path].states.items():
            if state is not None and states.get(rank) is None:
                states[rank] = state
    files = {int(d["rank"]): p for p, d in chosen.items()}
    for rank, path in files.items():
        own = reports[path].states.get(rank)
        if own is not None:
            states[rank] = own
    report = HangReport(
        incident=newest,
        written_by=min(files),
        timeout=first.timeout,
        world_size=first.world_size,
        trigger=first.trigger,
        states=states,
    )
    histories = {
        int(d["rank"]): tuple(CollectiveRecord.from_json(r) for r in d.get("history", []))
        for d in chosen.values()
    }
    return PostMortem(
        directory=root, report=report, files=files, histories=histories, skipped=tuple(skipped)
    )
