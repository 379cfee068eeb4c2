"""Read PyTorch's Flight Recorder dumps and say, in distcompat's words, who did not join what.

``distcompat diagnose DIR`` reads these beside distcompat's own dumps, or alone::

    found = read_flight_dumps("~/.cache/torch")      # or the folder TORCH_FR_DUMP_TEMP_FILE names
    print(found.describe())   # "rank 1 did not join #5 gloo:all_reduce(Float[4]) of group 0 ..."

A Flight Recorder dump is one file per rank, ``<prefix><rank>`` with no extension (torch's
default ``comm_lib_trace_rank_<R>``), holding a pickled dict: ``version``, ``pg_config`` (each
group's name, description and global ranks), ``pg_status`` and ``entries`` (the rank's recent
collectives, oldest first, each with its group, ``collective_seq_id``, op name, sizes, state).
NCCL writes them on a timeout or through the debug pipe; torch's gloo group records them too
(``torch._C._distributed_c10d._dump_fr_trace``); distcompat's watchdog writes them beside its own
dumps (``_flight_dump``). Files are unpickled with a loader that builds only plain data (dicts,
lists, strings, numbers): a file that names any class is refused, never executed.

The verdict, per process group: a member whose newest call there is older than the others'
did not join the next one; a member with no file is named as such; the first call number at
which members recorded different ops, sizes or dtypes is a disagreement; a point-to-point entry
not yet completed is a wait on its peer. Torch 2.13's gloo dumps name the default group ``''``
in ``pg_config`` and ``'0'`` in their entries (torch's analyzer fails on them with a KeyError);
here an entry's group is found by name, else by description, else it is the only group listed.
"""

from __future__ import annotations

import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distcompat.diagnostics._flight_dump import parse_ranks

__all__ = ["FlightDumps", "FlightEntry", "FlightReadError", "read_flight_dumps"]

_NAME = re.compile(r"^(?P<prefix>[\w\-]*?)(?P<rank>\d+)$")
_REQUIRED = ("version", "pg_config", "entries")
_PEERS = re.compile(r"^(?P<a>\d+)(?P<dir>->|<-)(?P<b>\d+)$")


class FlightReadError(OSError):
    """The directory holds no readable Flight Recorder dump."""


class _PlainData(pickle.Unpickler):
    """An unpickler that builds dicts, lists, tuples, strings and numbers, and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused: the file names {module}.{name}, not plain data")


@dataclass(frozen=True, slots=True, kw_only=True)
class FlightEntry:
    """One Flight Recorder entry: a call as one rank recorded it.

    Example:
        >>> e = FlightEntry(rank=0, group="0", seq=5, op="gloo:all_reduce", sizes=((4,),),
        ...     dtypes=("Float",), state="scheduled", is_p2p=False)
        >>> e.describe()
        '#5 gloo:all_reduce(Float[4]) scheduled'
    """

    rank: int
    group: str
    seq: int
    op: str
    sizes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    state: str
    is_p2p: bool
    site: str = ""

    def call(self) -> str:
        """Return the op with its dtypes and sizes: ``gloo:all_reduce(Float[4])``."""
        args = ", ".join(
            f"{dtype}[{','.join(map(str, size))}]"
            for dtype, size in zip(self.dtypes, self.sizes, strict=False)
        )
        return f"{self.op}({args})"

    def describe(self) -> str:
        """``#seq op(args) state`` and, where recorded, `` at file:line``."""
        where = f" at {self.site}" if self.site else ""
        if self.is_p2p:  # a point-to-point op has no call number of its own
            return f"{self.op} {self.state}{where}"
        return f"#{self.seq} {self.call()} {self.state}{where}"


