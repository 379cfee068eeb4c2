"""Post-mortem: read the per-rank hang dumps a watchdog wrote and say who diverged or vanished.

The line a user types (after copying every node's dump directory into one)::

    distcompat diagnose /tmp/distcompat-hangs

Watchdogs write ``<dir>/<job>/incident-<N>/rank<R>.json``; each file also names its job and
incident inside, so the folders may be merged or moved. One incident of one job is read at a time:
the newest, or the one asked for (``job=``, ``incident=``); the others found are listed, never
mixed in. Each dump holds that rank's own account (with its stacks and history) and the cross-rank
report it assembled; a rank with no file of its own is described from the other ranks' reports.
"""

from __future__ import annotations

import json
import os
import time
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
    """The merged view of one incident's dumps (one job's, never a mix of jobs).

    ``report`` merges every rank's account (its own file first); ``histories`` maps each rank
    with a file to its recorded collectives; ``skipped`` names what was left out, with the
    reason: unreadable files, and each other incident found (one line each); ``others`` holds
    those incidents as ``(job, incident)``, newest last.

    Example:
        >>> read_dumps("/nonexistent")  # doctest: +SKIP
    """

    directory: Path
    report: HangReport
    files: dict[int, Path]
    histories: dict[int, tuple[CollectiveRecord, ...]]
    skipped: tuple[str, ...]
    others: tuple[tuple[str, int], ...] = ()

    def describe(self) -> str:
        """Return the verdict, the calls side by side, then each rank's stacks, labelled."""
        ranks = sorted(self.files)
        lines = [
            f"{len(ranks)} dump(s) in {self.directory} (ranks {', '.join(map(str, ranks))}), "
            f"job {self.report.job}, incident {self.report.incident}",
            *(f"skipped {why}" for why in self.skipped),
        ]
        if self.others:
            lines.append(
                "(dumps of different incidents are never merged; read another one with "
                "`distcompat diagnose DIR --job JOB --incident N`)"
            )
        lines += [
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
    if not isinstance(data, dict) or "format" not in data:
        raise ValueError("not a distcompat hang dump")
    if data["format"] != _FORMAT:
        raise ValueError(
            f"format {data['format']!r}, not {_FORMAT!r} (older dumps name no job, so they "
            "cannot be told apart from other jobs' dumps)"
        )
    for key, kind in (("job", str), ("incident", int), ("rank", int)):
        kind(data[key])  # present and of the right kind, or KeyError / ValueError
    return data


_Key = tuple[str, int]  # (job, incident)


def _choose(
    keys: dict[_Key, list[Path]], loaded: dict[Path, dict[str, Any]], job: str | None,
    incident: int | None, root: Path,
) -> _Key:  # fmt: skip
    """Pick the incident to read: the newest of those matching ``job`` / ``incident``."""
    wanted = [
        key for key in keys
        if (job is None or key[0] == job or key[0].startswith(job))
        and (incident is None or key[1] == incident)
    ]  # fmt: skip
    if not wanted:
        found = ", ".join(f"job {j} incident {n}" for j, n in sorted(keys))
        raise DumpReadError(
            f"no dump of job={job!r} incident={incident!r} in {root} (found: {found})"
        )
    jobs = {key[0] for key in wanted}
    if job is not None and len(jobs) > 1:
        raise DumpReadError(f"job={job!r} matches several jobs: {', '.join(sorted(jobs))}")
    return max(wanted, key=lambda k: (_written(keys[k], loaded), k[1]))


def _written(paths: list[Path], loaded: dict[Path, dict[str, Any]]) -> float:
    """When the newest of ``paths`` was written (wall clock)."""
    return max(float(loaded[p]["written"]) for p in paths)


def _other(key: _Key, chosen: _Key, paths: list[Path], loaded: dict[Path, dict[str, Any]]) -> str:
    ranks = sorted({int(loaded[p]["rank"]) for p in paths})
    when = max(float(loaded[p]["written"]) for p in paths)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))
    what = "an older incident of this job" if key[0] == chosen[0] else "another job"
    if key[0] == chosen[0] and key[1] > chosen[1]:
        what = "a later incident of this job"
    return (
        f"job {key[0]} incident {key[1]} (ranks {', '.join(map(str, ranks))}, written {stamp}): "
        f"{what}, not merged"
    )