@dataclass(frozen=True, slots=True, kw_only=True)
class FlightDumps:
    """One set of Flight Recorder dumps (one folder, one file prefix) and its verdict.

    ``groups`` maps a group name to ``(description, global ranks)``; ``entries`` each rank with
    a file to its entries, oldest first; ``completed`` each rank's last completed call per group
    (from ``pg_status``, where given); ``written_by_distcompat`` is True for files distcompat's
    watchdog wrote (the same incident its JSON dumps describe); ``skipped`` says what was left
    out, and why.
    """

    folder: Path
    prefix: str
    files: dict[int, Path]
    version: str
    groups: dict[str, tuple[str, tuple[int, ...]]]
    entries: dict[int, tuple[FlightEntry, ...]]
    completed: dict[int, dict[str, int]]
    written_by_distcompat: bool
    skipped: tuple[str, ...] = ()

    def findings(self) -> list[str]:
        """Who did not join which call, who disagrees, who waits on a peer; per group."""
        found: list[str] = []
        for name, (desc, members) in sorted(self.groups.items()):
            calls = {r: [e for e in es if e.group == name] for r, es in self.entries.items()}
            label = f"group {name} ({desc})" if desc else f"group {name}"
            found += self._group_findings(label, members, calls)
        return found or [
            "every rank recorded the same calls: none is missing or different (a hang would be "
            "in the network or in work these dumps do not record)"
        ]

    def _group_findings(
        self, label: str, members: tuple[int, ...], calls: dict[int, list[FlightEntry]]
    ) -> list[str]:
        found = [
            f"rank {r} wrote no dump here (it died, was not reached, or its file was not copied)"
            for r in members
            if r not in self.entries
        ]
        collectives = {
            r: {e.seq: e for e in calls.get(r, []) if not e.is_p2p} for r in members
        }  # fmt: skip
        newest = {r: max(seqs) for r, seqs in collectives.items() if seqs and r in self.entries}
        if newest:
            frontier = max(newest.values())
            ahead = sorted(r for r, n in newest.items() if n == frontier)
            first = collectives[ahead[0]][frontier]
            for r in sorted(r for r in members if r in self.entries and r not in ahead):
                last = newest.get(r)
                missed = (last + 1) if last is not None else min(collectives[ahead[0]])
                missed_call = collectives[ahead[0]].get(missed, first)
                had = f"its newest there is #{last}" if last is not None else "it has none there"
                found.append(
                    f"rank {r} did not join #{missed} {missed_call.call()} of {label}: {had}; "
                    f"rank(s) {', '.join(map(str, ahead))} reached #{frontier}"
                )
        found += _disagreements(label, collectives)
        for r in sorted(calls):
            # gloo's entries stay "scheduled" even when done: only a rank's newest entry, if it
            # is a point-to-point op not seen completed, is taken for a wait on its peer
            newest_of_r = self.entries[r][-1] if self.entries.get(r) else None
            p2p = newest_of_r if newest_of_r is not None and newest_of_r.is_p2p else None
            if p2p is not None and p2p.state != "completed" and p2p in calls[r]:
                found.append(f"rank {r} waits in {_p2p_words(p2p, members)} on {label}")
        return found

    def doing(self, rank: int) -> str:
        """Say what ``rank`` was doing: its newest entry, its last completed call per group."""
        entries = self.entries.get(rank, ())
        if not entries:
            return "no entries recorded"
        newest = entries[-1]
        done = self.completed.get(rank, {})
        marks = "; ".join(f"group {g}: last completed #{n}" for g, n in sorted(done.items()))
        return f"newest {newest.describe()} on group {newest.group}" + (
            f" ({marks})" if marks else ""
        )

    def describe(self) -> str:
        """Return the verdict, then one line per rank, as ``distcompat diagnose`` prints it."""
        source = "distcompat's watchdog" if self.written_by_distcompat else "torch"
        ranks = sorted(self.files)
        lines = [
            f"{len(ranks)} Flight Recorder dump(s) written by {source} in {self.folder} "
            f"(files {self.prefix}<rank>, ranks {', '.join(map(str, ranks))}, "
            f"schema {self.version})",
            *(f"skipped {why}" for why in self.skipped),
            "findings:",
            *(f"  - {finding}" for finding in self.findings()),
            "ranks:",
            *(f"  rank {r}: {self.doing(r)}" for r in self._all_ranks()),
        ]
        return "\n".join(lines)

    def _all_ranks(self) -> list[int]:
        members = {r for _, ranks in self.groups.values() for r in ranks}
        return sorted(members | set(self.files))


def _disagreements(label: str, collectives: dict[int, dict[int, FlightEntry]]) -> list[str]:
    """Name the first call number at which members recorded different calls (not later ones)."""
    numbers = sorted({n for seqs in collectives.values() for n in seqs})
    for number in numbers:
        row = {r: seqs[number] for r, seqs in collectives.items() if number in seqs}
        kinds = {(e.op, e.sizes, e.dtypes) for e in row.values()}
        if len(row) > 1 and len(kinds) > 1:
            sides = "".join(f"\n      rank {r}: {e.describe()}" for r, e in sorted(row.items()))
            return [f"ranks disagree on #{number} of {label}:{sides}"]
    return []


def _p2p_words(entry: FlightEntry, members: tuple[int, ...]) -> str:
    """``recv from rank 1`` for ``gloo:recv 0<-1`` (group ranks mapped to global ones)."""
    op, _, meta = entry.op.partition(" ")
    match = _PEERS.match(meta)
    kind = op.split(":", 1)[-1]
    if match is None:
        return f"{kind} (peer not recorded)"
    ordered = sorted(members)
    peer_local = int(match["b"])  # "me->peer" for a send, "me<-peer" for a recv
    peer = ordered[peer_local] if peer_local < len(ordered) else peer_local
    return f"{kind} {'from' if kind == 'recv' else 'to'} rank {peer}"


def _entry(rank: int, raw: dict[str, Any]) -> FlightEntry:
    frames = raw.get("frames") or []
    site = ""
    if frames and isinstance(frames[0], dict):
        site = f"{frames[0].get('filename', '?')}:{frames[0].get('line', '?')}"
    return FlightEntry(
        rank=rank,
        group=str(raw["process_group"][0]),
        seq=int(raw["collective_seq_id"]),
        op=str(raw["profiling_name"]),
        sizes=tuple(tuple(int(n) for n in size) for size in raw.get("input_sizes") or ()),
        dtypes=tuple(str(d) for d in raw.get("input_dtypes") or ()),
        state=str(raw.get("state", "?")),
        is_p2p=bool(raw.get("is_p2p", False)),
        site=site,
    )


def _load(path: Path) -> dict[str, Any]:
    with open(path, "rb") as handle:
        if handle.read(1) != b"\x80":
            raise ValueError("not a pickle")
        handle.seek(0)
        data = _PlainData(handle).load()
    if not isinstance(data, dict) or any(key not in data for key in _REQUIRED):
        raise ValueError(f"not a Flight Recorder dump (needs keys {', '.join(_REQUIRED)})")
    return data