def read_dumps(
    directory: str | os.PathLike[str], *, job: str | None = None, incident: int | None = None
) -> PostMortem:
    """Read the hang dumps under ``directory`` and merge one incident of one job.

    The newest incident is read unless ``job`` (its name or a unique prefix) or ``incident``
    pick another; every other incident found is listed in :attr:`PostMortem.others`, never
    merged. Raises :class:`DumpReadError` when the directory cannot be read, holds no dump, or
    none matches.

    Example:
        >>> read_dumps("/nonexistent/dir")
        Traceback (most recent call last):
        ...
        distcompat.diagnostics._postmortem.DumpReadError: cannot read /nonexistent/dir: ...
    """
    root = Path(directory)
    try:
        if not root.is_dir():
            raise NotADirectoryError(f"{root} is not a directory")
        paths = sorted(root.rglob("rank*.json"))
    except OSError as exc:
        raise DumpReadError(f"cannot read {root}: {exc}") from exc
    loaded: dict[Path, dict[str, Any]] = {}
    skipped = []
    for path in paths:
        try:
            loaded[path] = _load(path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            skipped.append(f"{path.relative_to(root)}: {exc}")
    if not loaded:
        extra = f" ({'; '.join(skipped)})" if skipped else ""
        raise DumpReadError(
            f"no hang dump (rank<R>.json from a distcompat watchdog) under {root}{extra}"
        )
    keys: dict[_Key, list[Path]] = {}
    for path, data in loaded.items():
        keys.setdefault((str(data["job"]), int(data["incident"])), []).append(path)
    chosen_key = _choose(keys, loaded, job, incident, root)
    rest = sorted((k for k in keys if k != chosen_key), key=lambda k: _written(keys[k], loaded))
    skipped += [_other(k, chosen_key, keys[k], loaded) for k in rest]
    by_rank: dict[int, Path] = {}
    for path in sorted(keys[chosen_key], key=lambda p: float(loaded[p]["written"])):
        rank = int(loaded[path]["rank"])
        if rank in by_rank:  # the same rank twice (copied twice): the newest wins
            skipped.append(f"{by_rank[rank].relative_to(root)}: rank {rank} again, newer file used")
        by_rank[rank] = path
    chosen = {path: loaded[path] for path in by_rank.values()}
    reports = {path: HangReport.from_json(data["report"]) for path, data in chosen.items()}
    first = reports[by_rank[min(by_rank)]]
    odd = [p for p, r in reports.items() if r.world_size != first.world_size]
    if odd:
        raise DumpReadError(
            f"dumps of job {chosen_key[0]} incident {chosen_key[1]} disagree on the world size "
            f"({', '.join(str(p) for p in odd)}): not merged"
        )
    states: dict[int, RankState | None] = dict.fromkeys(range(first.world_size))
    for path in chosen:  # other ranks' view first, then each rank's own account wins
        for rank, state in reports[path].states.items():
            if state is not None and states.get(rank) is None:
                states[rank] = state
    for rank, path in by_rank.items():
        own = reports[path].states.get(rank)
        if own is not None:
            states[rank] = own
    report = HangReport(
        incident=chosen_key[1],
        written_by=min(by_rank),
        timeout=first.timeout,
        world_size=first.world_size,
        trigger=first.trigger,
        states=states,
        job=chosen_key[0],
    )
    histories = {
        int(d["rank"]): tuple(CollectiveRecord.from_json(r) for r in d.get("history", []))
        for d in chosen.values()
    }
    return PostMortem(
        directory=root,
        report=report,
        files=dict(by_rank),
        histories=histories,
        skipped=tuple(skipped),
        others=tuple(rest),
    )