def _groups(dumps: dict[int, dict[str, Any]]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each group the entries name: its description and members, repairing an unnamed config."""
    configs: dict[str, tuple[str, tuple[int, ...]]] = {}
    for data in dumps.values():
        for key, config in dict(data["pg_config"]).items():
            configs.setdefault(str(key), (str(config.get("desc", "")), tuple(
                parse_ranks(str(config.get("ranks", "[]")))
            )))  # fmt: skip
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    everyone = tuple(sorted(dumps))
    for data in dumps.values():
        for raw in data["entries"]:
            name, desc = str(raw["process_group"][0]), str(raw["process_group"][1])
            if name in out:
                continue
            by_desc = [c for c in configs.values() if desc and c[0] == desc]
            if name in configs:
                out[name] = configs[name]
            elif by_desc:
                out[name] = (desc, by_desc[0][1])
            elif len(configs) == 1:  # torch 2.13's gloo: the only group, listed as ''
                out[name] = (desc, next(iter(configs.values()))[1])
            else:
                out[name] = (desc, everyone)
    return out


def _completed(data: dict[str, Any], pg_names: dict[int, str]) -> dict[str, int]:
    status = data.get("pg_status") or {}
    out = {}
    for pg_id, marks in dict(status).items():
        name = pg_names.get(int(pg_id), str(pg_id))
        done = int(dict(marks).get("last_completed_collective", -1))
        if done >= 0:
            out[name] = done
    return out


def _sets(root: Path) -> dict[tuple[Path, str], dict[int, Path]]:
    """Return the candidate dump files under ``root``, grouped by (folder, prefix)."""
    found: dict[tuple[Path, str], dict[int, Path]] = {}
    for folder, _, names in os.walk(root):
        for name in names:
            match = _NAME.match(name)
            if match is not None and (Path(folder) / name).is_file():  # never a pipe: it blocks
                key = (Path(folder), match["prefix"])
                found.setdefault(key, {})[int(match["rank"])] = Path(folder) / name
    return found


def read_flight_dumps(
    directory: str | os.PathLike[str], *, include_distcompat: bool = True
) -> FlightDumps:
    """Read the newest set of Flight Recorder dumps under ``directory`` (searched recursively).

    A set is the files of one folder sharing a prefix (``comm_lib_trace_rank_0``, ``_1``, ...);
    files that are not Flight Recorder pickles are passed over, other sets are listed in
    ``skipped``. ``include_distcompat=False`` passes over the sets distcompat's watchdog wrote
    (for a reader that has its JSON dumps already). Raises :class:`FlightReadError` if none is
    found.

    Example:
        >>> read_flight_dumps("/nonexistent/dir")
        Traceback (most recent call last):
        ...
        distcompat.diagnostics._flight_read.FlightReadError: cannot read /nonexistent/dir: ...
    """
    root = Path(directory)
    if not root.is_dir():
        raise FlightReadError(f"cannot read {root}: not a directory")
    candidates = _sets(root)
    skipped: list[str] = []
    loaded: dict[tuple[Path, str], dict[int, dict[str, Any]]] = {}
    for key, files in candidates.items():
        dumps = {}
        for rank, path in files.items():
            try:
                dumps[rank] = _load(path)
            except (OSError, ValueError, EOFError, pickle.UnpicklingError, KeyError) as exc:
                if not str(exc).startswith(("not a pickle", "not a Flight")):
                    skipped.append(f"{path.relative_to(root)}: {exc}")
        ours = any("distcompat" in d for d in dumps.values())
        if dumps and (include_distcompat or not ours):
            loaded[key] = dumps
    if not loaded:
        extra = f" ({'; '.join(skipped)})" if skipped else ""
        raise FlightReadError(f"no Flight Recorder dump under {root}{extra}")
    newest = max(loaded, key=lambda k: max(p.stat().st_mtime for p in candidates[k].values()))
    for key in loaded:
        if key != newest:
            skipped.append(
                f"{key[0].relative_to(root) or '.'}/{key[1]}<rank>: another set of dumps, not "
                "merged (point diagnose at that folder to read it)"
            )
    dumps = loaded[newest]
    versions = {str(d["version"]) for d in dumps.values()}
    entries: dict[int, tuple[FlightEntry, ...]] = {}
    completed: dict[int, dict[str, int]] = {}
    for rank, data in sorted(dumps.items()):
        try:
            entries[rank] = tuple(_entry(rank, raw) for raw in data["entries"])
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise FlightReadError(
                f"{candidates[newest][rank]}: an entry lacks a field torch writes: {exc!r}"
            ) from exc
        pg_names = {int(raw.get("pg_id", -1)): str(raw["process_group"][0])
                    for raw in data["entries"]}  # fmt: skip
        completed[rank] = _completed(data, pg_names)
    return FlightDumps(
        folder=newest[0],
        prefix=newest[1],
        files={r: candidates[newest][r] for r in dumps},
        version=" / ".join(sorted(versions)),
        groups=_groups(dumps),
        entries=entries,
        completed=completed,
        written_by_distcompat=any("distcompat" in d for d in dumps.values()),
        skipped=tuple(skipped),
    )
